"""R3 with vLLM: the routes vLLM returns (``CompletionOutput.routed_experts``) laid into the rollout
batch, against the fake ``vllm`` of test_vllm_engine_orchestration.py (imported, not copied).

vLLM's convention (docs/moe.md, "Routing replay"): with ``LLM(enable_return_routed_experts=True)``
each completion carries int32 ``[prompt + completion - 1, num_hidden_layers, top-k]`` (the last
sampled token is never fed), every layer (a dense layer's rows are zeros), logical expert ids.
The engine keeps the MoE layers, checks the array (one ``RunError`` line per failure) and lays it
from position 0, prompt first, as the built-in sampler lays its own routes.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_vllm_engine_orchestration import (  # noqa: F401 (fake_vllm, fake_sync: fixtures, used by name)
    PAD,
    PROMPTS,
    fake_chunks,
    fake_routes,
    fake_sync,
    fake_vllm,
)

from emapg_megatron.errors import RunError
from emapg_megatron.models.config import ModelConfig
from emapg_megatron.multiprocess import run_distributed
from emapg_megatron.rollout.config import VLLMConfig
from emapg_megatron.rollout.route_recording import fill_routes
from emapg_megatron.rollout.vllm_engine import VLLMEngine, episode_routes, vllm_routes

# a call that vLLM would ignore fails; every test runs with the fake installed as ``vllm`` and the
# weight export stubbed
pytestmark = [pytest.mark.filterwarnings("error:fake vLLM"), pytest.mark.usefixtures("fake_vllm", "fake_sync")]

# a MoE model mixing dense layers (0 and 2 dense, 1 and 3 MoE), as config.json and as the trainer's
HF_MIXED = {"num_hidden_layers": 4, "num_experts_per_tok": 2, "num_experts": 6, "mlp_only_layers": [0, 2]}
MIXED = ModelConfig(vocab_size=300, num_layers=4, num_experts=6, moe_router_topk=2, dense_mlp_layers=[0, 2])
HF_ALL = {"num_hidden_layers": 2, "num_experts_per_tok": 2, "num_local_experts": 4}
ALL_MOE = ModelConfig(vocab_size=300, num_layers=2, num_experts=4, moe_router_topk=2)


def make_engine(tmp_path, hf: dict | None, model_cfg, route_dtype=torch.uint8, seq_length=64):
    (tmp_path / "config.json").write_text(json.dumps(hf or {}))
    cfg = VLLMConfig(hf_dir=str(tmp_path), sleep_level=1, seed=77, weight_sync_bucket_mb=4096 / 2**20)
    return VLLMEngine(cfg, model_cfg, seq_length=seq_length, pad_id=PAD, trainer_tp=1,
                      model_chunks=fake_chunks(1.0), route_dtype=route_dtype)


def expected_routes(fed: list[int], hf: dict, model_cfg) -> torch.Tensor:
    """What the batch must hold for a sequence of ``fed`` tokens: vLLM's array, MoE layers only."""
    return torch.from_numpy(fake_routes(fed[:-1], hf)[:, model_cfg.moe_layers].astype(np.int64))


# --- the engine arguments ---------------------------------------------------------------------
def test_llm_kwargs_ask_for_routes_only_when_the_engine_records_them(tmp_path):
    cfg = VLLMConfig(hf_dir="-")
    assert "enable_return_routed_experts" not in cfg.llm_kwargs_for(8)
    assert VLLMConfig(hf_dir="-", return_routes=True).llm_kwargs_for(8)["enable_return_routed_experts"] is True
    with_routes = make_engine(tmp_path, HF_MIXED, MIXED)
    assert with_routes.llm.kwargs["enable_return_routed_experts"] is True
    assert with_routes.route_dtype == torch.uint8
    without = make_engine(tmp_path, {}, SimpleNamespace(name="dense"), route_dtype=None)
    assert "enable_return_routed_experts" not in without.llm.kwargs
    batch = without.generate(PROMPTS, 2, 1.0, 1.0, 8)
    assert batch.routes is None
    assert all(c.routed_experts is None for o in without.llm.generate_calls[0]["outputs"] for c in o.outputs)


