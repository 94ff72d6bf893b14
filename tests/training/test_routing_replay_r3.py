"""R3 routing replay (``--moe-routing-replay r3``): the built-in sampler records the experts it
routed every token to (prefill and decode steps, on each decode path), and the old-policy and
training passes replay them; ``moe_route_agreement`` compares the sampler's routes with the old
pass's under any MoE run.

The trainer cases take one step of the tiny MoE preset (fp32) each, in one forked process per
layout: one rank (the lockstep KV-cached path, the fixed-shape path, the cache-free reference, and
the routers perturbed between sampling and the passes) and EP=2 (two ranks, the expert group
sampling its union). The recording's bookkeeping is tested without a model.
"""

import pytest
import torch
from test_static_decode import FakeDecoder

from emapg_megatron.models.routing_replay import route_agreement
from emapg_megatron.multiprocess import run_distributed
from emapg_megatron.rollout.continuous_batching import SlotScheduler
from emapg_megatron.rollout.kv_cache_decoding import CONTINUE, DONE, Stream
from emapg_megatron.rollout.route_recording import (
    RouteTrace,
    batch_routes,
    fill_routes,
    pad_routes,
    write_rows,
)

BASE = ["--preset", "moe-tiny-cpu", "--rollout-batch-size", "4", "--num-samples-per-prompt", "4",
        "--micro-batch-size", "8", "--global-batch-size", "16"]
R3, NONE = ["--moe-routing-replay", "r3"], ["--moe-routing-replay", "none"]
PERTURB = 0.05  # noise added to the router weights (std ~0.1 at init) between sampling and the passes


# --- the bookkeeping, without a model -----------------------------------------------------------
def test_a_trace_keeps_each_position_as_last_fed():
    t = RouteTrace()
    assert t.routes() is None
    prefill = torch.arange(3 * 2 * 2, dtype=torch.uint8).view(3, 2, 2)  # 3 positions, 2 layers, k=2
    t.write(0, prefill)
    t.write(3, torch.full((1, 2, 2), 9, dtype=torch.uint8))  # a decode step at position 3
    assert t.routes().shape == (4, 2, 2) and torch.equal(t.routes()[:3], prefill)
    assert t.routes()[3].eq(9).all()
    t.write(0, torch.full((2, 2, 2), 7, dtype=torch.uint8))  # a restart: refed from 0
    assert t.routes().shape == (2, 2, 2) and t.routes().eq(7).all()


def test_forwards_assemble_into_batch_rows_with_unrouted_positions_filled():
    """A lockstep prefill of 2 rows (width 2), two decode steps, one row finished after the first;
    the batch is wider than either: positions never fed hold experts 0..k-1."""
    traces = [RouteTrace(), RouteTrace()]
    layers, k = 2, 2
    step = lambda value, rows, width: torch.full((rows, width, layers, k), value, dtype=torch.uint8)  # noqa: E731
    write_rows(traces, [0, 0], [2, 2], step(3, 2, 2))
    write_rows(traces, [2, 2], [1, 1], step(4, 2, 1))
    write_rows(traces[:1], [3], [1], step(5, 1, 1))
    out = batch_routes(traces, width=6)
    assert out.shape == (2, 6, layers, k) and out.dtype == torch.uint8
    assert out[0, :, 0, 0].tolist() == [3, 3, 4, 5, 0, 0]
    assert out[1, :, 0, 0].tolist() == [3, 3, 4, 0, 0, 0]
    assert out[1, 4].tolist() == [[0, 1], [0, 1]]  # a valid top-k: distinct experts
    assert batch_routes([RouteTrace()], 4) is None  # nothing recorded (a dense model)
    padded = pad_routes(out, 2)
    assert padded.shape == (2, 8, layers, k) and torch.equal(padded[:, 6:], fill_routes(2, layers, k, out.dtype)
                                                             .expand(2, -1, -1, -1))
    # a forward's padded rows (a batched prefill) write only the row's own tokens
    t = RouteTrace()
    write_rows([t], [0], [2], step(6, 1, 4))
    assert t.routes().shape == (2, layers, k)


class _SlotDecoder(FakeDecoder):
    """test_static_decode's model-free decoder, recording: slot ``i``'s routes at position ``p`` are
    ``10 * i + p``."""

    def routes_of(self, slot):
        return (10 * slot + torch.arange(self.fed[slot])).view(-1, 1, 1).to(torch.uint8)


