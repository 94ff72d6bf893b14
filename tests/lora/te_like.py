"""Stand-ins for Transformer Engine's tensor-parallel linears, for LoRA's CPU tests (TE does not
import without CUDA). They keep the contract TE 2.x implements and Megatron's ``TE*Linear``
wrappers pass on (read in ``transformer_engine/pytorch/module/linear.py`` and
``layernorm_linear.py`` and ``megatron/core/extensions/transformer_engine.py``), which is all
``emapg_megatron.lora`` relies on:

* attributes: ``parallel_mode`` (``"column"`` / ``"row"``), ``tp_size``, ``in_features`` /
  ``out_features`` *of this rank* (the split side divided by TP), ``sequence_parallel`` (only at
  TP > 1), ``weight`` / ``bias``, Megatron's ``_tp_group``;
* the column layer gathers a sequence-parallel input itself (reduce-scatter backward), the row
  layer all-reduces or reduce-scatters its output;
* ``LayerNormLinear`` (``TELayerNormColumnParallelLinear``) normalises its (sequence-local)
  input with its own ``layer_norm_weight`` first (``normalization``, ``eps``,
  ``zero_centered_gamma`` say how), then gathers and multiplies.

Built through a GPT layer spec (:func:`te_like_layer_spec`): Megatron's local layer with these in
the linear slots and no separate pre-attention / pre-MLP norm, as in Megatron's TE spec.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes


class TELikeLinear(torch.nn.Module):
    """TE's ``Linear`` as Megatron's ``TEColumnParallelLinear`` / ``TERowParallelLinear`` build it."""

    def __init__(self, input_size: int, output_size: int, *, parallel_mode: str, config, init_method,
                 bias: bool, skip_bias_add: bool, tp_group=None, **unused):
        super().__init__()
        self.config, self.parallel_mode = config, parallel_mode
        self._tp_group = tp_group or parallel_state.get_tensor_model_parallel_group()
        self.tp_size = torch.distributed.get_world_size(self._tp_group)
        self.sequence_parallel = self.tp_size > 1 and config.sequence_parallel
        self.in_features, self.out_features = input_size, output_size
        if parallel_mode == "column":
            self.out_features //= self.tp_size
        elif parallel_mode == "row":
            self.in_features //= self.tp_size
        self.te_return_bias = skip_bias_add and bias
        self.weight = torch.nn.Parameter(torch.empty(self.out_features, self.in_features))
        init_method(self.weight)
        self.bias = torch.nn.Parameter(torch.zeros(self.out_features)) if bias else None
        # TE marks its split parameters as Megatron does (same attribute names)
        split = 0 if parallel_mode == "column" else 1
        set_tensor_model_parallel_attributes(self.weight, True, split, 1)
        if self.bias is not None and parallel_mode == "column":
            set_tensor_model_parallel_attributes(self.bias, True, 0, 1)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        """The GEMM with TE's tensor-parallel communication around it (bias not yet added)."""
        group = self._tp_group
        if self.parallel_mode == "column":
            x = (tensor_parallel.gather_from_sequence_parallel_region(x, group=group)
                 if self.sequence_parallel else
                 tensor_parallel.copy_to_tensor_model_parallel_region(x, group=group))
            return F.linear(x, self.weight)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            return tensor_parallel.reduce_scatter_to_sequence_parallel_region(y, group=group)
        return tensor_parallel.reduce_from_tensor_model_parallel_region(y, group=group)

    def _returned(self, out: torch.Tensor):
        if self.bias is not None and not self.te_return_bias:
            out = out + self.bias
        return (out, self.bias) if self.te_return_bias else (out, None)

    def forward(self, x: torch.Tensor):
        return self._returned(self._linear(x))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """As Megatron's TE wrappers: the split weight (and a column layer's bias) sharded over TP."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {"weight": 0, "bias": 0} if self.parallel_mode == "column" else {"weight": 1}
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                   axes, sharded_offsets, tp_group=self._tp_group)


class TELikeColumnParallelLinear(TELikeLinear):
    def __init__(self, input_size, output_size, **kwargs):
        super().__init__(input_size, output_size, parallel_mode="column", **kwargs)


class TELikeRowParallelLinear(TELikeLinear):
    def __init__(self, input_size, output_size, **kwargs):
        super().__init__(input_size, output_size, parallel_mode="row", **kwargs)


class TELikeLayerNormColumnParallelLinear(TELikeColumnParallelLinear):
    """TE's ``LayerNormLinear`` (RMSNorm) as Megatron's ``TELayerNormColumnParallelLinear``."""

    def __init__(self, input_size, output_size, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size))
        self.normalization, self.eps, self.zero_centered_gamma = "RMSNorm", self.config.layernorm_epsilon, False

    def forward(self, x: torch.Tensor):
        return self._returned(self._linear(F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps)))


def te_like_layer_spec(cfg, device_type, tcfg, vp_stage=None, impl="auto"):
    """``emapg_megatron.models.gpt.layer_spec``'s signature: this stage's dense layers with the
    stand-ins in the linear slots, the norms fused into ``linear_qkv`` and ``linear_fc1``."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from emapg_megatron.models.gpt import LocalRMSNorm

    layer = specs.get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
    sub = layer.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = IdentityOp
    attn = sub.self_attention.submodules
    # the MLP slot is a ModuleSpec (megatron-core 0.16) or a partial of MLP.as_mlp_submodule (0.19)
    mlp = getattr(sub.mlp, "submodules", None) or sub.mlp.keywords["submodules"]
    attn.linear_qkv, attn.linear_proj = TELikeLayerNormColumnParallelLinear, TELikeRowParallelLinear
    mlp.linear_fc1, mlp.linear_fc2 = TELikeLayerNormColumnParallelLinear, TELikeRowParallelLinear
    if attn.q_layernorm is not IdentityOp:
        attn.q_layernorm = attn.k_layernorm = LocalRMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(tcfg, vp_stage=vp_stage),
                                      layer_norm=LocalRMSNorm)
