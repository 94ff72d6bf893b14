"""HF ``config.json`` <-> :class:`~emapg_megatron.models.gpt.ModelConfig` for Llama, Qwen2(.5), Qwen3.

Anything the Megatron model builder cannot reproduce exactly (RoPE scaling, sliding windows,
attention biases beyond Qwen2's q/k/v, non-SiLU MLPs) is rejected with a one-line
:class:`ConfigError` rather than converted into a model that silently computes something else.
"""

from __future__ import annotations

import json
from pathlib import Path

from emapg_megatron.errors import ConfigError
from emapg_megatron.models.config import ModelConfig

# architecture -> (model_type, q/k/v bias, q/k layernorm)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}

# ModelConfig fields that describe the network (the rest are Megatron-side choices).
ARCH_FIELDS = ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads",
               "num_query_groups", "kv_channels", "rotary_base", "norm_epsilon", "add_qkv_bias",
               "qk_layernorm", "tie_word_embeddings", "rope_scaling_factor")

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{hf_dir} has no config.json (is it a Hugging Face model directory?)")
    return json.loads(path.read_text())


def hf_architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ConfigError(
            f"unsupported architecture {archs or hf.get('model_type')!r}: "
            f"supported are {', '.join(ARCHITECTURES)}"
        )
    return archs[0]


def hf_dtype(hf: dict) -> str | None:
    """The checkpoint's dtype as ``fp32`` / ``bf16`` / ``fp16`` (None when not recorded)."""
    return _DTYPES.get(hf.get("dtype") or hf.get("torch_dtype"))


# The llama3 RoPE scaling Megatron reproduces: only the factor is configurable there.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}


def _rope(hf: dict) -> tuple[float, str]:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type") or "default"
    return float(theta), kind


def _rope_scaling(hf: dict) -> dict:
    return {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}


def _llama3_rope_problem(hf: dict) -> str | None:
    scaling = _rope_scaling(hf)
    off = {k: scaling.get(k) for k, v in _MEGATRON_LLAMA3_ROPE.items() if float(scaling.get(k, -1)) != v}
    return f"llama3 rope scaling with {off} (Megatron fixes {_MEGATRON_LLAMA3_ROPE})" if off else None


def _reject_unsupported(hf: dict, arch: str) -> None:
    _, qkv_bias, _ = ARCHITECTURES[arch]
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only silu)")
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
        problems.append(f"rope scaling {rope_kind!r}")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window=true")
    if any(t != "full_attention" for t in hf.get("layer_types") or []):
        problems.append("non-full-attention layer_types")
    if problems:
        raise ConfigError(f"{arch} config uses features the Megatron builder does not reproduce: "
                          + "; ".join(problems))


def model_config_from_hf(hf: dict, *, make_vocab_size_divisible_by: int = 128) -> tuple[ModelConfig, str]:
    """``(ModelConfig, architecture)`` for an HF config dict; :class:`ConfigError` if unsupported."""
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
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rotary_base=theta,
        rope_scaling_factor=float(_rope_scaling(hf)["factor"]) if rope_kind == "llama3" else None,
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        add_qkv_bias=qkv_bias,
        qk_layernorm=qk_norm,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        init_method_std=hf.get("initializer_range", 0.02),
    )
    return cfg, arch


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
    if "head_dim" in out or cfg.kv_channels is not None:
        out["head_dim"] = cfg.kv_channels or cfg.hidden_size // heads
    if model_type != "qwen2":
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
    if dtype is not None:
        name = {v: k for k, v in _DTYPES.items()}[dtype]
        out["torch_dtype" if "torch_dtype" in out else "dtype"] = name
    return out


def check_same_architecture(template: dict, cfg: ModelConfig) -> None:
    """A template config.json must describe the same network as ``cfg``."""
    other, _ = model_config_from_hf(template)
    diffs = [f"{n}: template {theirs!r} != checkpoint {mine!r}"
             for n, mine, theirs in architecture_diffs(cfg, other)]
    if diffs:
        raise ConfigError("--hf-template describes a different model: " + "; ".join(diffs))


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
    return out
