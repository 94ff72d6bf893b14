"""Adapters in peft's format: ``adapter_config.json`` + ``adapter_model.safetensors``, loadable by
``peft.PeftModel.from_pretrained`` on the base Hugging Face model (docs/lora.md).

The names follow :mod:`emapg_megatron.lora.apply`'s table. A fused layer's adapter becomes one
peft adapter per HF projection: the shared A for each, B's rows split the way the HF mapping splits
the base weight (the same codec: ``FusedQKV`` per query group, ``GateUp`` into halves), so
``B_q @ A`` is exactly the q rows of ``B @ A``.

Reading one (:func:`from_peft`) takes a peft adapter of rank r into the model's rank R >= r with
the same scale (alpha / r = the run's alpha / R, checked with the flags). A layer's A is the A
its projections share (an export of ours) or, when each projection has its own A (peft's usual
adapters, q_proj, k_proj and v_proj each with its own), those A stacked: ``[A_q; A_k; A_v]`` is a
rank-3r A of ``linear_qkv`` and B holds each projection's B in its own A's columns, zero in the
others, so B A is exactly peft's update. Rows of A past the peft's are the run's own initial A
(B zero there: a fresh adapter's share of the rank, which trains as one), and a projection the
peft adapter leaves out gets zero B rows. Training then moves the whole B: the adapter stays a
shared-A one of rank R, exported as such.

The conversions (:func:`to_peft`, :func:`from_peft`) are pure, on whole (one-rank) matrices keyed
by global name; :func:`gathered_adapters` assembles them from a TP-split model.
"""

from __future__ import annotations

import hashlib
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
              shapes: Mapping[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    """The whole adapter matrices (by global name, of ``shapes``: what the model holds, rank R)
    from peft's state dict (module docstring); rows of A the peft adapter does not fill are
    :func:`~emapg_megatron.lora.apply.initial_A` of ``seed``. One-line ConfigError for a layer
    with no adapter, a projection with A and no B (or B and no A), mis-shaped matrices, more rows
    of A than R, and tensors the model has no adapter for."""
    from emapg_megatron.lora.apply import initial_A

    mapping, out, used = HFMapping(model_cfg), {}, set()
    for adapter in sorted({name.rpartition(".")[0] for name in shapes}):
        projections, codec = _parts(mapping, adapter)
        (rank, width), b_shape = shapes[f"{adapter}.A"], shapes[f"{adapter}.B"]
        keys = {hf: (_peft_key(hf, "A"), _peft_key(hf, "B")) for hf in projections}
        present = [hf for hf, pair in keys.items() if any(k in state for k in pair)]
        if not present:
            raise ConfigError(f"the peft adapter has no {keys[projections[0]][0]} (the model adapts {adapter})")
        for hf in present:
            missing = [k for k in keys[hf] if k not in state]
            if missing:
                raise ConfigError(f"the peft adapter has no {missing[0]} (the model adapts {adapter})")
            used.update(keys[hf])
        a_of = {hf: state[keys[hf][0]] for hf in present}
        for hf, a in a_of.items():
            if a.ndim != 2 or a.shape[1] != width:
                raise ConfigError(f"the peft adapter's {keys[hf][0]}: shape {tuple(a.shape)}, the model's "
                                  f"input width is {width} (another base model?)")
        blocks, block_of = _distinct(list(a_of.values()))
        offsets = [sum(b.shape[0] for b in blocks[:i]) for i in range(len(blocks))]
        rows = sum(b.shape[0] for b in blocks)
        if rows > rank:
            names = ", ".join(p.rsplit(".", 1)[-1] for p in present)
            own = (f"{names} have {len(blocks)} distinct lora_A, {rows} rows stacked" if len(blocks) > 1
                   else f"rank {rows}")
            raise ConfigError(f"the peft adapter's {own}: {adapter} needs --lora-rank {rows} at least "
                              f"(this run has {rank}), its alpha scaled alike")
        A = torch.cat([a.float() for a in blocks], 0)
        if rows < rank:
            A = torch.cat([A, initial_A(seed, f"{adapter}.A", rank, width)[rows:]], 0)
        b_hf = {}
        out_rows = [t.shape[0] for t in codec.to_hf([torch.zeros(b_shape)])]  # each projection's
        for hf, b_rows in zip(projections, out_rows, strict=True):
            b = torch.zeros(b_rows, rank)
            if hf in a_of:  # its B in the columns of its A's block
                given, r = state[keys[hf][1]], a_of[hf].shape[0]
                if tuple(given.shape) != (b_rows, r):
                    raise ConfigError(f"the peft adapter's {keys[hf][1]}: shape {tuple(given.shape)}, not "
                                      f"{(b_rows, r)} (the model's output rows, its lora_A's rank)")
                start = offsets[block_of[present.index(hf)]]
                b[:, start:start + r] = given.float()
            b_hf[f"{hf}.weight"] = b
        out[f"{adapter}.A"] = A
        out[f"{adapter}.B"] = codec.to_megatron(lambda n, index: b_hf[n][index or ()],
                                                list(b_hf), 0, 1, b_shape).float().clone()
    _refuse_unadapted(set(state) - used)
    return out


def _digest(a: torch.Tensor) -> tuple:
    """What makes two lora_A tensors the same A: shape, dtype and bytes."""
    return tuple(a.shape), str(a.dtype), hashlib.sha256(a.contiguous().view(torch.uint8).numpy()).hexdigest()


def _distinct(a_list: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """The distinct A among one layer's projections' (first-seen order) and, for each
    projection, which of them is its A: stacked, they are the layer's A."""
    seen, blocks, block_of = {}, [], []
    for a in a_list:
        key = _digest(a)
        if key not in seen:
            seen[key] = len(blocks)
            blocks.append(a)
        block_of.append(seen[key])
    return blocks, block_of


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


def _weights_file(adapter_dir: str | Path) -> Path:
    """The folder's ``adapter_model.safetensors``: there, a regular file inside the folder (not a
    link out of it, not a pipe); a ``.bin`` is never read."""
    from emapg_megatron.checkpoint.safe_load import checked_file

    weights = Path(adapter_dir) / WEIGHTS_FILE
    if not os.path.lexists(weights):
        raise ConfigError(f"{adapter_dir}: no {WEIGHTS_FILE} (peft's safetensors weights; a .bin is "
                          "never unpickled)")
    checked_file(str(weights), str(adapter_dir))
    return weights


def load_peft(adapter_dir: str | Path, model_cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]],
              seed: int = 0) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """A peft LoRA folder's config and whole adapter matrices for a model holding ``shapes``
    (:func:`from_peft`; safetensors only: nothing in the folder is unpickled)."""
    from safetensors import SafetensorError, safe_open

    from emapg_megatron.checkpoint.safe_load import first_line

    cfg = read_peft_config(adapter_dir)
    weights = _weights_file(adapter_dir)
    # what the model's adapters look like in peft's names: every shape checked before a read (a
    # peft rank up to the model's: lora_A [r, in], lora_B [out, r], r <= R)
    expected = {k: tuple(v.shape) for k, v in
                to_peft({n: torch.zeros(shape) for n, shape in shapes.items()}, model_cfg).items()}

    def fits(key: str, shape: tuple) -> bool:
        want, rank_dim = expected[key], 0 if key.endswith(".lora_A.weight") else 1
        return (len(shape) == 2 and shape[1 - rank_dim] == want[1 - rank_dim]
                and 1 <= shape[rank_dim] <= want[rank_dim])

    try:
        with safe_open(str(weights), framework="pt") as handle:
            stored = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}  # noqa: SIM118
            wrong = sorted(f"{k}: {stored[k]} for {expected[k]}" for k in set(stored) & set(expected)
                           if not fits(k, stored[k]))
            if wrong:
                raise ConfigError(f"{weights}: adapter shapes do not fit this model's (a larger rank or "
                                  f"another base model?): {'; '.join(wrong[:3])}")
            state = {k: handle.get_tensor(k) for k in stored if k in expected}
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"corrupt safetensors file {weights}: {first_line(e)}") from None
    _refuse_unadapted(set(stored) - set(expected))  # the state below holds only the expected ones
    return cfg, from_peft(state, model_cfg, shapes, seed)


