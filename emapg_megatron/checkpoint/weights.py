"""Move weights between a built (TP/PP-sharded) Megatron model and HF tensors.

* :func:`load_hf_weights` - every rank reads only its own slices from an HF directory (the
  trainer's ``--load-hf`` and the converter's import).
* :func:`export_hf_weights` - streams full HF ``(name, tensor)`` pairs out of a sharded model: TP
  shards are all-gathered in size-bounded buckets, then broadcast from the owning PP stage (the
  weight sync to rollout engines and the converter's export).

Both resolve every parameter through :class:`~emapg_megatron.checkpoint.hf_mapping.HFMapping`.
A mixture of experts' expert weights are split over the expert tensor-parallel ranks (not the
dense TP ranks) and spread over the expert-parallel ranks: local expert ``i`` of EP rank ``r`` is
global expert ``r * experts / EP + i``; the export gathers them over both.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from tqdm import tqdm

from emapg_megatron import runtime
from emapg_megatron.checkpoint.hf_io import SafetensorsReader
from emapg_megatron.checkpoint.hf_mapping import HFMapping, dict_reader
from emapg_megatron.errors import ConfigError
from emapg_megatron.lora.config import is_adapter_name
from emapg_megatron.models.config import ModelConfig
from emapg_megatron.models.gpt import global_param_name, unwrap

DEFAULT_BUCKET_BYTES = 512 * 1024**2
HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


@dataclass(frozen=True)
class _Experts:
    """This rank's share of the experts: EP size and rank, expert-TP size and rank, and the
    experts per EP rank (a dense model: one rank of everything, no experts)."""

    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0
    local: int = 0

    @classmethod
    def of_this_rank(cls, cfg: ModelConfig) -> "_Experts":
        if not cfg.is_moe:
            return cls()
        ep = ps.get_expert_model_parallel_world_size()
        return cls(ep, ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                   ps.get_expert_tensor_parallel_rank(), cfg.num_experts // ep)

    def slot_name(self, name: str) -> str:
        """A global expert's name as its local slot (the same on every EP rank)."""
        return _expert_renamed(name, lambda e: e - self.ep_rank * self.local)


def _expert_renamed(name: str, index) -> str:
    m = _LOCAL_EXPERT.match(name)
    return name if m is None else f"{m[1]}{index(int(m[2]))}{m[3]}"


def _named_params(model_chunks, base_only: bool = False):
    """``(global name, param)`` over all chunks (``global_param_name``: layer indices made
    PP-stage independent, local expert indices made global); ``base_only``: without LoRA's
    adapter matrices (``<linear>.lora.A`` / ``.lora.B``, docs/lora.md), which no HF model holds."""
    for chunk in model_chunks:
        gpt = unwrap(chunk)
        for name, p in gpt.named_parameters():
            if base_only and is_adapter_name(name):
                continue
            yield global_param_name(gpt, name), p


ADAPTER_MODES = ("auto", "exclude")


def _merged(model_chunks) -> bool:
    """Whether the chunks carry LoRA adapters, every one merged into its base weight: the base
    weights are then the adapted model's, and the adapter matrices are left out of an export."""
    from emapg_megatron.lora.apply import has_adapters, is_merged

    return all(has_adapters(c) and is_merged(c) for c in model_chunks)


def _base_only(model_chunks, adapters: str) -> bool:
    """Whether an export leaves LoRA's adapter matrices out. ``"auto"``: only when every adapter
    is merged (the base weights are then the adapted model's; unmerged adapters are refused as
    unmapped parameters). ``"exclude"``: always, the frozen base alone (a rollout engine that
    applies the adapters itself, docs/lora.md), which refuses merged adapters: their update is
    in the base weights then."""
    from emapg_megatron.lora.apply import any_merged

    if adapters not in ADAPTER_MODES:
        raise ValueError(f"adapters must be one of {ADAPTER_MODES} (got {adapters!r})")
    if adapters == "auto":
        return _merged(model_chunks)
    if any(any_merged(c) for c in model_chunks):
        raise ConfigError("the base weights alone (adapters='exclude') cannot be exported with LoRA "
                          "adapters merged into them: unmerge first")
    return True


