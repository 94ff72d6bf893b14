"""Put LoRA adapters on a GPTModel (:func:`apply_lora`), read and set them by global name, merge
them into the base weights and take them out again (docs/lora.md).

Names. An adapter is the child ``lora`` of the linear it adapts, so the base keeps its names and
the adapter's matrices are ``<linear>.lora.A`` ``[rank, in]`` and ``<linear>.lora.B``
``[out, rank]``, oriented like peft's. With the global layer index N (:func:`named_adapters`) they
map onto peft's names (prefix ``base_model.model.model.layers.N.``) as follows:

=============================================  =====================================================
ours (``decoder.layers.N.``)                    peft (``base_model.model.model.layers.N.``)
=============================================  =====================================================
``self_attention.linear_qkv.lora.A``            ``self_attn.{q,k,v}_proj.lora_A.weight``: the same A
``self_attention.linear_qkv.lora.B``            ``self_attn.{q,k,v}_proj.lora_B.weight``: B's rows
                                                split per query group ``[q heads, k, v]`` as the
                                                base weight (``checkpoint.hf_mapping.FusedQKV``)
``self_attention.linear_proj.lora.{A,B}``       ``self_attn.o_proj.lora_{A,B}.weight``
``mlp.linear_fc1.lora.A``                       ``mlp.{gate,up}_proj.lora_A.weight``: the same A
``mlp.linear_fc1.lora.B``                       ``mlp.{gate,up}_proj.lora_B.weight``: B's halves
                                                ``[gate; up]`` (``hf_mapping.GateUp``)
``mlp.linear_fc2.lora.{A,B}``                   ``mlp.down_proj.lora_{A,B}.weight``
=============================================  =====================================================

peft's ``lora_alpha`` / ``r`` are ``--lora-alpha`` / ``--lora-rank`` (the same scale). A fused
layer's adapter shares one A between its projections, so it exports exactly into peft's format;
a peft adapter trained with a separate A per projection loads stacked into one of the summed
rank (``checkpoint.peft_format.from_peft``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

from emapg_megatron.errors import ConfigError
from emapg_megatron.lora import adapters
from emapg_megatron.lora.config import MEGATRON_TARGETS, LoRAConfig, check_rank
from emapg_megatron.models.gpt import global_param_name, unwrap

#: Megatron's local linears an adapter wraps, by parallel kind.
LOCAL_CLASSES = {adapters.COLUMN: ColumnParallelLinear, adapters.ROW: RowParallelLinear}


@dataclass(frozen=True)
class BaseLinear:
    """What an adapter needs of the linear it adapts: ``kind`` (``"column"`` / ``"row"``), the
    global widths, the TP group, sequence parallelism, and ``normed_input``: the layer is Transformer
    Engine's ``LayerNormLinear``, which applies the layer's norm itself, so the adapter reads the
    normed input (:func:`adapters.attach`) instead of the raw one."""

    kind: str
    in_features: int
    out_features: int
    tp_group: object
    sequence_parallel: bool
    normed_input: bool = False


def describe_base(name: str, module, kind: str) -> BaseLinear:
    """The :class:`BaseLinear` of ``module`` (Megatron's local ``ColumnParallelLinear`` /
    ``RowParallelLinear``, or a Transformer Engine linear: Megatron's ``TE*Linear`` wrappers or
    TE's own, recognised by TE's ``parallel_mode``), or one line for a layer an adapter cannot
    wrap exactly."""
    if ".experts." in f".{name}." or getattr(module, "is_expert", False):
        raise ConfigError(f"LoRA on mixture-of-experts experts is not supported yet ({name})")
    local = LOCAL_CLASSES[kind]
    if isinstance(module, local):
        if (kind == adapters.COLUMN and module.gather_output) or (kind == adapters.ROW and not module.input_is_parallel):
            raise ConfigError(f"LoRA needs {name} to keep its TP split (no gather_output, a split input)")
        return BaseLinear(kind, module.input_size, module.output_size, module.tp_group,
                          module.sequence_parallel)
    if not hasattr(module, "parallel_mode") or not isinstance(getattr(module, "weight", None), torch.Tensor):
        raise ConfigError(f"LoRA adapts Megatron's {local.__name__} or Transformer Engine's linears; "
                          f"{name} is a {type(module).__name__}")
    if module.parallel_mode != kind:
        raise ConfigError(f"LoRA needs {name} to be {kind}-parallel as in Megatron's GPT layers; this "
                          f"{type(module).__name__} is {module.parallel_mode or 'replicated'} over TP")
    tp = module.tp_size  # TE's in_features / out_features are this rank's
    widths = ((module.in_features, module.out_features * tp) if kind == adapters.COLUMN
              else (module.in_features * tp, module.out_features))
    group = (getattr(module, "_tp_group", None) or getattr(module, "tp_group", None)
             or parallel_state.get_tensor_model_parallel_group())
    return BaseLinear(kind, *widths, group, bool(module.sequence_parallel),
                      normed_input=hasattr(module, "layer_norm_weight"))


def _adapted_linears(gpt, targets: tuple[str, ...]) -> Iterator[tuple[str, torch.nn.Module, str]]:
    for name, module in gpt.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in targets:
            yield name, module, leaf


def apply_lora(model, cfg: LoRAConfig, *, seed: int = 0) -> list[str]:
    """Freeze every parameter of ``model`` (any wrapper of a GPTModel) and give each target
    linear an adapter: A drawn like peft's (:func:`init_adapters`), B = 0, so the model computes
    exactly what it did. Call on the model as built, before DDP and the optimizer. Returns the
    adapted modules' names."""
    gpt = unwrap(model)
    if not cfg.enabled:
        raise ConfigError("--lora-rank 0 means no LoRA: there is nothing to apply")
    cfg.validate()
    found = list(_adapted_linears(gpt, cfg.targets()))
    if not found:
        raise ConfigError(f"--lora-target-modules {' '.join(cfg.target_modules)}: no such layer in "
                          "this model (stage)")
    if any(hasattr(module, "lora") for _, module, _ in found):
        raise ConfigError("this model has LoRA adapters already: apply_lora runs once per model")
    bases = []
    for name, module, leaf in found:  # every refusal before the model changes
        base = describe_base(name, module, MEGATRON_TARGETS[leaf])
        check_rank(cfg.rank, leaf, base.in_features, base.out_features)
        bases.append(base)
    for param in gpt.parameters():
        param.requires_grad_(False)
    for (_, module, leaf), base in zip(found, bases):
        gated = leaf == "linear_fc1" and module.config.gated_linear_unit
        adapters.attach(module, adapters.LoRAAdapter(
            base.kind, base.in_features, base.out_features, cfg.rank, cfg.alpha, cfg.dropout,
            out_blocks=2 if gated else 1, tp_group=base.tp_group,
            sequence_parallel=base.sequence_parallel, dtype=module.weight.dtype,
            device=module.weight.device), normed_input=base.normed_input)
        _shard_adapters_in_checkpoints(module)
    init_adapters(gpt, seed)
    return [name for name, _, _ in found]


