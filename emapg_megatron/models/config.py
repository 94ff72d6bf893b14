"""The model's configs: the architecture (:class:`ModelConfig`, in Hugging Face terms), how the
layers compute (:class:`PrecisionConfig`) and the model as the command line describes it
(:class:`ModelOptions`: a random init of given shapes, or weights from --load-hf /
--pretrained-checkpoint). No Megatron here: the CLI validates with these before any import of it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

from emapg_megatron.configurable import (
    above,
    at_least,
    check_fields,
    option,
)
from emapg_megatron.errors import ConfigError, shown

if TYPE_CHECKING:
    import torch

SYNTHETIC_VOCAB = 13
"""Token ids of the built-in synthetic task's tokenizer (tasks.synthetic.CharTokenizer)."""

#: Upper bounds of the architecture's integers (each at least 1), far above released models (Llama
#: 3.1 405B: 126 layers, 128 heads, width 16384, FFN 53248; vocabularies up to ~256k) and low
#: enough that a hostile config (an HF config.json, a checkpoint's model config) cannot make the
#: converter or the trainer build per-layer tables or embeddings without end. The HF config's
#: checks (checkpoint/hf_config.py) apply the same bounds under the HF names.
INT_LIMITS = {
    "vocab_size": 1 << 21,
    "hidden_size": 1 << 16,
    "ffn_hidden_size": 1 << 18,
    "num_layers": 1024,
    "num_attention_heads": 1024,
    "num_query_groups": 1024,
    "kv_channels": 4096,
    "max_position_embeddings": 1 << 24,
    "make_vocab_size_divisible_by": 1 << 16,
    # Mixture of experts (DeepSeek-V3: 256 routed experts, 8 per token; Qwen3-235B-A22B: 128, 8)
    "num_experts": 4096,
    "moe_router_topk": 4096,
    "moe_ffn_hidden_size": 1 << 18,
}
OPTIONAL_INTS = ("num_query_groups", "kv_channels", "num_experts", "moe_ffn_hidden_size")
"""Integers that may be None (a default taken from another field, or a dense model)."""
#: Fields read as positive finite numbers.
POSITIVE = ("rotary_base", "rope_scaling_factor", "norm_epsilon")
_BOOLS = ("add_qkv_bias", "qk_layernorm", "tie_word_embeddings", "moe_norm_topk_prob")


def is_number(value) -> bool:
    """A finite int or float (not a bool, not a string)."""
    return type(value) in (int, float) and math.isfinite(value)


