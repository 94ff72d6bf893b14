"""BF16 / FP8 plumbing: the precision flags reach TransformerConfig, FP8 without TE or a Hopper
GPU stops with a clear message, and weights leave the trainer as BF16/FP32, never FP8."""

import pytest
import torch

from emapg_megatron.checkpoint.weights import high_precision
from emapg_megatron.errors import ConfigError
from emapg_megatron.models.config import ModelConfig, PrecisionConfig
from emapg_megatron.models.gpt import (
    build_gpt_model,
    te_available,
    transformer_config,
    validate_precision,
)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_fp8_flags_reach_transformer_config(fmt, recipe):
    prec = PrecisionConfig(bf16=True, fp8_format=fmt, fp8_recipe=recipe)
    tcfg = transformer_config(ModelConfig(), 1, 1, prec)
    assert (tcfg.fp8, tcfg.fp8_recipe) == (fmt, recipe)
    assert tcfg.bf16 and tcfg.params_dtype == torch.bfloat16


def test_without_fp8_the_config_has_no_fp8():
    tcfg = transformer_config(ModelConfig(), 1, 1, PrecisionConfig(bf16=True))
    assert tcfg.fp8 is None and tcfg.bf16
    assert transformer_config(ModelConfig(), 1, 1).params_dtype == torch.float32


@pytest.mark.parametrize("prec,device,message", [
    (PrecisionConfig(bf16=True, fp8_format="e5m2"), "cuda", "--fp8-format must be e4m3 or hybrid"),
    (PrecisionConfig(bf16=True, fp8_format="e4m3", fp8_recipe="mxfp8"), "cuda", "--fp8-recipe must be"),
    (PrecisionConfig(bf16=True, fp8_format="e4m3"), "cpu", "cannot run in CPU mode"),
])
def test_bad_fp8_settings_fail_clearly(prec, device, message):
    with pytest.raises(ConfigError, match=message):
        validate_precision(prec, device)


@pytest.mark.skipif(te_available(), reason="Transformer Engine is installed")
def test_fp8_without_transformer_engine_fails_clearly():
    with pytest.raises(ConfigError, match="FP8 needs Transformer Engine"):
        validate_precision(PrecisionConfig(bf16=True, fp8_format="hybrid"), "cuda")


def test_builder_refuses_fp8_on_cpu_before_building():
    # No parallel_state exists here: the check must come before any Megatron module is built.
    with pytest.raises(ConfigError, match="cannot run in CPU mode"):
        build_gpt_model(ModelConfig(), prec=PrecisionConfig(bf16=True, fp8_format="e4m3"), device_type="cpu")


def test_fp8_tensors_are_never_exported_or_checkpointed():
    assert high_precision("w", torch.ones(2, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="never FP8"):
        high_precision("decoder.layers.0.mlp.linear_fc1.weight", torch.ones(2).to(torch.float8_e4m3fn))


@pytest.mark.gpu
def test_pre_hopper_gpu_refuses_fp8():
    if torch.cuda.get_device_capability()[0] >= 9 or not te_available():
        pytest.skip("needs a pre-Hopper GPU with Transformer Engine")
    with pytest.raises(ConfigError, match="Hopper"):
        validate_precision(PrecisionConfig(bf16=True, fp8_format="e4m3"), "cuda")


@pytest.mark.gpu
@pytest.mark.slow
def test_fp8_run_keeps_embedding_head_and_weights_bf16(tmp_path):
    if not te_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Transformer Engine on a Hopper GPU")
    from checkpoint_workers import build_hf_model, fp8_job

    from emapg_megatron.multiprocess import run_distributed

    hf_dir = tmp_path / "hf"
    model = build_hf_model("qwen2", {"hidden_size": 128, "intermediate_size": 256, "vocab_size": 128}, seed=0)
    model.save_pretrained(hf_dir)
    (out,) = run_distributed(fp8_job, 1, args=(str(hf_dir), str(tmp_path)), device="cuda")
    bf16, fp8 = out["bf16"], out["fp8"]
    assert fp8["fp8"] == "e4m3" and bf16["fp8"] is None
    assert fp8["qkv_type"].startswith("TE")  # the TE spec (and its fused layernorm names) is used
    assert fp8["head_types"] == ["VocabParallelEmbedding", "ColumnParallelLinear"]
    assert fp8["head_dtypes"] == ["torch.bfloat16", "torch.bfloat16"]
    assert torch.isfinite(fp8["logits"]).all()
    cos = torch.nn.functional.cosine_similarity(fp8["logits"].flatten(), bf16["logits"].flatten(), dim=0)
    assert cos > 0.99
    for name, t in fp8["export"].items():  # FP8 compute, BF16 weights: identical exports
        assert t.dtype == torch.bfloat16 and torch.equal(t, bf16["export"][name]), name
    assert fp8["ckpt_dtypes"] == ["torch.bfloat16"]
