"""Distributed runtime: torch.distributed, Megatron parallel_state, seeding, CPU mode.

One call, :func:`initialize`, brings a process from ``torchrun`` (or the test
harness) to a state where Megatron-Core models can be built: the process group
is up, TP/PP/DP groups exist and the model-parallel RNG is seeded. On a machine
without a GPU (or with ``device="cpu"``) it first installs
:mod:`emapg_megatron.cpu_device` and uses gloo.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from emapg_megatron import cpu_device, expected_warnings


class ConfigError(ValueError):
    """A user error in the configuration: reported as one line, without a traceback."""


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout, the device and the process groups."""

    tensor_model_parallel_size: int = 1
    """TP degree (vocab-sharded logits)."""
    pipeline_model_parallel_size: int = 1
    """PP degree."""
    sequence_parallel: bool = False
    """Megatron's --sequence-parallel: norms' and dropout's activations sharded over TP."""
    device: str = "auto"
    """auto | cpu | cuda (cpu: Megatron-Core on the CPU through cpu_device)."""
    backend: str = "auto"
    """auto | gloo | nccl."""
    seed: int = 1234
    """Seed of weights, data order and sampling."""
    timeout_minutes: int = 30
    """Timeout of every collective, Megatron's groups included: a dead peer ends the run."""

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.resolved_device() == "cuda" else "gloo"

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)


def validate_parallel(cfg: ParallelConfig, world_size: int, *, check_devices: bool = True) -> None:
    """Check the parallel layout before any work starts. Raises :class:`ConfigError`.

    Model-shape checks (heads, groups, layers against TP/PP) live in
    :meth:`emapg_megatron.models.gpt.ModelConfig.validate`.
    """
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ConfigError(f"parallel sizes must be >= 1 (got TP={tp}, PP={pp})")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda (got {cfg.device!r})")
    if cfg.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"--distributed-backend must be auto, gloo or nccl (got {cfg.backend!r})")
    device, backend = cfg.resolved_device(), cfg.resolved_backend()
    if not check_devices and cfg.device == "cuda" and cfg.backend == "auto":
        backend = "nccl"  # a dry run on a CPU machine of a GPU launch
    if device == "cpu" and backend == "nccl":
        raise ConfigError("CPU mode cannot use the nccl backend: use --distributed-backend gloo")
    if check_devices and device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda requested but no GPU is visible")
    if world_size % (tp * pp) != 0:
        raise ConfigError(
            f"world size {world_size} is not TP x PP x DP: TP={tp} x PP={pp} does not divide it"
        )


def quiet_expected_warnings() -> None:
    """Re-apply the package's filters (a caller's ``warnings.resetwarnings`` drops them)."""
    expected_warnings.quiet()


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def initialize(cfg: ParallelConfig) -> None:
    """Initialise torch.distributed (from torchrun's env vars) and Megatron's parallel_state."""
    world_size = _env_int("WORLD_SIZE", 1)
    validate_parallel(cfg, world_size)
    device, backend = cfg.resolved_device(), cfg.resolved_backend()
    if device == "cpu":
        cpu_device.install()
    else:
        torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(
            backend=backend,
            world_size=world_size,
            rank=_env_int("RANK", 0),
            timeout=datetime.timedelta(minutes=cfg.timeout_minutes),
        )
    parallel_state.initialize_model_parallel(**model_parallel_options(cfg))
    torch.manual_seed(cfg.seed)
    model_parallel_cuda_manual_seed(cfg.seed)


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
                create_gloo_process_groups=True,
                distributed_timeout_minutes=cfg.timeout_minutes)


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
