"""tools/memory_plan.py: its parameter counts are those of real models, its byte arithmetic is the
documented one, and docs/memory.md shows its output (issue 39, item 12)."""

import os
import subprocess
import sys

import pytest
import torch

from emapg_megatron.models.config import ModelConfig
from emapg_megatron.multiprocess import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import memory_plan as mp  # noqa: E402

# Tiny shapes that exercise every term: GQA with a QKV bias and a tied head (Qwen2.5), an untied
# head with q/k norms and a head_dim that is not hidden/heads (Qwen3), a vocabulary Megatron pads.
SHAPES = [
    dict(vocab_size=200, hidden_size=64, ffn_hidden_size=96, num_layers=4, num_attention_heads=4,
         num_query_groups=2, add_qkv_bias=True, tie_word_embeddings=True, make_vocab_size_divisible_by=64,
         max_position_embeddings=64),
    dict(vocab_size=131, hidden_size=48, ffn_hidden_size=80, num_layers=2, num_attention_heads=4,
         num_query_groups=2, kv_channels=16, qk_layernorm=True, tie_word_embeddings=False,
         make_vocab_size_divisible_by=32, max_position_embeddings=64),
    dict(vocab_size=100, hidden_size=32, ffn_hidden_size=64, num_layers=2, num_attention_heads=2,
         tie_word_embeddings=True, make_vocab_size_divisible_by=16, max_position_embeddings=64),
]
CACHE_LEN = 24


def count_this_rank(shapes):
    """On each rank: its pipeline stage, then per shape the parameters of the GPTModel this rank
    builds and the sampler's KV-cache bytes for one sequence of CACHE_LEN tokens (fp32 model)."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.models.gpt import build_for_this_rank
    from emapg_megatron.rollout.kv_cache_decoding import cache_bytes_per_row

    out = [ps.get_pipeline_model_parallel_rank()]
    for kw in shapes:
        model = build_for_this_rank(ModelConfig(**kw))
        out += [sum(p.numel() for p in model.parameters()), cache_bytes_per_row(model, CACHE_LEN)]
    return torch.tensor(out)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_parameters_and_kv_cache_per_rank_are_a_real_gptmodels(tp, pp):
    world = tp * pp
    results = run_distributed(count_this_rank, world, tp=tp, pp=pp, args=(SHAPES,))
    for got in results:
        stage, counts = int(got[0]), got[1:].tolist()
        for i, kw in enumerate(SHAPES):
            cfg = ModelConfig(**kw)
            assert counts[2 * i] == mp.stage_params(cfg, tp, pp, stage), (kw, tp, pp, stage)
            assert counts[2 * i + 1] == mp.kv_bytes_per_token(cfg, tp, pp, itemsize=4) * CACHE_LEN


@pytest.mark.parametrize("tied,qwen3", [(True, False), (False, False), (False, True)])
def test_model_params_are_the_hugging_face_models(tied, qwen3):
    """The unsharded count (unpadded vocabulary, tied head once) is what transformers builds."""
    import transformers

    from emapg_megatron.checkpoint.hf_config import model_config_from_hf

    name = "Qwen3" if qwen3 else "Qwen2"
    kw = dict(vocab_size=151, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              tie_word_embeddings=tied)
    if qwen3:
        kw["head_dim"] = 24
    hf_cfg = getattr(transformers, f"{name}Config")(architectures=[f"{name}ForCausalLM"], **kw)
    model = getattr(transformers, f"{name}ForCausalLM")(hf_cfg)
    cfg, _ = model_config_from_hf(hf_cfg.to_dict())
    assert mp.model_params(cfg) == sum(p.numel() for p in model.parameters())


def test_bytes_per_parameter_of_each_mode():
    cfg = ModelConfig(**SHAPES[0])
    n = mp.stage_params(cfg)
    per = {ema: mp.memory(cfg, mp.Layout(dp=4, distributed_optimizer=True, ema=ema)) for ema in mp.EMA_MODES}
    assert mp.memory(cfg, mp.Layout())["total_device"] == 22 * n  # bf16: 2 + 4 + 4 + 8 + 4
    assert per["plain"]["total_device"] == 10 * n + 12 * n // 4
    assert per["shard"]["total_device"] == 6 * n + 16 * n // 4
    assert per["offload"]["total_device"] == 6 * n + 12 * n // 4 and per["offload"]["ema_host"] == 4 * n
    assert per["shard-offload"]["ema_host"] == n
    fp32 = mp.memory(cfg, mp.Layout(bf16=False))
    assert fp32["total_device"] == 20 * n and fp32["main_params"] == 0 and fp32["ema_swap_transient"] == 4 * n
    # The heaviest stage is the one counted: at PP = 2 the tied head is a second copy on stage 1.
    assert mp.memory(cfg, mp.Layout(pp=2))["params_per_rank"] == max(
        mp.stage_params(cfg, 1, 2, 0), mp.stage_params(cfg, 1, 2, 1))


def test_layouts_megatron_refuses_are_refused():
    cfg = mp.qwen25("qwen2.5-1.5b")  # 12 heads, 2 query groups, 28 layers
    assert "query groups" in mp.fits(cfg, mp.Layout(tp=4))
    assert "layers" in mp.fits(cfg, mp.Layout(pp=3))
    assert "distributed" in mp.fits(cfg, mp.Layout(dp=2, ema="shard"))
    with pytest.raises(ValueError):
        mp.memory(cfg, mp.Layout(tp=4))
    assert mp.row("x", cfg, mp.Layout(tp=4), 16)["fits"] is False


def test_the_qwen25_counts():
    """494,032,768 is the 0.5B shape of tools/bench_gpu_train.py ("494 M" in docs/gpu.md); the
    others follow from the same config fields."""
    got = {name: mp.model_params(mp.qwen25(name)) for name in mp.QWEN25}
    assert got["qwen2.5-0.5b"] == 494_032_768
    assert got["qwen2.5-7b"] == 7_615_616_512
    assert got["qwen2.5-32b"] == 32_763_876_352


def test_docs_show_the_tools_output():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "memory_plan.py")],
                         capture_output=True, text=True, check=True).stdout
    with open(os.path.join(ROOT, "docs", "memory.md"), encoding="utf-8") as f:
        doc = f.read()
    assert out.strip() in doc, "docs/memory.md is not `python tools/memory_plan.py`'s current output"


def test_json_for_one_layout():
    import json

    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "memory_plan.py"), "--model",
                          "qwen2.5-7b", "--tp", "2", "--dp", "4", "--distributed-optimizer", "--ema", "shard"],
                         capture_output=True, text=True, check=True).stdout
    (r,) = json.loads(out)
    assert r["fits"] and r["layout"] == "TP2·DP4 (dist-opt, EMA shard)"
    assert r["total_device"] == 6 * r["params_per_rank"] + 16 * r["params_per_rank"] // 4
