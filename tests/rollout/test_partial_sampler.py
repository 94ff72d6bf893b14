"""Partial rollouts through the KV-cached sampler: a sequence stopped after some decode steps
and continued (re-prefilled with its prefix) in a second call under the same weights samples
the same tokens, with the same log-probs, as one uninterrupted generation; at TP=1, TP=2 and PP=2,
through the lockstep cache and the fixed-shape decode step, on the Qwen-like shape (tied
embeddings, qk-layernorm, GQA with qkv bias)."""

import pytest
import torch
from partial_workers import continue_across_steps

from emapg_megatron.multiprocess import run_distributed

SHAPE = {"tie_word_embeddings": True, "qk_layernorm": True, "add_qkv_bias": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("partial") / "weights")
    return {"tp1": run_distributed(continue_across_steps, 1, args=(ckpt, True, 4, SHAPE)),
            "tp2": run_distributed(continue_across_steps, 2, tp=2, args=(ckpt, False, 6, SHAPE)),
            "pp2": run_distributed(continue_across_steps, 2, pp=2, args=(ckpt, False, 3, SHAPE))}


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
@pytest.mark.parametrize("mode", ["lockstep", "fixed_shape"])
def test_a_continued_sequence_equals_the_one_generated_in_one_step(runs, layout, mode):
    for rank in (r[mode] for r in runs[layout]):
        assert rank["carried"] > 0 and min(rank["first_lengths"]) < 6  # some were cut and continued
        for (tok_a, lp_a, why_a), (tok_b, lp_b, why_b) in zip(rank["whole"], rank["joined"]):
            assert tok_a == tok_b and why_a == why_b and why_a
            torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-5, rtol=0)