def _check_layout(name: str, codec, param) -> None:
    # Megatron tags TP-split params; a disagreement means the table and the spec diverged.
    dim = getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None
    if dim != codec.tp_dim:
        raise ConfigError(f"{name}: Megatron splits dim {dim} over TP, the HF mapping expects {codec.tp_dim}")


def _mapped(model_chunks, mapping: HFMapping, experts: _Experts,
            base_only: bool = False) -> list[tuple[str, torch.nn.Parameter]]:
    params = list(_named_params(model_chunks, base_only))
    unknown = [n for n, _ in params if mapping.lookup(n) is None]
    if unknown:
        raise ConfigError(f"Megatron parameters without an HF mapping ({len(unknown)}): {', '.join(unknown)}")
    tp = ps.get_tensor_model_parallel_world_size()
    for name, p in params:  # at (expert) TP=1 a split dim is moot (and may be untagged)
        entry = mapping.lookup(name)
        if (experts.etp if entry.expert is not None else tp) > 1:
            _check_layout(name, entry.codec, p)
    return params


def load_hf_weights(model_chunks, model_cfg: ModelConfig,
                    hf: str | Path | SafetensorsReader | Mapping[str, torch.Tensor],
                    *, progress: bool = False) -> int:
    """Copy HF weights (a directory, a reader or an in-memory state dict) into this rank's model chunks.

    Call inside an initialised parallel_state; each rank reads only its TP slices (lazily, from
    the memory-mapped safetensors). Checks the HF tensor set first and raises
    :class:`ConfigError` listing missing / unexpected / mis-shaped tensors. With a Megatron
    optimizer already built, call ``optimizer.reload_model_params()`` afterwards. Returns the
    number of bytes written into parameters.
    """
    mapping = HFMapping(model_cfg)
    if isinstance(hf, Mapping):
        read, shapes = dict_reader(hf), {n: tuple(t.shape) for n, t in hf.items()}
    else:
        reader = hf if isinstance(hf, SafetensorsReader) else SafetensorsReader(hf)
        read, shapes = reader.read, reader.shapes()
    read, _ = mapping.source(read, shapes)
    experts = _Experts.of_this_rank(model_cfg)
    params = _mapped(model_chunks, mapping, experts, base_only=True)  # LoRA adapters keep their init
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    total = sum(p.numel() * p.element_size() for _, p in params)
    with torch.no_grad(), tqdm(total=total, unit="B", unit_scale=True, desc="import HF weights",
                               disable=not progress) as bar:
        for name, p in params:
            expert = mapping.lookup(name).expert is not None  # split over the expert-TP ranks
            t = mapping.to_megatron(name, read, experts.etp_rank if expert else rank,
                                    experts.etp if expert else tp, p.shape)
            if tuple(t.shape) != tuple(p.shape):
                raise ConfigError(f"{name}: HF tensors give {tuple(t.shape)} for the local shape "
                                  f"{tuple(p.shape)}")
            p.copy_(t)
            bar.update(p.numel() * p.element_size())
    return total


@dataclass(frozen=True)
class _Item:
    name: str  # canonical Megatron name (an expert's: of its local slot, global expert = slot)
    stage: int  # owning PP rank
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    split: bool  # sharded over TP (gathered) or replicated
    expert: bool = False  # one local expert slot: gathered over expert TP, then over EP

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    def full_bytes(self, tp: int, expert_ranks: int = 1) -> int:
        """Gathered bytes: ``expert_ranks`` = expert TP x EP."""
        return self.numel * (expert_ranks if self.expert else tp if self.split else 1) * self.dtype.itemsize


def plan_buckets(items: list[_Item], bucket_bytes: int, tp: int, expert_ranks: int = 1) -> list[list[_Item]]:
    """Group consecutive params of one stage and dtype into buckets of at most ``bucket_bytes``
    gathered bytes; a single param larger than the bound travels alone."""
    buckets: list[list[_Item]] = []
    size = 0
    for item in items:
        nbytes = item.full_bytes(tp, expert_ranks)
        last = buckets[-1] if buckets else None
        if (last is None or last[0].stage != item.stage or last[0].dtype != item.dtype
                or size + nbytes > bucket_bytes):
            buckets.append([item])
            size = nbytes
        else:
            last.append(item)
            size += nbytes
    return buckets


