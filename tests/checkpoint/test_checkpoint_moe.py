"""HF <-> Megatron-Core conversion of mixtures of experts (Qwen3-MoE, Mixtral) on tiny random
models: bit-exact round trips (also through saves at TP=2 x EP=2 and PP=2 x EP=2), logits against
transformers at TP=1, TP=2 x EP=2 (expert TP 2) and PP=2 x EP=2, the export stream with every
expert on every rank, and the refused configs.

Reference: ``transformers`` in fp32 in this process. Megatron runs on forked gloo ranks.
"""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from checkpoint_workers import hf_state_dict
from moe_checkpoint_workers import (
    MODELS,
    convert_job,
    export_job,
    parallel_job,
    reference_dir,
    save_hf_models,
    tokens,
)

from emapg_megatron.checkpoint import hf_to_mcore
from emapg_megatron.checkpoint.hf_config import (
    architecture_for,
    check_same_architecture,
    hf_config_from_model,
    model_config_from_hf,
)
from emapg_megatron.checkpoint.hf_mapping import HFMapping, dict_reader
from emapg_megatron.checkpoint.verify import hf_logits
from emapg_megatron.errors import ConfigError
from emapg_megatron.models.config import ModelConfig
from emapg_megatron.multiprocess import run_distributed

ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return save_hf_models(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def ref_logits(hf_dirs):
    return {name: hf_logits(hf_dirs[name], tokens()) for name in MODELS}


@pytest.fixture(scope="module")
def converted(hf_dirs, root):
    (out,) = run_distributed(convert_job, 1, args=(hf_dirs, str(root)))
    return out


@pytest.fixture(scope="module")
def tp2_ep2(converted, hf_dirs, root):  # expert TP = TP = 2, four ranks
    return run_distributed(parallel_job, 4, tp=2, ep=2, args=(hf_dirs, str(root), "tp2_ep2"))


@pytest.fixture(scope="module")
def pp2_ep2(converted, hf_dirs, root):
    return run_distributed(parallel_job, 4, pp=2, ep=2, args=(hf_dirs, str(root), "pp2_ep2"))


@pytest.fixture(scope="module")
def exported_from_pp2_ep2(pp2_ep2, hf_dirs, root):
    (out,) = run_distributed(export_job, 1, args=(hf_dirs, str(root), "pp2_ep2"))
    return out


@pytest.fixture(scope="module")
def exported_from_tp2_ep2(tp2_ep2, hf_dirs, root):
    (out,) = run_distributed(export_job, 1, args=(hf_dirs, str(root), "tp2_ep2", False))
    return out


def _max_diff(a, b):
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def _assert_same_tensors(got: dict, want: dict):
    assert list(got) and set(got) == set(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n


# --- one process ----------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_succeeds_both_ways(converted):
    assert converted["rc"] and all(rc == 0 for rc in converted["rc"].values()), converted["rc"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_to_mcore_to_hf_is_bit_identical(converted, hf_dirs, root, name):
    # A fused folder comes back as save_pretrained writes the same model: one tensor per expert.
    ref = Path(reference_dir(hf_dirs, name))
    _assert_same_tensors(hf_state_dict(root / "hf" / name), hf_state_dict(str(ref)))
    out = root / "hf" / name
    assert json.loads((out / "config.json").read_text()) == json.loads((ref / "config.json").read_text())
    assert (out / "tokenizer_config.json").read_text() == (ref / "tokenizer_config.json").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_transformers_at_tp1(converted, ref_logits, name):
    assert _max_diff(converted["logits"][name], ref_logits[name]) <= ATOL


@pytest.mark.slow
def test_checkpoint_keys_are_the_table_keys(converted):
    assert converted["key_mismatches"] == {name: [] for name in MODELS}


# --- TP=2 x EP=2 (expert TP 2) and PP=2 x EP=2 -----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_at_tp2_ep2(tp2_ep2, ref_logits, name):
    # TP is the inner dimension: ranks 0, 1 are EP rank 0's TP pair, ranks 2, 3 EP rank 1's
    assert [(r["tp_rank"], r["ep_rank"]) for r in tp2_ep2] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert all(r["local_experts"][name] == 2 for r in tp2_ep2)
    for rank in tp2_ep2:
        if rank["tp_rank"]:
            assert rank[name]["logits_mcore"] is None  # gathered on TP rank 0 only
            continue
        assert _max_diff(rank[name]["logits_mcore"], ref_logits[name]) <= ATOL
        assert _max_diff(rank[name]["logits_hf"], ref_logits[name]) <= ATOL


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_at_pp2_ep2(pp2_ep2, ref_logits, name):
    # Ranks 0, 1: the first stage (EP ranks 0 and 1); ranks 2, 3: the last stage.
    assert [r["ep_rank"] for r in pp2_ep2] == [0, 1, 0, 1]
    first_stage = None if name == "qwen3_moe_mixed" else 2  # its first layer's MLP is dense
    assert [r["local_experts"][name] for r in pp2_ep2] == [first_stage] * 2 + [2] * 2
    assert pp2_ep2[0][name]["logits_mcore"] is None and pp2_ep2[1][name]["logits_hf"] is None
    for rank in pp2_ep2[2:]:  # each EP rank ran the same tokens through both halves of the experts
        assert _max_diff(rank[name]["logits_mcore"], ref_logits[name]) <= ATOL
        assert _max_diff(rank[name]["logits_hf"], ref_logits[name]) <= ATOL


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2_ep2", "pp2_ep2"])
def test_export_stream_holds_every_expert_on_every_rank(request, hf_dirs, layout):
    ranks = request.getfixturevalue(layout)
    for name in MODELS:
        want = hf_state_dict(reference_dir(hf_dirs, name))
        for rank in ranks:
            _assert_same_tensors(rank[name]["export"], want)
            assert 1 < rank[name]["buckets"] < len(want)  # bounded, yet grouped
        if layout == "pp2_ep2":  # each stage owns its layers' experts, both EP ranks all of them
            first, last = (set(ranks[r][name]["owned"]) for r in (0, 2))
            assert first | last == set(want) and not first & last
            assert set(ranks[1][name]["owned"]) == first and set(ranks[3][name]["owned"]) == last
            assert {n for n in want if ".experts." in n and n.startswith("model.layers.0.")} <= first


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2_ep2", "pp2_ep2"])
@pytest.mark.parametrize("name", list(MODELS))
def test_saved_at_ep2_exports_bit_identical(request, hf_dirs, root, name, layout):
    """HF -> Megatron at TP=2 x EP=2 or PP=2 x EP=2 (each rank loading its slices) -> saved ->
    exported at TP = EP = 1: the HF folder bit for bit."""
    assert request.getfixturevalue(f"exported_from_{layout}")[name] == 0
    out = root / f"{layout}_hf" / name
    _assert_same_tensors(hf_state_dict(out), hf_state_dict(reference_dir(hf_dirs, name)))
    # No template: config.json from the one the conversion stored.
    ref = json.loads((Path(reference_dir(hf_dirs, name)) / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == ref


@pytest.mark.slow
def test_moe_checkpoint_with_te_norm_key_exports(exported_from_pp2_ep2, hf_dirs, root):
    # Transformer Engine's spec stores a MoE layer's pre-MLP norm as pre_mlp_layernorm.weight,
    # the local spec (the converter's) as mlp.linear_fc1.layer_norm_weight: both load.
    assert exported_from_pp2_ep2["te_stored_norm_keys"] == ["decoder.layers.pre_mlp_layernorm.weight"]
    assert exported_from_pp2_ep2["te_keys"] == 0
    _assert_same_tensors(hf_state_dict(root / "te_keys_hf"), hf_state_dict(hf_dirs["qwen3_moe"]))


@pytest.mark.slow
def test_verify_cli_at_ep2(converted, hf_dirs, root, capsys):
    from emapg_megatron.checkpoint import cli

    name = "mixtral"
    rc = cli.main(["verify", "--hf-dir", hf_dirs[name], "--load", str(root / "mcore" / name),
                   "--ep", "2", "--seq-len", "16"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and (report["tp"], report["pp"], report["ep"], report["tokens"]) == (1, 1, 2, 32)
    assert report["max_abs_logit_diff"] <= ATOL and report["top1_agreement"] == 1.0


# --- config.json translation and refusals (no Megatron runtime) ------------------------------

_MOE = dict(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2, num_attention_heads=4,
            num_query_groups=2, max_position_embeddings=64, num_experts=8, moe_router_topk=2)


@pytest.mark.parametrize("arch,extra", [
    ("Qwen3MoeForCausalLM", dict(qk_layernorm=True, moe_ffn_hidden_size=48, moe_norm_topk_prob=False)),
    ("Qwen3MoeForCausalLM", dict(qk_layernorm=True, kv_channels=16, tie_word_embeddings=True)),
    ("MixtralForCausalLM", dict(rotary_base=1e6)),
    ("Qwen3MoeForCausalLM", dict(qk_layernorm=True, num_layers=4, dense_mlp_layers=[0, 2])),
])
def test_model_config_round_trips_through_hf_config(arch, extra):
    cfg = ModelConfig(**{**_MOE, **extra})
    assert architecture_for(cfg) == arch
    back, back_arch = model_config_from_hf(hf_config_from_model(cfg, arch))
    # The experts' width comes back spelled out (Mixtral's: intermediate_size).
    assert back.moe_ffn_hidden_size == (cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size)
    assert back_arch == arch and replace(back, moe_ffn_hidden_size=cfg.moe_ffn_hidden_size) == cfg


def test_dense_layers_read_as_transformers_builds_them_and_kept_as_the_config_names_them():
    """Qwen3MoeDecoderLayer: layer i is a MoE layer unless it is in mlp_only_layers or (i + 1) is
    no multiple of decoder_sparse_step; an export keeps the base's spelling when it says the same."""
    cfg = ModelConfig(**{**_MOE, "num_layers": 6}, qk_layernorm=True)
    base = hf_config_from_model(cfg, "Qwen3MoeForCausalLM")
    for change, dense in [(dict(decoder_sparse_step=2), [0, 2, 4]), (dict(mlp_only_layers=[1, 5]), [1, 5]),
                          (dict(decoder_sparse_step=3, mlp_only_layers=[5]), [0, 1, 3, 4, 5])]:
        hf = {**base, **change}
        read, _ = model_config_from_hf(hf)
        assert read.dense_mlp_layers == dense and read.moe_layers == [i for i in range(6) if i not in dense]
        assert hf_config_from_model(read, "Qwen3MoeForCausalLM", base=hf) == hf
        spelled_out = hf_config_from_model(read, "Qwen3MoeForCausalLM", base=base)
        assert (spelled_out["decoder_sparse_step"], spelled_out["mlp_only_layers"]) == (1, dense)
    # Mixtral has no dense layers: a model with some is no Mixtral
    assert architecture_for(ModelConfig(**_MOE, dense_mlp_layers=[0])) is None


@pytest.mark.parametrize("layers, message", [
    ([1, 0], "distinct ascending indices of the 2 layers (got [1, 0])"),
    ([2], "distinct ascending indices of the 2 layers (got [2])"),
    ([0, 1], "every layer's MLP is dense"),
    ("0", "dense_mlp_layers must be a list of layer indices"),
])
def test_a_stored_model_config_with_bad_dense_layers_is_one_line(layers, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_dict({**_MOE, "dense_mlp_layers": layers}, "stored config")
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        ModelConfig.from_dict({**_MOE, "num_experts": None, "dense_mlp_layers": [0]}, "stored config")


def test_released_qwen3_moe_config_is_read():
    # The shape of Qwen3-30B-A3B's config.json (pre-v5 spelling: num_experts, rope_theta).
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
          "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
          "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
          "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
          "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
          "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
          "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
          "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
          "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
          "use_sliding_window": False, "vocab_size": 151936}
    cfg, arch = model_config_from_hf(hf)
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_norm_topk_prob,
            cfg.kv_channels, cfg.qk_layernorm) == (128, 8, 768, True, 128, True)
    assert hf_config_from_model(cfg, arch, base=hf, dtype="bf16") == hf  # nothing added, nothing lost
    last = {e.hf[0] for e in HFMapping(cfg).entries if e.expert == 127 and "layers.47." in e.megatron}
    assert last == {f"model.layers.47.mlp.experts.127.{p}_proj.weight" for p in ("gate", "down")}


def test_flag_built_moe_models_get_the_architecture_that_computes_them():
    assert architecture_for(ModelConfig(**_MOE, moe_ffn_hidden_size=48)) is None  # Mixtral's are FFN wide
    assert architecture_for(ModelConfig(**_MOE, moe_norm_topk_prob=False)) is None  # Mixtral renormalises
    assert architecture_for(ModelConfig(**_MOE, add_qkv_bias=True)) is None
    assert architecture_for(ModelConfig(**{**_MOE, "num_experts": None})) == "LlamaForCausalLM"
    # A MoE model no HF architecture computes still maps (Qwen3-MoE's names): the weight sync.
    mapping = HFMapping(ModelConfig(**_MOE, add_qkv_bias=True))
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in mapping.expected_hf_shapes()


def test_template_with_other_experts_is_rejected():
    cfg = ModelConfig(**_MOE, qk_layernorm=True)
    other = hf_config_from_model(ModelConfig(**{**_MOE, "num_experts": 16}, qk_layernorm=True),
                                 "Qwen3MoeForCausalLM")
    with pytest.raises(ConfigError, match="num_experts: template 16 != checkpoint 8"):
        check_same_architecture(other, cfg)


def _qwen3_moe_config(**change) -> dict:
    cfg = ModelConfig(**_MOE, qk_layernorm=True, moe_ffn_hidden_size=48)
    return {**hf_config_from_model(cfg, "Qwen3MoeForCausalLM"), **change}


def _mixtral_config(**change) -> dict:
    return {**hf_config_from_model(ModelConfig(**_MOE), "MixtralForCausalLM"), **change}


@pytest.mark.parametrize("hf,message", [
    (_qwen3_moe_config(num_experts_per_tok=9), "num_experts_per_tok 9 exceeds the 8 experts"),
    (_mixtral_config(num_experts_per_tok=9), "num_experts_per_tok 9 exceeds the 8 experts"),
    (_qwen3_moe_config(num_experts=10**9), "num_experts must be an integer from 1 to 4096 (got 1000000000)"),
    (_qwen3_moe_config(num_experts="8"), "num_experts must be an integer from 1 to 4096 (got '8')"),
    (_mixtral_config(num_local_experts=10**9), "num_local_experts must be an integer from 1 to 4096"),
    (_qwen3_moe_config(num_experts_per_tok=0), "num_experts_per_tok must be an integer from 1 to 4096"),
    (_qwen3_moe_config(moe_intermediate_size=1 << 40), "moe_intermediate_size must be an integer from 1"),
    (_qwen3_moe_config(decoder_sparse_step=0), "decoder_sparse_step must be an integer from 1 to the 2 layers"),
    (_qwen3_moe_config(decoder_sparse_step=10**9), "decoder_sparse_step must be an integer from 1 to the 2"),
    (_qwen3_moe_config(mlp_only_layers=[0, 2]), "mlp_only_layers must hold indices of the 2 layers (got [0, 2])"),
    (_qwen3_moe_config(mlp_only_layers=[0, 1]), "no MoE layer (decoder_sparse_step 1, mlp_only_layers [0, 1])"),
    (_qwen3_moe_config(mlp_only_layers="0"), "mlp_only_layers must be a list"),
    (_qwen3_moe_config(shared_expert_intermediate_size=128), "shared_expert_intermediate_size=128"),
    (_qwen3_moe_config(norm_topk_prob="yes"), "norm_topk_prob must be a bool"),
    (_qwen3_moe_config(num_experts=8, num_local_experts=16), "num_experts 8 != num_local_experts 16"),
    ({k: v for k, v in _qwen3_moe_config().items() if k != "moe_intermediate_size"},
     "no moe_intermediate_size"),
    ({k: v for k, v in _mixtral_config().items() if k != "num_local_experts"}, "no num_local_experts"),
    (_mixtral_config(sliding_window=4096), "sliding_window=4096 (only null)"),
    (_mixtral_config(router_jitter_noise=-1), "router_jitter_noise must be a number >= 0"),
])
def test_bad_moe_configs_fail_in_one_line_before_anything_is_sized(tmp_path, hf, message):
    # config.json alone: a check that came after the weights were looked at would say so instead.
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError) as e:
        hf_to_mcore(src, tmp_path / "out")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_mixtral_router_jitter_is_accepted_and_ignored():
    cfg, arch = model_config_from_hf(_mixtral_config(router_jitter_noise=0.01))
    assert arch == "MixtralForCausalLM" and cfg.moe_norm_topk_prob


def test_fused_experts_of_the_wrong_shape_are_refused_in_one_line():
    cfg = ModelConfig(**_MOE, qk_layernorm=True, moe_ffn_hidden_size=48)
    mapping = HFMapping(cfg)
    sd = {n: torch.zeros(s) for n, s in mapping.expected_hf_shapes().items() if ".experts." not in n}
    for i in range(2):
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.zeros(8, 96, 32)
        sd[f"model.layers.{i}.mlp.experts.down_proj"] = torch.zeros(8, 32, 96)  # [E, H, F]: F is 48
    with pytest.raises(ConfigError) as e:
        mapping.source(dict_reader(sd), {n: tuple(t.shape) for n, t in sd.items()})
    assert "model.layers.0.mlp.experts.down_proj: (8, 32, 96) != (8, 32, 48)" in str(e.value)
    assert "\n" not in str(e.value)
