"""The EMA anchor's config (paper Algorithm 3: eta, T_ema) and where its storage lives."""

from __future__ import annotations

from dataclasses import dataclass

from emapg_megatron.configurable import at_least, between, check_fields, option
from emapg_megatron.errors import ConfigError


@dataclass
class EmaConfig:
    """The EMA anchor: theta_ema <- eta theta_ema + (1 - eta) theta every T_ema steps."""

    eta: float = option(0.9, flag="--ema-eta", aliases=("--ref-policy-ema-tau",), range=between(0, 1))
    """EMA anchor decay eta (paper: 0.9-0.95); 1.0 is the fixed reference policy of GRPO, 0 a copy
    of the policy."""
    update_period: int = option(10, flag="--ema-update-period", range=at_least(1))
    """Update the EMA every T_ema trainer steps."""
    shard_over_dp: bool = option(False, flag="--ema-shard-over-dp")
    """Shard the EMA across data-parallel ranks (needs --use-distributed-optimizer)."""
    cpu_offload: bool = option(False, flag="--ema-cpu-offload")
    """Keep the EMA in pinned CPU memory, streamed bucket by bucket."""
    stability_interval: int = option(0, flag="--ema-stability-interval", range=at_least(0))
    """Estimate the stability margin 1+eta-alpha*beta*lambda every N steps (0: off)."""
    transfer_numel: int = 16 * 2**20
    """Staging bucket of the offload stream (fp32 elements)."""

    def validate(self, use_distributed_optimizer: bool) -> None:
        check_fields(self)
        if self.transfer_numel < 1:
            raise ConfigError(f"EMA transfer bucket must hold >= 1 element (got {self.transfer_numel})")
        if self.shard_over_dp and not use_distributed_optimizer:
            raise ConfigError("--ema-shard-over-dp needs --use-distributed-optimizer: the EMA is "
                              "sharded like the distributed optimizer's main params")


@dataclass
class TeacherConfig:
    """On-policy distillation: a frozen teacher takes the EMA's place as the KL anchor."""

    load_hf: str | None = option(None, flag="--teacher-load-hf", path="dir")
    """A Hugging Face model folder (converted on load, like --load-hf) to distil from: the KL term
    becomes KL(student || teacher) (--kl-loss-type, --kl-tail and --kl-coef keep their meaning;
    --kl-in-reward-coef subtracts the sequence's sampled-token log-ratio to the teacher from the
    reward). The teacher needs the student's tokenizer and vocabulary; its depth and width are its
    own. The EMA anchor is off: the --ema-* flags cannot be given."""
    checkpoint: str | None = option(None, flag="--teacher-checkpoint", path="dir")
    """A Megatron checkpoint to distil from instead of --teacher-load-hf: emapg-convert hf-to-mcore's
    output, a trainer's --save directory (its latest step) or one of its iter_N directories."""
    cpu_offload: bool = option(False, flag="--teacher-cpu-offload")
    """Keep the teacher's weights in host memory between its passes (GPU runs)."""

    @property
    def path(self) -> str | None:
        return self.load_hf or self.checkpoint

    @property
    def flag(self) -> str:
        """The flag that named the teacher (for messages)."""
        return "--teacher-load-hf" if self.load_hf else "--teacher-checkpoint"

    def validate(self) -> None:
        check_fields(self)
        if self.load_hf and self.checkpoint:
            raise ConfigError("give the teacher once: --teacher-load-hf or --teacher-checkpoint, not both")
        if self.cpu_offload and not self.path:
            raise ConfigError("--teacher-cpu-offload needs a teacher (--teacher-load-hf or --teacher-checkpoint)")