def high_precision(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a BF16/FP32 tensor: exports and checkpoints are never FP8.

    FP8 *compute* (``--fp8-format``) keeps BF16 weights; TE's FP8 parameters (QuantizedTensor,
    which reports a high-precision dtype) are dequantised; raw float8 tensors are refused.
    """
    if type(t) is not torch.Tensor and hasattr(t, "dequantize"):
        t = t.dequantize()
    if t.dtype not in HIGH_PRECISION:
        raise ConfigError(f"{name} is {t.dtype}: checkpoints and exports are BF16/FP32, never FP8")
    return t


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def _pack(dst: torch.Tensor, tensors) -> None:
    offset = 0
    for t in tensors:
        dst[offset:offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()


def _sections(bucket) -> tuple[list[_Item], list[_Item], list[_Item]]:
    """A bucket's TP-split, replicated and expert items."""
    return ([i for i in bucket if i.split and not i.expert], [i for i in bucket if not i.split],
            [i for i in bucket if i.expert])


def _numel(items) -> int:
    return sum(i.numel for i in items)


def _bucket_payload(bucket, local, tp, tp_group, device, experts: _Experts) -> torch.Tensor:
    """One flat buffer: the TP-gathered split params ``[tp, n_split]``, the replicated ones, then
    the experts gathered over expert TP and EP ``[ep, etp, n_expert]``."""
    split, rep, expert = _sections(bucket)
    n_split, n_rep, n_exp = _numel(split), _numel(rep), _numel(expert)
    n_gathered = experts.ep * experts.etp * n_exp
    payload = torch.empty(tp * n_split + n_rep + n_gathered, dtype=bucket[0].dtype, device=device)
    if local is None:  # another stage owns it: filled by the broadcast
        return payload
    if tp > 1 and split:
        flat = torch.empty(n_split, dtype=payload.dtype, device=device)
        _pack(flat, [local[i.name] for i in split])
        _all_gather(payload[: tp * n_split], flat, tp_group)
    else:
        _pack(payload[:n_split], [local[i.name] for i in split])
    _pack(payload[tp * n_split:tp * n_split + n_rep], [local[i.name] for i in rep])
    if expert:
        out = payload[tp * n_split + n_rep:]
        flat = out if n_gathered == n_exp else torch.empty(n_exp, dtype=payload.dtype, device=device)
        _pack(flat, [local[i.name] for i in expert])
        if experts.etp > 1:
            gathered = out if experts.ep == 1 else torch.empty(experts.etp * n_exp, dtype=payload.dtype,
                                                                device=device)
            _all_gather(gathered, flat, ps.get_expert_tensor_parallel_group())
            flat = gathered
        if experts.ep > 1:
            _all_gather(out, flat, ps.get_expert_model_parallel_group())
    return payload


def _payload_shards(bucket, payload, tp, experts: _Experts):
    """Item -> its TP shards, as views into the bucket's payload; an expert item -> per EP rank,
    its expert-TP shards."""
    split, rep, expert = _sections(bucket)
    n_split, n_rep, n_exp = _numel(split), _numel(rep), _numel(expert)
    gathered = payload[: tp * n_split].view(tp, n_split)
    gathered_experts = payload[tp * n_split + n_rep:].view(experts.ep, experts.etp, n_exp)
    split_off, rep_off, exp_off, views = 0, tp * n_split, 0, {}
    for i in bucket:
        if i.expert:
            views[i.name] = [[gathered_experts[r, t, exp_off:exp_off + i.numel].view(i.local_shape)
                              for t in range(experts.etp)] for r in range(experts.ep)]
            exp_off += i.numel
        elif i.split:
            views[i.name] = [gathered[r, split_off:split_off + i.numel].view(i.local_shape)
                             for r in range(tp)]
            split_off += i.numel
        else:
            views[i.name] = [payload[rep_off:rep_off + i.numel].view(i.local_shape)]
            rep_off += i.numel
    return views