def test_fixed_shape_slots_hand_each_sequence_its_own_routes():
    """Three sequences through two slots (the third takes a freed slot): each gets the routes of
    every position it fed, read from its slot when it finishes."""
    streams = [Stream(i, [5] * (2 + i), budget, [0.5] * budget) for i, budget in enumerate([2, 3, 2])]

    def advance(due, tokens, lps):
        for s, t in zip(due, tokens):
            s.known.append(t)
            s.turn.token_ids.append(t)
        return [DONE if len(s.turn.token_ids) >= s.budget else CONTINUE for s in due]

    SlotScheduler(_SlotDecoder(2), advance).run(streams)
    # fed: the history and every sampled token but the last
    assert [s.trace.routes().flatten().tolist() for s in streams] == [
        [0, 1, 2], [10, 11, 12, 13, 14], [0, 1, 2, 3, 4]]  # the third in slot 0


def test_route_agreement_ignores_the_order_of_a_tokens_experts():
    a = torch.tensor([[[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[0, 1], [0, 1]]]], dtype=torch.uint8)
    b = torch.tensor([[[[1, 0], [3, 2]], [[1, 2], [0, 2]], [[3, 2], [1, 0]]]], dtype=torch.uint8)
    assert route_agreement(a, b, torch.tensor([[1, 1, 0]])) == (1, 2)  # token 1 differs in layer 1
    assert route_agreement(a, b, torch.zeros(1, 3)) == (0, 0)


# --- the refusals -------------------------------------------------------------------------------
def test_r3_accepts_vllm_and_refuses_dense_models_in_one_line():
    """vLLM returns its routes (tests/rollout/test_vllm_routes.py): r3 with --rollout-engine vllm
    passes the architecture checks; a dense model and the layouts without per-sequence routes
    are still refused."""
    from emapg_megatron.arguments import parse_args, validate_architecture
    from emapg_megatron.errors import ConfigError
    from emapg_megatron.models.config import ModelConfig

    moe = ModelConfig(vocab_size=13, num_experts=4)
    base = ["--preset", "tiny-cpu", "--tensor-model-parallel-size", "1", "--moe-routing-replay", "r3"]
    validate_architecture(parse_args(base), moe)
    validate_architecture(parse_args([*base, "--partial-rollouts"]), moe)
    validate_architecture(parse_args([*base, "--rollout-engine", "vllm"]), moe)
    with pytest.raises(ConfigError, match="--moe-routing-replay r3 needs a mixture-of-experts model"):
        validate_architecture(parse_args([*base, "--rollout-engine", "vllm"]), ModelConfig(vocab_size=13))
    with pytest.raises(ConfigError, match="r3 does not support --sequence-packing"):
        validate_architecture(parse_args([*base, "--rollout-engine", "vllm", "--sequence-packing"]), moe)


# --- the trainer --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank():
    from routing_replay_r3_workers import cases

    runs = {"r3": (R3, 0.0), "r3_fixed_shape": ([*R3, "--inference-fixed-shape-decode"], 0.0),
            "r3_recompute": ([*R3, "--no-rollout-kv-cache"], 0.0),
            "none_perturbed": (NONE, PERTURB), "r3_perturbed": (R3, PERTURB)}
    (out,) = run_distributed(cases, 1, args=([*BASE, "--expert-model-parallel-size", "1"], runs), timeout=600)
    return out


@pytest.mark.parametrize("case", ["r3", "r3_fixed_shape", "r3_recompute"])
def test_r3_old_logprobs_equal_the_samplers(one_rank, case):
    """Under R3 the old pass (the training passes' first forward: same weights, same routes)
    gives every trained token the sampler's log-prob, on every decode path."""
    out = one_rank[case]
    assert out["trained_tokens"] > 0
    assert out["max_abs_diff"] < 1e-6, out
    assert out["moe_route_agreement"] == 1.0 and out["rollout_logprob_diff"] < 1e-6


def test_a_perturbed_router_disagrees_without_replay_and_not_under_r3(one_rank):
    none, r3 = one_rank["none_perturbed"], one_rank["r3_perturbed"]
    assert none["moe_route_agreement"] < 1, none
    assert none["rollout_logprob_diff"] > 1e-4
    assert r3["moe_route_agreement"] == 1.0
    # the routing weights still come from the perturbed router: smaller, not zero
    assert r3["rollout_logprob_diff"] < none["rollout_logprob_diff"], (r3, none)


def test_r3_at_ep2_replays_the_expert_groups_routes():
    """EP=2 (two ranks, each sampling the group's union of sequences and keeping its own rows):
    each rank's old log-probs are its sampler's, and without replay (unchanged weights) the old
    pass routes every trained token as the sampler recorded."""
    from routing_replay_r3_workers import cases

    outs = run_distributed(cases, 2, ep=2, args=(BASE, {"r3": (R3, 0.0), "none": (NONE, 0.0)}), timeout=600)
    for out in outs:
        assert out["r3"]["trained_tokens"] > 0 and out["r3"]["max_abs_diff"] < 1e-6, out
        assert out["r3"]["moe_route_agreement"] == 1.0 and out["none"]["moe_route_agreement"] == 1.0


