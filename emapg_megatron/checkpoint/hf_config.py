"""HF ``config.json`` <-> :class:`~emapg_megatron.models.gpt.ModelConfig` for Llama, Qwen2(.5), Qwen3
and the mixtures of experts Qwen3-MoE and Mixtral.

Anything the Megatron model builder cannot reproduce exactly (RoPE scaling, sliding windows,
attention biases beyond Qwen2's q/k/v, non-SiLU MLPs, dense layers mixed into a MoE model, shared
experts) is rejected with a one-line :class:`ConfigError` rather than converted into a model that
silently computes something else. So is a config.json that is not a JSON object, or whose
architecture entries have the wrong type or lie outside :data:`_INT_LIMITS`
(:func:`check_hf_config`), before anything is sized by them.
"""

from __future__ import annotations

import os
from pathlib import Path

from emapg_megatron.checkpoint.safe_load import read_json
from emapg_megatron.errors import ConfigError, shown
from emapg_megatron.models.config import INT_LIMITS, ModelConfig, is_number

# architecture -> (model_type, q/k/v bias, q/k layernorm)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False, True),
    "MixtralForCausalLM": ("mixtral", False, False),
}
#: The mixture-of-experts architectures (every layer's MLP routed to experts).
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")

# ModelConfig fields that describe the network (the rest are Megatron-side choices).
ARCH_FIELDS = ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads",
               "num_query_groups", "kv_channels", "rotary_base", "norm_epsilon", "add_qkv_bias",
               "qk_layernorm", "tie_word_embeddings", "rope_scaling_factor", "num_experts",
               "moe_router_topk", "moe_ffn_hidden_size", "moe_norm_topk_prob", "dense_mlp_layers")

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

MAX_CONFIG_BYTES = 16 << 20  # a config.json is a few KB

# The architecture's integers under their HF names: name -> (required, upper bound), the bounds
# of the ModelConfig fields they become (models.config.INT_LIMITS), so that a config.json and a
# checkpoint's model config are held to the same limits.
_INT_LIMITS = {hf: (required, INT_LIMITS[ours]) for hf, ours, required in (
    ("vocab_size", "vocab_size", True),
    ("hidden_size", "hidden_size", True),
    ("intermediate_size", "ffn_hidden_size", True),
    ("num_hidden_layers", "num_layers", True),
    ("num_attention_heads", "num_attention_heads", True),
    ("num_key_value_heads", "num_query_groups", False),
    ("head_dim", "kv_channels", False),
    ("max_position_embeddings", "max_position_embeddings", False),
    # Mixture of experts: Qwen3-MoE's num_experts (transformers 5 writes num_local_experts),
    # Mixtral's num_local_experts; the experts' width (Qwen3-MoE; Mixtral's is intermediate_size).
    ("num_experts", "num_experts", False),
    ("num_local_experts", "num_experts", False),
    ("num_experts_per_tok", "moe_router_topk", False),
    ("moe_intermediate_size", "moe_ffn_hidden_size", False),
)}
# Entries read as positive numbers, at the top level and in rope_parameters / rope_scaling.
_POSITIVE = ("rope_theta", "rms_norm_eps", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings")
_TYPES = {"architectures": list, "rope_parameters": dict, "rope_scaling": dict,
          "layer_types": list, "tie_word_embeddings": bool, "norm_topk_prob": bool,
          "mlp_only_layers": list, "decoder_sparse_step": int}


def read_hf_config(hf_dir: str | Path) -> dict:
    """``hf_dir``'s config.json, checked (:func:`check_hf_config`); ConfigError naming it."""
    path = Path(hf_dir) / "config.json"
    if not os.path.lexists(path):
        raise ConfigError(f"{hf_dir} has no config.json (is it a Hugging Face model directory?)")
    hf = read_json(str(path), MAX_CONFIG_BYTES, "invalid JSON in")
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} holds a JSON {type(hf).__name__}, not an object")
    check_hf_config(hf, str(path))
    return hf


