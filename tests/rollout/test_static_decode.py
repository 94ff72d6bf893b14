"""The fixed-shape decode step (rollout/static_decode.py) and continuous batching
(rollout/continuous_batching.py) against today's KV-cached path, at TP=1, TP=2, PP=2 and on the
TE route, on the Qwen-like shape (tied embeddings, qk-layernorm, GQA with qkv bias).

With the same per-sequence uniforms the fixed-shape path must sample the same tokens with the
same log-probs (fp32, 1e-6), single- and multi-turn, continuously batched or in waves over fewer
slots than sequences; and continuous batching must need fewer decode forwards than waves.
"""

import pytest
import torch
from kv_cache_workers import WAVE, assert_same_samples
from static_decode_workers import sample_fixed_shape, sample_fixed_shape_te_like

from emapg_megatron.multiprocess import run_distributed
from emapg_megatron.rollout.continuous_batching import (
    ScheduleStats,
    SlotScheduler,
    to_feed,
)
from emapg_megatron.rollout.kv_cache_decoding import CONTINUE, DONE, Stream
from emapg_megatron.rollout.static_decode import bucket_for, bucket_sizes, length_mask

ATOL = 1e-6
SHAPE = {"tie_word_embeddings": True, "qk_layernorm": True, "add_qkv_bias": True}
RUNS = ["", "_top_p", "_episodes", "_episodes_cut"]
FIXED = ["continuous", "waves", "one_cache"]
LAYOUTS = ["tp1", "tp2", "pp2", "te"]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("static") / "weights")
    return {"tp1": run_distributed(sample_fixed_shape, 1, args=(ckpt, True, SHAPE)),
            "tp2": run_distributed(sample_fixed_shape, 2, tp=2, args=(ckpt, False, SHAPE)),
            "pp2": run_distributed(sample_fixed_shape, 2, pp=2, args=(ckpt, False, SHAPE)),
            "te": run_distributed(sample_fixed_shape_te_like, 1, args=(ckpt, SHAPE))}


def _same(a: dict, b: dict) -> None:
    assert_same_samples(a, b, ATOL)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fixed", FIXED)
@pytest.mark.parametrize("run", RUNS)
def test_fixed_shape_step_samples_what_the_cached_path_samples(layouts, layout, fixed, run):
    for rank in layouts[layout]:
        _same(rank[fixed + run], rank["cached" + run])


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_fixed_shape_samples_do_not_depend_on_the_layout(layouts, layout):
    for rank in layouts[layout]:
        for run in RUNS:
            _same(rank["continuous" + run], layouts["tp1"][0]["continuous" + run])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_continuous_batching_needs_fewer_decode_forwards_than_waves(layouts, layout):
    """8 sequences over ``WAVE`` slots: a freed slot takes the next prefill at once, so the
    steps are fewer and fuller than in waves; each sequence prefilled once either way, every
    history waiting fed in one forward (a wave's in one)."""
    for rank in layouts[layout]:
        cont, waves = rank["continuous"], rank["waves"]
        assert cont["decode_forwards"] < waves["decode_forwards"]
        assert cont["prefilled"] == waves["prefilled"] == len(cont["responses"])
        assert waves["prefill_forwards"] < cont["prefill_forwards"] < cont["prefilled"]
        live = cont["metrics"]["rollout_mean_live_slots"]
        assert waves["metrics"]["rollout_mean_live_slots"] < live <= WAVE
        assert cont["metrics"]["rollout_decode_forwards"] == cont["decode_forwards"]
        assert rank["one_cache"]["decode_forwards"] < cont["decode_forwards"]
    assert layouts[layout][0]["training_mode_kept"]


def test_te_route_runs_the_te_specs_modules(layouts):
    """The stand-in TE kernel ran for today's cached path; the fixed-shape step attends itself
    (SDPA over its own cache) around the same modules, and samples the same (tests above)."""
    (te,) = layouts["te"]
    assert te["attention_calls"]["causal"] > 0


# --- the pure parts, without a model --------------------------------------------------------
def test_buckets_cover_every_live_count():
    assert bucket_sizes(1) == [1] and bucket_sizes(8) == [1, 2, 4, 8] and bucket_sizes(6) == [1, 2, 4, 6]
    assert [bucket_for(h, bucket_sizes(6)) for h in range(6)] == [1, 2, 4, 4, 6, 6]


def test_length_mask_is_causal_at_each_rows_own_offset():
    mask = length_mask(torch.tensor([[2], [0]]), 4)  # two slots decoding at lengths 2 and 0
    assert mask.shape == (2, 1, 1, 4) and mask[:, 0, 0].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    chunk = length_mask(torch.tensor([[1, 2]]), 4)[0, 0]  # a chunk fed at offset 1
    assert chunk.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]


def test_what_a_row_feeds_after_its_token():
    known = [1, 2, 3]
    assert to_feed(2, known, known, CONTINUE) is None  # its sampled token: the next decode step
    assert to_feed(2, known, [1, 2, 3, 7, 8], CONTINUE) == 2  # an observation after it
    assert to_feed(2, known, [1, 9, 3], CONTINUE) == 0  # cached tokens rewritten: start over


class FakeDecoder:
    """Slots without a model: every token sampled is 1; records the slots of each step."""

    def __init__(self, slots):
        self.slots, self.fed, self.steps, self.prefills = slots, [0] * slots, [], []

    def extend(self, slots, histories, starts, uniforms):
        self.prefills.append(list(slots))
        for slot, tokens, start in zip(slots, histories, starts):
            self.fed[slot] = start + len(tokens)
        return [1] * len(slots), [0.0] * len(slots)

    def step(self, live, uniforms):
        self.steps.append(list(live))
        for slot in live:
            self.fed[slot] += 1
        return [1] * len(live), [0.0] * len(live)

    def free(self, slot):
        pass

    def routes_of(self, slot):
        return None  # a dense model: nothing recorded


def _run(schedule, budgets, slots):
    streams = [Stream(k, [5], b, [0.5] * b) for k, b in enumerate(budgets)]

    def advance(due, ids, lps):
        for s, tok in zip(due, ids):
            s.known.append(tok)
            s.turn.token_ids.append(tok)
        return [DONE if len(s.turn.token_ids) >= s.budget else CONTINUE for s in due]

    decoder, stats = FakeDecoder(slots), ScheduleStats()
    SlotScheduler(decoder, advance, schedule, stats).run(streams)
    assert [len(s.turn.token_ids) for s in streams] == budgets
    return decoder.steps, stats, decoder.prefills


def test_a_freed_slot_takes_the_next_sequence_at_once():
    """Budgets 4, 1, 1, 1, 1 over two slots: the long sequence keeps slot 0 while slot 1 takes
    each short one at its prefill (a one-token budget finishes there), so the long one decodes
    alone."""
    steps, stats, prefills = _run("continuous", [4, 1, 1, 1, 1], 2)
    assert steps == [[0]] * 3 and stats.prefilled == 5
    assert prefills == [[0, 1], [1], [1], [1]] and stats.prefill_forwards == 4  # both slots at once
    # slot 1 is refilled after step 1, slot 0 after step 2: the last sequence decodes alone
    assert _run("continuous", [3, 2, 2, 2], 2)[0] == [[0, 1], [0, 1], [0]]
    # waves: slot 1 idles while the first wave's long sequence finishes
    assert _run("waves", [3, 2, 2, 2], 2)[0] == [[0, 1], [0], [0, 1]]
