"""Shared helpers of the GPU test set: optional-dependency probes, the trainer flags and launcher, metrics.

Nothing here touches CUDA in the pytest process: probes run in a subprocess, and every GPU run is
a spawned rank (``run_distributed(..., device="cuda")``) or a ``torchrun`` subprocess, so the
pytest process never holds GPU memory that a later test (vLLM sizes its KV cache from the free
memory) would miss.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The trainer's CLI flags shared by every GPU trainer run: the tiny-cpu preset's model (2 layers,
# hidden 64, the 13-token copy task) on one GPU. One PPO mini-batch per step (global batch = the
# whole rollout), so step 1's first loss sees pi_theta == pi_ema and its KL is 0; EMA updated
# every step with eta 0.5, so step 2's KL is not.
TRAINER_BASE = [
    "--preset", "tiny-cpu", "--device", "cuda", "--bf16", "--tensor-model-parallel-size", "1",
    "--train-iters", "2", "--rollout-batch-size", "8", "--num-samples-per-prompt", "4",
    "--micro-batch-size", "16", "--global-batch-size", "32", "--max-new-tokens", "4",
    "--ema-update-period", "1", "--ema-eta", "0.5", "--kl-topk-tokens", "4",
]


# --- optional dependencies ------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def import_problem(statement: str, timeout: float = 300.0) -> str | None:
    """None if ``statement`` (e.g. ``import vllm``) runs in a fresh interpreter, else why not.

    A subprocess, so a package that is installed but broken (a TE whose torch extension was never
    built, a vLLM compiled against another torch) is found out without poisoning this process.
    """
    try:
        r = subprocess.run([sys.executable, "-c", statement], capture_output=True, text=True,
                           timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return f"`{statement}` did not finish in {timeout:.0f}s"
    if r.returncode == 0:
        return None
    lines = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
    return f"`{statement}` fails: {lines[-1] if lines else f'exit code {r.returncode}'}"


def require_import(statement: str, what: str) -> None:
    problem = import_problem(statement)
    if problem is not None:
        pytest.skip(f"{what}: {problem}")


def require_te() -> None:
    require_import("import transformer_engine.pytorch", "needs Transformer Engine (see docs/gpu.md)")


def require_vllm() -> None:
    require_import("import vllm", "needs vLLM (pip install 'emapg-megatron[gpu]')")


@functools.lru_cache(maxsize=None)
def compute_capability() -> tuple[int, int]:
    r = subprocess.run([sys.executable, "-c",
                        "import torch; print(*torch.cuda.get_device_capability())"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"cannot query the GPU: {r.stderr.strip()[-500:]}")
    major, minor = r.stdout.split()
    return int(major), int(minor)


# --- the trainer CLI ------------------------------------------------------------------------
LOCAL_SPEC = ["--transformer-impl", "local"]  # Megatron's local layers, even where TE is installed
FP8_HYBRID = ["--transformer-impl", "transformer_engine", "--fp8-format", "hybrid"]

# The EMA anchor modes the in-process trainer tests run (flags added to TRAINER_BASE).
EMA_MODES = {
    "plain": [],
    "shard-over-dp": ["--use-distributed-optimizer", "--ema-shard-over-dp"],
    "cpu-offload": ["--ema-cpu-offload"],
}


def vllm_flags(hf_dir: str) -> list[str]:
    """The vLLM rollout engine on the tiny local Qwen2 (``tests/tiny_hf.py``) in ``hf_dir``."""
    return ["--rollout-engine", "vllm", "--load-hf", hf_dir, "--seq-length", "32",
            "--make-vocab-size-divisible-by", "64", "--vllm-gpu-memory-utilization", "0.3",
            "--vllm-enforce-eager", "--vllm-weight-sync-bucket-mb", "1"]


def torchrun_train(argv: list[str], log_dir, *, timeout: float = 420.0) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 1 -m emapg_megatron.train ARGV --log-dir LOG_DIR``."""
    from emapg_megatron.multiprocess import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
           "--master_port", str(free_port()), "-m", "emapg_megatron.train", *argv, "--log-dir", str(log_dir)]
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def output_tail(r: subprocess.CompletedProcess, n: int = 4000) -> str:
    return f"exit {r.returncode}\n--- stdout ---\n{r.stdout[-n:]}\n--- stderr ---\n{r.stderr[-n:]}"


def read_metrics(log_dir) -> list[dict]:
    with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def check_common_metrics(ms: list[dict], steps: int = 2, logprob_tol: float = 0.05) -> None:
    """What every healthy GPU trainer run logs: each step, finite numbers, nothing skipped."""
    assert [m["step"] for m in ms] == list(range(1, steps + 1)), [m.get("step") for m in ms]
    for m in ms:
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {m['step']}: non-finite metrics {bad}"
        assert m["skipped"] == 0, f"step {m['step']} was skipped"
        assert 0.0 <= m["reward_mean"] <= 1.0
        assert m["response_len"] > 0 and m["tokens_per_s"] > 0
        assert 0 < m["rollout_time_s"] < m["step_time_s"]
        assert m["entropy"] > 0
        # Sampler and trainer see the same bf16 model: their log-probs of the sampled tokens agree
        # to bf16 rounding (a model left on the CPU, or another device's weights, would not).
        assert m["rollout_logprob_diff"] < logprob_tol, m["rollout_logprob_diff"]
        assert m["max_memory_allocated_gib"] > 0, f"step {m['step']}: nothing allocated on the GPU?"