def check_hf_config(hf: dict, where: str = "config.json") -> None:
    """Refuse, naming ``where``, a config whose entries :func:`model_config_from_hf` reads have
    the wrong type or lie outside :data:`_INT_LIMITS` / :data:`_POSITIVE`."""
    for name, (required, upper) in _INT_LIMITS.items():
        value = hf.get(name)
        if value is None and required:
            raise ConfigError(f"{where}: no {name} (an integer from 1 to {upper})")
        if value is not None and (type(value) is not int or not 1 <= value <= upper):
            raise ConfigError(f"{where}: {name} must be an integer from 1 to {upper} "
                              f"(got {shown(value)})")
    for name, kind in _TYPES.items():
        if hf.get(name) is not None and not isinstance(hf[name], kind):
            raise ConfigError(f"{where}: {name} must be a {kind.__name__} (got {shown(hf[name])})")
    for prefix, entries in (("", hf), ("rope_parameters.", hf.get("rope_parameters") or {}),
                            ("rope_scaling.", hf.get("rope_scaling") or {})):
        for name in _POSITIVE:
            value = entries.get(name)
            if value is not None and not (is_number(value) and value > 0):
                raise ConfigError(f"{where}: {prefix}{name} must be a positive number "
                                  f"(got {shown(value)})")
    for name in ("initializer_range", "router_jitter_noise"):
        value = hf.get(name)
        if value is not None and not (is_number(value) and value >= 0):
            raise ConfigError(f"{where}: {name} must be a number >= 0 (got {shown(value)})")


def hf_architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    if len(archs) != 1 or not isinstance(archs[0], str) or archs[0] not in ARCHITECTURES:
        raise ConfigError(
            f"unsupported architecture {shown(archs or hf.get('model_type'))}: "
            f"supported are {', '.join(ARCHITECTURES)}"
        )
    return archs[0]


def hf_dtype(hf: dict) -> str | None:
    """The checkpoint's dtype as ``fp32`` / ``bf16`` / ``fp16`` (None when not recorded)."""
    name = hf.get("dtype") or hf.get("torch_dtype")
    return _DTYPES.get(name) if isinstance(name, str) else None


# The llama3 RoPE scaling Megatron reproduces: only the factor is configurable there.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}


def _rope(hf: dict) -> tuple[float, str]:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta") or params.get("rope_theta") or 10000.0
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type") or "default"
    return float(theta), kind


def _rope_scaling(hf: dict) -> dict:
    return {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}


def _llama3_rope_problem(hf: dict) -> str | None:
    scaling = _rope_scaling(hf)
    if scaling.get("factor") is None:
        return "llama3 rope scaling without a factor"
    off = {k: scaling.get(k) for k, v in _MEGATRON_LLAMA3_ROPE.items() if float(scaling.get(k, -1)) != v}
    return f"llama3 rope scaling with {off} (Megatron fixes {_MEGATRON_LLAMA3_ROPE})" if off else None


def _reject_unsupported(hf: dict, arch: str) -> None:
    _, qkv_bias, _ = ARCHITECTURES[arch]
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={shown(hf['hidden_act'])} (only silu)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true")
    if hf.get("attention_bias") and not qkv_bias:
        problems.append("attention_bias=true (o_proj bias)")
    _, rope_kind = _rope(hf)
    if rope_kind == "llama3":
        problem = _llama3_rope_problem(hf)
        if problem:
            problems.append(problem)
    elif rope_kind != "default":
        problems.append(f"rope scaling {shown(rope_kind)}")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window=true")
    if arch == "MixtralForCausalLM" and hf.get("sliding_window") is not None:
        problems.append(f"sliding_window={shown(hf['sliding_window'])} (only null)")
    if any(t != "full_attention" for t in hf.get("layer_types") or []):
        problems.append("non-full-attention layer_types")
    if problems:
        raise ConfigError(f"{arch} config uses features the Megatron builder does not reproduce: "
                          + "; ".join(problems))
    if arch in MOE_ARCHITECTURES:
        _reject_unsupported_moe(hf, arch)


