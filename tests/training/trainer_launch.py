"""Launching the trainer as a user does (``torchrun -m emapg_megatron.train``) and reading its
metrics: shared by the trainer, checkpoint, strict-device and task end-to-end tests.

:func:`torchrun` runs the trainer on ranks forked from the preloaded forkserver
(``emapg_megatron.multiprocess.launch_ranks``: torchrun's environment, the trainer's own
``run`` and exit codes, each rank's output) unless ``real=True`` or ``wait=False``: a real
``python -m torch.distributed.run`` is kept for what only a launch shows (signals sent to the
ranks, a killed peer, torchrun's own exit codes, one smoke run); such tests are marked
``launch``."""

import os
import subprocess
import sys

from emapg_megatron.multiprocess import free_port, launch_ranks, preload
from emapg_megatron.run.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
preload("emapg_megatron.train")  # the ranks' program: imported once, by the forkserver

BASE = ["--preset", "tiny-cpu", "--rollout-batch-size", "4", "--num-samples-per-prompt", "4",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--ppo-epochs", "1",
        "--ema-update-period", "1", "--ema-eta", "0.5", "--max-new-tokens", "4",
        "--tensor-model-parallel-size", "1", "--untie-embeddings-and-output-weights",
        # The WARP sequence-KL reward is on in every run, so layouts and resume cover it too.
        "--kl-in-reward-coef", "0.05"]

# The per-step metrics compared between runs (layouts, resumes).
COMPARED = ("reward_mean", "kl", "pg_loss", "entropy", "clip_frac", "ema_lag")


def torchrun(nproc, argv, log_dir, timeout=300, wait=True, real=False):
    """The trainer on ``nproc`` ranks with ``BASE + argv --log-dir LOG_DIR``: a CompletedProcess
    (stdout and stderr: every rank's), or with ``wait=False`` the real launch's Popen (its
    stderr joined to stdout)."""
    argv = [*BASE, *argv, "--log-dir", str(log_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    if wait and not real:
        return run_trainer(nproc, argv, timeout=timeout, env=env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), "-m", "emapg_megatron.train", *argv]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def train_main(argv: list) -> int:
    """A rank's program: ``python -m emapg_megatron.train ARGV`` (``main`` without its exit)."""
    from emapg_megatron import train

    sys.argv = [train.__file__, *argv]
    return train.run_checked(lambda: train.run(argv))


def run_trainer(nproc: int, argv: list, timeout: float = 300, env: dict | None = None,
                cwd: str | None = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node NPROC -m emapg_megatron.train ARGV`` on forked ranks."""
    return launch_ranks(train_main, nproc, args=(list(argv),), timeout=timeout, env=env, cwd=cwd,
                        name="emapg_megatron.train")


def emapg_train(*argv, nproc: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
    """What ``emapg-train --nproc-per-node 2 --preset tiny-cpu ARGV`` (tests/test_launch.py's
    ``launch``) runs once its validation passed: the trainer on 2 ranks, from the repository
    root. For tests of the trainer behind it; the launcher itself is tested with real launches."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    return run_trainer(nproc, ["--preset", "tiny-cpu", *argv], timeout=timeout, env=env, cwd=ROOT)


def metrics(log_dir):
    """The run's metrics.jsonl, one dict per logged step (the trainer's own reader)."""
    return read_jsonl(os.path.join(log_dir, "metrics.jsonl"))