@pytest.mark.parametrize("ep", [1, 2])
def test_r3_under_tp2_sequence_parallelism_replays_each_ranks_part(ep):
    """TP = 2 with sequence parallelism, EP = 1 (two ranks) and EP = 2 (four): each rank's routers
    see half of every sequence. The routes the sampler records are gathered whole (without replay
    they are the old pass's on every trained token) and each rank replays its half: every trained
    token's old log-prob is the sampler's, on every rank."""
    from routing_replay_r3_workers import cases

    tp2 = [*BASE, "--expert-model-parallel-size", str(ep), "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    outs = run_distributed(cases, 2 * ep, tp=2, ep=ep, args=(tp2, {"r3": (R3, 0.0), "none": (NONE, 0.0)}),
                           timeout=600)
    for out in outs:
        assert out["r3"]["trained_tokens"] > 0 and out["r3"]["max_abs_diff"] < 1e-6, out
        assert out["none"]["moe_route_agreement"] == 1.0, out


def test_the_sampler_records_the_routes_a_full_forward_takes():
    """Every cached decode path (lockstep, lockstep in row micro-batches, fixed-shape slots),
    single-turn and multi-turn (cut turns restart a sequence), and partial rollouts' continued
    sequences (the carried prefix prefilled again) and re-routed ones (one forward each): at every
    position the sampler fed, the batch's routes are those of a forward of the whole sequence."""
    from routing_replay_r3_workers import sampler_routes_against_a_full_forward

    (out,) = run_distributed(sampler_routes_against_a_full_forward, 1, timeout=300)
    assert len(out) == 7  # with partial rollouts' continued and re-routed sequences
    for case, (agree, total) in out.items():
        assert total > 20 and agree == total, (case, agree, total)


# --- with partial rollouts ----------------------------------------------------------------------
# Groups of 2 with room for 32 tokens, a pool of 3 groups per trained one: some groups finish at
# once, others are carried into the next step, unfinished or finished.
PARTIAL = ["--partial-rollouts", "--max-new-tokens", "32", "--seq-length", "40", "--max-position-embeddings", "40",
           "--num-samples-per-prompt", "2", "--micro-batch-size", "8", "--global-batch-size", "8",
           "--expert-model-parallel-size", "1", "--rollout-is", "tis"]


@pytest.fixture(scope="module")
def partial_runs():
    from routing_replay_r3_workers import partial_steps

    def run(extra):
        return run_distributed(partial_steps, 1, args=([*BASE, *PARTIAL, *R3, *extra], 4), timeout=600)[0]

    # training without replay: the old pass routes every token itself, with the step's weights
    return {"frozen": run(["--lr", "0"]), "training": run(NONE)}


def test_r3_with_partial_rollouts_replays_what_the_sampler_fed(partial_runs):
    """Unchanged weights (--lr 0): every trained token's old log-prob is the sampler's, also those
    of sequences carried from an earlier step (their continuation prefilled the carried prefix and
    recorded its routes; one finished earlier is routed by a forward now)."""
    steps = partial_runs["frozen"]
    assert sum(m["partial/carried"] for m in steps) > 0, steps  # sequences were carried
    for m in steps:
        assert m["max_abs_diff"] < 1e-6 and m["moe_route_agreement"] == 1.0, steps


def test_partial_rollouts_route_carried_sequences_with_the_current_weights(partial_runs):
    """Training, no replay (the old pass routes itself, with the step's weights): the routes a
    step's rollout carries, which r3 would replay, are the step's own weights' on every trained
    token (agreement 1 with the old pass's), though carried tokens were sampled by earlier
    policies (their log-probs differ: the lag the importance weights correct)."""
    steps = partial_runs["training"]
    assert max(m["partial/policy_lag_max"] for m in steps) >= 1, steps
    for m in steps:
        assert m["moe_route_agreement"] == 1.0, steps
    assert max(m["max_abs_diff"] for m in steps) > 1e-4  # earlier policies' tokens were trained


def test_r3_with_partial_rollouts_at_dp2_gathers_each_ranks_routes():
    """DP = 2: each rank continues every other pending sequence of the shared pool and trains its
    own groups, whose routes another rank may have recorded: gathered, they are replayed exactly
    (unchanged weights: every trained token's old log-prob is the sampler's, on both ranks)."""
    from routing_replay_r3_workers import partial_steps

    dp2 = ["--micro-batch-size", "4"]  # the rollout of 4 groups of 2: one micro-batch per rank
    outs = run_distributed(partial_steps, 2, args=([*BASE, *PARTIAL, *R3, "--lr", "0", *dp2], 3), timeout=600)
    assert sum(m["partial/carried"] for m in outs[0]) > 0, outs[0]
    for steps in outs:
        for m in steps:
            assert m["max_abs_diff"] < 1e-6 and m["moe_route_agreement"] == 1.0, steps
