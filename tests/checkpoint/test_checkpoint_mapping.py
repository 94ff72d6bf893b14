"""The HF <-> Megatron mapping table, config translation and the converter's error paths
(single process, no Megatron runtime: every check here fails before a model is built)."""

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from checkpoint_workers import build_hf_model, hf_state_dict
from safetensors.torch import save_file

from emapg_megatron.checkpoint import HFMapping, atomic_dir, hf_to_mcore
from emapg_megatron.checkpoint.hf_config import (
    check_same_architecture,
    hf_config_from_model,
    model_config_from_hf,
)
from emapg_megatron.checkpoint.hf_mapping import (
    FusedQKV,
    GateUp,
    Replicated,
    RowParallel,
    VocabParallel,
    dict_reader,
)
from emapg_megatron.checkpoint.weights import _Item, plan_buckets
from emapg_megatron.errors import ConfigError
from emapg_megatron.models.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]

CONFIGS = {
    "gqa_bias": ModelConfig(vocab_size=100, hidden_size=32, ffn_hidden_size=48, num_layers=2,
                            num_attention_heads=8, num_query_groups=4, add_qkv_bias=True,
                            make_vocab_size_divisible_by=16),
    "mha_qknorm_headdim": ModelConfig(vocab_size=61, hidden_size=32, ffn_hidden_size=64, num_layers=1,
                                      num_attention_heads=4, kv_channels=12, qk_layernorm=True,
                                      tie_word_embeddings=True, make_vocab_size_divisible_by=8),
}


def _random_hf(mapping: HFMapping) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in mapping.expected_hf_shapes().items()}