def _shard_adapters_in_checkpoints(base) -> None:
    """Make ``base.sharded_state_dict`` (what Megatron's dist_checkpointing, the optimizer's and
    the EMA's checkpoint entries are derived from) give each TP-split adapter matrix its TP
    sharding: Megatron's linear marks every entry but its weight and bias replicated. A gated
    ``linear_fc1``'s B gets the SwiGLU factory of its weight (``[gate_r; up_r]`` per rank)."""
    plain = base.sharded_state_dict

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        out = plain(prefix, sharded_offsets, metadata)
        adapter = base.lora
        for key, param in adapter.named_parameters():
            sharding, name = adapter.shardings[key], f"{prefix}lora.{key}"
            if sharding.dim is None:
                continue  # replicated over TP: Megatron's entry is right
            entry = make_tp_sharded_tensor_for_checkpoint(param, out[name].key, tp_axis=sharding.dim,
                                                          prepend_offsets=sharded_offsets)
            if sharding.blocks == 2:
                singleton = (metadata or {}).get("singleton_local_shards", False)
                entry = apply_swiglu_sharded_factory(entry, sharded_offsets, singleton)
            out[name] = entry
        return out

    base.sharded_state_dict = sharded_state_dict


def named_adapters(model) -> Iterator[tuple[str, adapters.LoRAAdapter]]:
    """``(global name, adapter)`` of every adapter, e.g.
    ``decoder.layers.3.self_attention.linear_qkv.lora`` (the global layer index: PP-stage
    independent)."""
    gpt = unwrap(model)
    for name, module in gpt.named_modules():
        if isinstance(module, adapters.LoRAAdapter):
            yield global_param_name(gpt, name), module


