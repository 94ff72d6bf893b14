"""torch.distributed, Megatron parallel_state, seeding, CPU mode.

One call, :func:`initialize`, brings a process from ``torchrun`` (or the test
harness) to a state where Megatron-Core models can be built: the process group
is up, TP/PP/DP groups exist and the model-parallel RNG is seeded. On a machine
without a GPU (or with ``device="cpu"``) it first installs
:mod:`emapg_megatron.cpu_device` and uses gloo.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from emapg_megatron import cpu_device, expected_warnings
from emapg_megatron.runtime.config import ParallelConfig


def quiet_expected_warnings() -> None:
    """Re-apply the package's filters (a caller's ``warnings.resetwarnings`` drops them)."""
    expected_warnings.quiet()


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def initialize(cfg: ParallelConfig, seed: int = 1234) -> None:
    """Initialise torch.distributed (from torchrun's env vars) and Megatron's parallel_state, and
    seed the model-parallel RNG with ``seed``."""
    from emapg_megatron import mcore_compat  # noqa: F401  (fills the release's gaps without TE)

    world_size = _env_int("WORLD_SIZE", 1)
    cfg.validate(world_size)
    device, backend = cfg.resolved_device(), cfg.resolved_backend()
    if device == "cpu":
        cpu_device.install()
    else:
        torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if world_size == 1 and "MASTER_PORT" not in os.environ:
            # a lone process has no peer to agree on a port with: two such runs on one machine
            # must not both take 29500 (the second failed with EADDRINUSE)
            os.environ["MASTER_PORT"] = str(_free_port())
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(
            backend=backend,
            world_size=world_size,
            rank=_env_int("RANK", 0),
            timeout=datetime.timedelta(minutes=cfg.timeout_minutes),
        )
    parallel_state.initialize_model_parallel(**model_parallel_options(cfg))
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_failure(exc: BaseException) -> str | None:
    """One line for a collective that failed because a peer died or hung, else None."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    dist_error = isinstance(exc, getattr(dist, "DistError", ()))
    peer_words = ("Connection closed by peer", "Connection reset by peer", "timed out", "Timed out",
                  "Broken pipe", "NCCL communicator was aborted", "ProcessGroupGloo")
    if dist_error or (isinstance(exc, RuntimeError) and any(w in text for w in peer_words)):
        return (f"a collective failed ({text}): a peer process died or stopped responding "
                "(see the other ranks' logs; --distributed-timeout-minutes bounds the wait)")
    return None


def model_parallel_options(cfg: ParallelConfig) -> dict:
    """Arguments of Megatron's ``initialize_model_parallel`` for this config.

    The Gloo groups are created under nccl too: Megatron's optimizer asks for the Gloo
    (intra-partial) data-parallel groups whatever the backend, to move optimizer state on the CPU.
    """
    return dict(tensor_model_parallel_size=cfg.tensor_model_parallel_size,
                pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
                expert_model_parallel_size=cfg.expert_model_parallel_size,
                expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
                create_gloo_process_groups=True,
                distributed_timeout_minutes=cfg.timeout_minutes)


def end_child_processes() -> None:
    """Kill this process's multiprocessing children (the writers Megatron forks during a save and
    its results Manager): a rank that exits without teardown must not leave them running."""
    for child in multiprocessing.active_children():
        child.kill()


def destroy() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def device() -> torch.device:
    """The device model tensors and batches are placed on: this rank's GPU.

    In CPU mode this is still ``cuda:N`` on purpose: :mod:`emapg_megatron.cpu_device` maps the
    request to the CPU (and its strict mode tags the result as a device tensor), so the code placing
    a tensor is the same on both platforms and a missing placement shows up in CPU tests. Without
    the mapping and without a GPU (plain unit tests) it is the CPU.
    """
    if cpu_device.installed() or torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def hardware() -> str:
    """What really computes: ``"cuda"``, or ``"cpu"`` (CPU mode, or no GPU)."""
    return "cuda" if torch.cuda.is_available() and not cpu_device.installed() else "cpu"
