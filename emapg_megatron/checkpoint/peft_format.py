"""Adapters in peft's format: ``adapter_config.json`` + ``adapter_model.safetensors``, loadable by
``peft.PeftModel.from_pretrained`` on the base Hugging Face model (docs/lora.md).

The names follow :mod:`emapg_megatron.lora.apply`'s table. A fused layer's adapter becomes one
peft adapter per HF projection: the shared A for each, B's rows split the way the HF mapping splits
the base weight (the same codec: ``FusedQKV`` per query group, ``GateUp`` into halves), so
``B_q @ A`` is exactly the q rows of ``B @ A``. Reading one back needs each fused layer's
projections to share one A (what an export writes); a peft adapter trained with its own A per
projection is a rank-3r family our fused adapters cannot hold, refused in one line.

The conversions (:func:`to_peft`, :func:`from_peft`) are pure, on whole (one-rank) matrices keyed
by global name; :func:`gathered_adapters` assembles them from a TP-split model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from emapg_megatron.checkpoint.hf_mapping import HFMapping
from emapg_megatron.errors import ConfigError, shown
from emapg_megatron.lora.config import LoRAConfig
from emapg_megatron.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes


def _parts(mapping: HFMapping, adapter: str):
    """The HF projections (``model.layers.N.self_attn.q_proj``, ...) and codec of the base linear of
    ``adapter`` (``decoder.layers.N.self_attention.linear_qkv.lora``)."""
    base = adapter.removesuffix(".lora") + ".weight"
    entry = mapping.lookup(base)
    if entry is None:
        raise ConfigError(f"no HF projection for the adapted layer {base}")
    return [n.removesuffix(".weight") for n in entry.hf], entry.codec


def to_peft(adapters: Mapping[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """peft's state dict of the whole adapter matrices ``adapters`` (``<layer>.lora.A`` /
    ``<layer>.lora.B`` by global name)."""
    mapping, out = HFMapping(model_cfg), {}
    for name in sorted(adapters):
        adapter, _, matrix = name.rpartition(".")
        projections, codec = _parts(mapping, adapter)
        t = adapters[name].detach().cpu().contiguous()
        values = [t] * len(projections) if matrix == "A" else codec.to_hf([t])
        for hf, value in zip(projections, values, strict=True):  # a copy each: peft's file has no aliases
            out[f"{PEFT_PREFIX}{hf}.lora_{matrix}.weight"] = value.clone(memory_format=torch.contiguous_format)
    return out


def from_peft(state: Mapping[str, torch.Tensor], model_cfg: ModelConfig,
              shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The whole adapter matrices (by global name, of ``shapes``: what the model holds) from
    peft's state dict; one-line ConfigError for a missing, mis-shaped or unshared-A adapter and
    for tensors the model has no adapter for."""
    mapping, out, used = HFMapping(model_cfg), {}, set()
    for name, shape in shapes.items():
        adapter, _, matrix = name.rpartition(".")
        projections, codec = _parts(mapping, adapter)
        keys = [f"{PEFT_PREFIX}{hf}.lora_{matrix}.weight" for hf in projections]
        missing = [k for k in keys if k not in state]
        if missing:
            raise ConfigError(f"the peft adapter has no {missing[0]} (the model adapts {adapter})")
        used.update(keys)
        if matrix == "A":
            first = state[keys[0]]
            if any(not torch.equal(state[k], first) for k in keys[1:]):
                raise ConfigError(f"the peft adapter gives {', '.join(p.rsplit('.', 1)[-1] for p in projections)} "
                                  "their own lora_A: a fused layer's adapter shares one A between them "
                                  "(as the adapters this package exports do)")
            value = first
        else:
            value = codec.to_megatron(lambda n, index: state[_peft_key(n, matrix)][index or ()],
                                      [f"{hf}.weight" for hf in projections], 0, 1, shape)
        if tuple(value.shape) != tuple(shape):
            raise ConfigError(f"the peft adapter's {name}: shape {tuple(value.shape)}, the model's {tuple(shape)} "
                              "(another rank or base model?)")
        out[name] = value.float().clone()
    _refuse_unadapted(set(state) - used)
    return out


def _refuse_unadapted(extra: set[str]) -> None:
    """One line naming peft tensors the model has no adapter for."""
    if extra:
        names = sorted(extra)
        raise ConfigError(f"the peft adapter holds tensors this model does not adapt: {shown(names[:3])}"
                          + (f" (and {len(names) - 3} more)" if len(names) > 3 else ""))


def _peft_key(hf_weight: str, matrix: str) -> str:
    return f"{PEFT_PREFIX}{hf_weight.removesuffix('.weight')}.lora_{matrix}.weight"


def peft_config(cfg: LoRAConfig, adapters: Mapping[str, torch.Tensor], model_cfg: ModelConfig,
                base: str | None = None) -> dict:
    """``adapter_config.json`` for these adapters: peft's LoRA with our rank, alpha and dropout on
    the HF projections they cover."""
    mapping = HFMapping(model_cfg)
    targets = sorted({hf.rsplit(".", 1)[-1] for name in adapters
                      for hf in _parts(mapping, name.rpartition(".")[0])[0]})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "bias": "none",
            "target_modules": targets, "fan_in_fan_out": False, "use_rslora": False,
            "init_lora_weights": True, "modules_to_save": None}


