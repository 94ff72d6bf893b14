"""Whole trainer steps under the strict device mode: every tensor where a GPU run puts it.

``EMAPG_STRICT_DEVICE=1`` makes the CPU mapping tag tensors requested on CUDA and refuse any op or
NCCL-group collective that mixes them with host tensors (see ``emapg_megatron/cpu_device.py``).
Each run covers the built-in sampler (rollout), the old and anchor passes (EMA swapped in), the
loss, the optimizer step and the EMA update, at the layouts and EMA modes a GPU run uses; one
also saves and resumes. On the code before the GPU-path fixes these runs stopped at the first
forward (norms built on the host), the first batch (tokens on the host) and the sampler (host
uniforms times a device cdf).
"""

import pytest
from trainer_launch import metrics, torchrun

pytestmark = pytest.mark.slow

RUNS = {  # nproc, flags
    "tp2-save-resume": (2, ["--tensor-model-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2-distopt-ema-sharded": (2, ["--use-distributed-optimizer", "--ema-shard-over-dp"]),
    "ema-offload-stability": (1, ["--ema-cpu-offload", "--ema-stability-interval", "1"]),
    "moe-ep2-alltoall-replay": (2, ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
                                    "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
                                    "--moe-routing-replay", "r2"]),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_trainer_steps_keep_every_tensor_on_the_device(name, tmp_path, monkeypatch):
    monkeypatch.setenv("EMAPG_STRICT_DEVICE", "1")
    nproc, flags = RUNS[name]
    ckpt = ["--save", str(tmp_path / "ckpt")] if name.endswith("save-resume") else []
    r = torchrun(nproc, ["--train-iters", "2", *flags, *ckpt], tmp_path / "a")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [m["step"] for m in metrics(tmp_path / "a")] == [1, 2]
    if ckpt:
        r = torchrun(nproc, ["--train-iters", "3", "--load", str(tmp_path / "ckpt"), *flags], tmp_path / "b")
        assert r.returncode == 0, r.stdout + r.stderr
        assert [m["step"] for m in metrics(tmp_path / "b")] == [3]
    assert "DeviceMixError" not in r.stdout + r.stderr
    assert all(m["ema_lag"] > 0 for m in metrics(tmp_path / "a"))  # updates and EMA steps ran
