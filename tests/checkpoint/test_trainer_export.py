"""A trained model leaves: train -> export to HF -> evaluate, from the trainer's own checkpoints.

Two steps at TP=2 from a tiny HF model; `emapg-convert mcore-to-hf` reads the --save directory
(its tracker) or one iter_N directory alone, its config and tokenizer included; the exported
weights are the trained ones bit for bit; examples/eval_math.sh runs on the --save directory."""

import json
import os
import subprocess
import sys

import pytest
from checkpoint_workers import resumed_vs_exported
from tiny_hf import SAMPLES
from trainer_launch import run_trainer

from emapg_megatron.multiprocess import run_distributed

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")


def trainer_argv(hf: str, tp: int) -> list:
    return ["--preset", "tiny-cpu", "--task", "math", "--load-hf", hf,
            "--data-path", os.path.join(SAMPLES, "math.jsonl"), "--seq-length", "192",
            "--max-new-tokens", "8", "--tensor-model-parallel-size", str(tp), "--train-iters", "2",
            "--rollout-batch-size", "2", "--num-samples-per-prompt", "2", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--chat-template", "never", "--kl-topk-tokens", "8",
            "--lr", "1e-2", "--make-vocab-size-divisible-by", "16"]


def _run(cmd: list, **env) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=ROOT, env={**ENV, **env}, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def trained(tiny_hf_model, tmp_path_factory):
    pytest.importorskip("math_verify")
    root = tmp_path_factory.mktemp("export")
    hf = tiny_hf_model  # conftest.py's, shared with other modules
    # the trainer on 2 ranks, as emapg-train runs it (its launcher is tested in tests/test_launch.py)
    r = run_trainer(2, [*trainer_argv(hf, 2), "--save", str(root / "ckpt"), "--log-dir", str(root / "log")],
                    timeout=900, env=ENV, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return root, hf


def _export(load, out) -> dict:
    r = _run([sys.executable, "-m", "emapg_megatron.checkpoint.cli", "mcore-to-hf", "--load", str(load),
              "--out", str(out), "--no-progress"])
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_save_directory_exports_alone_and_bit_for_bit(trained):
    root, hf = trained
    summary = _export(root / "ckpt", root / "hf-export")  # the --save root: its latest step
    assert summary["architecture"] == "Qwen2ForCausalLM" and summary["dtype"] == "fp32"
    assert set(summary["tokenizer_files"]) >= {"tokenizer.json", "tokenizer_config.json"}  # from --load-hf
    with open(root / "hf-export" / "config.json") as f, open(os.path.join(hf, "config.json")) as g:
        exported, source = json.load(f), json.load(g)
    assert {k: exported[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")} == \
        {k: source[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    # one step directory alone gives the same files
    _export(root / "ckpt" / "iter_0000002", root / "hf-export-step2")
    for name in ("model-00001-of-00001.safetensors", "config.json"):
        assert (root / "hf-export" / name).read_bytes() == (root / "hf-export-step2" / name).read_bytes()
    # the trained weights (resumed by the trainer at TP=1) are the exported ones, bit for bit
    (equal,) = run_distributed(resumed_vs_exported, 1, timeout=600,
                               args=(trainer_argv(hf, 1) + ["--log-dir", str(root / "log-check")],
                                     str(root / "ckpt"), str(root / "hf-export")))
    assert equal and all(equal.values()), [k for k, same in equal.items() if not same]


def test_eval_math_runs_on_the_save_directory(trained):
    root, hf = trained
    r = _run(["bash", "examples/eval_math.sh"], CKPT=str(root / "ckpt"), MODEL_DIR=hf, DATA_DIR=SAMPLES,
             EVAL_FILES="math.jsonl", N_SAMPLES="1", MAX_NEW_TOKENS="8")
    with open(root / "ckpt-hf-eval-math" / "results.json") as f:
        results = json.load(f)
    assert results, r.stdout
    assert (root / "ckpt-hf" / "config.json").is_file()
