"""The EMA in ``megatron.core.dist_checkpointing``: reshardable over TP, PP and DP.

The EMA's sharded state dict is derived from the model's own: every
ShardedTensor (or ShardedTensorFactory, e.g. the SwiGLU fc1 split) whose data is
a parameter the anchor tracks is re-emitted with the key ``ema.<key>``, the
same global shape and offsets, and fp32 EMA data. A checkpoint is therefore laid
out in the model's canonical (unsharded) coordinates and loads at any TP/PP/DP.

A DP-sharded EMA holds a contiguous run of each flattened local tensor, which
megatron-core 0.16 cannot express with ``flattened_range`` any more. A run of a
row-major tensor splits into at most ``2·ndim − 1`` rectangular blocks, each a
contiguous slice of the run; each block becomes one ShardedTensor (an irregular
grid, which the torch_dist backend supports). Every DP rank writes only its own
blocks, in parallel, and reads back only what its shard needs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensor,
    ShardedTensorFactory,
)

from emapg_megatron.checkpoint.safe_load import verify_on_every_rank
from emapg_megatron.errors import ConfigError, agreed
from emapg_megatron.models.gpt import unwrap

logger = logging.getLogger(__name__)

PREFIX = "ema."


def flat_range_blocks(shape: tuple, lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """Split the flat range [lo, hi) of a row-major ``shape`` into (offset, block_shape) boxes.

    Boxes come in order and each is a contiguous run of the flat range.
    """
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(lo, inner)
    r1, c1 = divmod(hi, inner)

    def nested(r, a, b):  # the partial row r, split along the remaining dims
        return [((r, *o), (1, *s)) for o, s in flat_range_blocks(shape[1:], a, b)]

    if r0 == r1:
        return nested(r0, c0, c1)
    blocks = []
    if c0:
        blocks += nested(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        blocks.append(((r0, *(0,) * (len(shape) - 1)), (r1 - r0, *shape[1:])))
    if c1:
        blocks += nested(r1, 0, c1)
    return blocks


def _templates(sh, param):
    """(ShardedTensor, flat offset in param) for each tensor the model would save for ``param``."""
    if isinstance(sh, ShardedTensor):
        return [(sh, 0)]
    # A factory transforms the param before saving (SwiGLU: two halves with their own offsets):
    # build it on the param and locate each produced tensor inside it.
    base = param.detach()
    out = []
    for built in nested_values(replace(sh, data=base).build()):
        data = built.data
        offset = (data.data_ptr() - base.data_ptr()) // base.element_size()
        if not data.is_contiguous() or not 0 <= offset <= base.numel() - data.numel():
            raise ConfigError(f"cannot map checkpoint factory {sh.key} onto the EMA layout")
        out.append((built, offset))
    return out


def _stored_runs(anchor):
    """``id(param) -> (store, slot, [(param_lo, param_hi)])``: the parts of each param this rank keeps."""
    runs = {}
    for store in anchor.stores:
        bucket = store.bucket
        for slot in bucket.slots:
            a, b = max(slot.lo, store.lo), min(slot.hi, store.hi)
            parts = [(a - slot.lo, b - slot.lo)] if a < b else []
            runs[id(slot.param)] = (store, slot, parts)
    return runs


def build_sharded_state_dict(anchor, model_sharded_state_dict=None) -> dict:
    if model_sharded_state_dict is None:  # the GPTModel's own keys, as the trainer saves them
        model_sharded_state_dict = {f"chunk{i}": unwrap(c).sharded_state_dict()
                                    for i, c in enumerate(anchor.model_chunks)}
    runs = _stored_runs(anchor)
    sharded = anchor.cfg.shard_over_dp
    tensors: dict[str, list] = {}
    seen = set()
    for sh in nested_values(model_sharded_state_dict):
        if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)) or id(sh.data) not in runs:
            continue
        store, slot, parts = runs[id(sh.data)]
        seen.add(id(sh.data))
        for tmpl, t_off in _templates(sh, slot.param):
            replica_id = tmpl.replica_id
            if sharded and isinstance(replica_id, tuple):
                replica_id = (*replica_id[:-1], 0)  # DP ranks hold disjoint runs: all are main replicas
            pre = tmpl.prepend_axis_num
            t_numel = math.prod(tmpl.local_shape)
            for p_lo, p_hi in parts:
                lo, hi = max(p_lo, t_off), min(p_hi, t_off + t_numel)
                for offset, shape in flat_range_blocks(tuple(tmpl.local_shape), lo - t_off, hi - t_off):
                    start = t_off + sum(o * math.prod(tmpl.local_shape[i + 1:]) for i, o in enumerate(offset))
                    begin = slot.lo + start - store.lo
                    data = store.data[begin:begin + math.prod(shape)].view((1,) * pre + shape)
                    # Prepended (layer) axes become explicit singleton dims: irregular grids need
                    # local and global shapes of the same rank.
                    tensors.setdefault(slot.name, []).append(ShardedTensor(
                        key=PREFIX + tmpl.key, data=data, dtype=torch.float32,
                        local_shape=(1,) * pre + shape, global_shape=tuple(tmpl.global_shape),
                        global_offset=(*tmpl.global_offset[:pre],
                                       *(g + o for g, o in zip(tmpl.global_offset[pre:], offset))),
                        axis_fragmentations=None, replica_id=replica_id, prepend_axis_num=0,
                        allow_shape_mismatch=tmpl.allow_shape_mismatch))
    missing = [slot.name for _, slot in anchor.layout.slots() if id(slot.param) not in seen]
    if missing:
        raise ConfigError(f"the model's sharded state dict has no entry for {missing[0]}")
    return {"tensors": tensors, "meta": anchor.state_dict_meta()}


def _expected(anchor) -> dict[str, list]:
    """The ShardedTensors this rank saves/loads, per parameter name (data = EMA views)."""
    return build_sharded_state_dict(anchor)["tensors"]


@torch.no_grad()
def load_loaded_state(anchor, loaded: dict) -> None:
    if not isinstance(loaded, dict) or "tensors" not in loaded or "meta" not in loaded:
        raise ConfigError("EMA checkpoint state must have 'tensors' and 'meta' (from sharded_state_dict)")
    got = loaded["tensors"]
    for name, expected in _expected(anchor).items():
        if name not in got:
            raise ConfigError(f"EMA checkpoint has no tensor for {name}")
        if len(got[name]) != len(expected):
            raise ConfigError(f"EMA checkpoint tensor {expected[0].key} has {len(got[name])} pieces, "
                              f"this layout expects {len(expected)}")
        for tensor, sh in zip(got[name], expected):
            if tuple(tensor.shape) != tuple(sh.local_shape):
                raise ConfigError(f"EMA checkpoint tensor {sh.key} has shape {tuple(tensor.shape)}, "
                                  f"the model expects {tuple(sh.local_shape)}")
            if tensor.data_ptr() != sh.data.data_ptr():  # dist_checkpointing usually loads in place
                sh.data.copy_(tensor)
    meta = loaded["meta"]
    anchor.num_updates = int(meta["num_updates"])
    anchor.last_update_iteration = int(meta["last_update_iteration"])
    if float(meta["eta"]) != anchor.cfg.eta or int(meta["update_period"]) != anchor.cfg.update_period:
        logger.warning("EMA checkpoint was written with eta=%s, period=%s; continuing with eta=%s, "
                       "period=%s", meta["eta"], meta["update_period"], anchor.cfg.eta,
                       anchor.cfg.update_period)
    anchor._sync()


def check_checkpoint(anchor, ckpt_dir: str) -> None:
    """Compare the EMA tensors in ``ckpt_dir`` with this model before loading (metadata only).

    ``dist_checkpointing.load`` would otherwise fail deep inside torch DCP on a shape mismatch.
    """
    verify_on_every_rank(ckpt_dir)  # megatron unpickles .metadata: nothing in it may run
    stored = dist_checkpointing.load_tensors_metadata(ckpt_dir)
    checked = set()
    for expected in _expected(anchor).values():
        for sh in expected:
            if sh.key in checked:
                continue
            checked.add(sh.key)
            if sh.key not in stored:
                hint = ("" if any(k.startswith("ema.") for k in stored) else
                        " (it holds no EMA anchor: a distillation run's checkpoint resumes with its "
                        "teacher, --teacher-load-hf or --teacher-checkpoint)")
                raise agreed(ConfigError(f"checkpoint {ckpt_dir} has no EMA tensor {sh.key}{hint}"))
            shape, want = tuple(stored[sh.key].global_shape), tuple(sh.global_shape)
            if sh.allow_shape_mismatch:  # padded vocabulary: only the hidden dims must agree
                shape, want = shape[1:], want[1:]
            if shape != want:
                raise ConfigError(f"EMA checkpoint tensor {sh.key} has shape "
                                  f"{tuple(stored[sh.key].global_shape)}, the model expects "
                                  f"{tuple(sh.global_shape)}")
