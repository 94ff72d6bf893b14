"""A LoRA adapter on one of Megatron-Core's tensor-parallel linears (docs/lora.md).

The frozen layer computes ``W x``; its adapter adds ``(alpha / rank) B A dropout(x)`` with ``A``
``[rank, in]`` and ``B`` ``[out, rank]`` (peft's ``lora_A.weight`` / ``lora_B.weight``
orientation). Over TP each matrix is split where the base weight is (no rank holds a full-width
adapter matrix):

* column-parallel base (``linear_qkv``, ``linear_fc1``: output split over TP): ``A`` is
  replicated (it reads the whole input), ``B`` split on its output rows exactly like the base
  weight, so row ``i`` of ``B`` feeds output feature ``i`` of the base and the update lands in the
  base's layout, fused or interleaved;
* row-parallel base (``linear_proj``, ``linear_fc2``: input split over TP): ``A`` split on its
  input columns like the base weight, ``B`` replicated.

Only Megatron-Core's collectives move data (``tensor_parallel`` mappings, on the base layer's own
TP group); their forward/backward pairs keep every replicated matrix's gradient whole and equal on
every TP rank, so nothing has to be reduced after the backward (``finalize_model_grads`` sums over
TP only the weights marked ``sequence_parallel``, which these are not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

COLUMN, ROW = "column", "row"


@dataclass(frozen=True)
class Sharding:
    """How one adapter matrix is split over TP: along ``dim`` (None: replicated), in ``blocks``
    equal blocks each split on its own. A fused gated MLP's ``linear_fc1`` is ``[gate; up]`` at
    one rank and ``[gate_r; up_r]`` on TP rank ``r`` (2 blocks); ``linear_qkv``'s query groups
    are contiguous on each rank, so it is one block."""

    dim: int | None
    blocks: int = 1

    def local(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """TP rank ``rank``'s part of the one-rank tensor ``full``."""
        if self.dim is None:
            return full
        return torch.cat([block.chunk(tp, self.dim)[rank]
                          for block in full.chunk(self.blocks, self.dim)], self.dim)

    def full(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The one-rank tensor from every TP rank's part (rank order): :meth:`local`'s inverse."""
        if self.dim is None:
            return shards[0]
        per_rank = [s.chunk(self.blocks, self.dim) for s in shards]
        return torch.cat([torch.cat([p[b] for p in per_rank], self.dim)
                          for b in range(self.blocks)], self.dim)


def kaiming_uniform_bound(fan_in: int) -> float:
    """The bound of peft's ``kaiming_uniform_(lora_A.weight, a=sqrt(5))``:
    gain sqrt(2 / (1 + 5)) times sqrt(3 / fan_in) = 1 / sqrt(fan_in)."""
    return 1.0 / math.sqrt(fan_in)


def low_rank_update(A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * B @ A`` in fp32: the weight an adapter adds to its base (local shapes agree on
    both kinds of layer: ``B_r @ A`` is ``W_r``'s shape on a column-parallel base, ``B @ A_r`` on a
    row-parallel one)."""
    return scale * (B.float() @ A.float())


class LoRAAdapter(torch.nn.Module):
    """The update of one TP-parallel linear; :func:`attach` adds it to the base's output.

    ``kind``: ``"column"`` or ``"row"``, how the base is parallel; ``in_features`` and
    ``out_features`` are the base's global widths; ``out_blocks``: blocks of the output that TP
    splits separately (2 for a fused gate-up, else 1). ``tp_group``: the base layer's TP group.
    """

    def __init__(self, kind: str, in_features: int, out_features: int, rank: int, alpha: float,
                 dropout: float, *, out_blocks: int, tp_group, sequence_parallel: bool,
                 dtype: torch.dtype, device):
        super().__init__()
        tp = dist.get_world_size(group=tp_group)
        self.kind, self.tp_group, self.sequence_parallel = kind, tp_group, sequence_parallel
        self.tp_rank, self.tp = dist.get_rank(group=tp_group), tp
        self.in_features, self.scale, self.dropout = in_features, alpha / rank, dropout
        self.merged = False
        self.enabled = True  # off: the layer computes its base alone (lora.apply.adapters_off)
        column = kind == COLUMN
        self.shardings = {"A": Sharding(None if column else 1),
                          "B": Sharding(0, out_blocks) if column else Sharding(None)}
        local_in = in_features if column else in_features // tp
        local_out = out_features // tp if column else out_features
        self.A = torch.nn.Parameter(torch.zeros(rank, local_in, dtype=dtype, device=device))
        self.B = torch.nn.Parameter(torch.zeros(local_out, rank, dtype=dtype, device=device))
        for name, param in self.named_parameters():  # Megatron's marks: grad norms, checkpoints
            dim = self.shardings[name].dim
            set_tensor_model_parallel_attributes(param, dim is not None, 0 if dim is None else dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update to add to the base's output, given the base's input ``x``."""
        return self._column(x) if self.kind == COLUMN else self._row(x)

    def _column(self, x: torch.Tensor) -> torch.Tensor:
        # x: the base's input (under SP this rank's part of the sequence, which the base gathers
        # too). The gather's backward splits, not reduce-scatters: the input's gradient through
        # A is already whole, because each rank's B_r sends its part of dh back through the
        # copy below, whose backward all-reduces dh.
        if self.sequence_parallel:
            x = tensor_parallel.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=False, group=self.tp_group)
        h = F.linear(self._drop(x, replicated=True), self.A)
        h = tensor_parallel.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        return self.scale * F.linear(h, self.B)

    def _row(self, x: torch.Tensor) -> torch.Tensor:
        # x: this rank's slice of the input features, the whole sequence. Summing A_r x_r over TP
        # gives A x on every rank (rank-wide, cheap), so the replicated B sees it all; under SP
        # each rank then keeps its part of the sequence, as the base's reduce-scatter does.
        h = tensor_parallel.reduce_from_tensor_model_parallel_region(
            F.linear(self._drop(x, replicated=False), self.A), group=self.tp_group)
        y = self.scale * F.linear(h, self.B)
        if self.sequence_parallel:
            y = tensor_parallel.scatter_to_sequence_parallel_region(y, group=self.tp_group)
        return y

    def _drop(self, x: torch.Tensor, replicated: bool) -> torch.Tensor:
        """Dropout: with the default generator on an input every TP rank holds whole (the same
        mask everywhere, so the replicated A stays the same), with Megatron's model-parallel
        generator on a TP-split input (each rank its own mask), as Megatron's own dropouts."""
        if not self.dropout or not self.training:
            return x
        if replicated:
            return F.dropout(x, self.dropout, training=True)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return F.dropout(x, self.dropout, training=True)

    def local(self, key: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the one-rank matrix ``full`` of ``key`` (``"A"`` or ``"B"``)."""
        return self.shardings[key].local(full, self.tp_rank, self.tp)

    def update_weight(self) -> torch.Tensor:
        """The local shard of ``scale * B @ A`` (fp32)."""
        return low_rank_update(self.A, self.B, self.scale)

    def extra_repr(self) -> str:
        return (f"{self.kind}-parallel, rank={self.A.shape[0]}, scale={self.scale:g}, "
                f"dropout={self.dropout:g}, A={tuple(self.A.shape)}, B={tuple(self.B.shape)}")


def fused_norm_output(base, x: torch.Tensor) -> torch.Tensor:
    """The output of the norm that Transformer Engine's ``LayerNormLinear`` applies to ``x``
    before its GEMM, from TE's own attributes (``normalization``, ``eps``,
    ``zero_centered_gamma``, ``layer_norm_weight`` / ``layer_norm_bias``), in fp32 and cast back
    to ``x``'s dtype as TE's kernels do: what a norm-fused layer's adapter reads."""
    weight = base.layer_norm_weight.float() + (1.0 if base.zero_centered_gamma else 0.0)
    shape = (x.shape[-1],)
    if base.normalization == "RMSNorm":
        y = F.rms_norm(x.float(), shape, weight, base.eps)
    else:
        bias = getattr(base, "layer_norm_bias", None)
        y = F.layer_norm(x.float(), shape, weight, None if bias is None else bias.float(), base.eps)
    return y.to(x.dtype)


def _update_hook(normed_input: bool):
    """The forward hook of an adapted layer: its ``(output, bias)`` with the adapter's update added
    to the output (not when merged: then the base weight holds it; not when switched off). The
    adapter reads the layer's input, normed first with ``normed_input`` (:func:`fused_norm_output`)."""

    def add_update(base, args, kwargs, output):
        adapter = base.lora
        if adapter.merged or not adapter.enabled:
            return output
        x = args[0] if args else kwargs.get("input_", kwargs.get("x"))
        if normed_input:
            x = fused_norm_output(base, x)
        out, bias = output
        return out + adapter(x).to(out.dtype), bias

    return add_update


def attach(base: torch.nn.Module, adapter: LoRAAdapter, *, normed_input: bool = False) -> None:
    """Make ``adapter`` the child ``lora`` of ``base`` and add its update to every forward. The
    base keeps its module and parameter names (``...linear_qkv.weight``): checkpoints, the HF
    mapping and the anchor see the same model.

    ``normed_input``: ``base`` is Transformer Engine's ``LayerNormLinear`` (the layer's norm fused
    in), so the adapter reads the norm's output, computed again from the layer's input
    (:func:`fused_norm_output`; elementwise, and autograd carries its gradient to the input). TE
    can return its own (``return_layernorm_output``), but Megatron's FP8 inference padding, which
    the built-in sampler uses under FP8, handles only ``(out, bias)`` returns, and since TE's #1711
    the gathered form's gradient is not propagated (docs/lora.md)."""
    base.lora = adapter
    base.register_forward_hook(_update_hook(normed_input), with_kwargs=True)


@torch.no_grad()
def merge(base: torch.nn.Module) -> None:
    """Fold the adapter's update into the base weight (for sampling or export): exact up to
    fp32 rounding, and the adapter is skipped until :func:`unmerge`."""
    adapter = base.lora
    if not adapter.merged:
        base.weight.add_(adapter.update_weight().to(base.weight.dtype))
        adapter.merged = True


@torch.no_grad()
def unmerge(base: torch.nn.Module) -> None:
    """Take the update out of the base weight again (recomputed from the same A and B)."""
    adapter = base.lora
    if adapter.merged:
        base.weight.sub_(adapter.update_weight().to(base.weight.dtype))
        adapter.merged = False