def _hf_pairs(mapping: HFMapping, item: _Item, shards, experts: _Experts) -> list:
    """The HF tensors of an item: an expert slot's of every EP rank (global expert r x local + slot)."""
    if not item.expert:
        return mapping.to_hf(item.name, shards)
    return [pair for r, per_rank in enumerate(shards)
            for pair in mapping.to_hf(_expert_renamed(item.name, lambda s, r=r: r * experts.local + s),
                                      per_rank)]


def export_hf_buckets(model_chunks, model_cfg: ModelConfig, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      all_stages: bool = True, dtype: torch.dtype | None = None, adapters: str = "auto"
                      ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Like :func:`export_hf_weights`, one list per communication bucket."""
    mapping = HFMapping(model_cfg)
    experts = _Experts.of_this_rank(model_cfg)
    base_only = _base_only(model_chunks, adapters)
    local = {experts.slot_name(mapping.lookup(n).megatron): high_precision(n, p.detach())
             for n, p in _mapped(model_chunks, mapping, experts, base_only=base_only)
             if mapping.lookup(n).export}
    tp, tp_group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    mine = {n: (tuple(t.shape), t.dtype) for n, t in local.items()}
    per_stage = [mine]
    if pp > 1:
        pp_group = ps.get_pipeline_model_parallel_group()
        per_stage = [None] * pp
        dist.all_gather_object(per_stage, mine, group=pp_group)
        pp_ranks = dist.get_process_group_ranks(pp_group)
    owner = {}
    for s, params in enumerate(per_stage):
        for n, (shape, param_dtype) in params.items():
            owner.setdefault(n, (s, shape, param_dtype))
    # One item per dense param and per local expert slot (EP rank 0's experts stand for the slots).
    exported = [e for e in mapping.entries if e.export and (e.expert is None or e.expert < experts.local)]
    missing = [e.megatron for e in exported if e.megatron not in owner]
    if missing:
        raise ConfigError(f"no pipeline stage holds {', '.join(missing)}")
    items = [_Item(e.megatron, *owner[e.megatron], split=e.codec.tp_dim is not None,
                   expert=e.expert is not None) for e in exported]
    device = runtime.device()
    # TP=1, one expert rank and nothing to broadcast: convert straight from the parameters.
    local_only = tp == experts.etp == experts.ep == 1 and (pp == 1 or not all_stages)
    for bucket in plan_buckets(items, bucket_bytes, tp, experts.etp * experts.ep):
        owned = bucket[0].stage == stage
        if not owned and not all_stages:
            continue
        if local_only:
            shards = {i.name: [[local[i.name]]] if i.expert else [local[i.name]] for i in bucket}
        else:
            payload = _bucket_payload(bucket, local if owned else None, tp, tp_group, device, experts)
            if pp > 1 and all_stages:
                dist.broadcast(payload, src=pp_ranks[bucket[0].stage], group=pp_group)
            shards = _payload_shards(bucket, payload, tp, experts)
        pairs = [pair for i in bucket for pair in _hf_pairs(mapping, i, shards[i.name], experts)]
        yield pairs if dtype is None else [(n, t.to(dtype)) for n, t in pairs]


def export_hf_weights(model_chunks, model_cfg: ModelConfig, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      all_stages: bool = True, dtype: torch.dtype | None = None, adapters: str = "auto"
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the model as full HF ``(name, tensor)`` pairs (padding removed, tied head omitted).

    A collective: every rank of the model-parallel group must consume the iterator in step.
    Within a bucket the TP shards are all-gathered (at most ``bucket_bytes`` gathered bytes per
    bucket, unless one parameter alone is bigger); with ``all_stages`` the bucket is then
    broadcast from the owning pipeline stage so every rank yields every tensor, otherwise each
    stage yields only what it owns. Tensors stay on the model's device, in its dtype unless
    ``dtype`` is given (e.g. ``torch.bfloat16`` for a rollout engine). A LoRA model's adapter
    matrices (``adapters``): ``"auto"`` leaves them out only when every adapter is merged (else
    refuses them); ``"exclude"`` streams the frozen base alone (vLLM's LoRA path, which gets the
    adapters in peft's format instead).
    """
    for bucket in export_hf_buckets(model_chunks, model_cfg, bucket_bytes=bucket_bytes,
                                    all_stages=all_stages, dtype=dtype, adapters=adapters):
        yield from bucket
