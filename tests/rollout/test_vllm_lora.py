"""LoRA rollouts through vLLM's LoRA requests (adapters only), against the fake ``vllm`` of
test_vllm_engine_orchestration.py (imported, not copied; docs/lora.md, "Rollouts through vLLM").

The engine streams the frozen base once (``adapters="exclude"``) and every sync writes the
adapters as a peft folder that the fake reads from disk when a generate names it; its samples
depend on the base weights *and* the adapter's tensors. In-process tests stub the base export and
the adapter gather (``weight_sync.sync_weights`` / ``weight_sync.all_adapters``) with tensors of a
tiny model's shapes, and run the real peft writer; the spawned tests run a real tiny Megatron
LoRA model at TP = 2 and PP = 2 through the real export and gather.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
from test_vllm_engine_orchestration import (  # noqa: F401 (fake_vllm: a fixture, used by name)
    PAD,
    PROMPTS,
    FakeLLM,
    LoRARequest,
    events_after,
    fake_vllm,
    hf_dir,
    install_fake_vllm,
)
from vllm_engine_workers import TINY

from emapg_megatron.checkpoint.peft_format import to_peft
from emapg_megatron.errors import ConfigError
from emapg_megatron.lora.config import LoRAConfig
from emapg_megatron.models.config import ModelConfig
from emapg_megatron.rollout import weight_sync
from emapg_megatron.rollout.config import VLLMConfig, vllm_max_lora_rank
from emapg_megatron.rollout.vllm_engine import VLLMEngine, vllm_lora_base_name
from emapg_megatron.rollout.weight_sync import SyncStats

# a call that vLLM would ignore fails; every test runs with the fake installed as ``vllm``
pytestmark = [pytest.mark.filterwarnings("error:fake vLLM"), pytest.mark.usefixtures("fake_vllm")]

RANK, ALPHA = 4, 8.0
CFG = ModelConfig(**TINY)


# ============================================================================================
# a tiny model's tensors (TINY: hidden 64, 4 heads, 2 query groups, ffn 128, 2 layers)
# ============================================================================================
def base_hf() -> dict[str, torch.Tensor]:
    """The frozen base as the HF export names it (the linears the adapters need, and a few more)."""
    g = torch.Generator().manual_seed(0)
    h, kv, ffn = 64, 2 * 16, 128
    shapes = {"model.embed_tokens.weight": (128, h), "model.norm.weight": (h,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                       p + "mlp.down_proj.weight": (h, ffn)})
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def whole_adapters(seed: int) -> dict[str, torch.Tensor]:
    """Whole (one-rank) adapter matrices of every target linear, by Megatron's global name."""
    g = torch.Generator().manual_seed(seed)
    h, qkv, ffn = 64, 64 + 2 * 32, 128
    shapes = {"self_attention.linear_qkv": (h, qkv), "self_attention.linear_proj": (h, h),
              "mlp.linear_fc1": (h, 2 * ffn), "mlp.linear_fc2": (ffn, h)}
    out = {}
    for i in range(2):
        for layer, (fan_in, fan_out) in shapes.items():
            name = f"decoder.layers.{i}.{layer}.lora"
            out[f"{name}.A"] = torch.randn(RANK, fan_in, generator=g)
            out[f"{name}.B"] = torch.randn(fan_out, RANK, generator=g)
    return out


def chunks(adapters_seed: int = 1) -> list[dict]:
    """Stand-ins for the model chunks: what the stubbed export and gather hand over."""
    return [{"base": base_hf(), "adapters": whole_adapters(adapters_seed)}]


@pytest.fixture
def stubs(monkeypatch):
    """The base export (records each call and its ``adapters`` mode) and the adapter gather."""
    calls = []

    def sync_weights(model_chunks, model_cfg, load, *, bucket_bytes, adapters="auto"):
        pairs = [(n, t) for chunk in model_chunks for n, t in chunk["base"].items()]
        for bucket in weight_sync.rebucket(pairs, bucket_bytes):
            load(bucket)
        calls.append(SimpleNamespace(adapters=adapters, cfg=model_cfg))
        return SyncStats(0.5, 0.25, sum(t.numel() * t.element_size() for _, t in pairs), len(pairs), 2)

    monkeypatch.setattr(weight_sync, "sync_weights", sync_weights)
    monkeypatch.setattr(weight_sync, "all_adapters",
                        lambda model_chunks: {n: t for c in model_chunks for n, t in c["adapters"].items()})
    return calls


