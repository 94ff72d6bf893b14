"""Checkpoints written by each end of the supported megatron-core range, committed under
``data/mcore-<version>/`` so that either suite resumes the other's (``test_mcore_versions.py``).

Each holds step 2 of the trainer's 3-step run ``ARGS`` (``iter_0000002`` and the tracker) and
``expected.json``, that run's step-3 metrics. Made by the installed megatron-core with::

    python tests/checkpoint/mcore_versions.py      # writes data/mcore-<installed version>/

(in ``.venv-mcore019`` for 0.19.x). A resume of it must continue to the same step 3.
"""

import json
import os
import shutil
import sys
import tempfile
from importlib.metadata import version

if __name__ == "__main__":  # as a script: the helpers' folder, as conftest.py puts it on the path
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "training"))
from trainer_launch import BASE, COMPARED, metrics, torchrun  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
ARGS = ["--train-iters", "3", "--tensor-model-parallel-size", "2"]  # 2 ranks: sharded tensors
NPROC = 2


def fixture(mcore: str) -> str:
    return os.path.join(DATA, f"mcore-{mcore}")


def make(out: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, log = os.path.join(tmp, "ckpt"), os.path.join(tmp, "log")
        r = torchrun(NPROC, [*ARGS, "--save", ckpt, "--save-interval", "2"], log)
        assert r.returncode == 0, r.stdout + r.stderr
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        shutil.copytree(os.path.join(ckpt, "iter_0000002"), os.path.join(out, "iter_0000002"))
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
        step3 = metrics(log)[2]
        with open(os.path.join(out, "expected.json"), "w") as f:
            json.dump({"argv": " ".join(BASE + ARGS), "step": 3, **{k: step3[k] for k in COMPARED}},
                      f, indent=1)


if __name__ == "__main__":
    make(fixture(version("megatron-core")))
    sys.exit(0)