def adapter_parameters(model) -> Iterator[tuple[str, torch.nn.Parameter, adapters.Sharding]]:
    """``(global name, local parameter, its TP sharding)`` of every adapter matrix."""
    for prefix, adapter in named_adapters(model):
        for key, param in adapter.named_parameters():
            yield f"{prefix}.{key}", param, adapter.shardings[key]


def adapter_shapes(model) -> dict[str, tuple[int, ...]]:
    """The whole (one-rank) shape of every adapter matrix of this model stage, by global name."""
    out = {}
    for prefix, adapter in named_adapters(model):
        for key, param in adapter.named_parameters():
            shape, dim = list(param.shape), adapter.shardings[key].dim
            if dim is not None:
                shape[dim] *= adapter.tp
            out[f"{prefix}.{key}"] = tuple(shape)
    return out


def name_seed(seed: int, name: str) -> int:
    """A generator seed from the run's seed and a global parameter name: the same on every rank
    and layout, different for every matrix."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def initial_A(seed: int, name: str, rank: int, in_features: int) -> torch.Tensor:
    """The one-rank initial A of the adapter matrix ``name`` (global, ``<layer>.lora.A``):
    U(-1/sqrt(in), 1/sqrt(in)) (peft's kaiming-uniform), drawn on the host from the seed and the
    name, so every rank and layout draws the same."""
    bound = adapters.kaiming_uniform_bound(in_features)
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.empty(rank, in_features).uniform_(-bound, bound, generator=gen)


@torch.no_grad()
def init_adapters(model, seed: int = 0) -> None:
    """A as :func:`initial_A`, sliced: a TP rank's A is the matching part of the one-rank A, and
    replicated copies are equal. B = 0."""
    for prefix, adapter in named_adapters(model):
        full = initial_A(seed, f"{prefix}.A", adapter.A.shape[0], adapter.in_features)
        adapter.A.copy_(adapter.local("A", full))
        adapter.B.zero_()


@torch.no_grad()
def set_adapter_weights(model, full: Mapping[str, torch.Tensor]) -> None:
    """Copy one-rank (whole) adapter matrices, by global name, into this rank's shards; every
    adapter matrix of the model must be given."""
    for prefix, adapter in named_adapters(model):
        for key, param in adapter.named_parameters():
            if f"{prefix}.{key}" not in full:
                raise ConfigError(f"no value for the adapter matrix {prefix}.{key}")
            param.copy_(adapter.local(key, full[f"{prefix}.{key}"]))


def has_adapters(model) -> bool:
    """Whether ``model`` (any wrapper of a GPTModel) carries LoRA adapters."""
    return any(True for _ in _adapted_layers(model))


@contextmanager
def adapters_off(model_chunks):
    """Every adapter of ``model_chunks`` switched off for the ``with`` block: the chunks compute
    the frozen base model (an adapter that is merged is refused: its update is in the weight)."""
    layers = [layer for chunk in model_chunks for layer in _adapted_layers(chunk)]
    if any(layer.lora.merged for layer in layers):
        raise RuntimeError("adapters_off on merged adapters: unmerge first")
    for layer in layers:
        layer.lora.enabled = False
    try:
        yield model_chunks
    finally:
        for layer in layers:
            layer.lora.enabled = True


def is_merged(model) -> bool:
    """Whether every adapter of ``model`` is merged into its base weight (False without any)."""
    layers = list(_adapted_layers(model))
    return bool(layers) and all(layer.lora.merged for layer in layers)


def any_merged(model) -> bool:
    """Whether any adapter of ``model`` is merged into its base weight."""
    return any(layer.lora.merged for layer in _adapted_layers(model))


def merge_lora(model) -> None:
    """Fold every adapter into its base weight (:func:`adapters.merge`)."""
    for layer in _adapted_layers(model):
        adapters.merge(layer)


def unmerge_lora(model) -> None:
    """Take every adapter out of its base weight again (:func:`adapters.unmerge`)."""
    for layer in _adapted_layers(model):
        adapters.unmerge(layer)


def _adapted_layers(model) -> Iterator[torch.nn.Module]:
    return (m for m in unwrap(model).modules() if isinstance(getattr(m, "lora", None), adapters.LoRAAdapter))
