"""The trainer's few collectives over scalars and per-sequence values, on the device.

NCCL takes device tensors only, so every buffer here is placed on :func:`runtime.device` (the CPU
in CPU mode, where the strict device mode checks that placement). ``group=None`` is the world.
:func:`on_rank0` broadcasts a small Python object instead (file-system work done once).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from emapg_megatron import errors, runtime

#: What :func:`on_rank0` raises on every rank: the one-line error kinds, by name.
_SHARED_ERRORS = {cls.__name__: cls for cls in (errors.ConfigError, errors.RunError, errors.WeightsError,
                                                 errors.CheckpointWriteError, errors.SkippedStepsError)}


def on_rank0(fn):
    """``fn()`` on global rank 0 only, its (picklable) result on every rank. A ConfigError or
    RunError it raises is raised, of the same kind, on every rank, so none is left waiting in a
    later collective. Without a process group, just ``fn()``."""
    if not (dist.is_available() and dist.is_initialized()):
        return fn()
    box = [None, None, None]  # result, error kind, message
    if dist.get_rank() == 0:
        try:
            box[0] = fn()
        except (errors.ConfigError, errors.RunError) as e:
            box[1:] = type(e).__name__, str(e)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)  # our own values, not user data
    if box[1] is not None:
        raise errors.agreed(_SHARED_ERRORS.get(box[1], errors.RunError)(box[2]))
    return box[0]


def reduce_sum(values: dict, group=None) -> dict:
    """Sum a dict of scalars over ``group`` in one packed fp64 collective."""
    keys = sorted(values)
    packed = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=runtime.device())
    dist.all_reduce(packed, group=group)
    return dict(zip(keys, packed.tolist()))


def all_true(flag: bool, group=None) -> bool:
    """Whether ``flag`` holds on every rank of ``group``."""
    bad = torch.tensor([0.0 if flag else 1.0], device=runtime.device())
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return bad.item() == 0.0


def any_true(flag: bool, group=None) -> bool:
    """Whether ``flag`` holds on some rank of ``group``."""
    return any_true_each(flag, group=group)[0]


def any_true_each(*flags: bool, group=None) -> list[bool]:
    """For each flag, whether it holds on some rank of ``group``: one collective for them all."""
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=runtime.device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [v == 1.0 for v in t.tolist()]


def gather_cat(local: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's equal-shaped ``local`` in rank order (returned on the device)."""
    local = local.to(runtime.device())
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts)


def gather_ragged(local: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's 1-D ``local`` (lengths may differ), in rank order: counts first, then one
    gather padded to the longest."""
    local = local.to(runtime.device())
    counts = gather_cat(torch.tensor([local.numel()], device=runtime.device()), group).tolist()
    padded = torch.cat([local, local.new_zeros(max(counts) - local.numel())])
    every = gather_cat(padded, group).view(len(counts), -1)
    return [row[:n] for row, n in zip(every, counts)]


def gather_lists(lists: list[list], group, dtype=torch.float64) -> list[list]:
    """Every rank's lists (of ``dtype`` numbers, lengths may differ), concatenated in rank order:
    two ragged gathers, exact for ids and float32 values in float64."""
    lengths = gather_ragged(torch.tensor([len(x) for x in lists], dtype=torch.long), group)
    values = gather_ragged(torch.tensor([v for x in lists for v in x], dtype=dtype), group)
    out = []
    for lens, flat in zip(lengths, values):
        flat, lens = flat.tolist(), lens.tolist()
        out += [flat[end - n:end] for n, end in zip(lens, itertools.accumulate(lens))]
    return out


def flags_and_any(flags: list[bool], positions: list[int], total: int, busy: bool, group) -> tuple[list[bool], bool]:
    """The ``[total]`` flags whose entries ``positions`` each rank of ``group`` holds (disjoint),
    and whether ``busy`` holds on any rank: one all-reduce."""
    full = torch.zeros(total + 1, device=runtime.device())
    full[torch.tensor(positions, dtype=torch.long, device=full.device)] = torch.tensor(
        flags, dtype=full.dtype, device=full.device)
    full[total] = float(busy)
    dist.all_reduce(full, group=group)
    both = full.tolist()
    return [v > 0 for v in both[:total]], both[total] > 0


def gather_at(values: torch.Tensor, positions: torch.Tensor, total: int, group) -> torch.Tensor:
    """The ``[total]`` vector whose entries ``positions`` (disjoint over ``group``, covering it)
    each rank holds as ``values``: zeros elsewhere, then a sum, which is exact."""
    full = torch.zeros(total, dtype=values.dtype, device=runtime.device())
    full[positions.to(runtime.device())] = values.to(runtime.device())
    dist.all_reduce(full, group=group)
    return full


def gather_objects_to_first(obj, group) -> list | None:
    """Every rank's ``obj`` (our own, picklable) on ``group``'s first rank, in rank order; None
    on the others."""
    if dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, 0), group=group)
    return out


def reduce_max(value: float, group=None) -> float:
    """The largest ``value`` over ``group`` (NaN counts as +inf)."""
    v = torch.tensor([value if value == value else float("inf")], dtype=torch.float64,
                     device=runtime.device())
    dist.all_reduce(v, op=dist.ReduceOp.MAX, group=group)
    return v.item()