def check_int(name: str, value, where: str) -> None:
    """``value`` is an integer from 1 to :data:`INT_LIMITS` ``[name]``; ConfigError naming ``where``."""
    upper = INT_LIMITS[name]
    if type(value) is not int or not 1 <= value <= upper:
        raise ConfigError(f"{where}: {name} must be an integer from 1 to {upper} (got {shown(value)})")


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
    num_experts: int | None = None
    """Routed experts of every MoE layer (HF num_experts / num_local_experts); None: a dense model."""
    moe_router_topk: int = 2
    """Experts each token is routed to (HF num_experts_per_tok)."""
    moe_ffn_hidden_size: int | None = None
    """Each expert's SwiGLU inner width (HF moe_intermediate_size); None: ffn_hidden_size."""
    moe_norm_topk_prob: bool = True
    """Top-k routing weights renormalised to sum to 1 (HF norm_topk_prob; Mixtral always): the
    softmax over the chosen experts' logits. False: the full softmax's top-k probabilities."""
    dense_mlp_layers: list[int] = field(default_factory=list)
    """A MoE model's layers (global indices, ascending) whose MLP is dense, ffn_hidden_size wide:
    HF Qwen3-MoE's mlp_only_layers and the layers its decoder_sparse_step skips; Megatron's
    --moe-layer-freq pattern's zeros. Empty: every layer routes to experts."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this x TP."""
    init_method_std: float = 0.02
    """Weight init std (random init only)."""
    extra: dict = field(default_factory=dict)
    """Anything else carried along (not used by the model build)."""

    @classmethod
    def from_dict(cls, d: dict, where: str = "model config") -> "ModelConfig":
        """The config ``d`` (what :meth:`to_dict` wrote), its entries checked for type and bounds
        before anything is sized by them (:data:`INT_LIMITS`, :data:`POSITIVE`); ConfigError
        naming ``where``."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: a {type(d).__name__}, not an object")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"{where}: unknown model config keys: {shown(sorted(map(str, unknown)))}")
        cfg = cls(**d)
        cfg.check_entries(where)
        return cfg

    def check_entries(self, where: str = "model config") -> None:
        """Each field of the right type and within its bounds (ConfigError naming ``where``)."""
        for name in INT_LIMITS:
            value = getattr(self, name)
            if value is not None or name not in OPTIONAL_INTS:
                check_int(name, value, where)
        for name in POSITIVE:
            value = getattr(self, name)
            if not (value is None and name == "rope_scaling_factor") and not (is_number(value) and value > 0):
                raise ConfigError(f"{where}: {name} must be a positive number (got {shown(value)})")
        if not (is_number(self.init_method_std) and self.init_method_std >= 0):
            raise ConfigError(f"{where}: init_method_std must be a number >= 0 "
                              f"(got {shown(self.init_method_std)})")
        for name in _BOOLS:
            if type(getattr(self, name)) is not bool:
                raise ConfigError(f"{where}: {name} must be true or false (got {shown(getattr(self, name))})")
        if not isinstance(self.extra, dict):
            raise ConfigError(f"{where}: extra must be an object (got {shown(self.extra)})")
        self._check_dense_mlp_layers(where)

    def _check_dense_mlp_layers(self, where: str) -> None:
        layers = self.dense_mlp_layers
        if not isinstance(layers, list) or not all(type(i) is int for i in layers):
            raise ConfigError(f"{where}: dense_mlp_layers must be a list of layer indices (got {shown(layers)})")
        if not layers:
            return
        if not self.is_moe:
            raise ConfigError(f"{where}: dense_mlp_layers {shown(layers)} needs a mixture-of-experts model")
        if layers != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] < self.num_layers:
            raise ConfigError(f"{where}: dense_mlp_layers must be distinct ascending indices of the "
                              f"{self.num_layers} layers (got {shown(layers)})")
        if len(layers) == self.num_layers:
            raise ConfigError(f"{where}: every layer's MLP is dense (dense_mlp_layers {shown(layers)}): "
                              "a mixture of experts needs at least one MoE layer")

    def to_dict(self) -> dict:
        return asdict(self)

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron pads the vocabulary to a multiple of divisible_by x TP."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` routes its MLP to experts."""
        return self.is_moe and layer not in self.dense_mlp_layers

    @property
    def moe_layers(self) -> list[int]:
        """The global indices of the MoE layers (none for a dense model)."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def moe_layer_pattern(self) -> list[int] | None:
        """Megatron's ``moe_layer_freq`` list (1: a MoE layer, 0: a dense MLP), or None when every
        layer is a MoE layer (Megatron's default; a list makes its checkpoints key each layer)."""
        if not self.is_moe or not self.dense_mlp_layers:
            return None
        return [int(self.is_moe_layer(i)) for i in range(self.num_layers)]

    def validate(self, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
        if self.is_moe and self.moe_router_topk > self.num_experts:
            raise ConfigError(f"the router's top-k ({self.moe_router_topk}) exceeds the {self.num_experts} "
                              "experts: set --moe-router-topk to at most the expert count")
        if ep > 1 and not self.is_moe:
            raise ConfigError(f"--expert-model-parallel-size {ep} needs a mixture-of-experts model "
                              "(--num-experts, or a MoE --load-hf): this one is dense")
        if self.is_moe and self.num_experts % ep:
            raise ConfigError(f"--expert-model-parallel-size {ep} does not divide the {self.num_experts} experts")
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

    bf16: bool = option(False)
    """bf16 weights and activations, fp32 main params."""
    transformer_impl: str = option("auto", choices=("auto", "local", "transformer_engine"))
    """Layer implementation: Megatron's local spec (CPU and GPU), Transformer Engine's (GPU; needed
    for FP8), or auto: TE on a GPU when it imports, else local."""
    fp8_format: str | None = option(None, choices=("e4m3", "hybrid"))
    """FP8 GEMMs via Transformer Engine (needs --bf16 and a Hopper GPU): e4m3 everywhere, or
    hybrid: e4m3 forward, e5m2 gradients."""
    fp8_recipe: str = option("delayed", choices=("delayed", "tensorwise", "blockwise"))
    """FP8 scaling recipe."""

    def params_dtype(self) -> torch.dtype:
        import torch  # the config itself stays light: the CLI checks it before torch loads

        return torch.bfloat16 if self.bf16 else torch.float32

    def validate(self) -> None:
        """What needs no GPU (a dry run checks it too); models.gpt.validate_precision the rest."""
        check_fields(self)
        if self.fp8_format is not None and not self.bf16:
            raise ConfigError("--fp8-format needs --bf16")
        if self.fp8_format is not None and self.transformer_impl == "local":
            raise ConfigError("FP8 runs on Transformer Engine's layers: drop --transformer-impl local")


@dataclass
class MoEOptions:
    """How a mixture-of-experts model routes and dispatches tokens (Megatron-LM's flags; the
    architecture, experts and top-k, is the model's). Ignored by a dense model."""

    token_dispatcher_type: str = option("allgather", flag="--moe-token-dispatcher-type",
                                        choices=("allgather", "alltoall"))
    """How tokens reach the experts of other expert-parallel ranks: all-gather every token, or
    all-to-all only the routed ones."""
    router_load_balancing_type: str = option("aux_loss", flag="--moe-router-load-balancing-type",
                                             choices=("aux_loss", "seq_aux_loss", "none"))
    """The load-balancing loss: over the batch (aux_loss), per sequence (seq_aux_loss), or none."""
    aux_loss_coeff: float = option(0.0, flag="--moe-aux-loss-coeff", range=at_least(0))
    """Weight of the load-balancing loss, added to the policy loss through Megatron's own
    mechanism (its gradient enters in the backward, as a mean over micro-batches) and logged,
    before the weight, as moe_aux_loss (1 for a perfectly balanced router)."""
    z_loss_coeff: float | None = option(None, flag="--moe-z-loss-coeff", range=at_least(0))
    """Weight of the router z-loss (logged before the weight as moe_z_loss); default none."""
    router_dtype: str | None = option(None, flag="--moe-router-dtype", choices=("fp32", "fp64"))
    """Compute the router's softmax and top-k in this dtype; default the model's."""
    routing_replay: str = option("none", flag="--moe-routing-replay", choices=("none", "r2", "r3"))
    """r2: the training passes replay the experts the old-policy pass chose for each token
    (Megatron's RouterReplay), so an update sees the routes that gave the old log-probs. r3: the
    old-policy and training passes replay the experts the built-in sampler chose while generating
    (not with --partial-rollouts or vLLM), so they route as the rollout did. The anchor pass routes
    itself. none: every pass routes afresh. (docs/moe.md)"""
    grouped_gemm: bool = option(False, flag="--moe-grouped-gemm")
    """Run the local experts as one grouped GEMM (Transformer Engine on a GPU) instead of one
    GEMM per expert."""

    record_routes: bool = True
    """Not a flag: whether the routers record routes (Megatron's RouterReplay), for the expert
    load metrics and replay; off for a teacher, which routes itself and records nothing."""

    def validate(self) -> None:
        check_fields(self)


@dataclass
class ModelOptions:
    """The model: a random init of the shape the flags give, or --load-hf's (shape, weights and
    tokenizer), or --pretrained-checkpoint's weights."""

    num_layers: int = option(2, range=at_least(1))
    """Transformer layers."""
    hidden_size: int = option(64, range=at_least(1))
    """Model width."""
    ffn_hidden_size: int = option(128, range=at_least(1))
    """SwiGLU inner width."""
    num_attention_heads: int = option(4, range=at_least(1))
    """Query heads."""
    num_query_groups: int | None = option(None, range=at_least(1))
    """Key/value heads (GQA); default: as many as query heads, or 1 with --group-query-attention."""
    group_query_attention: bool = option(False)
    """Megatron-LM's GQA switch: --num-query-groups sets the groups (1 when not given);
    --num-query-groups alone also works."""
    kv_channels: int | None = option(None, range=at_least(1))
    """Head dim; default hidden/heads."""
    max_position_embeddings: int = option(256, range=at_least(1))
    """RoPE table length."""
    rotary_base: float = option(10000.0, range=above(0))
    """RoPE base."""
    norm_epsilon: float = option(1e-6, range=above(0))
    """RMSNorm epsilon."""
    add_qkv_bias: bool = option(False)
    """Bias on the fused QKV projection (Qwen2)."""
    qk_layernorm: bool = option(False)
    """RMSNorm on queries and keys (Qwen3)."""
    untie_embeddings_and_output_weights: bool = option(False)
    """Separate output layer instead of the tied input embedding."""
    make_vocab_size_divisible_by: int = option(128, range=at_least(1))
    """Pad the vocabulary to a multiple of this x TP."""
    num_experts: int | None = option(None, range=at_least(1))
    """Mixture of experts: routed experts in every layer's MLP (random init; --load-hf reads it
    from config.json). Default: a dense model."""
    moe_router_topk: int = option(2, range=at_least(1))
    """Mixture of experts: experts each token is routed to."""
    moe_ffn_hidden_size: int | None = option(None, range=at_least(1))
    """Mixture of experts: each expert's SwiGLU inner width; default --ffn-hidden-size."""
    moe_layer_freq: str | None = option(None, metavar="N|PATTERN")
    """Mixture of experts: which layers route to experts, as Megatron-LM's flag: N (layers 0, N,
    2N, ... are MoE layers, the others a dense --ffn-hidden-size MLP) or one 0/1 per layer
    ("[0,1,1,1]" or "0,1,1,1": 1 a MoE layer). Default: every layer (--load-hf reads Qwen3-MoE's
    mlp_only_layers / decoder_sparse_step from config.json)."""
    vocab_size: int | None = option(None, range=at_least(1))
    """Vocabulary of a randomly initialised model (synthetic task; default: its tokenizer's 13 ids).
    Larger sizes model a real LM head for benchmarks; ids beyond the tokenizer's decode to nothing."""
    init_method_std: float = option(0.02, range=above(0))
    """Weight init std (random init only)."""
    load_hf: str | None = option(None, path="dir")
    """Initialise weights, model shape and tokenizer from a Hugging Face checkpoint directory."""
    pretrained_checkpoint: str | None = option(None, path="dir")
    """Initialise weights from a Megatron dist checkpoint (e.g. from emapg-convert), any TP/PP; the
    model flags must describe its architecture (checked against the one it stores)."""

    def validate(self) -> None:
        if self.vocab_size is not None and self.load_hf is not None:
            raise ConfigError("--vocab-size is for a randomly initialised model: --load-hf sets the vocabulary")
        if self.vocab_size is not None and self.vocab_size < SYNTHETIC_VOCAB:
            raise ConfigError(f"--vocab-size must cover the synthetic task's {SYNTHETIC_VOCAB} token "
                              f"ids (got {self.vocab_size})")
        check_fields(self)
        if self.moe_layer_freq is not None:
            if self.num_experts is None:
                raise ConfigError("--moe-layer-freq needs a mixture-of-experts model (--num-experts)")
            dense_mlp_layers(self.moe_layer_freq, self.num_layers)

    def architecture(self, seq_length: int) -> ModelConfig:
        """The architecture of a random init (no --load-hf): the flags' shapes, a RoPE table that
        covers ``seq_length``."""
        shared = {f.name: getattr(self, f.name) for f in fields(ModelConfig) if hasattr(self, f.name)}
        return ModelConfig(**{
            **shared, "vocab_size": self.vocab_size or SYNTHETIC_VOCAB,
            "max_position_embeddings": max(self.max_position_embeddings, seq_length),
            "tie_word_embeddings": not self.untie_embeddings_and_output_weights,
            "dense_mlp_layers": (dense_mlp_layers(self.moe_layer_freq, self.num_layers)
                                 if self.moe_layer_freq is not None else []),
            "num_query_groups": self.num_query_groups or (1 if self.group_query_attention else None)})


def dense_mlp_layers(moe_layer_freq: str, num_layers: int) -> list[int]:
    """The dense-MLP layers ``--moe-layer-freq`` describes (Megatron-LM's meaning, read without
    evaluating it): ``N`` makes every N-th layer from 0 a MoE layer; a list has one 0 (dense) or
    1 (MoE) per layer. One-line ConfigError otherwise."""
    text = moe_layer_freq.strip()
    if text.isdigit():
        every = int(text)
        if not 1 <= every <= num_layers:
            raise ConfigError(f"--moe-layer-freq {text}: a layer interval from 1 to the {num_layers} layers")
        return [i for i in range(num_layers) if i % every]
    items = [t.strip() for t in text.removeprefix("[").removesuffix("]").split(",")]
    if len(items) != num_layers or any(t not in ("0", "1") for t in items):
        raise ConfigError(f"--moe-layer-freq {text}: an interval N, or one 0 (dense) or 1 (MoE) per "
                          f"layer ({num_layers} of them, e.g. [0{',1' * (num_layers - 1)}])")
    if "1" not in items:
        raise ConfigError(f"--moe-layer-freq {text}: no MoE layer (1) in the pattern")
    return [i for i, t in enumerate(items) if t == "0"]


def validate_fp8_shapes(cfg: ModelConfig, tp: int, seq_length: int, sequence_parallel: bool = False,
                        etp: int | None = None) -> None:
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
    if cfg.is_moe:  # the experts' GEMMs, split over the expert TP ranks
        dims["expert FFN size / expert TP"] = (cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size) // (etp or tp)
    for name, size in dims.items():
        if size % 16:
            raise ConfigError(f"FP8 needs every GEMM dimension to be a multiple of 16: the {name} is {size}")