def lora_engine(tmp_path, *, sleep_level=1, rank=RANK, model_chunks=None) -> VLLMEngine:
    cfg = VLLMConfig(hf_dir=hf_dir(tmp_path), sleep_level=sleep_level, seed=77,
                     weight_sync_bucket_mb=200_000 / 2**20, lora=LoRAConfig(rank=rank, alpha=ALPHA))
    return VLLMEngine(cfg, CFG, seq_length=64, pad_id=PAD, trainer_tp=1,
                      model_chunks=chunks() if model_chunks is None else model_chunks)


def peft_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


def loaded_names(llm: FakeLLM) -> list[str]:
    return [n for load in llm.model.loads for n in load["names"]]


# ============================================================================================
# 1. configuration
# ============================================================================================
@pytest.mark.parametrize("rank, max_rank", [(1, 8), (8, 8), (9, 16), (64, 64), (65, 128), (300, 320),
                                            (512, 512)])
def test_llm_kwargs_with_lora_round_the_rank_up_to_one_vllm_accepts(rank, max_rank, tmp_path):
    cfg = VLLMConfig(hf_dir=hf_dir(tmp_path), lora=LoRAConfig(rank=rank))
    kw = cfg.llm_kwargs_for(32)
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["max_loras"]) == (True, max_rank, 1)
    assert vllm_max_lora_rank(rank) == max_rank
    FakeLLM(**kw)  # the fake accepts exactly vLLM's allowed ranks
    plain = VLLMConfig(hf_dir=hf_dir(tmp_path)).llm_kwargs_for(32)
    assert not {"enable_lora", "max_lora_rank", "max_loras"} & set(plain)
    assert set(kw) - set(plain) == {"enable_lora", "max_lora_rank", "max_loras"}
    assert VLLMConfig(hf_dir="-", lora=LoRAConfig(rank=0)).lora_kwargs() == {}


def test_export_adapter_modes(tmp_path):
    from emapg_megatron.checkpoint.weights import export_hf_weights

    with pytest.raises(ValueError, match=r"adapters must be one of \('auto', 'exclude'\)"):
        list(export_hf_weights([], CFG, adapters="include"))
    assert vllm_lora_base_name("model.layers.3.self_attn.k_proj.bias") == \
        "model.layers.3.self_attn.k_proj.base_layer.bias"
    for kept in ("model.layers.3.input_layernorm.weight", "lm_head.weight", "model.embed_tokens.weight",
                 "model.layers.0.mlp.experts.2.down_proj.weight", "model.layers.0.self_attn.q_norm.weight"):
        assert vllm_lora_base_name(kept) == kept


def test_rank_above_vllms_largest_is_one_line_and_the_fake_validates_like_vllm(tmp_path):
    with pytest.raises(ConfigError) as err:
        VLLMConfig(hf_dir=hf_dir(tmp_path), lora=LoRAConfig(rank=513)).check_settings()
    assert str(err.value) == ("--lora-rank 513 is above vLLM's largest max_lora_rank (512): use the "
                              "built-in sampler or a lower rank")
    with pytest.raises(ValueError, match=r"max_lora_rank \(12\) must be one of"):
        FakeLLM(str(tmp_path), enable_lora=True, max_lora_rank=12, max_loras=1)
    with pytest.raises(ValueError, match="id must be > 0"):
        LoRARequest("x", 0, "/p")


