"""``emapg-convert`` (also ``tools/convert_checkpoint.py``): HF <-> Megatron-Core checkpoints.

    emapg-convert hf-to-mcore --hf-dir D --out M --tp T --pp P [--dtype bf16|fp32]
    emapg-convert mcore-to-hf --load M --out D [--hf-template D0]
    emapg-convert verify --hf-dir D --load M --tp T --pp P

User errors (unsupported architecture, missing or mismatched tensors, TP not dividing the heads
or groups, an existing output) print one ``error:`` line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from emapg_megatron.checkpoint import convert, verify
from emapg_megatron.errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emapg-convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("hf-to-mcore", help="HF safetensors directory -> Megatron torch_dist checkpoint")
    a.add_argument("--hf-dir", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--tp", type=int, default=1, help="TP the checkpoint will be trained at (padding, checks)")
    a.add_argument("--pp", type=int, default=1, help="PP the checkpoint will be trained at (checks)")
    a.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="stored dtype (default: the HF checkpoint's, fp16 becomes bf16)")
    a.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    a.add_argument("--overwrite", action="store_true")

    b = sub.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF safetensors directory")
    b.add_argument("--load", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--hf-template", default=None,
                   help="HF directory to take config.json extras and tokenizer files from")
    b.add_argument("--max-shard-size-gb", type=float, default=5.0)
    b.add_argument("--overwrite", action="store_true")

    c = sub.add_parser("verify", help="compare logits of the HF model and the Megatron checkpoint")
    c.add_argument("--hf-dir", required=True)
    c.add_argument("--load", required=True)
    c.add_argument("--tp", type=int, default=1)
    c.add_argument("--pp", type=int, default=1)
    c.add_argument("--batch", type=int, default=2)
    c.add_argument("--seq-len", type=int, default=32)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the Megatron ranks run (the HF reference is always CPU fp32)")
    for sp in (a, b):
        sp.add_argument("--no-progress", action="store_true")
    return p


def _run(args) -> dict:
    if args.command == "hf-to-mcore":
        return convert.hf_to_mcore(args.hf_dir, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype,
                                   make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                   overwrite=args.overwrite, progress=not args.no_progress)
    if args.command == "mcore-to-hf":
        return convert.mcore_to_hf(args.load, args.out, hf_template=args.hf_template,
                                   max_shard_bytes=int(args.max_shard_size_gb * 1024**3),
                                   overwrite=args.overwrite, progress=not args.no_progress)
    return verify.verify(args.hf_dir, args.load, tp=args.tp, pp=args.pp, batch=args.batch,
                         seq_len=args.seq_len, seed=args.seed, device=args.device)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        result = _run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