def _local_shape(entry, cfg: ModelConfig, tp: int) -> tuple[int, ...]:
    """Megatron's local shape of a param at TP=tp (independent of the codecs)."""
    codec, shape = entry.codec, entry.hf_shapes[0]
    if isinstance(codec, Replicated):
        return shape
    if isinstance(codec, RowParallel):
        return (shape[0], shape[1] // tp)
    if isinstance(codec, VocabParallel):
        return (cfg.padded_vocab_size(tp) // tp, shape[1])
    if isinstance(codec, GateUp):
        return (2 * shape[0] // tp, shape[1])
    rows = sum(s[0] for s in entry.hf_shapes)
    return (rows // tp, *shape[1:])


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_import_slices_then_export_round_trips_bit_exactly(name, tp):
    cfg = CONFIGS[name]
    mapping = HFMapping(cfg)
    hf = _random_hf(mapping)
    read = dict_reader(hf)
    exported = {}
    for entry in mapping.entries:
        shape = _local_shape(entry, cfg, tp)
        shards = [mapping.to_megatron(entry.megatron, read, r, tp, shape) for r in range(tp)]
        assert all(tuple(s.shape) == shape for s in shards), entry.megatron
        if entry.export:
            exported.update(mapping.to_hf(entry.megatron, shards))
    assert set(exported) == set(hf) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    for n, t in exported.items():
        assert torch.equal(t, hf[n]), n
        assert t._base is None  # owns its memory (safetensors refuses shared storage)


def test_qkv_layout_is_per_group_q_k_v_and_tp_ranks_take_whole_groups():
    codec = FusedQKV(num_heads=4, num_groups=2, head_dim=1)
    q, k, v = torch.arange(4.0), torch.arange(10.0, 12.0), torch.arange(20.0, 22.0)
    read = dict_reader({"q": q, "k": k, "v": v})
    full = codec.to_megatron(read, ("q", "k", "v"), 0, 1, (8,))
    # group 0: q heads 0,1 then k0, v0; group 1: q heads 2,3 then k1, v1
    assert full.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert codec.to_megatron(read, ("q", "k", "v"), 1, 2, (4,)).tolist() == [2, 3, 11, 21]


def test_fc1_rank_holds_its_gate_chunk_then_its_up_chunk():
    codec = GateUp(ffn_hidden_size=4)
    read = dict_reader({"gate": torch.arange(4.0)[:, None], "up": torch.arange(10.0, 14.0)[:, None]})
    shard = codec.to_megatron(read, ("gate", "up"), 1, 2, (4, 1))
    assert shard.flatten().tolist() == [2, 3, 12, 13]


def test_vocab_padding_rows_are_zero_and_dropped_on_export():
    codec = VocabParallel(vocab_size=5)
    emb = torch.randn(5, 3)
    shards = [codec.to_megatron(dict_reader({"e": emb}), ("e",), r, 2, (4, 3)) for r in range(2)]
    assert torch.equal(shards[0], emb[:4]) and torch.equal(shards[1][0], emb[4])
    assert shards[1][1:].abs().sum() == 0
    assert torch.equal(codec.to_hf(shards)[0], emb)


def test_te_fused_and_local_spec_layernorm_names_share_one_entry():
    mapping = HFMapping(CONFIGS["gqa_bias"])
    te = mapping.lookup("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight")
    assert te is mapping.lookup("decoder.layers.1.input_layernorm.weight")
    assert te.hf == ("model.layers.1.input_layernorm.weight",)
    mlp = mapping.lookup("decoder.layers.0.mlp.linear_fc1.layer_norm_weight")
    assert mlp is mapping.lookup("decoder.layers.0.pre_mlp_layernorm.weight")
    assert mlp.hf == ("model.layers.0.post_attention_layernorm.weight",)


def test_tied_output_layer_imports_the_embedding_and_is_never_exported():
    tied = HFMapping(CONFIGS["mha_qknorm_headdim"])
    entry = tied.lookup("output_layer.weight")
    assert entry.hf == ("model.embed_tokens.weight",) and not entry.export
    untied = HFMapping(CONFIGS["gqa_bias"]).lookup("output_layer.weight")
    assert untied.hf == ("lm_head.weight",) and untied.export


def test_check_hf_lists_missing_unexpected_and_mismatched_tensors():
    mapping = HFMapping(CONFIGS["gqa_bias"])
    shapes = mapping.expected_hf_shapes()
    shapes.pop("model.layers.1.mlp.up_proj.weight")
    shapes["model.layers.0.self_attn.o_proj.bias"] = (32,)
    shapes["model.norm.weight"] = (31,)
    shapes["model.layers.0.self_attn.rotary_emb.inv_freq"] = (2,)  # legacy buffer: ignored
    with pytest.raises(ConfigError) as e:
        mapping.check_hf(shapes)
    msg = str(e.value)
    assert "missing tensors (1): model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected tensors (1): model.layers.0.self_attn.o_proj.bias" in msg
    assert "mismatched shapes (1): model.norm.weight: (31,) != (32,)" in msg


def test_tied_checkpoint_may_carry_an_lm_head_copy():
    mapping = HFMapping(CONFIGS["mha_qknorm_headdim"])
    mapping.check_hf({**mapping.expected_hf_shapes(), "lm_head.weight": (61, 32)})


def _item(name, nbytes, stage=0, dtype=torch.float32, split=False):
    return _Item(name, stage, (nbytes // dtype.itemsize,), dtype, split)


def test_buckets_are_bounded_and_split_at_stage_and_dtype_changes():
    items = [_item("a", 40), _item("b", 40), _item("c", 40, split=True), _item("d", 200),
             _item("e", 8, stage=1), _item("f", 8, stage=1, dtype=torch.bfloat16)]
    buckets = plan_buckets(items, 100, tp=2)
    # c gathers to 80 bytes at TP=2; d alone exceeds the bound and travels alone.
    assert [[i.name for i in b] for b in buckets] == [["a", "b"], ["c"], ["d"], ["e"], ["f"]]


# --- config.json translation --------------------------------------------------------------


@pytest.mark.parametrize("arch,extra", [
    ("LlamaForCausalLM", dict(num_query_groups=2, rotary_base=500000.0)),
    ("Qwen2ForCausalLM", dict(add_qkv_bias=True, tie_word_embeddings=True, rotary_base=1e6)),
    ("Qwen3ForCausalLM", dict(qk_layernorm=True, kv_channels=24, num_query_groups=2)),
])
def test_model_config_round_trips_through_hf_config(arch, extra):
    cfg = ModelConfig(vocab_size=100, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                      num_attention_heads=4, max_position_embeddings=64, **extra)
    back, back_arch = model_config_from_hf(hf_config_from_model(cfg, arch))
    assert back_arch == arch and back == cfg


def test_pre_v5_qwen25_config_is_read():
    # The shape of Qwen2.5-1.5B-Instruct's config.json (rope_theta / torch_dtype spelling).
    hf = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
          "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 1536, "initializer_range": 0.02,
          "intermediate_size": 8960, "max_position_embeddings": 32768, "max_window_layers": 21,
          "model_type": "qwen2", "num_attention_heads": 12,
          "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
          "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 32768,
          "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
          "vocab_size": 151936}
    cfg, _ = model_config_from_hf(hf)
    assert cfg.num_query_groups == 2 and cfg.rotary_base == 1e6
    assert cfg.add_qkv_bias and cfg.tie_word_embeddings
    assert cfg.padded_vocab_size(1) == 151936 and cfg.padded_vocab_size(2) == 152064
    out = hf_config_from_model(cfg, "Qwen2ForCausalLM", base=hf, dtype="bf16")
    assert out == hf  # nothing added, nothing lost


@pytest.mark.parametrize("change,message", [
    (dict(architectures=["MistralForCausalLM"]), "unsupported architecture"),
    # Megatron reproduces llama3 scaling only with Llama 3.x's fixed frequency factors.
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                           "rope_theta": 5e5}), "llama3 rope scaling with"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5}),
     "rope scaling 'yarn'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_hf_configs_are_rejected(change, message):
    cfg = ModelConfig(vocab_size=100, hidden_size=64, num_attention_heads=4)
    hf = {**hf_config_from_model(cfg, "LlamaForCausalLM"), **change}
    with pytest.raises(ConfigError, match=message):
        model_config_from_hf(hf)


def test_template_of_another_model_is_rejected():
    cfg = ModelConfig(vocab_size=100, hidden_size=64, num_attention_heads=4)
    other = hf_config_from_model(replace(cfg, num_layers=3), "LlamaForCausalLM")
    with pytest.raises(ConfigError, match="num_layers: template 3 != checkpoint 2"):
        check_same_architecture(other, cfg)


# --- converter error paths: clear message, nothing left behind ----------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "hf"
    build_hf_model("llama", {}, seed=0).save_pretrained(path)
    return path


def _variant(src: Path, dst: Path, *, config=None, tensors=None) -> Path:
    dst.mkdir()
    hf = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**hf, **(config or {})}))
    sd = hf_state_dict(str(src))
    save_file(tensors(sd) if tensors else sd, str(dst / "model.safetensors"))
    return dst


