"""Build a Megatron-Core ``GPTModel`` for Llama / Qwen style architectures.

:class:`ModelConfig` holds the architecture in Hugging Face terms (so it maps
1:1 onto ``config.json`` of Llama, Qwen2/2.5 and Qwen3), :func:`transformer_config`
turns it into Megatron's ``TransformerConfig`` and :func:`build_gpt_model`
builds the local shard for this rank's TP/PP position.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import asdict, dataclass, field, fields

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

from emapg_megatron import runtime
from emapg_megatron.runtime import ConfigError


@dataclass
class ModelConfig:
    """The architecture, in Hugging Face terms (maps 1:1 onto a Llama / Qwen2 / Qwen3 config.json)."""

    vocab_size: int = 128
    """True vocabulary size (Megatron pads it, see :meth:`padded_vocab_size`)."""
    hidden_size: int = 64
    """Model width."""
    ffn_hidden_size: int = 128
    """SwiGLU intermediate size (HF intermediate_size)."""
    num_layers: int = 2
    """Transformer layers (HF num_hidden_layers)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int | None = None
    """Key/value heads for GQA (HF num_key_value_heads); None: one per query head."""
    kv_channels: int | None = None
    """Head dimension (HF head_dim); None: hidden_size / heads."""
    max_position_embeddings: int = 256
    """RoPE table length."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    rope_scaling_factor: float | None = None
    """Llama 3.1-style frequency scaling (HF rope_type "llama3"); None: plain RoPE. Megatron fixes
    the low/high frequency factors 1/4 and an original context of 8192, as Llama 3.x uses."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    add_qkv_bias: bool = False
    """Bias on the fused QKV projection (Qwen2 / Qwen2.5)."""
    qk_layernorm: bool = False
    """RMSNorm on queries and keys (Qwen3)."""
    tie_word_embeddings: bool = False
    """The output layer shares the input embedding's weight."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this x TP."""
    init_method_std: float = 0.02
    """Weight init std (random init only)."""
    extra: dict = field(default_factory=dict)
    """Anything else carried along (not used by the model build)."""

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron pads the vocabulary to a multiple of divisible_by x TP."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def validate(self, tp: int = 1, pp: int = 1) -> None:
        groups = self.num_query_groups or self.num_attention_heads
        if self.hidden_size % self.num_attention_heads != 0 and self.kv_channels is None:
            raise ConfigError(
                f"hidden size {self.hidden_size} is not divisible by {self.num_attention_heads} heads"
            )
        if self.num_attention_heads % groups != 0:
            raise ConfigError(
                f"{self.num_attention_heads} attention heads are not divisible into {groups} groups"
            )
        if self.num_attention_heads % tp != 0:
            raise ConfigError(
                f"--tensor-model-parallel-size {tp} does not divide the number of attention heads "
                f"({self.num_attention_heads})"
            )
        if groups % tp != 0:
            raise ConfigError(
                f"--tensor-model-parallel-size {tp} does not divide the number of query groups ({groups})"
            )
        if self.num_layers % pp != 0:
            raise ConfigError(
                f"--pipeline-model-parallel-size {pp} does not divide the number of layers "
                f"({self.num_layers})"
            )


