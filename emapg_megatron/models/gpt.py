"""Build a Megatron-Core ``GPTModel`` for Llama / Qwen style architectures.

:class:`ModelConfig` holds the architecture in Hugging Face terms (so it maps
1:1 onto ``config.json`` of Llama, Qwen2/2.5 and Qwen3), :func:`transformer_config`
turns it into Megatron's ``TransformerConfig`` and :func:`build_gpt_model`
builds the local shard for this rank's TP/PP position.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import gpt_layer_specs as specs
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from emapg_megatron import runtime
from emapg_megatron.errors import ConfigError
from emapg_megatron.models.config import ModelConfig, MoEOptions, PrecisionConfig


def has_local_attention(model) -> bool:
    """Whether ``model`` (any wrapper) attends with Megatron's local ``DotProductAttention`` (the
    local spec: it takes an explicit mask at any cache offset, and no THD packing) rather than TE's."""
    return any(isinstance(m, DotProductAttention) for m in model.modules())


def te_available() -> bool:
    """Transformer Engine imports and its torch extension loads (a broken install is not TE)."""
    return _te_import_error() is None


@functools.lru_cache(maxsize=1)
def _te_import_error() -> str | None:
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine is not installed"
    try:
        import transformer_engine.pytorch  # noqa: F401  (loads transformer_engine_torch)
    except Exception as e:  # noqa: BLE001 - any failure means the TE spec cannot be used
        return f"transformer_engine is installed but does not import: {type(e).__name__}: {e}"
    return None


def use_transformer_engine(device_type: str, impl: str = "auto") -> bool:
    if impl == "auto":
        return device_type == "cuda" and te_available()
    return impl == "transformer_engine"


def validate_precision(prec: PrecisionConfig, device_type: str, *, hardware: bool = True) -> None:
    """The precision flags; ``hardware=False`` (a --dry-run, maybe on another machine) checks
    only what needs no GPU or Transformer Engine here."""
    prec.validate()
    if not hardware:
        return
    if prec.transformer_impl == "transformer_engine" and (device_type != "cuda" or not te_available()):
        raise ConfigError("--transformer-impl transformer_engine needs a GPU and Transformer Engine "
                          f"({_te_import_error() or 'no GPU in this run'}): see docs/gpu.md")
    if prec.fp8_format is None:
        return
    if device_type != "cuda":
        raise ConfigError("FP8 needs a GPU with Transformer Engine; it cannot run in CPU mode")
    if not te_available():
        raise ConfigError(f"FP8 needs Transformer Engine ({_te_import_error()}): see docs/gpu.md "
                          "or use the NGC image")
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        raise ConfigError("FP8 needs a Hopper (sm90) or newer GPU")


def moe_config(cfg: ModelConfig, moe: MoEOptions | None, ep: int = 1, etp: int | None = None) -> dict:
    """``TransformerConfig``'s mixture-of-experts fields (none for a dense model): dropless
    routing (no capacity factor), the router's softmax over the chosen experts' logits when the
    top-k weights are renormalised (HF ``norm_topk_prob``), else over all experts first."""
    if not cfg.is_moe:
        return {}
    moe = moe or MoEOptions()
    return dict(num_moe_experts=cfg.num_experts, moe_router_topk=cfg.moe_router_topk,
                moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
                moe_router_pre_softmax=not cfg.moe_norm_topk_prob,
                moe_token_dispatcher_type=moe.token_dispatcher_type,
                moe_router_load_balancing_type=moe.router_load_balancing_type,
                moe_aux_loss_coeff=moe.aux_loss_coeff, moe_z_loss_coeff=moe.z_loss_coeff,
                moe_router_dtype=moe.router_dtype, moe_grouped_gemm=moe.grouped_gemm,
                moe_expert_capacity_factor=None, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp, moe_enable_routing_replay=moe.record_routes,
                **({"moe_layer_freq": pattern} if (pattern := cfg.moe_layer_pattern()) else {}))