def save_peft(out_dir: str | Path, cfg: LoRAConfig, adapters: Mapping[str, torch.Tensor],
              model_cfg: ModelConfig, base: str | None = None) -> int:
    """Write ``out_dir`` (a new or empty folder) in peft's format; returns the tensor bytes
    written (peft's names: a fused layer's shared A counts once per projection)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise ConfigError(f"{out} is not empty: the adapter folder is written afresh")
    state = to_peft(adapters, model_cfg)
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(peft_config(cfg, adapters, model_cfg, base), indent=2) + "\n")
    return sum(t.numel() * t.element_size() for t in state.values())


def read_peft_config(adapter_dir: str | Path) -> LoRAConfig:
    """The rank, alpha and dropout of a peft LoRA folder, checked (one line for anything else: a
    non-LoRA peft type, rsLoRA, fan-in-fan-out weights, biases trained, per-module ranks)."""
    from emapg_megatron.checkpoint.safe_load import read_json

    path = Path(adapter_dir) / CONFIG_FILE
    if not os.path.lexists(path):
        raise ConfigError(f"{adapter_dir}: no {CONFIG_FILE} (a peft adapter folder has one)")
    # a regular file of bounded size inside the folder (not a link out of it, not a pipe)
    cfg = read_json(str(path), MAX_CONFIG_BYTES, "invalid JSON in", root=str(adapter_dir))
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise ConfigError(f"{path}: peft_type {shown(cfg.get('peft_type') if isinstance(cfg, dict) else cfg)}, "
                          "not LORA")
    unsupported = [f"{k}={shown(cfg[k])}" for k, ok in (
        ("use_rslora", False), ("fan_in_fan_out", False), ("bias", "none"), ("use_dora", False))
        if k in cfg and cfg[k] != ok]
    unsupported += [f"{k}={shown(cfg[k])}" for k in ("rank_pattern", "alpha_pattern", "modules_to_save",
                                                     "layers_to_transform") if cfg.get(k)]
    if unsupported:
        raise ConfigError(f"{path}: {', '.join(unsupported)} is not supported (plain LoRA only)")
    rank, alpha, dropout = cfg.get("r"), cfg.get("lora_alpha"), cfg.get("lora_dropout", 0.0)
    if type(rank) is not int or rank < 1 or not _number(alpha) or not _number(dropout):
        raise ConfigError(f"{path}: r {shown(rank)}, lora_alpha {shown(alpha)}, lora_dropout {shown(dropout)}: "
                          "an integer rank >= 1 and numbers")
    return LoRAConfig(rank=rank, alpha=float(alpha), dropout=float(dropout))


def _number(x) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def load_peft(adapter_dir: str | Path, model_cfg: ModelConfig,
              shapes: Mapping[str, tuple[int, ...]]) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """A peft LoRA folder's config and whole adapter matrices for a model holding ``shapes``
    (safetensors only: nothing in the folder is unpickled)."""
    from safetensors import SafetensorError, safe_open

    from emapg_megatron.checkpoint.safe_load import checked_file, first_line

    cfg = read_peft_config(adapter_dir)
    weights = Path(adapter_dir) / WEIGHTS_FILE
    if not os.path.lexists(weights):
        raise ConfigError(f"{adapter_dir}: no {WEIGHTS_FILE} (peft's safetensors weights; a .bin is "
                          "never unpickled)")
    checked_file(str(weights), str(adapter_dir))  # a regular file inside the folder, not a pipe
    # what the model's adapters look like in peft's names: every shape checked before a read
    expected = {k: tuple(v.shape) for k, v in
                to_peft({n: torch.zeros(shape) for n, shape in shapes.items()}, model_cfg).items()}
    try:
        with safe_open(str(weights), framework="pt") as handle:
            stored = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}  # noqa: SIM118
            wrong = sorted(f"{k}: {stored[k]} != {expected[k]}" for k in set(stored) & set(expected)
                           if stored[k] != expected[k])
            if wrong:
                raise ConfigError(f"{weights}: adapter shapes differ from this model's (another rank or "
                                  f"base model?): {'; '.join(wrong[:3])}")
            state = {k: handle.get_tensor(k) for k in stored if k in expected}
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"corrupt safetensors file {weights}: {first_line(e)}") from None
    _refuse_unadapted(set(stored) - set(expected))  # the state below holds only the expected ones
    return cfg, from_peft(state, model_cfg, shapes)


@torch.no_grad()
def init_from_peft(model_chunks, lora: LoRAConfig, model_cfg: ModelConfig) -> None:
    """Set every chunk's adapters from the peft folder ``lora.peft_init`` (--lora-peft-init; its
    rank and alpha were checked against the run's with the flags). Call before the optimizer's
    main params and the EMA are taken from the weights."""
    from emapg_megatron.lora.apply import adapter_shapes, set_adapter_weights

    for chunk in model_chunks:
        _, full = load_peft(lora.peft_init, model_cfg, adapter_shapes(chunk))
        set_adapter_weights(chunk, full)


def gathered_adapters(model) -> dict[str, torch.Tensor]:
    """The whole adapter matrices of this model stage by global name, each TP-split one gathered
    over its tensor-parallel group (a collective over it)."""
    import torch.distributed as dist

    from emapg_megatron.lora.apply import named_adapters

    out = {}
    for prefix, adapter in named_adapters(model):
        for key, param in adapter.named_parameters():
            sharding = adapter.shardings[key]
            tp = dist.get_world_size(adapter.tp_group) if adapter.tp_group is not None else 1
            shards = [param.detach()]
            if sharding.dim is not None and tp > 1:
                shards = [torch.empty_like(param) for _ in range(tp)]
                dist.all_gather(shards, param.detach().contiguous(), group=adapter.tp_group)
            out[f"{prefix}.{key}"] = sharding.full(shards).float().cpu()
    return out
