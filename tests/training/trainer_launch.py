"""Launching the trainer as a user does (``torchrun -m emapg_megatron.train``) and reading its
metrics: shared by the trainer, checkpoint, strict-device and task end-to-end tests."""

import os
import subprocess
import sys

from emapg_megatron.multiprocess import free_port
from emapg_megatron.run.metrics import read_jsonl

BASE = ["--preset", "tiny-cpu", "--rollout-batch-size", "4", "--num-samples-per-prompt", "4",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--ppo-epochs", "1",
        "--ema-update-period", "1", "--ema-eta", "0.5", "--max-new-tokens", "4",
        "--tensor-model-parallel-size", "1", "--untie-embeddings-and-output-weights",
        # The WARP sequence-KL reward is on in every run, so layouts and resume cover it too.
        "--kl-in-reward-coef", "0.05"]

# The per-step metrics compared between runs (layouts, resumes).
COMPARED = ("reward_mean", "kl", "pg_loss", "entropy", "clip_frac", "ema_lag")


def torchrun(nproc, argv, log_dir, timeout=300, wait=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), "-m", "emapg_megatron.train", *BASE, *argv,
           "--log-dir", str(log_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def metrics(log_dir):
    """The run's metrics.jsonl, one dict per logged step (the trainer's own reader)."""
    return read_jsonl(os.path.join(log_dir, "metrics.jsonl"))