def validate_moe(cfg: ModelConfig, moe: MoEOptions | None, device_type: str) -> None:
    """What the routing options need of the machine (one line each)."""
    if moe is not None and moe.grouped_gemm and cfg.is_moe and device_type != "cuda":
        raise ConfigError("--moe-grouped-gemm runs on a GPU (Transformer Engine's grouped GEMM): "
                          "drop it in CPU mode")


def transformer_config(cfg: ModelConfig, tp: int, pp: int, prec: PrecisionConfig | None = None,
                       *, sequence_parallel: bool = False, perform_initialization: bool = True,
                       moe: MoEOptions | None = None, ep: int = 1, etp: int | None = None):
    prec = prec or PrecisionConfig()
    kwargs = moe_config(cfg, moe, ep, etp)
    if prec.fp8_format is not None:
        kwargs.update(fp8=prec.fp8_format, fp8_recipe=prec.fp8_recipe)
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.add_qkv_bias,
        qk_layernorm=cfg.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        perform_initialization=perform_initialization,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel and tp > 1,
        bf16=prec.bf16,
        params_dtype=prec.params_dtype(),
        pipeline_dtype=prec.params_dtype(),
        autocast_dtype=prec.params_dtype(),
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **kwargs,
    )


class LocalRMSNorm(torch.nn.RMSNorm):
    """The local spec's RMSNorm, built on the device and usable under sequence parallelism.

    Megatron's ``WrappedTorchNorm`` refuses sequence parallelism because a plain torch norm does
    not mark its weight: under SP each TP rank sees a slice of the sequence, so the weight's
    gradient is partial, and Megatron's ``finalize_model_grads`` sums it over TP only for weights
    marked ``sequence_parallel`` (as the TE and Apex norms mark theirs).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        # On the device, as Megatron's own layers request it (torch's norm takes no device by default).
        super().__init__(hidden_size, eps=eps, device=torch.cuda.current_device())
        self.weight.sequence_parallel = config.sequence_parallel


def layer_spec(cfg: ModelConfig, device_type: str, tcfg, vp_stage: int | None = None,
               impl: str = "auto"):
    """TE spec on a GPU with a working Transformer Engine, else the local spec with
    :class:`LocalRMSNorm` in every norm slot (per layer, q/k and the final norm) for this stage's
    layers (``tcfg``: the TransformerConfig)."""
    grouped = bool(tcfg.moe_grouped_gemm)
    if use_transformer_engine(device_type, impl):
        if cfg.moe_layer_pattern():  # dense and MoE layers: Megatron's per-layer block spec
            return specs.get_gpt_decoder_block_spec(tcfg, use_transformer_engine=True, vp_stage=vp_stage)
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=cfg.num_experts, moe_grouped_gemm=grouped, qk_layernorm=cfg.qk_layernorm)

    def local(num_experts):
        layer = specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=grouped,
                                               qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
        sub = layer.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = LocalRMSNorm
        attn = sub.self_attention.submodules
        if attn.q_layernorm is not IdentityOp:
            attn.q_layernorm = attn.k_layernorm = LocalRMSNorm
        return layer

    moe_layer, dense_layer = local(cfg.num_experts), local(None) if cfg.moe_layer_pattern() else None
    first = get_transformer_layer_offset(tcfg, vp_stage=vp_stage)  # this stage's first global layer
    layers = [moe_layer if dense_layer is None or cfg.is_moe_layer(first + i) else dense_layer
              for i in range(get_num_layers_to_build(tcfg, vp_stage=vp_stage))]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LocalRMSNorm)


def build_gpt_model(cfg: ModelConfig, *, tp: int = 1, pp: int = 1, pre_process: bool = True,
                    post_process: bool = True, prec: PrecisionConfig | None = None,
                    device_type: str = "cpu", vp_stage: int | None = None,
                    perform_initialization: bool = True, sequence_parallel: bool = False,
                    moe: MoEOptions | None = None, ep: int = 1, etp: int | None = None):
    """Build this rank's shard of the model (call after :func:`emapg_megatron.runtime.initialize`).

    ``perform_initialization=False`` skips the random init (weights are left uninitialised):
    only for callers that overwrite every weight, like the converter. ``moe``: a MoE model's
    routing options; ``ep``/``etp``: the expert-parallel layout it is built for.
    """
    prec = prec or PrecisionConfig()
    cfg.validate(tp, pp, ep)
    validate_precision(prec, device_type)
    validate_moe(cfg, moe, device_type)
    tcfg = transformer_config(cfg, tp, pp, prec, perform_initialization=perform_initialization,
                              sequence_parallel=sequence_parallel, moe=moe, ep=ep, etp=etp)
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=layer_spec(cfg, device_type, tcfg, vp_stage, prec.transformer_impl),
        vocab_size=cfg.padded_vocab_size(tp),
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rotary_base),
        rope_scaling=cfg.rope_scaling_factor is not None,
        rope_scaling_factor=cfg.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
    )
    if cfg.is_moe:
        mark_experts_expert_parallel(model)
    return model


def mark_experts_expert_parallel(model) -> None:
    """Mark every expert weight as expert-parallel (``allreduce=False``) at any EP size.

    Megatron marks them so only at EP > 1, and its DDP and optimizer split the parameters by that
    mark: at EP = 1 the experts would share the dense params' buffers and optimizer, at EP > 1
    they get their own (reduced over the expert data-parallel group, which at EP = 1 is the
    data-parallel group itself, so nothing changes numerically). With one split at every EP a
    checkpoint's optimizer state has the same structure at EP = 1 and EP = 2 and reshards across.
    """
    for name, param in model.named_parameters():
        if ".experts." in name:  # SequentialMLP's local_experts.j.* and the grouped GEMM's weightj
            param.allreduce = False


def build_for_this_rank(cfg: ModelConfig, prec: PrecisionConfig | None = None, *,
                        sequence_parallel: bool = False, moe: MoEOptions | None = None):
    """Build the model for the current parallel_state position, on this rank's device.

    Like Megatron's own model builder it moves the model with ``.cuda()``: not every module takes
    a device (the local spec's ``torch.nn.RMSNorm`` is built on the host).
    """
    model = build_gpt_model(
        cfg,
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        prec=prec,
        device_type=runtime.hardware(),
        sequence_parallel=sequence_parallel,
        moe=moe,
        # a dense model in a MoE run (a teacher) has no experts to split
        ep=ps.get_expert_model_parallel_world_size() if cfg.is_moe else 1,
        etp=ps.get_expert_tensor_parallel_world_size() if cfg.is_moe else None,
    )
    return model.cuda(torch.cuda.current_device())


def refresh_quantized_weights(model_chunks) -> None:
    """Make Transformer Engine's FP8 layers quantize their weights afresh at their next forward.

    TE keeps an FP8 copy of each weight between microbatches (``is_first_microbatch``: cast at
    the first, reused after). Megatron's pipeline schedule refreshes it at each call's first
    microbatch; a forward outside the schedule (the in-process sampler's) would otherwise run on
    the copy cast before the last optimizer update. A no-op without FP8."""
    for chunk in model_chunks:
        refresh = getattr(chunk, "set_is_first_microbatch", None)
        if refresh is not None:
            refresh()


def unwrap(model):
    """The GPTModel inside DDP (and Float16Module) wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


EXPERTS = "mlp.experts.local_experts."


@torch.no_grad()
def global_param_name(gpt_model, name: str) -> str:
    """Rename local ``decoder.layers.i.`` to the global layer index (PP-stage independent), and a
    MoE layer's local expert ``j`` to its global expert index (EP-rank independent)."""
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return name
    local, rest = name[len(prefix):].split(".", 1)
    layer = gpt_model.decoder.layers[int(local)]
    if rest.startswith(EXPERTS):
        j, tail = rest[len(EXPERTS):].split(".", 1)
        rest = f"{EXPERTS}{layer.mlp.local_expert_indices[int(j)]}.{tail}"
    return f"{prefix}{layer.layer_number - 1}.{rest}"