def _drop(name):
    return lambda sd: {n: t for n, t in sd.items() if n != name}


@pytest.mark.parametrize("kind,kwargs,message", [
    ("arch", dict(config={"architectures": ["GPT2LMHeadModel"]}), "unsupported architecture"),
    ("missing", dict(tensors=_drop("model.layers.1.mlp.up_proj.weight")),
     "missing tensors (1): model.layers.1.mlp.up_proj.weight"),
    ("unexpected", dict(tensors=lambda sd: {**sd, "model.layers.0.mlp.up_proj.bias": torch.zeros(128)}),
     "unexpected tensors (1): model.layers.0.mlp.up_proj.bias"),
    ("mismatched", dict(config={"vocab_size": 96}), "model.embed_tokens.weight: (100, 64) != (96, 64)"),
])
def test_bad_hf_input_fails_clearly_and_writes_nothing(llama_dir, tmp_path, kind, kwargs, message):
    src = _variant(llama_dir, tmp_path / kind, **kwargs)
    with pytest.raises(ConfigError) as e:
        hf_to_mcore(src, tmp_path / "out", tp=1)
    assert message in str(e.value)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [kind]


@pytest.mark.parametrize("tp,pp,message", [
    (3, 1, "does not divide the number of attention heads (4)"),
    (4, 1, "does not divide the number of query groups (2)"),
    (1, 3, "does not divide the number of layers (2)"),
])
def test_parallel_sizes_that_do_not_divide_the_model_are_rejected(llama_dir, tmp_path, tp, pp, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hf_to_mcore(llama_dir, tmp_path / "out", tp=tp, pp=pp)
    assert not any(tmp_path.iterdir())


def test_existing_output_is_not_overwritten_by_default(llama_dir, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(ConfigError, match="already exists"):
        hf_to_mcore(llama_dir, tmp_path / "out")


def test_bin_only_directory_gets_a_hint(llama_dir, tmp_path):
    src = tmp_path / "bin"
    src.mkdir()
    shutil.copy(llama_dir / "config.json", src)
    (src / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="convert .bin weights to safetensors"):
        hf_to_mcore(src, tmp_path / "out")


def test_atomic_dir_commits_on_success_and_vanishes_on_failure(tmp_path):
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "out") as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("boom")
    assert not any(tmp_path.iterdir())
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "a").write_text("1")
    with atomic_dir(tmp_path / "out", overwrite=True) as tmp:
        (tmp / "b").write_text("2")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["b"]


def test_cli_reports_one_line_and_exit_status_2(llama_dir, tmp_path):
    src = _variant(llama_dir, tmp_path / "gpt2", config={"architectures": ["GPT2LMHeadModel"]})
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), "hf-to-mcore",
         "--hf-dir", str(src), "--out", str(tmp_path / "out"), "--tp", "2"],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [(
        "error: unsupported architecture ['GPT2LMHeadModel']: supported are LlamaForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM")]
    assert not (tmp_path / "out").exists()


def test_a_param_split_differently_from_the_table_is_refused():
    from emapg_megatron.checkpoint.weights import _check_layout

    p = torch.nn.Parameter(torch.zeros(4, 4))
    p.tensor_model_parallel, p.partition_dim = True, 1
    _check_layout("decoder.layers.0.mlp.linear_fc2.weight", RowParallel(), p)
    with pytest.raises(ConfigError, match="Megatron splits dim 1 over TP, the HF mapping expects 0"):
        _check_layout("decoder.layers.0.mlp.linear_fc1.weight", GateUp(ffn_hidden_size=4), p)
    with pytest.raises(ConfigError, match="expects None"):
        _check_layout("decoder.final_layernorm.weight", Replicated(), p)
