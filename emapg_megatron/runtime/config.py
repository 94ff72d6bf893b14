"""The parallel layout, the device and the process groups a run asks for: the config of
:mod:`emapg_megatron.runtime`. A plain dataclass that imports neither torch nor Megatron (the CLI
checks it before anything heavy is loaded)."""

from __future__ import annotations

from dataclasses import dataclass

from emapg_megatron.configurable import at_least, check_fields, option
from emapg_megatron.errors import ConfigError


def _gpu_visible() -> bool:
    import torch  # only when a device must be resolved: --help and flag checks stay light

    return torch.cuda.is_available()


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout, the device and the process groups."""

    tensor_model_parallel_size: int = option(1, range=at_least(1))
    """TP degree (vocab-sharded logits)."""
    pipeline_model_parallel_size: int = option(1, range=at_least(1))
    """PP degree."""
    expert_model_parallel_size: int = option(1, range=at_least(1))
    """EP degree of a mixture-of-experts model: each rank of an expert-parallel group holds
    experts / EP of every MoE layer's experts (carved out of the data-parallel ranks)."""
    expert_tensor_parallel_size: int | None = option(None, range=at_least(1))
    """TP degree inside each expert; default --tensor-model-parallel-size."""
    sequence_parallel: bool = option(False)
    """Megatron sequence parallelism: with TP >= 2, shard the norms' and dropout's activations
    along the sequence over the TP group (needs --seq-length divisible by TP)."""
    device: str = option("auto", choices=("auto", "cpu", "cuda"))
    """cpu runs Megatron-Core on the CPU with gloo; auto picks cuda when a GPU is visible."""
    backend: str = option("auto", flag="--distributed-backend", choices=("auto", "gloo", "nccl"))
    """torch.distributed backend; auto = nccl on GPU, gloo on CPU."""
    timeout_minutes: int = option(30, flag="--distributed-timeout-minutes", range=at_least(1))
    """Timeout of every collective, Megatron's groups included: a dead peer ends the run."""

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if _gpu_visible() else "cpu"

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.resolved_device() == "cuda" else "gloo"

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    @property
    def expert_tensor_size(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def expert_data_parallel_size(self, world_size: int) -> int:
        """Ranks holding the same experts (their gradients are reduced over these)."""
        return world_size // (self.expert_tensor_size * self.expert_model_parallel_size *
                              self.pipeline_model_parallel_size)

    def validate(self, world_size: int, *, check_devices: bool = True) -> None:
        """The layout against ``world_size`` and the machine (``check_devices=False``: a dry run,
        maybe of a GPU launch on a CPU machine). Model shapes against TP/PP: ModelConfig.validate."""
        check_fields(self)
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        backend = self.resolved_backend()
        if not check_devices and self.device == "cuda" and self.backend == "auto":
            backend = "nccl"  # a dry run on a CPU machine of a GPU launch
        if self.resolved_device() == "cpu" and backend == "nccl":
            raise ConfigError("CPU mode cannot use the nccl backend: use --distributed-backend gloo")
        if check_devices and self.resolved_device() == "cuda" and not _gpu_visible():
            raise ConfigError("--device cuda requested but no GPU is visible")
        if world_size % (tp * pp) != 0:
            raise ConfigError(f"world size {world_size} is not TP x PP x DP: TP={tp} x PP={pp} "
                              f"does not divide it (start a multiple of {tp * pp} ranks, e.g. emapg-train "
                              f"--nproc-per-node {tp * pp} ..., or set --tensor-model-parallel-size and "
                              f"--pipeline-model-parallel-size for {world_size})")
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_size
        if world_size % (etp * ep * pp) != 0:
            raise ConfigError(f"world size {world_size} is not expert TP x EP x PP x expert DP: expert "
                              f"TP={etp} x EP={ep} x PP={pp} does not divide it (start a multiple of "
                              f"{etp * ep * pp} ranks, or lower --expert-model-parallel-size)")
        if self.sequence_parallel and tp < 2:
            raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size >= 2")
