"""HF <-> Megatron-Core checkpoint converter (same as the ``emapg-convert`` console script).

    python tools/convert_checkpoint.py hf-to-mcore --hf-dir D --out M --tp T --pp P [--dtype bf16|fp32]
    python tools/convert_checkpoint.py mcore-to-hf --load M --out D [--hf-template D0]
    python tools/convert_checkpoint.py verify --hf-dir D --load M --tp T --pp P
"""

import sys

from emapg_megatron.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main())
