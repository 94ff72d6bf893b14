"""Packing through Megatron's THD path (``PackedSeqParams``), as with the Transformer Engine
spec, at TP=2 x PP=2 with sequence parallelism on a tied, qk-layernorm, GQA-with-bias model:
the passes, every loss aggregation and the gradients equal the padded run. Transformer
Engine's kernel needs a GPU, so a stand-in (tests/te_like_attention.py) computes what it
computes with ``qkv_format="thd"``; everything around it (the plan, ``cu_seqlens`` with the
padding as a segment, RoPE restarted per segment by Megatron's ``_apply_rotary_pos_emb_thd``,
no ``rope_at`` hook) is the production path. The GPU suite runs the same comparison on TE
(tests/gpu)."""

import pytest
from packing_thd_workers import thd_packed_vs_padded
from packing_workers import AGG_MODES
from test_packing import LENGTHS, assert_passes_equal, assert_update_equal

from emapg_megatron.multiprocess import run_distributed
from emapg_megatron.training import packing

pytestmark = pytest.mark.slow

# The anchor is the policy in these runs, so every KL sum is 0 up to the rounding of log-prob
# differences, and the update compares the packed forward with the padded passes' log-probs:
# attention over a segment and over the padded row reduce in different orders (about 1e-7 per
# token in fp32, summed over ~100 tokens).
ATOL = 1e-6
# The shape users run (Qwen2.5/Qwen3-like): tied embeddings, qk-layernorm, GQA with qkv bias.
QWEN_SHAPE = {"tie_word_embeddings": True, "qk_layernorm": True, "add_qkv_bias": True}


@pytest.fixture(scope="module")
def thd():
    return run_distributed(thd_packed_vs_padded, 4, tp=2, pp=2, timeout=240,
                           args=(LENGTHS, 48, 40, "topk-reverse", True, False, QWEN_SHAPE))


def test_the_thd_path_ran(thd):
    assert all(o["thd_calls"] > 0 for o in thd)


def test_thd_no_grad_passes_equal(thd):
    assert_passes_equal(thd)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_thd_loss_metrics_and_grads_equal(thd, agg):
    assert_update_equal(thd, agg, atol=ATOL)  # ATOL: the KL sums, 0 here (see above)


@pytest.mark.parametrize("cudnn, flash_attn, gqa, slow", [
    (91300, False, True, False),   # cuDNN takes THD with GQA from 9.6
    (90500, False, True, True),    # 9.1-9.5: THD only without GQA
    (90500, False, False, False),
    (91000, False, False, True),   # 9.10.0 and 9.10.1 are excluded
    (90000, False, False, True),   # THD with a padding mask from 9.1
    (None, False, True, True),
    (None, True, True, False),     # FlashAttention takes THD with GQA
])
def test_packed_attention_on_te_warns_when_only_the_unfused_backend_is_left(cudnn, flash_attn, gqa, slow):
    note = packing.slow_thd_attention(cudnn, flash_attn, gqa)
    assert (note is not None) == slow
    if slow:
        assert "unfused" in note and ("9.6" if gqa else "9.1") in note


def test_packing_on_the_local_spec_warns_when_its_block_mask_outgrows_padding():
    assert packing.local_attention_cost(1024, 1, 1024) is None  # one row: the padded cost
    note = packing.local_attention_cost(8 * 1024, 8, 1024)  # the default budget, 8 rows
    assert "8x the attention memory" in note and "--max-tokens-per-microbatch" in note
