"""`CKPT=SAVE_DIR bash examples/eval_math.sh`, as the README says it: on the shipped sample data
with nothing else set, and exported again once the checkpoint has moved on (issue 39, item 6)."""

import json
import os
import subprocess
import sys

import pytest
from tiny_hf import SAMPLES, build_tiny_hf

from emapg_megatron.multiprocess import free_port

pytestmark = [pytest.mark.slow, pytest.mark.one_suite("mcore019")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {k: v for k, v in os.environ.items() if k not in ("DATA_DIR", "MODEL_DIR", "HF_MODEL", "EVAL_FILES",
                                                         "N_SAMPLES", "MAX_NEW_TOKENS", "DRY_RUN")}


def _run(cmd: list, **env) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=ROOT, env={**ENV, "OMP_NUM_THREADS": "1", **env}, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _train(hf: str, ckpt, iters: int, *extra):
    _run([sys.executable, "-m", "emapg_megatron.launch", "--nproc-per-node", "1", "--master-port",
          str(free_port()), "--preset", "tiny-cpu", "--task", "math", "--load-hf", hf, "--data-path",
          os.path.join(SAMPLES, "math.jsonl"), "--seq-length", "192", "--max-new-tokens", "8",
          "--tensor-model-parallel-size", "1", "--train-iters", str(iters), "--rollout-batch-size", "2",
          "--num-samples-per-prompt", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--chat-template", "never", "--kl-topk-tokens", "8", "--lr", "1e-2",
          "--make-vocab-size-divisible-by", "16", "--save", str(ckpt), "--log-dir", str(ckpt) + "-log", *extra])


def test_eval_math_runs_on_the_shipped_sample_and_follows_the_checkpoint(tmp_path):
    pytest.importorskip("math_verify")
    hf, ckpt = build_tiny_hf(str(tmp_path / "hf")), tmp_path / "ckpt"
    _train(hf, ckpt, 2)
    r = _run(["bash", "examples/eval_math.sh"], CKPT=str(ckpt))
    assert "evaluating on the shipped sample" in r.stderr
    export = tmp_path / "ckpt-hf"
    assert (export / ".emapg-export-of").read_text().strip() == str(ckpt / "iter_0000002")
    results = json.loads((tmp_path / "ckpt-hf-eval-math" / "results.json").read_text())
    assert results

    r = _run(["bash", "examples/eval_math.sh"], CKPT=str(ckpt))  # nothing new: the export is reused
    assert f"using the existing HF export {export}" in r.stderr

    _train(hf, ckpt, 3, "--load", str(ckpt))  # the checkpoint moves on: exported again
    r = _run(["bash", "examples/eval_math.sh"], CKPT=str(ckpt))
    assert "using the existing HF export" not in r.stderr
    assert (export / ".emapg-export-of").read_text().strip() == str(ckpt / "iter_0000003")