# Keys of other MoE families (shared experts, leading dense layers) that no supported
# architecture reads: set, they would describe a network the conversion does not build.
_FOREIGN_MOE_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts",
                     "first_k_dense_replace")


def _reject_unsupported_moe(hf: dict, arch: str) -> None:
    """Every layer a MoE layer of routed experts only, top-k at most the expert count."""
    if arch == "Qwen3MoeForCausalLM":
        _check_dense_layer_keys(hf, arch)
        if hf.get("num_experts") is not None and hf.get("num_local_experts") is not None \
                and hf["num_experts"] != hf["num_local_experts"]:
            raise ConfigError(f"{arch} config: num_experts {hf['num_experts']} != num_local_experts "
                              f"{hf['num_local_experts']}")
    foreign = [f"{k}={shown(hf[k])}" for k in _FOREIGN_MOE_KEYS if hf.get(k)]
    if foreign:
        raise ConfigError(f"{arch} config uses features the Megatron builder does not reproduce: "
                          f"{', '.join(foreign)} (shared experts and dense layers are not supported yet)")
    experts, topk = _num_experts(hf, arch), hf.get("num_experts_per_tok")
    if experts is None or topk is None:
        count = "num_local_experts" if arch == "MixtralForCausalLM" else "num_experts"
        raise ConfigError(f"{arch} config: no {count} or num_experts_per_tok (the experts and how "
                          "many each token is routed to)")
    if topk > experts:
        raise ConfigError(f"{arch} config: num_experts_per_tok {topk} exceeds the {experts} experts")
    if arch == "Qwen3MoeForCausalLM" and hf.get("moe_intermediate_size") is None:
        raise ConfigError(f"{arch} config: no moe_intermediate_size (the experts' width)")


def _check_dense_layer_keys(hf: dict, arch: str) -> None:
    """Qwen3-MoE's dense layers: decoder_sparse_step from 1 to the layer count, mlp_only_layers
    indices of existing layers, and at least one MoE layer left."""
    layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    if step is None:
        step = 1
    if type(step) is not int or not 1 <= step <= layers:
        raise ConfigError(f"{arch} config: decoder_sparse_step must be an integer from 1 to the "
                          f"{layers} layers (got {shown(step)})")
    only = hf.get("mlp_only_layers") or []
    if not all(type(i) is int and 0 <= i < layers for i in only):
        raise ConfigError(f"{arch} config: mlp_only_layers must hold indices of the {layers} layers "
                          f"(got {shown(only)})")
    if not _hf_moe_layers(hf):
        raise ConfigError(f"{arch} config: no MoE layer (decoder_sparse_step {step}, mlp_only_layers "
                          f"{shown(only)}): every MLP is dense")


def _hf_moe_layers(hf: dict) -> list[int]:
    """Qwen3-MoE's rule (transformers' Qwen3MoeDecoderLayer): layer i routes to experts unless it
    is in mlp_only_layers or (i + 1) is no multiple of decoder_sparse_step."""
    step, only = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or [])
    return [i for i in range(hf["num_hidden_layers"]) if i not in only and (i + 1) % step == 0]


def _num_experts(hf: dict, arch: str) -> int | None:
    if arch == "MixtralForCausalLM":
        return hf.get("num_local_experts")
    return hf["num_experts"] if hf.get("num_experts") is not None else hf.get("num_local_experts")


