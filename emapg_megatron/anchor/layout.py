"""Where every EMA element lives, derived from Megatron's own data structures.

The EMA mirrors the policy's memory layout instead of inventing one: for each
bucket of Megatron DDP's contiguous parameter/gradient buffer it keeps an fp32
range in the same coordinates (element ``i`` of the bucket is element ``i`` of
the EMA bucket). That makes three things cheap:

* the update reads the optimizer's fp32 *main* parameters, which the
  distributed optimizer keeps for one contiguous shard of each bucket per DP
  rank (``_get_model_param_range_map``) -- so a DP-sharded EMA is exactly that
  shard and the update needs no communication;
* the swap-in of a DP-sharded EMA is the same in-place bucket all-gather the
  distributed optimizer runs after every step;
* TP/PP sharding is inherited, because DDP buckets hold this rank's local
  parameter shards.

A :class:`Piece` is a run of one parameter's flattened elements whose fp32 main
values this rank's optimizer owns: the whole parameter for FP32Optimizer and
Float16OptimizerWithFloat16Params, the DP shard's part of it for the
DistributedOptimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.fp8_utils import is_float8tensor
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
)
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from emapg_megatron.errors import ConfigError
from emapg_megatron.models.gpt import global_param_name, unwrap


@dataclass
class Piece:
    param: torch.nn.Parameter
    main: torch.Tensor  # 1-D fp32: the optimizer's main values of param.view(-1)[param_lo:param_hi]
    aliased: bool  # main shares memory with the model weight (fp32 params): a swap must save it
    param_lo: int
    param_hi: int
    lo: int  # the same run in bucket coordinates
    hi: int
    counted: bool  # counts towards global norms: not a TP duplicate, not the tied copy of a weight


@dataclass
class Slot:
    """A whole local parameter inside its bucket."""

    param: torch.nn.Parameter
    name: str  # global name (PP-stage independent layer index)
    lo: int
    hi: int


@dataclass
class Bucket:
    numel: int  # padded size (the distributed optimizer pads buckets to a multiple of DP)
    slots: list[Slot]
    flat_param: torch.Tensor | None  # DDP's contiguous param buffer of the bucket (distributed optimizer)
    dp_group: object
    dp_size: int
    dp_rank: int
    shard_lo: int  # the range whose main params this rank's optimizer owns
    shard_hi: int
    norm_group: object = None  # the ranks whose main params of this kind (dense or expert) partition them
    pieces: list[Piece] = field(default_factory=list)

    def write_model(self, lo: int, hi: int, src: torch.Tensor) -> None:
        """Copy ``src`` (bucket range [lo, hi), any float dtype/device) into the live weights."""
        if self.flat_param is not None:
            self.flat_param[lo:hi].copy_(src, non_blocking=True)
            return
        for slot in self.slots:
            a, b = max(lo, slot.lo), min(hi, slot.hi)
            if a < b:
                slot.param.detach().view(-1)[a - slot.lo:b - slot.lo].copy_(
                    src[a - lo:b - lo], non_blocking=True)

    def gather_flat_param(self) -> None:
        """Every DP rank wrote its shard of the param buffer: all-gather it in place."""
        if self.dp_size > 1:
            dist.all_gather_into_tensor(self.flat_param, self.flat_param[self.shard_lo:self.shard_hi],
                                        group=self.dp_group)


@dataclass
class Layout:
    buckets: list[Bucket]
    distributed_optimizer: bool
    model_dtype: torch.dtype
    device: torch.device

    @property
    def norm_groups(self) -> list:
        """Each kind of parameter's grad-norm group (the dense params', then the experts'), in
        the same order on every rank: a global norm reduces each kind over its own group."""
        groups = []
        for bucket in self.buckets:
            if not any(bucket.norm_group is g for g in groups):
                groups.append(bucket.norm_group)
        return groups

    @property
    def numel(self) -> int:
        """Local parameter elements managed (TP/PP shard, not padded)."""
        return sum(s.hi - s.lo for b in self.buckets for s in b.slots)

    def slots(self):
        for bucket in self.buckets:
            for slot in bucket.slots:
                yield bucket, slot


def inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _norm_groups(optimizer) -> dict[int, object]:
    """``id(model_param) -> the grad-norm group of the inner optimizer holding it`` (a MoE model's
    chained optimizer has one for the dense params and one for the experts)."""
    groups = {}
    for opt in inner_optimizers(optimizer):
        group = opt.get_grad_stats_parallel_group()
        for param_group in opt.param_groups if not isinstance(opt, DistributedOptimizer) else []:
            for param in param_group["params"]:
                groups[id(param)] = group
        if isinstance(opt, DistributedOptimizer):
            for model_group in (*opt.model_float16_groups, *opt.model_fp32_groups):
                for param in model_group:
                    groups[id(param)] = group
        elif isinstance(opt, Float16OptimizerWithFloat16Params):
            for model_group in opt.float16_groups:
                for param in model_group:
                    groups[id(param)] = group
    return groups


def _main_runs(optimizer) -> tuple[dict[int, list[tuple[torch.Tensor, int, int]]], bool]:
    """``id(model_param) -> [(fp32 main 1-D, lo, hi)]`` for every optimizer kind in megatron-core 0.16."""
    runs: dict[int, list] = {}
    kinds = set()
    for opt in inner_optimizers(optimizer):
        if isinstance(opt, DistributedOptimizer):
            kinds.add("distributed")
            if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                raise ConfigError("the EMA anchor needs fp32 main params: the precision-aware "
                                  "optimizer keeps them inside FusedAdam")
            # bf16/fp16 params: a separate fp32 shard; fp32 params: a view of the param itself.
            pairs = [*zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                     *zip(opt.model_fp32_groups, opt.shard_fp32_groups)]
            for model_group, main_group in pairs:
                for param, main in zip(model_group, main_group):
                    rng = opt._get_model_param_range_map(param)["param"]
                    runs.setdefault(id(param), []).append((main.detach().view(-1), rng.start, rng.end))
        elif isinstance(opt, Float16OptimizerWithFloat16Params):
            kinds.add("replicated")
            for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for param, main in zip(model_group, main_group):
                    runs[id(param)] = [(main.detach().view(-1), 0, param.numel())]
            for group in opt.fp32_from_fp32_groups:
                for param in group:
                    runs[id(param)] = [(param.detach().view(-1), 0, param.numel())]
        elif isinstance(opt, FP32Optimizer):
            kinds.add("replicated")
            for group in opt.optimizer.param_groups:
                for param in group["params"]:
                    runs[id(param)] = [(param.detach().view(-1), 0, param.numel())]
        else:
            raise ConfigError(f"the EMA anchor does not support the {type(opt).__name__} optimizer")
    if len(kinds) != 1:
        raise ConfigError("the EMA anchor needs one optimizer kind (distributed or not) for all params")
    return runs, kinds == {"distributed"}


def build_layout(model_chunks: list, optimizer) -> Layout:
    runs, distributed = _main_runs(optimizer)
    norm_groups = _norm_groups(optimizer)
    buckets: list[Bucket] = []
    dtypes = set()
    for chunk in model_chunks:
        if not hasattr(chunk, "buffers") or not hasattr(chunk, "ddp_config"):
            raise ConfigError("the EMA anchor needs Megatron DDP-wrapped model chunks")
        if chunk.ddp_config.overlap_param_gather:
            # Weights would be gathered lazily in the next forward: a swap would race with it.
            raise ConfigError("the EMA anchor cannot be used with overlap_param_gather")
        gpt = unwrap(chunk)
        names = {id(p): global_param_name(gpt, n) for n, p in gpt.named_parameters()}
        if any(is_float8tensor(p) for p in gpt.parameters()):
            raise ConfigError("the EMA anchor does not support FP8 parameters (fp8 param gather)")
        # Expert-parallel params (a MoE model at EP > 1) have buffers of their own, sharded and
        # reduced over the expert data-parallel group: the EMA follows each buffer's group.
        for buffer in (*chunk.buffers, *chunk.expert_parallel_buffers):
            dtypes.add(buffer.param_dtype)
            group = buffer.data_parallel_group
            dp_size, dp_rank = group.size(), group.rank()
            for bucket in buffer.buckets:
                numel = bucket.grad_data.numel()
                shard = numel // dp_size if distributed else numel
                lo = dp_rank * shard if distributed else 0
                b = Bucket(numel=numel, slots=[], flat_param=bucket.param_data, dp_group=group,
                           dp_size=dp_size if distributed else 1, dp_rank=dp_rank if distributed else 0,
                           shard_lo=lo, shard_hi=lo + shard)
                b.norm_group = next((norm_groups[id(p)] for p in bucket.params_list if id(p) in norm_groups),
                                    None)
                for param in bucket.params_list:
                    start = buffer.param_index_map[param][0] - bucket.offset
                    b.slots.append(Slot(param, names[id(param)], start, start + param.numel()))
                    # With the distributed optimizer a param may lie wholly in other DP ranks' shards.
                    if id(param) not in runs and not distributed:
                        raise ConfigError(f"parameter {names[id(param)]} has no fp32 main param in the optimizer")
                    counted = param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param)
                    for main, plo, phi in runs.get(id(param), []):
                        piece = Piece(param, main, _same_memory(main, param), plo, phi,
                                      start + plo, start + phi, counted)
                        if not (b.shard_lo <= piece.lo <= piece.hi <= b.shard_hi):
                            raise RuntimeError(f"{names[id(param)]}: main param outside this rank's shard")
                        b.pieces.append(piece)
                b.slots.sort(key=lambda s: s.lo)
                b.pieces.sort(key=lambda p: p.lo)
                buckets.append(b)
    if not buckets:
        raise ConfigError("the model has no trainable parameters for the EMA anchor")
    if len(dtypes) != 1:
        raise ConfigError(f"the EMA anchor needs one model dtype (got {sorted(map(str, dtypes))})")
    first = buckets[0].slots[0].param
    return Layout(buckets, distributed, dtypes.pop(), first.device)
