"""LoRA's config (:class:`LoRAConfig`) and the names of the layers it adapts. No torch, no Megatron:
the command line can check it before any import of them (docs/lora.md)."""

from __future__ import annotations

from dataclasses import dataclass

from emapg_megatron.configurable import above, at_least, between, check_fields, option
from emapg_megatron.errors import ConfigError

#: Megatron-Core's linears of a GPT layer that take an adapter, and how each is parallel: the
#: column-parallel ones split their output over TP, the row-parallel ones their input.
MEGATRON_TARGETS = {"linear_qkv": "column", "linear_proj": "row", "linear_fc1": "column",
                    "linear_fc2": "row"}

#: Hugging Face (peft) projection names -> the Megatron linear that computes them. q/k/v are one
#: fused ``linear_qkv``, gate/up one fused ``linear_fc1``: an adapter covers a whole fused layer.
HF_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
              "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
              "down_proj": "linear_fc2"}


def is_adapter_name(name: str) -> bool:
    """Whether a parameter's or checkpoint entry's name is an adapter matrix's
    (``<linear>.lora.A`` / ``<linear>.lora.B``) rather than a base model weight's."""
    return ".lora." in name


def megatron_targets(names) -> tuple[str, ...]:
    """The Megatron linears that ``names`` (Megatron or HF names, a list or comma-separated
    entries) adapt, in layer order; ConfigError (one line) for an unknown name or for part of a
    fused layer (q_proj without k_proj and v_proj, gate_proj without up_proj)."""
    given = [n.strip() for entry in names for n in str(entry).split(",") if n.strip()]
    if not given:
        raise ConfigError("--lora-target-modules needs at least one module")
    unknown = [n for n in given if n not in MEGATRON_TARGETS and n not in HF_TARGETS]
    if unknown:
        raise ConfigError(f"--lora-target-modules: unknown module {unknown[0]!r}; known: "
                          f"{', '.join([*MEGATRON_TARGETS, *HF_TARGETS])}")
    for fused in ("linear_qkv", "linear_fc1"):
        parts = [hf for hf, target in HF_TARGETS.items() if target == fused]
        named = [p for p in parts if p in given]
        if named and len(named) < len(parts) and fused not in given:
            raise ConfigError(
                f"--lora-target-modules {','.join(named)}: {', '.join(parts)} are one fused Megatron "
                f"layer ({fused}) and its adapter covers all of them: name all of them or {fused}")
    wanted = {HF_TARGETS.get(n, n) for n in given}
    return tuple(t for t in MEGATRON_TARGETS if t in wanted)


def check_rank(rank: int, layer: str, in_features: int, out_features: int) -> None:
    """A rank no larger than the layer's narrower side (global widths): beyond it A and B cannot
    both have full rank, so the extra rank only costs memory."""
    if rank > min(in_features, out_features):
        raise ConfigError(f"--lora-rank {rank} exceeds the width of {layer} ({in_features} in, "
                          f"{out_features} out): use at most {min(in_features, out_features)}")


@dataclass
class LoRAConfig:
    """LoRA: low-rank adapters on the frozen model's linears, y = W x + (alpha / rank) B A x
    (docs/lora.md). Off at rank 0."""

    rank: int = option(0, flag="--lora-rank", range=at_least(0))
    """Rank of each adapter (0: no LoRA, every weight trains)."""
    alpha: float = option(32.0, flag="--lora-alpha", range=above(0))
    """Scale numerator: an adapter's update is (alpha / rank) B A x."""
    dropout: float = option(0.0, flag="--lora-dropout", range=between(0, 1, high_open=True))
    """Dropout on an adapter's input (not on the frozen layer's)."""
    target_modules: tuple[str, ...] = option(
        tuple(MEGATRON_TARGETS), flag="--lora-target-modules", metavar="MODULE")
    """The linears that take an adapter: Megatron names (linear_qkv, linear_proj, linear_fc1,
    linear_fc2) or Hugging Face ones (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj), space- or comma-separated. q/k/v and gate/up are fused layers in Megatron: name
    all of a fused layer's projections or none."""
    peft_init: str | None = option(None, flag="--lora-peft-init", path="dir")
    """Start the adapters from a peft LoRA folder (adapter_config.json + adapter_model.safetensors,
    e.g. emapg-convert lora-to-peft's) instead of A random, B = 0: continue training it. Its rank
    and alpha must be the flags'; the EMA anchor starts from it."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def targets(self) -> tuple[str, ...]:
        """The Megatron linears to adapt (:func:`megatron_targets`)."""
        return megatron_targets(self.target_modules)

    def validate(self) -> None:
        check_fields(self)
        self.targets()