@dataclass
class PrecisionConfig:
    """How the layers compute: dtype, FP8, and which implementation (Megatron's local spec or TE)."""

    bf16: bool = False
    """bf16 weights and activations (fp32 main params in the optimizer)."""
    fp8_format: str | None = None
    """FP8 GEMMs through Transformer Engine: e4m3 | hybrid; None is off."""
    fp8_recipe: str = "delayed"
    """FP8 scaling recipe: delayed | tensorwise | blockwise."""
    transformer_impl: str = "auto"
    """Megatron's --transformer-impl: local | transformer_engine | auto (TE on a GPU when it imports)."""

    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32


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
    if prec.transformer_impl not in ("auto", "local", "transformer_engine"):
        raise ConfigError(f"--transformer-impl must be auto, local or transformer_engine "
                          f"(got {prec.transformer_impl!r})")
    if hardware and prec.transformer_impl == "transformer_engine" and (device_type != "cuda" or not te_available()):
        raise ConfigError("--transformer-impl transformer_engine needs a GPU and Transformer Engine "
                          f"({_te_import_error() or 'no GPU in this run'}): see docs/gpu.md")
    if prec.fp8_format is None:
        return
    if prec.transformer_impl == "local":
        raise ConfigError("FP8 runs on Transformer Engine's layers: drop --transformer-impl local")
    if prec.fp8_format not in ("e4m3", "hybrid"):
        raise ConfigError(f"--fp8-format must be e4m3 or hybrid (got {prec.fp8_format!r})")
    if prec.fp8_recipe not in ("delayed", "tensorwise", "blockwise"):
        raise ConfigError(
            f"--fp8-recipe must be delayed, tensorwise or blockwise (got {prec.fp8_recipe!r})"
        )
    if not hardware:
        return
    if device_type != "cuda":
        raise ConfigError("FP8 needs a GPU with Transformer Engine; it cannot run in CPU mode")
    if not te_available():
        raise ConfigError(f"FP8 needs Transformer Engine ({_te_import_error()}): see docs/gpu.md "
                          "or use the NGC image")
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        raise ConfigError("FP8 needs a Hopper (sm90) or newer GPU")


def validate_fp8_shapes(cfg: ModelConfig, tp: int, seq_length: int, sequence_parallel: bool = False) -> None:
    """FP8 GEMMs need the token dimension a multiple of 8 and the weight dimensions of 16.

    A multiple of 8 in ``seq_length`` (per rank under sequence parallelism) leaves room for the
    widths the passes use: the trainer pads each batch to 8 tokens per rank
    (``Trainer._width_multiple``), which never exceeds ``seq_length``, and packed rows are
    multiples of 8 x TP.
    """
    local = seq_length // tp if sequence_parallel else seq_length
    if local % 8:
        raise ConfigError(f"FP8 needs --seq-length{' / TP' if sequence_parallel else ''} "
                          f"({local}) to be a multiple of 8")
    head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    groups = cfg.num_query_groups or cfg.num_attention_heads
    dims = {"hidden size": cfg.hidden_size, "FFN size / TP": cfg.ffn_hidden_size // tp,
            "query projection / TP": cfg.num_attention_heads * head_dim // tp,
            "key/value projection / TP": groups * head_dim // tp,
            "padded vocabulary / TP": cfg.padded_vocab_size(tp) // tp}
    for name, size in dims.items():
        if size % 16:
            raise ConfigError(f"FP8 needs every GEMM dimension to be a multiple of 16: the {name} is {size}")


def transformer_config(cfg: ModelConfig, tp: int, pp: int, prec: PrecisionConfig | None = None,
                       *, sequence_parallel: bool = False, perform_initialization: bool = True):
    prec = prec or PrecisionConfig()
    kwargs = {}
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
    if use_transformer_engine(device_type, impl):
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_layernorm)
    layer = specs.get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
    sub = layer.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = LocalRMSNorm
    attn = sub.self_attention.submodules
    if attn.q_layernorm is not IdentityOp:
        attn.q_layernorm = attn.k_layernorm = LocalRMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(tcfg, vp_stage=vp_stage),
                                      layer_norm=LocalRMSNorm)


def build_gpt_model(cfg: ModelConfig, *, tp: int = 1, pp: int = 1, pre_process: bool = True,
                    post_process: bool = True, prec: PrecisionConfig | None = None,
                    device_type: str = "cpu", vp_stage: int | None = None,
                    perform_initialization: bool = True, sequence_parallel: bool = False):
    """Build this rank's shard of the model (call after :func:`emapg_megatron.runtime.initialize`).

    ``perform_initialization=False`` skips the random init (weights are left uninitialised):
    only for callers that overwrite every weight, like the converter.
    """
    prec = prec or PrecisionConfig()
    cfg.validate(tp, pp)
    validate_precision(prec, device_type)
    tcfg = transformer_config(cfg, tp, pp, prec, perform_initialization=perform_initialization,
                              sequence_parallel=sequence_parallel)
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
    return model


def build_for_this_rank(cfg: ModelConfig, prec: PrecisionConfig | None = None, *,
                        sequence_parallel: bool = False):
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
    )
    return model.cuda(torch.cuda.current_device())