# ============================================================================================
# 2. what each sync sends
# ============================================================================================
def test_first_sync_sends_the_base_alone_and_the_adapters_as_a_peft_folder(stubs, tmp_path):
    from peft import LoraConfig
    from peft.utils import load_peft_weights

    engine = lora_engine(tmp_path)
    llm, model_chunks = engine.llm, engine.model_chunks
    first = engine.generate(PROMPTS, 2, 1.0, 1.0, 8, rng_step=3)
    assert llm.events == ["sleep(1)", "wake_up(weights)", "load_weights", "load_weights",
                          "reset_prefix_cache", "wake_up(kv_cache)", "load_lora(1)", "generate", "sleep(1)"]
    # the base: exported without the adapter matrices, every tensor of it, no adapter name; the
    # linears vLLM wraps for LoRA under their base_layer names
    assert [c.adapters for c in stubs] == ["exclude"] and stubs[0].cfg is CFG
    assert loaded_names(llm) == [vllm_lora_base_name(n) for n in model_chunks[0]["base"]]
    assert not any("lora" in n for n in loaded_names(llm))
    assert "model.layers.1.mlp.down_proj.base_layer.weight" in loaded_names(llm)
    assert "model.norm.weight" in loaded_names(llm)
    # the adapters: a peft folder in this rank's private directory, bit for bit to_peft's tensors
    request = engine.lora_request
    assert (request.lora_name, request.lora_int_id) == ("emapg-policy-1", 1)
    assert os.path.dirname(request.lora_path) == engine._lora_dir
    assert os.stat(engine._lora_dir).st_mode & 0o077 == 0  # private to this user
    expected = to_peft(model_chunks[0]["adapters"], CFG)
    stored = peft_tensors(request.lora_path)
    assert sorted(stored) == sorted(expected) and len(stored) == 2 * 2 * 7  # 2 layers, A and B, 7 projections
    assert all(torch.equal(stored[k], expected[k]) and stored[k].dtype == torch.float32 for k in expected)
    # peft's own loader reads it
    peft_cfg = LoraConfig.from_pretrained(request.lora_path)
    assert (peft_cfg.r, peft_cfg.lora_alpha, peft_cfg.peft_type.value) == (RANK, ALPHA, "LORA")
    assert set(peft_cfg.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"}
    peft_loaded = load_peft_weights(request.lora_path, device="cpu")
    assert all(torch.equal(peft_loaded[k], expected[k]) for k in expected)
    # generate named it, and vLLM read that folder
    assert llm.generate_calls[-1]["lora_request"] is request
    assert llm.lora_loads[0]["hash"] == llm.generate_calls[-1]["adapter"]
    # the stats: base + adapters, the adapter bytes said apart
    adapter_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    base_bytes = sum(t.numel() * 4 for t in model_chunks[0]["base"].values())
    stats = engine.last_sync
    assert (stats.adapter_bytes, stats.base_bytes, stats.bytes) == (adapter_bytes, base_bytes,
                                                                    base_bytes + adapter_bytes)
    assert engine.metrics()["weight_sync_adapter_mb"] == pytest.approx(adapter_bytes / 1e6)
    assert first.tokens.shape[0] == 6


def test_later_syncs_send_only_the_adapters_and_changed_adapters_change_the_samples(stubs,
                                                                                     tmp_path):
    engine = lora_engine(tmp_path)
    llm = engine.llm
    first = engine.generate(PROMPTS, 2, 1.0, 1.0, 8, rng_step=3)
    loads = len(llm.model.loads)

    new_chunks = chunks(adapters_seed=2)  # new adapters, the same base
    mark = len(llm.events)
    stats = engine.update_weights(new_chunks)
    assert events_after(llm, mark) == ["wake_up(weights)", "remove_lora(1)", "reset_prefix_cache"]
    assert len(stubs) == 1 and len(llm.model.loads) == loads  # no base weight sent
    assert stats.bytes == stats.adapter_bytes > 0 and stats.base_bytes == 0
    assert engine.lora_request.lora_int_id == 2
    stored = peft_tensors(engine.lora_request.lora_path)
    expected = to_peft(new_chunks[0]["adapters"], CFG)
    assert all(torch.equal(stored[k], expected[k]) for k in expected)
    # the old adapter left vLLM and the disk: one folder at a time
    assert llm.removed == [1] and llm.evicted == [] and os.listdir(engine._lora_dir) == ["adapter-2"]

    second = engine.generate(PROMPTS, 2, 1.0, 1.0, 8, rng_step=3)
    assert events_after(llm, mark)[-4:] == ["wake_up(kv_cache)", "load_lora(2)", "generate", "sleep(1)"]
    assert second.responses != first.responses  # the adapter reached sampling

    engine.update_weights(chunks(adapters_seed=2))  # the same adapters again, under id 3
    third = engine.generate(PROMPTS, 2, 1.0, 1.0, 8, rng_step=3)
    assert third.responses == second.responses
    assert llm.lora_loads[-1]["hash"] == llm.lora_loads[-2]["hash"] != llm.lora_loads[0]["hash"]
    engine.update_weights(chunks(adapters_seed=1))  # back to the first adapters
    assert engine.generate(PROMPTS, 2, 1.0, 1.0, 8, rng_step=3).responses == first.responses
    assert llm.removed == [1, 2, 3] and llm.llm_engine.list_loras() == {4}
    assert len(stubs) == 1 and os.listdir(engine._lora_dir) == ["adapter-4"]


def test_continue_histories_and_episodes_pass_the_adapter(stubs, tmp_path):
    engine = lora_engine(tmp_path, sleep_level=0)
    engine.continue_histories([[11, 12], [21]], temperature=1.0, top_p=1.0, max_new_tokens=4,
                              seeds=[1, 2])
    assert engine.llm.generate_calls[-1]["lora_request"] is engine.lora_request is not None


def test_a_removed_adapter_id_cannot_be_used_again(stubs, tmp_path):
    engine = lora_engine(tmp_path, sleep_level=0)
    engine.generate(PROMPTS, 1, 1.0, 1.0, 4)
    old = engine.lora_request
    engine.update_weights()
    with pytest.raises(RuntimeError, match="adapter id 1 was removed"):
        engine.llm.generate([{"prompt_token_ids": [1, 2]}], lora_request=old)
    assert not os.path.exists(old.lora_path)


# ============================================================================================
# 3. sleep levels
# ============================================================================================
def test_sleep_level_2_resyncs_the_base_and_a_new_adapter(stubs, tmp_path):
    engine = lora_engine(tmp_path, sleep_level=2)
    llm = engine.llm
    first = engine.generate(PROMPTS, 2, 1.0, 1.0, 8)
    mark = len(llm.events)
    second = engine.generate(PROMPTS, 2, 1.0, 1.0, 8)
    # the weights were dropped: the base streams again, then adapter 2 replaces adapter 1
    assert events_after(llm, mark) == ["wake_up(weights)", "load_weights", "load_weights", "remove_lora(1)",
                                       "reset_prefix_cache", "wake_up(kv_cache)", "load_lora(2)",
                                       "generate", "sleep(2)"]
    assert [c.adapters for c in stubs] == ["exclude", "exclude"]
    assert second.responses == first.responses  # the same base and adapters


def test_sleep_level_2_without_a_fresh_adapter_would_sample_a_discarded_slot(stubs, tmp_path):
    """The fake's check the test above relies on: the adapter slot a level-2 sleep dropped is
    refused (vLLM would sample with garbage), so the engine must send a new adapter."""
    engine = lora_engine(tmp_path, sleep_level=2)
    engine.generate(PROMPTS, 1, 1.0, 1.0, 4)
    llm = engine.llm
    llm.wake_up()
    llm.model.params = {vllm_lora_base_name(n): t for n, t in engine.model_chunks[0]["base"].items()}
    llm.weights_valid = True
    with pytest.raises(RuntimeError, match="discarded by sleep"):
        llm.generate([{"prompt_token_ids": [1, 2]}], lora_request=engine.lora_request)


@pytest.mark.parametrize("sleep_level", [0, 1])
def test_levels_that_keep_the_weights_sync_the_base_once(stubs, tmp_path, sleep_level):
    engine = lora_engine(tmp_path, sleep_level=sleep_level)
    for step in range(3):
        engine.generate(PROMPTS, 1, 1.0, 1.0, 4)
        engine.update_weights(chunks(adapters_seed=10 + step))
    assert len(stubs) == 1 and engine.lora_request.lora_int_id == 4
    assert engine.llm.removed == [1, 2, 3] and engine.llm.evicted == []


# ============================================================================================
# 4. the adapter folders do not outlive the engine
# ============================================================================================
def test_close_and_garbage_collection_remove_the_adapter_folders(stubs, tmp_path):
    engine = lora_engine(tmp_path)
    engine.generate(PROMPTS, 1, 1.0, 1.0, 4)
    root = engine._lora_dir
    assert os.listdir(root) == ["adapter-1"]
    engine.close()
    engine.close()  # idempotent
    assert not os.path.exists(root) and engine.lora_request is None
    with pytest.raises(RuntimeError, match="after close"):
        engine.update_weights()

    engine = lora_engine(tmp_path)
    engine.update_weights()
    root = engine._lora_dir
    assert os.path.isdir(root)
    del engine
    gc.collect()
    assert not os.path.exists(root)


def test_a_killed_engines_adapter_folders_are_swept_at_the_next_start(stubs, tmp_path, monkeypatch):
    """A process killed before close() leaves its adapter folder: the next LoRA engine of this user
    removes it (its process id names no live process), and only it."""
    import subprocess
    import tempfile

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = temp / f"emapg-vllm-lora-r0-p{gone.pid}-abc"
    (stale / "adapter-3").mkdir(parents=True)
    live = temp / f"emapg-vllm-lora-r1-p{os.getpid()}-xyz"  # a live engine's (this process)
    live.mkdir()
    other = temp / f"something-p{gone.pid}-else"
    other.mkdir()
    engine = lora_engine(tmp_path)
    assert not stale.exists() and live.is_dir() and other.is_dir()
    assert os.path.dirname(engine._lora_dir) == str(temp) and f"-p{os.getpid()}-" in engine._lora_dir
    engine.close()


def test_the_run_closes_its_engine_at_the_end(monkeypatch):
    """train.run closes the trainer's engine whatever happens after it is built."""
    from emapg_megatron import build, train
    from emapg_megatron.arguments import parse_args

    closed = []
    cfg = parse_args(["--preset", "tiny-cpu"])
    monkeypatch.setattr(build, "prepare", lambda argv: SimpleNamespace(config=cfg))
    monkeypatch.setattr(train.runtime, "initialize", lambda *a: None)
    monkeypatch.setattr(train.runtime, "destroy", lambda: None)
    monkeypatch.setattr(train.prompt_cache, "release", lambda: None)
    monkeypatch.setattr(train, "lock_outputs", lambda *a: [])
    monkeypatch.setattr(train, "on_rank0", lambda fn: None)
    monkeypatch.setattr(build, "build_trainer",
                        lambda inputs: SimpleNamespace(engine=SimpleNamespace(close=lambda: closed.append(1))))
    monkeypatch.setattr(build, "model_metadata", lambda inputs: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        train.run([])
    assert closed == [1]


# ============================================================================================
# 5. the fake refuses what vLLM's loader refuses
# ============================================================================================
def _folder(tmp_path, rank: int) -> str:
    from emapg_megatron.checkpoint.peft_format import save_peft

    g = torch.Generator().manual_seed(3)
    adapters = {k: torch.randn(*(rank if d == RANK else d for d in v.shape), generator=g)
                for k, v in whole_adapters(1).items()}
    save_peft(tmp_path / f"r{rank}", LoRAConfig(rank=rank, alpha=ALPHA), adapters, CFG)
    return str(tmp_path / f"r{rank}")


def test_the_fake_refuses_a_missing_folder_a_rank_too_high_and_lora_off(tmp_path):
    llm = FakeLLM(hf_dir(tmp_path), enable_lora=True, max_lora_rank=8, max_loras=1)
    with pytest.raises(KeyError, match="q_proj.weight"):  # vLLM's wrapped linears: base_layer names
        llm.model.load_weights(list(base_hf().items()))
    llm.model.load_weights([(vllm_lora_base_name(n), t) for n, t in base_hf().items()])
    prompt = [{"prompt_token_ids": [1, 2]}]
    with pytest.raises(ValueError, match="No adapter found"):
        llm.generate(prompt, lora_request=LoRARequest("a", 1, str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="LoRA rank 16 is greater than max_lora_rank 8"):
        llm.generate(prompt, lora_request=LoRARequest("b", 2, _folder(tmp_path, 16)))
    fits = _folder(tmp_path, 8)
    ok = llm.generate(prompt, lora_request=LoRARequest("c", 3, fits))
    assert ok and llm.lora_loads[-1]["rank"] == 8
    off = FakeLLM(hf_dir(tmp_path))
    with pytest.raises(KeyError, match="base_layer"):
        off.model.load_weights([(vllm_lora_base_name(n), t) for n, t in base_hf().items()])
    off.model.load_weights(list(base_hf().items()))
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        off.generate(prompt, lora_request=LoRARequest("c", 3, fits))
    small = FakeLLM(hf_dir(tmp_path), enable_lora=True, max_lora_rank=8, max_loras=1)
    small.model.load_weights([(vllm_lora_base_name(n), t[:, :32] if n.endswith("q_proj.weight") else t)
                              for n, t in base_hf().items()])
    with pytest.raises(ValueError, match=r"q_proj.lora_A.weight: shape \(8, 64\), expected \(8, 32\)"):
        small.generate(prompt, lora_request=LoRARequest("c", 3, fits))  # another base model


# ============================================================================================
# 6. the trainer's wiring
# ============================================================================================
def test_build_rollout_engine_hands_vllm_the_runs_lora(monkeypatch, tmp_path):
    from emapg_megatron import build
    from emapg_megatron.arguments import parse_args
    from emapg_megatron.rollout import vllm_engine

    made = []

    class Recorder:
        def __init__(self, cfg, model_cfg, **kwargs):
            made.append(self)
            self.cfg, self.kwargs = cfg, kwargs

    monkeypatch.setattr(vllm_engine, "VLLMEngine", Recorder)
    base = ["--preset", "tiny-cpu", "--rollout-engine", "vllm", "--load-hf", str(tmp_path)]
    args = parse_args([*base, "--lora-rank", "12", "--lora-alpha", "24"])
    engine = build.build_rollout_engine(args, ["chunk"], ModelConfig(), tokenizer=None)
    assert made == [engine] and engine.kwargs["model_chunks"] == ["chunk"]
    assert (engine.cfg.lora.rank, engine.cfg.lora.alpha) == (12, 24.0)
    kw = engine.cfg.llm_kwargs_for(32)
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["max_loras"]) == (True, 16, 1)
    plain = build.build_rollout_engine(parse_args(base), ["chunk"], ModelConfig(), tokenizer=None)
    assert plain.cfg.lora is None and "enable_lora" not in plain.cfg.llm_kwargs_for(32)


def test_vllm_with_lora_is_no_longer_refused_and_a_too_high_rank_is_one_line(tmp_path):
    from emapg_megatron import arguments
    from emapg_megatron.arguments import parse_args

    base = ["--preset", "tiny-cpu", "--rollout-engine", "vllm", "--load-hf", str(tmp_path)]
    arguments._validate_lora(parse_args([*base, "--lora-rank", "512"]))  # no refusal
    with pytest.raises(ConfigError) as err:
        arguments._validate_lora(parse_args([*base, "--lora-rank", "513"]))
    assert str(err.value) == ("--lora-rank 513 is above vLLM's largest max_lora_rank (512): use the "
                              "built-in sampler or a lower rank")
    arguments._validate_lora(parse_args(["--preset", "tiny-cpu", "--lora-rank", "513"]))  # built-in sampler


# ============================================================================================
# 7. a real tiny Megatron LoRA model (TP = 2 or PP = 2, two spawned ranks) into the fake
# ============================================================================================
def _stage_adapters(model, seed: int) -> dict[str, torch.Tensor]:
    """Whole adapter matrices of this stage, each a function of the seed and its global name only
    (so every layout draws the same one-rank matrices)."""
    from emapg_megatron.lora.apply import adapter_shapes, name_seed

    return {name: 0.1 * torch.randn(shape, generator=torch.Generator().manual_seed(name_seed(seed, name)))
            for name, shape in adapter_shapes(model).items()}


def _real_lora_worker(hf: str, out: str) -> dict:
    """Runs in a spawned rank: the fake vLLM, a real tiny Megatron LoRA model, the real export."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    install_fake_vllm()
    from emapg_megatron.checkpoint.weights import export_hf_weights
    from emapg_megatron.lora.apply import apply_lora, merge_lora, set_adapter_weights, unmerge_lora
    from emapg_megatron.models.gpt import build_for_this_rank

    rank = dist.get_rank()
    model = build_for_this_rank(CFG)
    apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA), seed=5)
    full = {1: _stage_adapters(model, 1), 2: _stage_adapters(model, 2)}
    set_adapter_weights(model, full[1])
    engine = VLLMEngine(VLLMConfig(hf, sleep_level=1, weight_sync_bucket_mb=20_000 / 2**20,
                                   tensor_parallel_size=1, lora=LoRAConfig(rank=RANK, alpha=ALPHA)),
                        CFG, seq_length=32, pad_id=0, model_chunks=[model],
                        trainer_tp=ps.get_tensor_model_parallel_world_size(),
                        pipeline_parallel=ps.get_pipeline_model_parallel_world_size())
    llm = engine.llm
    prompts = [[1, 2, 3], [4, 5]]
    first = engine.generate(prompts, 2, 1.0, 1.0, 6)
    own_first = [c.token_ids for o in llm.generate_calls[-1]["outputs"] for c in o.outputs]
    direct = list(export_hf_weights([model], CFG, bucket_bytes=20_000, adapters="exclude"))
    shutil.copytree(engine.lora_request.lora_path, os.path.join(out, f"rank{rank}-1"))
    base_loads = len(llm.model.loads)

    set_adapter_weights(model, full[2])  # a training step moved the adapters
    engine.update_weights()
    second = engine.generate(prompts, 2, 1.0, 1.0, 6)
    own_second = [c.token_ids for o in llm.generate_calls[-1]["outputs"] for c in o.outputs]
    shutil.copytree(engine.lora_request.lora_path, os.path.join(out, f"rank{rank}-2"))
    refusals = []
    try:
        list(export_hf_weights([model], CFG, adapters="auto"))  # unmerged adapters: no HF name
    except ConfigError as e:
        refusals.append(str(e))
    merge_lora(model)
    try:
        list(export_hf_weights([model], CFG, adapters="exclude"))
    except ConfigError as e:
        refusals.append(str(e))
    unmerge_lora(model)
    root = engine._lora_dir
    engine.close()
    return {"loads": [ld["names"] for ld in llm.model.loads], "base_loads": base_loads,
            "received": llm.model.received, "direct": direct, "full": full, "own": [own_first, own_second],
            "responses": [first.responses, second.responses],
            "removed": llm.removed, "evicted": llm.evicted, "stats": [engine.last_sync.bytes,
                                                                    engine.last_sync.adapter_bytes],
            "refusals": refusals, "root_left": os.path.exists(root)}


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_real_lora_model_streams_its_base_and_adapters_into_vllm(tmp_path, tp, pp):
    """Each rank's vLLM gets the base without any adapter matrix (exactly the base export), and a
    peft folder holding every stage's adapters, equal bit for bit to the one-rank matrices."""
    from peft.utils import load_peft_weights

    from emapg_megatron.multiprocess import run_distributed

    out = tmp_path / "out"
    out.mkdir()
    results = run_distributed(_real_lora_worker, world_size=2, tp=tp, pp=pp,
                              args=(hf_dir(tmp_path), str(out)), timeout=240)
    for version in (1, 2):
        whole = {n: t for res in results for n, t in res["full"][version].items()}  # PP: both stages
        assert len(whole) == 2 * 4 * 2  # 2 layers x 4 linears x (A, B)
        expected = to_peft(whole, CFG)
        for r in range(2):
            stored = load_peft_weights(str(out / f"rank{r}-{version}"), device="cpu")
            assert sorted(stored) == sorted(expected)
            assert all(torch.equal(stored[k], expected[k]) for k in expected), (r, version)
            config = json.loads((out / f"rank{r}-{version}" / "adapter_config.json").read_text())
            assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    for res in results:
        names = [n for names in res["loads"] for n in names]
        assert res["base_loads"] == len(res["loads"]) > 0  # the second sync sent no base weight
        assert not any("lora" in n for n in names)
        assert names == [vllm_lora_base_name(n) for n, _ in res["direct"]]
        assert sum(".base_layer." in n for n in names) == 2 * (7 + 3)  # 7 linears and q/k/v's bias
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(res["received"], res["direct"]))
        assert res["own"][0] != res["own"][1]  # new adapters, new samples
        assert res["removed"] == [1] and res["evicted"] == [] and not res["root_left"]
        assert res["stats"][0] == res["stats"][1] > 0  # adapters only
        assert res["refusals"][0].startswith("Megatron parameters without an HF mapping")
        assert res["refusals"][1] == ("the base weights alone (adapters='exclude') cannot be exported "
                                      "with LoRA adapters merged into them: unmerge first")
        assert res["responses"][0] == results[0]["responses"][0]  # the group trains on one batch
