"""The KV-cached sampler against the cache-free reference, at TP=1, TP=2 and PP=2, on the tiny
GQA shape and on a Qwen-like one (tied embeddings, qk-layernorm, GQA with qkv bias).

With the same uniforms both paths must sample the same tokens with the same log-probs (fp32,
up to rounding), single- and multi-turn; the cached samples must not depend on the layout;
and a finished sequence must leave the batch (rows fed per cached forward).
"""

import pytest
import torch
from kv_cache_workers import (
    EOS,
    MAX_NEW,
    PROMPTS,
    SPLIT,
    WAVE,
    N,
    assert_same_samples,
    sample_both_paths,
    sample_both_paths_te_like,
    split_one_token_prefill_te_like,
)

from emapg_megatron.multiprocess import run_distributed

ATOL = 1e-5
# _flaky: environments whose copies on ranks other than 0 answer differently; rank 0's answers
# must win on every rank (at TP=1, rank 0's are the only ones: the same as _episodes)
RUNS = ["", "_top_p", "_episodes", "_episodes_cut", "_one_episode", "_flaky"]
USER_SHAPE = {"tie_word_embeddings": True, "qk_layernorm": True, "add_qkv_bias": True}
# Each multi-rank layout and the one-rank layout of the same model it must sample like.
ONE_RANK = {"tp2": "tp1", "pp2": "tp1", "te": "tp1", "tp2_user": "tp1_user", "pp2_user": "tp1_user"}
ALL = ["tp1", "tp1_user", *ONE_RANK]
MODEL_PARALLEL = ["tp1", "tp2", "pp2", "tp1_user", "tp2_user", "pp2_user"]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Each layout's per-rank results; the TP=1 run of each shape writes the weights its other
    layouts load."""
    out = {}
    for suffix, shape in (("", None), ("_user", USER_SHAPE)):
        ckpt = str(tmp_path_factory.mktemp("kv") / "weights")
        out["tp1" + suffix] = run_distributed(sample_both_paths, 1, args=(ckpt, True, shape))
        out["tp2" + suffix] = run_distributed(sample_both_paths, 2, tp=2, args=(ckpt, False, shape))
        out["pp2" + suffix] = run_distributed(sample_both_paths, 2, pp=2, args=(ckpt, False, shape))
        if shape is None:
            out["te"] = run_distributed(sample_both_paths_te_like, 1, args=(ckpt,))
            out["ckpt"] = ckpt
    return out


def _same(a: dict, b: dict) -> None:
    assert_same_samples(a, b, ATOL)


@pytest.mark.parametrize("layout", ALL)
@pytest.mark.parametrize("run", RUNS)
def test_cached_path_samples_what_the_cache_free_path_samples(layouts, layout, run):
    for rank in layouts[layout]:
        _same(rank["cached" + run], rank["reference" + run])


@pytest.mark.parametrize("layout", ONE_RANK)
@pytest.mark.parametrize("run", RUNS)
def test_cached_samples_do_not_depend_on_the_model_parallel_layout(layouts, layout, run):
    for rank in layouts[layout]:  # every rank of the model-parallel group holds the batch
        _same(rank["cached" + run], layouts[ONE_RANK[layout]][0]["cached" + run])


def test_cached_samples_do_not_depend_on_the_data_parallel_layout(layouts):
    """Each DP=2 rank's share (a smaller cache, other prompt lengths beside it) samples what
    those sequences sample in the whole batch."""
    ref = layouts["tp1"][0]["cached"]
    for rank, got in enumerate(layouts["tp1"][0]["dp2"]):
        mine = [i * N + k for i in range(rank, len(PROMPTS), 2) for k in range(N)]
        assert got["responses"] == [ref["responses"][s] for s in mine]
        torch.testing.assert_close(got["logprobs"], ref["logprobs"][mine], atol=ATOL, rtol=0)


def test_finished_sequences_leave_the_batch(layouts):
    """Forward k feeds exactly the rows still unfinished: a row is fed from the prefill (which
    covers the shortest prompt) until its last token is sampled."""
    got = layouts["tp1"][0]["cached"]
    lengths = [len(PROMPTS[s // N]) for s in range(len(got["responses"]))]
    shortest = min(lengths)
    forwards = [p + len(r) - shortest for p, r in zip(lengths, got["responses"])]
    assert any(r[-1] == EOS and len(r) < MAX_NEW for r in got["responses"])  # some stop early
    assert got["rows_fed"] == [sum(f > k for f in forwards) for k in range(max(forwards))]


def test_episodes_feed_observations_into_the_cache_and_restart_only_on_rewrites(layouts):
    """Without rewrites a multi-turn batch runs in one cache (rows only leave it); a turn the
    environment cuts after cached tokens sends its row to a fresh cache."""
    rank = layouts["tp1"][0]
    fed = rank["cached_episodes"]["rows_fed"]
    assert fed[0] == len(PROMPTS) * N and all(a >= b for a, b in zip(fed, fed[1:]))
    cut = rank["cached_episodes_cut"]["rows_fed"]
    assert any(b > a for a, b in zip(cut, cut[1:]))  # a second cache starts
    assert rank["training_mode_kept"]


@pytest.mark.parametrize("layout", ALL)
def test_turns_ending_at_one_step_are_answered_together(layouts, layout):
    """Every model turn is answered exactly once, and the environments of all turns that end
    at one decoding step answer in one agreement (one broadcast over the model-parallel group)
    instead of one each: at most one agreement per cached forward. (Only the group's first
    rank, rank 0, steps environments: its count of turns is the group's.)"""
    first = layouts[layout][0]
    for rank in layouts[layout]:
        for run in ("_episodes", "_episodes_cut", "_flaky", "_one_episode"):
            got = rank["cached" + run]
            assert sum(got["answers"]) == first["cached" + run]["turns"] == first["reference" + run]["turns"]
            assert len(got["answers"]) <= len(got["rows_fed"])
        assert len(rank["cached_episodes"]["answers"]) < first["cached_episodes"]["turns"]


def test_te_route_feeds_history_one_token_at_a_time_after_the_prefill(layouts):
    """With Transformer Engine's attention (a CPU stand-in that, like TE, drops an explicit mask:
    Megatron gives it no mask once the cache holds tokens), chunks after the prefill would see
    later tokens, so the cached path feeds them one at a time: more forwards than the local
    spec's chunks, and the same samples (tests above). The stand-in refuses unmasked attention
    over several new tokens, the error this avoids."""
    (te,), local = layouts["te"], layouts["tp1"][0]
    assert te["attention_calls"]["no_mask"] > 0 and te["attention_calls"]["causal"] > 0
    assert te["cached"]["rows_fed"] == local["cached"]["rows_fed"]  # a decoding row: width 1 anyway
    one_te, one_local = te["cached_one_episode"]["rows_fed"], local["cached_one_episode"]["rows_fed"]
    assert len(one_te) > len(one_local)  # the local spec feeds each observation as one chunk


@pytest.mark.parametrize("layout", ALL)
def test_waves_sample_what_one_cache_samples(layouts, layout):
    """At most ``WAVE`` sequences per cache, by --inference-max-requests or by free memory (which
    differs across the model-parallel ranks here: they agree on the smallest fit, else their
    forwards would not match): the same samples as the reference, fewer rows per cache."""
    for rank in layouts[layout]:
        for run, ref in (("cached_waves", ""), ("cached_fit", ""), ("cached_waves_episodes", "_episodes_cut")):
            _same(rank[run], rank["reference" + ref])
            assert max(rank[run]["rows_fed"]) == WAVE
        assert rank["cached_waves"]["waves"] == rank["cached_fit"]["waves"] == -(-len(PROMPTS) * N // WAVE)
        assert rank["cached_waves_episodes"]["waves"] > rank["cached_waves"]["waves"]  # + restarts
        assert rank["cached"]["waves"] == 1


@pytest.mark.parametrize("layout", MODEL_PARALLEL)
def test_no_room_for_one_sequence_is_an_error_on_every_rank(layouts, layout):
    """One rank of the model-parallel group cannot hold one sequence's cache: all of them raise
    (a rank that raised alone would leave the others waiting in the next collective)."""
    last = len(layouts[layout]) - 1
    for r, rank in enumerate(layouts[layout]):
        assert "KV cache of one sequence" in rank["no_room"] and "--seq-length" in rank["no_room"]
        assert ("another rank" in rank["no_room"]) == (r != last)


@pytest.mark.parametrize("layout", MODEL_PARALLEL)
def test_cache_size_per_sequence_is_what_megatron_allocates(layouts, layout):
    """``cache_bytes_per_row`` (which sizes the waves by memory) against the bytes Megatron's
    attention layers allocate on each rank: this stage's layers, this TP rank's query groups."""
    for rank in layouts[layout]:
        sizes = rank["cache_bytes"]
        assert [b for b, _ in sizes] == [rows * rank["cache_bytes_per_row"] for _, rows in sizes]
        assert [rows for _, rows in sizes] == [WAVE, WAVE, len(PROMPTS) * N - 2 * WAVE]
        if layout in ONE_RANK:  # half the query groups (TP=2) or half the layers (PP=2) per rank
            assert 2 * rank["cache_bytes_per_row"] == layouts[ONE_RANK[layout]][0]["cache_bytes_per_row"]


@pytest.mark.parametrize("layout", ["tp2", "pp2", "tp2_user", "pp2_user"])
def test_model_parallel_ranks_take_the_first_ranks_environment_answers(layouts, layout):
    """Only rank 0 of a model-parallel group steps the environments (its copies elsewhere would
    answer differently): every rank of TP=2 and PP=2, on both paths, holds what one rank samples
    with the good answers."""
    good = layouts[ONE_RANK[layout]][0]["cached_episodes"]
    _same(layouts[ONE_RANK[layout]][0]["cached_flaky"], good)
    first, other = layouts[layout]
    assert first["flaky_env_steps"] > 0 and other["flaky_env_steps"] == 0
    for rank in (first, other):
        _same(rank["cached_flaky"], good)
        _same(rank["reference_flaky"], good)


def test_te_one_position_prefill_is_not_split_at_a_row_offset(layouts, tmp_path):
    """Seen on an H100 with TE 2.11: a one-token prefill split into row micro-batches raised "The
    provided qkv memory layout is not supported!". Under TE-like attention (which refuses what TE
    refuses) it now runs whole and samples what the unsplit run samples; wider forwards split."""
    ckpt = layouts["ckpt"]
    (out,) = run_distributed(split_one_token_prefill_te_like, 1, args=(ckpt,))
    _same(out["split"], out["whole"])
    assert out["split"]["rows_fed"][0] == len(PROMPTS) * N  # the one-position prefill: all rows


@pytest.mark.parametrize("layout", ALL)
def test_large_forwards_run_in_row_micro_batches_and_sample_the_same(layouts, layout):
    """Forwards of more than ``SPLIT`` tokens (the prefill of 8 rows x 3 tokens; history chunks
    of the multi-turn run) run in micro-batches of rows of at most ``SPLIT`` tokens (one row at
    least), which together cover the forward's rows: the same samples."""
    for rank in layouts[layout]:
        _same(rank["cached_split"], rank["reference"])
        _same(rank["cached_split_episodes"], rank["reference_episodes_cut"])
        assert rank["split_calls"][0] == (len(PROMPTS) * N, 3)  # the prefill
        assert all(rows * width > SPLIT for rows, width in rank["split_calls"])
        for (rows, width), parts in zip(rank["split_calls"], rank["split_parts"], strict=True):
            assert sum(r for r, _ in parts) == rows and len(parts) > 1
            assert all(w == width and (r * w <= SPLIT or r == 1) for r, w in parts)