def rank_needed(adapter_dir: str | Path) -> int:
    """The smallest run rank a peft LoRA folder loads into (:func:`from_peft`): the largest count of
    A rows one Megatron layer takes, its projections' A stacked where they differ (q_proj, k_proj
    and v_proj of one layer each with its own rank-r A need 3r) and counted once where shared.
    Reads the folder's A tensors only (safetensors), one at a time."""
    from safetensors import SafetensorError, safe_open

    from emapg_megatron.checkpoint.safe_load import first_line
    from emapg_megatron.lora.config import HF_TARGETS

    weights = _weights_file(adapter_dir)
    rows: dict[tuple[str, str], dict[tuple, int]] = {}  # (module, Megatron layer) -> distinct A -> rows
    try:
        with safe_open(str(weights), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118
                module, _, tail = key.rpartition(".lora_A.")
                parent, _, projection = module.rpartition(".")
                if tail == "weight" and projection in HF_TARGETS:
                    a = handle.get_tensor(key)  # one at a time: only digests are kept
                    if a.ndim == 2:
                        rows.setdefault((parent, HF_TARGETS[projection]), {})[_digest(a)] = a.shape[0]
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"corrupt safetensors file {weights}: {first_line(e)}") from None
    return max((sum(layer.values()) for layer in rows.values()), default=0)


@torch.no_grad()
def init_from_peft(model_chunks, lora: LoRAConfig, model_cfg: ModelConfig, seed: int = 0) -> None:
    """Set every chunk's adapters from the peft folder ``lora.peft_init`` (--lora-peft-init; its
    scale was checked against the run's with the flags); ``seed``: the run's, whose initial A
    fills the rows the peft adapter does not. Call before the optimizer's main params and the
    EMA are taken from the weights."""
    from emapg_megatron.lora.apply import adapter_shapes, set_adapter_weights

    for chunk in model_chunks:
        _, full = load_peft(lora.peft_init, model_cfg, adapter_shapes(chunk), seed)
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