# --- generate: the routes laid ------------------------------------------------------------------
@pytest.mark.parametrize("hf,model_cfg,dtype", [(HF_MIXED, MIXED, torch.uint8),
                                                (HF_ALL, ALL_MOE, torch.int16)],
                         ids=["mixed_dense_and_moe", "all_moe_int16"])
def test_generate_lays_each_completions_routes_from_position_0(tmp_path, hf,
                                                               model_cfg, dtype):
    engine = make_engine(tmp_path, hf, model_cfg, route_dtype=dtype)
    n = 3
    batch = engine.generate(PROMPTS, n, 1.0, 1.0, 12, rng_step=2)
    S, width = len(PROMPTS) * n, batch.tokens.shape[1]
    layers, k = len(model_cfg.moe_layers), model_cfg.moe_router_topk
    assert batch.routes.dtype == dtype and batch.routes.shape == (S, width, layers, k)
    fill = fill_routes(width, layers, k, dtype)
    lengths = set()
    for s, resp in enumerate(batch.responses):
        fed = PROMPTS[s // n] + resp
        lengths.add(len(fed))
        assert batch.tokens[s, :len(fed)].tolist() == fed
        got = batch.routes[s]
        assert torch.equal(got[:len(fed) - 1].long(), expected_routes(fed, hf, model_cfg)), s
        assert torch.equal(got[len(fed) - 1:], fill[len(fed) - 1:]), s  # never fed: fill
    assert len(lengths) > 2  # prompts and completions of different lengths
    # the n samples of a prompt share the prompt's routes and differ after it
    assert torch.equal(batch.routes[0, :2], batch.routes[1, :2])


def test_a_layer_dimension_of_the_moe_layers_alone_is_taken_as_it_is(tmp_path):
    engine = make_engine(tmp_path, HF_MIXED, MIXED)
    engine.llm.mangle_routes = lambda r: r[:, MIXED.moe_layers]
    batch = engine.generate(PROMPTS, 2, 1.0, 1.0, 8)
    fed = PROMPTS[0] + batch.responses[0]
    assert torch.equal(batch.routes[0, :len(fed) - 1].long(), expected_routes(fed, HF_MIXED, MIXED))


def test_vllm_routes_selects_the_moe_layers_and_accepts_both_lengths():
    routes = np.zeros((5, 4, 2), dtype=np.int32)
    routes[:, 1] = [3, 1]
    routes[:, 3] = [0, 5]
    out = vllm_routes(routes, fed=6, model_cfg=MIXED, dtype=torch.uint8)
    assert out.dtype == torch.uint8 and out.shape == (5, 2, 2)
    assert out[:, 0].tolist() == [[3, 1]] * 5 and out[:, 1].tolist() == [[0, 5]] * 5
    assert vllm_routes(routes, fed=5, model_cfg=MIXED, dtype=torch.uint8).shape == (5, 2, 2)


# --- each failure, one line ---------------------------------------------------------------------
def _dup(r):
    r = r.copy()
    r[:, 1, 1] = r[:, 1, 0]
    return r


def _out_of_range(r, value):
    r = r.copy()
    r[-1, 3, 0] = value
    return r


@pytest.mark.parametrize("mangle,message", [
    (lambda r: None, r"vLLM returned no routed experts \(CompletionOutput.routed_experts is None\)"),
    (lambda r: r[:, :3], "vLLM returned routes for 3 layers; the policy has 4 layers, 2 of them MoE"),
    (lambda r: r[:-1], r"routes for \d+ positions of a \d+-token sequence .*: neither"),
    (lambda r: np.concatenate([r, r, r]), r"routes for \d+ positions"),
    (lambda r: r[..., :1], "vLLM returned 1 experts per token; the policy routes each token to 2"),
    (lambda r: _out_of_range(r, 6), "vLLM routed a token to expert 6, outside the policy's 6 experts 0..5"),
    (lambda r: _out_of_range(r, -1), "vLLM routed a token to expert -1"),
    (_dup, "the same expert twice in one layer"),
    (lambda r: r.astype(np.float32), r"not integer expert ids shaped \[positions, layers, top-k\]"),
    (lambda r: r[:, :, 0], r"not integer expert ids shaped"),
], ids=["none", "layers", "too_short", "too_long", "topk", "expert_above", "expert_negative",
        "duplicate", "float", "two_dims"])
def test_each_bad_route_array_is_one_line(tmp_path, mangle, message):
    engine = make_engine(tmp_path, HF_MIXED, MIXED)
    engine.llm.mangle_routes = mangle
    with pytest.raises(RunError, match=message) as err:
        engine.generate(PROMPTS, 2, 1.0, 1.0, 8)
    assert "\n" not in str(err.value)
    assert not engine.llm.weights_awake and not engine.llm.kv_awake  # asleep again after the error


def test_routes_need_a_moe_config_in_vllm(tmp_path):
    """The fake reads config.json as vLLM does: no MoE entries, no routed experts."""
    with pytest.raises(AttributeError, match="routed experts need a MoE config.json"):
        make_engine(tmp_path, {"num_hidden_layers": 4}, MIXED)


# --- multi-turn: the last request's routes --------------------------------------------------------
class CutEnv:
    """Two turns: the first cut to 3 sampled tokens and answered by an observation; the second cut
    to ``last_cut`` tokens (None: kept whole), then, with ``tail``, an observation; done."""

    def __init__(self, last_cut=None, tail=()):
        self.segments, self.done, self.max_turn_tokens, self.turns = [], False, None, 0
        self.last_cut, self.tail = last_cut, list(tail)

    @property
    def response_text(self):
        return "".join(s.text for s in self.segments)

    def step(self, text, token_ids=None):
        seg = SimpleNamespace
        if self.turns == 0:
            self.segments += [seg(text=text[:3], token_ids=list(token_ids[:3])),
                              seg(text="<o>", token_ids=[60, 61, 62])]
        else:
            cut = self.last_cut or len(token_ids)
            self.segments.append(seg(text=text[:cut], token_ids=list(token_ids[:cut])))
            if self.tail:
                self.segments.append(seg(text="t", token_ids=list(self.tail)))
            self.done = True
        self.turns += 1


def test_episodes_take_their_last_requests_routes(tmp_path):
    engine = make_engine(tmp_path, HF_MIXED, MIXED, seq_length=96)
    engine.llm.script = lambda ids: "abcdefgh"  # 8 tokens every turn
    prompts, n = [PROMPTS[0], PROMPTS[1]], 2
    envs = [CutEnv(), CutEnv(last_cut=2, tail=[70, 71]), CutEnv(), CutEnv(last_cut=5)]
    batch, episodes = engine.generate_episodes(prompts, n, envs, tokenizer=engine.tokenizer,
                                               temperature=1.0, top_p=1.0, max_new_tokens=16)
    calls = engine.llm.generate_calls
    assert len(calls) == 2
    width, fill = batch.tokens.shape[1], fill_routes(batch.tokens.shape[1], 2, 2, torch.uint8)
    for s, ep in enumerate(episodes):
        kept = ep.history()
        last_fed = calls[1]["prompts"][s] + list(calls[1]["outputs"][s].outputs[0].token_ids)
        same = next(i for i, (a, b) in enumerate(zip(kept + [-1], last_fed + [-2])) if a != b)
        assert batch.tokens[s, :len(kept)].tolist() == kept
        # the routes of the tokens the episode keeps as the last request fed them
        want = expected_routes(last_fed, HF_MIXED, MIXED)[:same]
        assert torch.equal(batch.routes[s, :len(want)].long(), want), s
        assert torch.equal(batch.routes[s, len(want):], fill[len(want):]), s
        # whole last turn: all but its last token were fed; cut to 5 of 8: all 5 were fed; cut to 2
        # then an observation: the 2 only (the observation's tokens were never fed)
        assert len(want) == {0: len(kept) - 1, 1: len(kept) - 2, 2: len(kept) - 1, 3: len(kept)}[s]
    assert width >= max(len(ep.history()) for ep in episodes)


def test_episode_routes_stop_where_the_episode_leaves_what_was_fed():
    ep = SimpleNamespace(history=lambda: [1, 2, 3, 9, 9])
    routes = torch.arange(6).view(6, 1, 1)
    assert episode_routes(ep, [1, 2, 3, 4, 5, 6, 7], routes)[:, 0, 0].tolist() == [0, 1, 2]
    assert episode_routes(ep, [1, 2, 3, 9, 9, 7, 8], routes)[:, 0, 0].tolist() == [0, 1, 2, 3, 4]
    assert episode_routes(ep, [1, 2], None) is None


# --- the model-parallel broadcast carries the routes -------------------------------------------
@pytest.mark.parametrize("dtype", ["uint8", "int16"])
def test_broadcast_rollout_batch_carries_the_routes(dtype):
    from vllm_routes_workers import broadcast_routes

    outs = run_distributed(broadcast_routes, 2, tp=2, args=(dtype,), timeout=120)
    src = outs[0]["sent"]
    for out in outs:
        got = out["got"]
        assert got["routes"] is not None and got["routes"].dtype == getattr(torch, dtype)
        assert torch.equal(got["routes"], src["routes"]) and torch.equal(got["tokens"], src["tokens"])
        assert got["responses"] == src["responses"]
    assert not torch.equal(outs[1]["sent"]["routes"], src["routes"])  # rank 1 had its own


# --- the trainer's wiring -------------------------------------------------------------------------
def test_build_gives_the_vllm_engine_the_route_dtype(monkeypatch, tmp_path):
    from emapg_megatron import build
    from emapg_megatron.arguments import parse_args
    from emapg_megatron.rollout import vllm_engine

    seen = {}

    class Recorder:
        def __init__(self, cfg, model_cfg, **kwargs):
            seen.update(kwargs, cfg=cfg)

    monkeypatch.setattr(vllm_engine, "VLLMEngine", Recorder)
    (tmp_path / "config.json").write_text("{}")
    cfg = parse_args(["--preset", "moe-tiny-cpu", "--rollout-engine", "vllm", "--load-hf", str(tmp_path),
                      "--moe-routing-replay", "r3"])
    tok = SimpleNamespace(pad_token_id=3, eos_token_id=None)
    build.build_rollout_engine(cfg, None, ALL_MOE, tok, route_dtype=torch.uint8)
    assert seen["route_dtype"] == torch.uint8 and seen["pad_id"] == 3
    build.build_rollout_engine(cfg, None, ALL_MOE, tok)
    assert seen["route_dtype"] is None


@pytest.mark.parametrize("engine, replay, expected", [
    ("megatron", "none", torch.uint8), ("megatron", "r3", torch.uint8),  # the built-in sampler: always
    ("vllm", "r3", torch.uint8), ("vllm", "r2", None), ("vllm", "none", None)])  # vLLM: for R3 only
def test_which_engine_returns_routes(engine, replay, expected):
    from emapg_megatron import build
    from emapg_megatron.arguments import parse_args
    from emapg_megatron.step.moe import MoERouting

    cfg = parse_args(["--preset", "moe-tiny-cpu", "--rollout-engine", engine, "--moe-routing-replay", replay])
    routing = MoERouting.for_policy(MIXED, cfg.moe, pipeline=1, sequence_parallel=False, packing=False)
    assert build.rollout_route_dtype(cfg, routing) == expected
    assert build.rollout_route_dtype(cfg, None) is None  # a dense policy


def test_the_policys_route_dtype_is_what_the_engine_gets():
    """``MoERouting.record_dtype``, what build_trainer hands the built-in sampler (and vLLM under
    r3): a MoE policy at PP = 1 records, a dense one does not."""
    from emapg_megatron.arguments import parse_args
    from emapg_megatron.step.moe import MoERouting

    cfg = parse_args(["--preset", "moe-tiny-cpu", "--moe-routing-replay", "r3"])
    routing = MoERouting.for_policy(MIXED, cfg.moe, pipeline=1, sequence_parallel=False, packing=False)
    assert routing.record_dtype == torch.uint8 and routing.num_layers == 2
    assert MoERouting.for_policy(ModelConfig(vocab_size=13), cfg.moe, pipeline=1,
                                 sequence_parallel=False, packing=False) is None


# --- the trainer: vLLM's routes are what the passes replay ---------------------------------------
STUB_BASE = ["--preset", "moe-tiny-cpu", "--rollout-batch-size", "2", "--num-samples-per-prompt", "2",
             "--micro-batch-size", "4", "--global-batch-size", "4", "--expert-model-parallel-size", "1"]


def test_vllm_routes_reach_the_old_policy_pass_under_r3():
    """The rollout engine is a stub of vLLM: the built-in sampler's batch with routes it did not
    take (each expert id + 1), passed through :func:`vllm_routes` as vLLM's array. Under r3 the
    passes get exactly those routes (the old pass routes every trained token as they say:
    agreement 1); without replay the old pass routes as the sampler did, which they are not."""
    from vllm_routes_workers import stub_cases

    runs = {"r3": (["--moe-routing-replay", "r3"], 1), "none": (["--moe-routing-replay", "none"], 1)}
    (out,) = run_distributed(stub_cases, 1, args=(STUB_BASE, runs), timeout=600)
    assert out["r3"]["stub_ran"] and out["r3"]["handed"] is True
    assert out["r3"]["moe_route_agreement"] == 1.0  # (by construction: the passes replay what they compare)
    assert out["none"]["stub_ran"] and out["none"]["handed"] is None
    assert out["none"]["moe_route_agreement"] == 0.0
    # the old pass really replayed the shifted routes: its log-probs left the sampler's, which it
    # matches when it routes itself (as the sampler did)
    assert out["r3"]["rollout_logprob_diff"] > 1e-3 and out["none"]["rollout_logprob_diff"] < 1e-6, out


def test_a_vllm_without_an_options_keyword_is_one_line():
    """A vLLM whose LLM(...) lacks what --moe-routing-replay r3 or --lora-rank adds (check_vllm_api
    reports it as an unavailable feature) is refused naming the option; another TypeError is not
    reworded."""
    from emapg_megatron.errors import ConfigError
    from emapg_megatron.rollout.vllm_engine import _start_llm

    class OldLLM:
        def __init__(self, model, **kwargs):
            if kwargs:  # as EngineArgs(...) says it
                raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument '{sorted(kwargs)[0]}'")

    vllm = SimpleNamespace(LLM=OldLLM, __version__="0.9.0")
    with pytest.raises(ConfigError) as e:
        _start_llm(vllm, {"model": "m", "enable_return_routed_experts": True})
    assert str(e.value) == ("--moe-routing-replay r3 with --rollout-engine vllm: this vLLM (0.9.0) does not take "
                            "LLM(enable_return_routed_experts=...): use a vLLM that does, or drop "
                            "--moe-routing-replay r3")
    with pytest.raises(ConfigError, match=r"^--lora-rank with --rollout-engine vllm: this vLLM \(0.9.0\)"):
        _start_llm(vllm, {"model": "m", "enable_lora": True, "max_loras": 1})
    with pytest.raises(TypeError):
        _start_llm(vllm, {"model": "m", "bogus": 1})
    assert isinstance(_start_llm(vllm, {"model": "m"}), OldLLM)
