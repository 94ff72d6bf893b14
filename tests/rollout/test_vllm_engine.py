"""The vLLM rollout engine's CPU-checkable parts: the import guard, weight-sync bucketing (real
Megatron export at TP=2 into a recording loader), the sampler-vs-trainer log-prob metric, the
model-parallel batch broadcast and the multi-turn episode bookkeeping."""

import math
import subprocess
import sys

import pytest
import torch

from emapg_megatron.errors import ConfigError
from emapg_megatron.models.config import ModelConfig
from emapg_megatron.rollout.config import VLLMConfig
from emapg_megatron.rollout.engine import logprob_mismatch
from emapg_megatron.rollout.episodes import Episode, Turn, pack_episodes
from emapg_megatron.rollout.vllm_engine import (
    INSTALL_HINT,
    VLLMEngine,
    load_generation_backend,
    request_seed,
)
from emapg_megatron.rollout.weight_sync import rebucket


# --- import guard ----------------------------------------------------------------------
def test_module_imports_without_vllm():
    code = ("import sys; sys.modules['vllm'] = None\n"  # None makes `import vllm` fail
            "import emapg_megatron.rollout.vllm_engine, emapg_megatron.rollout.weight_sync\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)


def _assert_install_hint(err):
    msg = str(err.value)
    assert "\n" not in msg
    assert "pip install 'emapg-megatron[gpu]'" in msg and "NGC" in msg
    assert msg.count(INSTALL_HINT) == 1


def test_engine_without_vllm_says_how_to_install(no_vllm, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as err:
        VLLMEngine(VLLMConfig(hf_dir=str(tmp_path)), ModelConfig(), seq_length=32, pad_id=0)
    _assert_install_hint(err)


def test_eval_backend_without_vllm_says_how_to_install(no_vllm, tmp_path):
    with pytest.raises(ConfigError) as err:
        load_generation_backend(str(tmp_path))
    _assert_install_hint(err)


def test_config_validation(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        VLLMConfig(hf_dir=str(tmp_path)).validate()
    (tmp_path / "config.json").write_text("{}")
    VLLMConfig(hf_dir=str(tmp_path), tensor_parallel_size=2).validate(trainer_tp=4)
    with pytest.raises(ConfigError, match="must divide"):
        VLLMConfig(hf_dir=str(tmp_path), tensor_parallel_size=4).validate(trainer_tp=2)
    with pytest.raises(ConfigError, match="sleep level"):
        VLLMConfig(hf_dir=str(tmp_path), sleep_level=3).validate()
    with pytest.raises(ConfigError, match=r"\['quantization'\] are not supported by the weight sync"):
        VLLMConfig(hf_dir=str(tmp_path), llm_kwargs={"quantization": "fp8"}).validate()
    kwargs = VLLMConfig(hf_dir=str(tmp_path)).llm_kwargs_for(4096)
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["enable_sleep_mode"] and kwargs["load_format"] == "dummy"
    assert kwargs["max_model_len"] == 4096


def test_request_seed_is_deterministic_and_spread():
    seeds = {request_seed(7, step, idx, turn) for step in range(3) for idx in range(50) for turn in range(3)}
    assert len(seeds) == 3 * 50 * 3
    assert all(0 <= s < 2**31 for s in seeds)
    assert request_seed(7, 1, 2, 0) == request_seed(7, 1, 2, 0) != request_seed(8, 1, 2, 0)


# --- log-prob mismatch ------------------------------------------------------------------------
def test_logprob_mismatch_by_hand():
    samp = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, -1.0]])
    old = torch.tensor([[-1.1, -1.5, -9.0], [-0.2, -2.0, -4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    # masked diffs old - samp: -0.1, 0.5, 0.0, -3.0
    out = logprob_mismatch(samp, old, mask)
    assert out["logprob_tokens"] == 4
    assert out["logprob_abs_diff_mean"] == pytest.approx((0.1 + 0.5 + 0.0 + 3.0) / 4)
    assert out["importance_ratio_max"] == pytest.approx(math.exp(0.5))
    assert out["importance_ratio_min"] == pytest.approx(math.exp(-3.0))


def test_logprob_mismatch_no_tokens():
    z = torch.zeros(2, 3)
    assert logprob_mismatch(z, z + 5, z) == {"logprob_abs_diff_mean": 0.0, "importance_ratio_max": 1.0,
                                             "importance_ratio_min": 1.0, "logprob_tokens": 0}


# --- bucketing -------------------------------------------------------------------------------
def test_rebucket_greedy_in_order():
    sizes = [100, 300, 50, 600, 20, 20]  # bytes (float32: numel = bytes / 4)
    pairs = [(f"t{i}", torch.zeros(b // 4)) for i, b in enumerate(sizes)]
    got = [[n for n, _ in b] for b in rebucket(pairs, 400)]
    assert got == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    with pytest.raises(ValueError):
        list(rebucket(pairs, 0))


@pytest.mark.slow
def test_weight_sync_buckets_mismatch_reduce_and_batch_broadcast():
    from vllm_engine_workers import TINY, _mismatch_inputs, sync_mismatch_and_broadcast

    from emapg_megatron.checkpoint.hf_mapping import HFMapping
    from emapg_megatron.multiprocess import run_distributed

    bound = 20_000  # the fp32 embedding (100 x 64 x 4 = 25.6 kB) must travel alone
    results = run_distributed(sync_mismatch_and_broadcast, world_size=2, tp=2, args=(bound,))
    expected = HFMapping(ModelConfig(**TINY)).expected_hf_shapes()
    for res in results:
        buckets = res["buckets"]
        sizes = [sum(b for _, b in bucket) for bucket in buckets]
        assert all(s <= bound or len(b) == 1 for s, b in zip(sizes, buckets))
        assert any(len(b) > 1 for b in buckets) and any(s > bound for s in sizes)
        for i in range(len(buckets) - 1):  # greedy: the next tensor did not fit
            assert sizes[i] + buckets[i + 1][0][1] > bound
        # the loader got exactly the export stream, in order, as full (TP-gathered) HF tensors
        assert [n for n, _ in res["received"]] == [n for n, _ in res["direct"]]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(res["received"], res["direct"]))
        assert {n: tuple(t.shape) for n, t in res["received"]} == {n: tuple(s) for n, s in expected.items()}
        stats = res["stats"]
        assert stats["bytes"] == sum(sizes) and stats["buckets"] == len(buckets)
        assert stats["tensors"] == len(res["received"])
        assert 0 <= stats["load_seconds"] <= stats["seconds"]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(results[0]["received"], results[1]["received"]))

    parts = [_mismatch_inputs(r) for r in range(2)]
    ref = logprob_mismatch(*(torch.cat([p[i] for p in parts]) for i in range(3)))
    for res in results:
        assert res["mismatch"]["logprob_tokens"] == ref["logprob_tokens"]
        for key in ("logprob_abs_diff_mean", "importance_ratio_max", "importance_ratio_min"):
            assert res["mismatch"][key] == pytest.approx(ref[key], rel=1e-12)

    assert not torch.equal(results[0]["mine"][0], results[1]["mine"][0])
    for res in results:
        assert all(torch.equal(a, b) for a, b in zip(res["agreed"], results[0]["mine"]))
        assert res["agreed_responses"] == results[0]["mine_responses"]


# --- multi-turn episodes ---------------------------------------------------------------------
class CharTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _turn(text, base):
    ids = [ord(c) for c in text]
    return Turn(ids, [base - 0.001 * i for i in range(len(ids))], text)


def test_episode_masks_observations_and_keeps_sampled_logprobs(retriever):
    from emapg_megatron.tasks.search import SearchConfig, SearchEnv

    tok = CharTokenizer()
    prompt = tok.encode("Q: who built it?\n")
    ep = Episode(prompt, SearchEnv(retriever, SearchConfig(max_turns=4), tokenizer=tok), tok, 4096)
    first = _turn("Let me look. <search> eiffel tower </search> and then more", -0.5)
    ep.add_turn(first)
    kept = len("Let me look. <search> eiffel tower </search>")  # the env cuts after the action
    assert ep.ids[:kept] == first.token_ids[:kept] and ep.mask[:kept] == [1] * kept
    assert ep.logprobs[:kept] == first.logprobs[:kept]
    obs = tok.decode(ep.ids[kept:])
    assert obs.startswith("\n\n<information>") and obs.endswith("</information>\n\n")
    assert set(ep.mask[kept:]) == {0} and set(ep.logprobs[kept:]) == {0.0}
    assert not ep.done and ep.history() == prompt + ep.ids

    second = _turn("<answer> Gustave Eiffel </answer>", -0.25)
    ep.add_turn(second)
    assert ep.done and ep.env.answer == "Gustave Eiffel"
    assert ep.ids[-len(second.token_ids):] == second.token_ids
    assert ep.mask[-len(second.token_ids):] == [1] * len(second.token_ids)
    assert ep.unaligned_tokens == 0 and not ep.truncated

    batch = pack_episodes([ep], 1, 4096, 0)
    L, P = len(ep.ids), len(prompt)
    assert batch.tokens[0, :P + L].tolist() == prompt + ep.ids
    assert batch.loss_mask[0, :P].sum() == 0 and batch.loss_mask[0, P + L:].sum() == 0
    assert batch.loss_mask[0, P:P + L].tolist() == [float(m) for m in ep.mask]
    assert batch.sampling_logprobs[0, P:P + L].tolist() == pytest.approx(ep.logprobs)
    assert batch.responses == [ep.ids]


def test_episode_re_encoded_turn_is_not_trained_and_length_is_capped(retriever):
    from emapg_megatron.tasks.search import SearchConfig, SearchEnv

    tok = CharTokenizer()
    prompt = tok.encode("Q?\n")
    # Without a tokenizer the env cannot cut on a token boundary and re-encodes the kept text.
    ep = Episode(prompt, SearchEnv(retriever, SearchConfig(max_turns=4)), tok, 4096)
    ep.add_turn(_turn("x <search> paris </search> tail", -1.0))
    kept = len("x <search> paris </search>")
    assert ep.unaligned_tokens == kept and ep.mask[:kept] == [0] * kept

    short = Episode(prompt, SearchEnv(retriever, SearchConfig(max_turns=4), tokenizer=tok), tok, 40)
    assert short.turn_budget(500) == 40 - len(prompt)
    short.add_turn(_turn("<search> eiffel tower </search>", -1.0))
    assert short.truncated and short.done and len(short.history()) == 40


# --- GPU (skipped without a GPU and vLLM; not yet run anywhere) ------------------------------------
@pytest.mark.gpu
@pytest.mark.slow
def test_vllm_round_trip_on_gpu(tmp_path):
    pytest.importorskip("vllm")
    from vllm_engine_workers import vllm_round_trip, write_tiny_hf_dir

    from emapg_megatron.multiprocess import run_distributed

    hf = write_tiny_hf_dir(tmp_path)
    res = run_distributed(vllm_round_trip, world_size=1, device="cuda", args=(hf,), timeout=900)[0]
    assert res["response_tokens"] > 0 and res["same_samples"]
    assert res["sync_buckets"] > 1 and res["sync"]["weight_sync_gbps"] > 0
    # BF16 on both sides: the processed log-probs agree to rounding, not exactly.
    assert res["mismatch"]["logprob_abs_diff_mean"] < 0.05
    assert 0.8 < res["mismatch"]["importance_ratio_min"] <= res["mismatch"]["importance_ratio_max"] < 1.25
    assert res["freed_bytes"] > 1 << 30  # sleeping released the KV cache (>= 1 GiB)


# --- wiring in build.py ------------------------------------------------------------------
def test_trainer_builds_the_vllm_engine_with_its_layout(monkeypatch, tmp_path):
    """--rollout-engine vllm: the engine learns the trainer's TP and PP (so a model-parallel
    group shares one batch) and gets the model chunks. It is not synced yet: a resume loads
    weights into those chunks afterwards, so the first generate syncs (lazily, in the engine)."""
    from emapg_megatron import build
    from emapg_megatron.arguments import parse_args
    from emapg_megatron.rollout import vllm_engine

    made = []

    class Recorder:
        def __init__(self, cfg, model_cfg, **kwargs):
            made.append(self)
            self.cfg, self.kwargs, self.synced = cfg, kwargs, 0

        def update_weights(self, model_chunks=None):
            self.synced += 1

    monkeypatch.setattr(vllm_engine, "VLLMEngine", Recorder)
    args = parse_args(["--preset", "tiny-cpu", "--rollout-engine", "vllm", "--load-hf", str(tmp_path),
                       "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
                       "--vllm-tensor-parallel-size", "2", "--vllm-weight-sync-bucket-mb", "64"])
    chunks = ["chunk"]
    engine = build.build_rollout_engine(args, chunks, ModelConfig(), tokenizer=None)
    assert made == [engine] and engine.synced == 0
    assert engine.kwargs["model_chunks"] is chunks
    assert engine.kwargs["trainer_tp"] == 4 and engine.kwargs["pipeline_parallel"] == 2
    assert engine.cfg.tensor_parallel_size == 2 and engine.cfg.bucket_bytes == 64 << 20
    assert engine.cfg.hf_dir == str(tmp_path) and engine.cfg.seed == args.loop.seed

