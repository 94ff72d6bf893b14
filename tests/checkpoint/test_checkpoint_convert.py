"""HF <-> Megatron-Core conversion on tiny random Llama / Qwen2 / Qwen3 models, at TP=2 and PP=2.

Reference: ``transformers`` in fp32 in this process. Megatron runs on spawned gloo ranks.
"""

import json
from pathlib import Path

import pytest
import torch
from checkpoint_workers import (
    FP32_MODELS,
    MODELS,
    convert_job,
    hf_state_dict,
    parallel_job,
    save_hf_models,
    tokens,
)

from emapg_megatron.checkpoint import HFMapping, checkpoint_model_config
from emapg_megatron.checkpoint.hf_io import INDEX
from emapg_megatron.checkpoint.verify import hf_logits
from emapg_megatron.multiprocess import run_distributed

pytestmark = pytest.mark.slow

BUCKET = 64 * 1024  # >= the largest gathered tiny param (padded embedding, fc1), < the model
ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return save_hf_models(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def ref_logits(hf_dirs):
    return {name: hf_logits(hf_dirs[name], tokens()) for name in FP32_MODELS}


@pytest.fixture(scope="module")
def converted(hf_dirs, root):
    (out,) = run_distributed(convert_job, 1, args=(hf_dirs, str(root)))
    return out


@pytest.fixture(scope="module")
def tp2(converted, hf_dirs, root):
    return run_distributed(parallel_job, 2, tp=2, args=(hf_dirs, str(root), BUCKET))


@pytest.fixture(scope="module")
def pp2(tp2, hf_dirs, root):  # loads the TP=2 save
    return run_distributed(parallel_job, 2, pp=2, args=(hf_dirs, str(root), BUCKET))


def _max_diff(a, b):
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def test_cli_succeeds_both_ways(converted):
    assert converted["rc"] and all(rc == 0 for rc in converted["rc"].values()), converted["rc"]


@pytest.mark.parametrize("name", FP32_MODELS)
def test_hf_to_mcore_logits_tp1(converted, ref_logits, name):
    assert _max_diff(converted["logits"][name], ref_logits[name]) <= ATOL


@pytest.mark.parametrize("name", FP32_MODELS)
def test_logits_tp2(tp2, ref_logits, name):
    first, second = (r[name] for r in tp2)
    assert second["logits_mcore"] is None  # gathered on TP rank 0 only
    assert _max_diff(first["logits_mcore"], ref_logits[name]) <= ATOL
    # --load-hf path: each TP rank read its own slices straight from safetensors.
    assert _max_diff(first["logits_hf"], ref_logits[name]) <= ATOL


@pytest.mark.parametrize("name", FP32_MODELS)
def test_logits_pp2(pp2, ref_logits, name):
    first, last = (r[name] for r in pp2)
    assert first["logits_mcore"] is None
    assert _max_diff(last["logits_mcore"], ref_logits[name]) <= ATOL
    assert _max_diff(last["logits_hf"], ref_logits[name]) <= ATOL


@pytest.mark.parametrize("name", FP32_MODELS)
def test_saved_at_tp2_loads_at_tp1_with_identical_logits(tp2, pp2, name):
    last = pp2[1][name]
    # Same weights, same (TP=1) layout: bit-identical to the model loaded from the conversion.
    assert torch.equal(last["logits_tp2_saved"], last["logits_mcore"])


@pytest.mark.parametrize("name", list(MODELS))
def test_mcore_to_hf_is_bit_identical(converted, hf_dirs, root, name):
    original, exported = hf_state_dict(hf_dirs[name]), hf_state_dict(root / "hf" / name)
    assert list(exported) and set(exported) == set(original)
    for n, t in original.items():
        assert exported[n].dtype == t.dtype and torch.equal(exported[n], t), n
    src, out = Path(hf_dirs[name]), root / "hf" / name
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    for f in ("tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_text() == (src / f).read_text()


def test_mcore_to_hf_without_template_restores_the_original_config(converted, hf_dirs, root):
    name = "qwen3_qknorm_untied"
    out, src = root / "hf_no_template" / name, Path(hf_dirs[name])
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert not (out / "tokenizer_config.json").exists()
    exported, original = hf_state_dict(out), hf_state_dict(src)
    assert set(exported) == set(original) and all(torch.equal(exported[n], t) for n, t in original.items())


def test_mcore_to_hf_shards_load_in_transformers(converted, root, ref_logits):
    out = root / "hf" / "llama_gqa_untied"
    index = json.loads((out / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert torch.equal(hf_logits(out, tokens()), ref_logits["llama_gqa_untied"])


def _assert_stream_equals_hf(stream, hf):
    assert set(stream) == set(hf)
    for n, t in hf.items():
        assert stream[n].dtype == t.dtype and stream[n].shape == t.shape, n
        assert torch.equal(stream[n], t), n


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_export_stream_equals_hf_state_dict(request, hf_dirs, layout):
    ranks = request.getfixturevalue(layout)
    for name in [*FP32_MODELS, "qwen2_bias_tied_bf16"]:
        hf = hf_state_dict(hf_dirs[name])
        assert ("lm_head.weight" in hf) == ("untied" in name)
        for rank in ranks:  # every rank streams every tensor
            _assert_stream_equals_hf(rank[name]["export"], hf)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_export_can_cast_for_the_rollout_engine(request, hf_dirs, layout):
    for rank in request.getfixturevalue(layout):
        for name in FP32_MODELS:
            hf = {n: t.to(torch.bfloat16) for n, t in hf_state_dict(hf_dirs[name]).items()}
            _assert_stream_equals_hf(rank[name]["export_as_bf16"], hf)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_export_buckets_respect_the_bound(request, hf_dirs, layout):
    for rank in request.getfixturevalue(layout):
        for name in FP32_MODELS:
            res = rank[name]
            sizes = [sum(res["export"][n].numel() * 4 for n in b) for b in res["buckets"]]
            assert max(sizes) <= BUCKET
            assert 1 < len(sizes) < len(res["export"])  # bounded, yet grouped


def test_export_with_tiny_buckets_sends_one_param_at_a_time(tp2, root):
    for name in FP32_MODELS:
        mapping = HFMapping(checkpoint_model_config(root / "mcore" / name))
        per_param = [list(e.hf) for e in mapping.entries if e.export]
        for rank in tp2:
            assert rank[name]["one_param_buckets"] == per_param


def test_export_owned_only_splits_by_stage(tp2, pp2):
    for name in FP32_MODELS:
        everything = set(tp2[0][name]["export"])
        assert set(tp2[0][name]["owned"]) == set(tp2[1][name]["owned"]) == everything
        first, last = (set(r[name]["owned"]) for r in pp2)
        assert first | last == everything and not first & last
        assert "model.embed_tokens.weight" in first and "model.norm.weight" in last


def test_local_spec_checkpoint_keys_are_the_table_names(converted):
    assert converted["key_mismatches"] == []


def test_failed_export_leaves_nothing_behind(converted):
    assert converted["broken_raised"]
    assert converted["broken_left"] == []


def test_verify_cli_prints_logit_agreement(converted, hf_dirs, root, capsys):
    from emapg_megatron.checkpoint import cli

    name = "qwen3_qknorm_untied"
    rc = cli.main(["verify", "--hf-dir", hf_dirs[name], "--load", str(root / "mcore" / name),
                   "--tp", "2", "--pp", "1", "--seq-len", "16"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and (report["tp"], report["pp"], report["tokens"]) == (2, 1, 32)
    assert report["max_abs_logit_diff"] <= ATOL and report["cosine_similarity"] > 0.99999
    assert report["top1_agreement"] == 1.0
