"""CPU tests of the GPU-path fixes that the strict device mode does not cover (issue 15)."""

import importlib.util

import pytest
import torch

from emapg_megatron import runtime
from emapg_megatron.errors import ConfigError
from emapg_megatron.models import gpt
from emapg_megatron.multiprocess import run_distributed


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_gloo_groups_are_created_under_nccl_too(backend):
    """Megatron's optimizer asks for the Gloo (intra-partial) DP groups whatever the backend."""
    opts = runtime.model_parallel_options(runtime.ParallelConfig(backend=backend, timeout_minutes=7))
    assert opts["create_gloo_process_groups"] is True
    assert opts["distributed_timeout_minutes"] == 7  # Megatron's groups time out like ours


def test_a_broken_transformer_engine_is_not_transformer_engine(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *a):  # installed, but its torch extension does not load
        return importlib.machinery.ModuleSpec(name, None) if name == "transformer_engine" else real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setitem(__import__("sys").modules, "transformer_engine.pytorch", None)
    gpt._te_import_error.cache_clear()
    try:
        assert not gpt.te_available()
        assert "does not import" in gpt._te_import_error()
        assert not gpt.use_transformer_engine("cuda")  # auto falls back to the local spec
        with pytest.raises(ConfigError, match="--transformer-impl transformer_engine needs"):
            gpt.validate_precision(gpt.PrecisionConfig(transformer_impl="transformer_engine"), "cuda")
    finally:
        gpt._te_import_error.cache_clear()


def _bf16_logits_dtype():
    from emapg_megatron.training.config import OptimConfig
    from emapg_megatron.training.model_and_optimizer import build_model_and_optimizer
    from emapg_megatron.training.schedule import model_output

    cfg = gpt.ModelConfig(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                          make_vocab_size_divisible_by=8)
    chunks, _ = build_model_and_optimizer(cfg, OptimConfig(), gpt.PrecisionConfig(bf16=True))
    tokens = torch.randint(0, 64, (2, 8), device=runtime.device())
    with torch.no_grad():
        return str(model_output(chunks[0], tokens).dtype)


@pytest.mark.slow
def test_bf16_logits_are_not_upcast_by_float16module():
    """Float16Module would return an fp32 copy of the [tokens, V/TP] logits: twice the memory."""
    assert run_distributed(_bf16_logits_dtype, 1) == ["torch.bfloat16"]