def model_config_from_hf(hf: dict, *, make_vocab_size_divisible_by: int = 128) -> tuple[ModelConfig, str]:
    """``(ModelConfig, architecture)`` for an HF config dict; :class:`ConfigError` if unsupported
    or malformed (:func:`check_hf_config`; :func:`read_hf_config` checked it naming the file)."""
    check_hf_config(hf)
    arch = hf_architecture(hf)
    _reject_unsupported(hf, arch)
    _, qkv_bias, qk_norm = ARCHITECTURES[arch]
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    groups = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim")
    theta, rope_kind = _rope(hf)
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        ffn_hidden_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=groups if groups != heads else None,
        kv_channels=head_dim if head_dim and head_dim * heads != hidden else None,
        max_position_embeddings=hf.get("max_position_embeddings") or 4096,
        rotary_base=theta,
        rope_scaling_factor=float(_rope_scaling(hf)["factor"]) if rope_kind == "llama3" else None,
        norm_epsilon=hf.get("rms_norm_eps") or 1e-6,
        add_qkv_bias=qkv_bias,
        qk_layernorm=qk_norm,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        init_method_std=0.02 if hf.get("initializer_range") is None else hf["initializer_range"],
        **_moe_fields(hf, arch),
    )
    return cfg, arch


def _moe_fields(hf: dict, arch: str) -> dict:
    """The MoE fields of a checked config (none for a dense architecture): Qwen3-MoE's experts are
    moe_intermediate_size wide and renormalise the top-k weights when norm_topk_prob is set
    (transformers' default: not); Mixtral's are intermediate_size wide and always renormalise.
    Mixtral's router_jitter_noise (a training-time input noise of transformers) is not
    reproduced: the Megatron model routes without it."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    mixtral = arch == "MixtralForCausalLM"
    moe_layers = set(range(hf["num_hidden_layers"]) if mixtral else _hf_moe_layers(hf))
    return dict(num_experts=_num_experts(hf, arch), moe_router_topk=hf["num_experts_per_tok"],
                moe_ffn_hidden_size=hf["intermediate_size"] if mixtral else hf["moe_intermediate_size"],
                moe_norm_topk_prob=True if mixtral else bool(hf.get("norm_topk_prob", False)),
                dense_mlp_layers=[i for i in range(hf["num_hidden_layers"]) if i not in moe_layers])


def hf_config_from_model(cfg: ModelConfig, arch: str, *, base: dict | None = None,
                         dtype: str | None = None) -> dict:
    """An HF config dict for ``cfg``: ``base`` (e.g. the original config.json) with the
    architecture fields overwritten, so token ids, chat settings etc. survive a round trip."""
    model_type, _, _ = ARCHITECTURES[arch]
    heads = cfg.num_attention_heads
    out = dict(base or {})
    out.update(
        architectures=[arch],
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=cfg.num_query_groups or heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_epsilon,
        tie_word_embeddings=cfg.tie_word_embeddings,
        hidden_act="silu",
        initializer_range=cfg.init_method_std,
    )
    if out.get("head_dim") is not None or cfg.kv_channels is not None:
        out["head_dim"] = cfg.kv_channels or cfg.hidden_size // heads
    if model_type not in ("qwen2", "mixtral") or "attention_bias" in out:  # Mixtral has no such key
        out["attention_bias"] = False
    scaling = ({"rope_type": "llama3", "factor": cfg.rope_scaling_factor, **_MEGATRON_LLAMA3_ROPE}
               if cfg.rope_scaling_factor is not None else {"rope_type": "default"})
    # transformers >= 5 writes rope_parameters, older versions rope_theta: keep the base's style.
    if "rope_parameters" in out or base is None:
        out["rope_parameters"] = {**out.get("rope_parameters", {}), **scaling,
                                  "rope_theta": cfg.rotary_base}
    else:
        out["rope_theta"] = cfg.rotary_base
        if cfg.rope_scaling_factor is not None:
            out["rope_scaling"] = scaling
    if arch in MOE_ARCHITECTURES:
        _write_moe_fields(out, cfg, arch)
    if dtype is not None:
        name = {v: k for k, v in _DTYPES.items()}[dtype]
        out["torch_dtype" if "torch_dtype" in out else "dtype"] = name
    return out


def _write_moe_fields(out: dict, cfg: ModelConfig, arch: str) -> None:
    if not cfg.is_moe or architecture_for(cfg) != arch:
        raise ConfigError(f"the model config does not describe a {arch}: "
                          f"{'a dense model' if not cfg.is_moe else _moe_text(cfg)}")
    out["num_experts_per_tok"] = cfg.moe_router_topk
    if arch == "MixtralForCausalLM":
        out["num_local_experts"] = cfg.num_experts
        out["sliding_window"] = None
        return
    # Qwen3-MoE: released configs say num_experts, transformers >= 5 writes num_local_experts.
    for key in [k for k in ("num_experts", "num_local_experts") if k in out] or ["num_experts"]:
        out[key] = cfg.num_experts
    out.update(moe_intermediate_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
               norm_topk_prob=cfg.moe_norm_topk_prob)
    # the base's own way of naming the dense layers when it names these (a round trip keeps
    # decoder_sparse_step 2 as it is), else every dense layer listed
    if "decoder_sparse_step" not in out or "mlp_only_layers" not in out or \
            _hf_moe_layers({**out, "num_hidden_layers": cfg.num_layers}) != cfg.moe_layers:
        out.update(decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_mlp_layers))


def _moe_text(cfg: ModelConfig) -> str:
    return (f"{cfg.num_experts} experts of width {cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size} "
            f"(dense FFN {cfg.ffn_hidden_size}), q/k layernorm {cfg.qk_layernorm}, top-k "
            f"renormalised {cfg.moe_norm_topk_prob}"
            + (f", dense MLP layers {cfg.dense_mlp_layers}" if cfg.dense_mlp_layers else ""))


def architecture_for(cfg: ModelConfig) -> str | None:
    """The HF architecture that computes what ``cfg`` (e.g. a model built from flags) computes:
    the one whose q/k/v bias, q/k layernorm and experts match; None if none does. A MoE model
    is Qwen3-MoE with q/k layernorm; Mixtral without, its experts as wide as intermediate_size
    and their top-k weights renormalised."""
    for arch, (_, qkv_bias, qk_norm) in ARCHITECTURES.items():
        if (qkv_bias, qk_norm) != (cfg.add_qkv_bias, cfg.qk_layernorm):
            continue
        if (arch in MOE_ARCHITECTURES) != cfg.is_moe:
            continue
        if arch == "MixtralForCausalLM" and not (
                cfg.moe_norm_topk_prob and cfg.moe_ffn_hidden_size in (None, cfg.ffn_hidden_size)
                and not cfg.dense_mlp_layers):
            continue
        return arch
    return None


def check_same_architecture(template: dict, cfg: ModelConfig, flag: str = "--hf-template") -> None:
    """A template config.json (given by ``flag``) must describe the same network as ``cfg``."""
    other, _ = model_config_from_hf(template)
    diffs = [f"{n}: template {theirs!r} != checkpoint {mine!r}"
             for n, mine, theirs in architecture_diffs(cfg, other)]
    if diffs:
        raise ConfigError(f"{flag} describes a different model: " + "; ".join(diffs))


def architecture_diffs(a: ModelConfig, b: ModelConfig) -> list[tuple[str, object, object]]:
    """``(field, a's value, b's value)`` for each of :data:`ARCH_FIELDS` where the two networks
    differ, defaults resolved."""
    na, nb = _normalized(a), _normalized(b)
    return [(n, na[n], nb[n]) for n in ARCH_FIELDS if na[n] != nb[n]]


def _normalized(cfg: ModelConfig) -> dict:
    """Architecture fields with defaults spelled out (None groups = MHA, None kv_channels)."""
    out = {n: getattr(cfg, n) for n in ARCH_FIELDS}
    out["num_query_groups"] = cfg.num_query_groups or cfg.num_attention_heads
    out["kv_channels"] = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    out["rotary_base"] = float(cfg.rotary_base)
    if cfg.is_moe:
        out["moe_ffn_hidden_size"] = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    else:  # routing settings of a dense model compute nothing
        out.update(moe_router_topk=None, moe_ffn_hidden_size=None, moe_norm_topk_prob=None,
                   dense_mlp_layers=None)
    return out
