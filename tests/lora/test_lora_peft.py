"""LoRA adapters in peft's format (issue 42, item 4): exported from the Megatron model, loaded by
``peft.PeftModel.from_pretrained`` on the HF base model with the Megatron model's logits (fp32),
read back bit for bit, gathered from TP = 2 shards like the one-rank matrices; each bad adapter
folder is one line."""

import json

import pytest
import torch
from peft_workers import build_hf, export_job

from emapg_megatron.errors import ConfigError
from emapg_megatron.multiprocess import run_distributed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    hf = build_hf(str(root / "hf"))
    (one,) = run_distributed(export_job, 1, args=(hf, str(root / "adapter")), timeout=240)
    tp2 = run_distributed(export_job, 2, tp=2, args=(hf, None, one["adapters"]), timeout=240)
    return {"root": root, "hf": hf, "one": one, "tp2": tp2}


def test_peft_loads_the_export_with_the_megatron_logits(exported):
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(exported["hf"], dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(exported["root"] / "adapter")).eval()
    with torch.no_grad():
        logits = model(exported["one"]["tokens"]).logits
        with model.disable_adapter():
            without = model(exported["one"]["tokens"]).logits
    torch.testing.assert_close(logits, exported["one"]["logits"], rtol=1e-4, atol=1e-4)
    assert (logits - without).abs().max() > 1e-2  # the adapters change the logits
    config = json.loads((exported["root"] / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                        "v_proj"]


def test_the_export_reads_back_bit_for_bit_and_tp2_gathers_the_one_rank_matrices(exported):
    from emapg_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from emapg_megatron.checkpoint.peft_format import load_peft

    one = exported["one"]
    cfg, _ = model_config_from_hf(read_hf_config(exported["hf"]))
    lora, back = load_peft(exported["root"] / "adapter", cfg, one["shapes"])
    assert (lora.rank, lora.alpha) == (4, 8.0)
    assert sorted(back) == sorted(one["adapters"])
    assert all(torch.equal(back[k], one["adapters"][k]) for k in back)
    assert one["gathered_equal"] and all(r["gathered_equal"] for r in exported["tp2"])


def _copy(exported, tmp_path, change_config=None, change_state=None):
    from safetensors.torch import load_file, save_file

    src, dst = exported["root"] / "adapter", tmp_path / "adapter"
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    state = load_file(str(src / "adapter_model.safetensors"))
    if change_config:
        change_config(config)
    if change_state:
        change_state(state)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    save_file(state, str(dst / "adapter_model.safetensors"))
    return dst


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
V_B = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"


@pytest.mark.parametrize("config, state, message", [
    (None, lambda s: s.__setitem__(Q_A, s[Q_A] + 1),
     "q_proj, k_proj, v_proj have 2 distinct lora_A, 8 rows stacked: decoder.layers.0.self_attention.linear_qkv.lora "
     "needs --lora-rank 8 at least (this run has 4)"),
    (None, lambda s: s.__setitem__(V_B, s[V_B][:, :2].contiguous()), V_B + ": shape (32, 2), not (32, 4)"),
    (None, lambda s: s.__setitem__(V_B, torch.zeros(32, 5)), "adapter shapes do not fit this model's"),
    (None, lambda s: s.pop(V_B), "the peft adapter has no " + V_B),
    (None, lambda s: s.__setitem__("base_model.model.lm_head.lora_A.weight", torch.zeros(4, 64)),
     "holds tensors this model does not adapt"),
    (lambda c: c.__setitem__("peft_type", "IA3"), None, "peft_type 'IA3', not LORA"),
    (lambda c: c.__setitem__("use_rslora", True), None, "use_rslora=True is not supported"),
    (lambda c: c.__setitem__("r", 0), None, "an integer rank >= 1"),
])
def test_a_bad_adapter_folder_is_one_line(exported, tmp_path, config, state, message):
    from emapg_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from emapg_megatron.checkpoint.peft_format import load_peft

    cfg, _ = model_config_from_hf(read_hf_config(exported["hf"]))
    folder = _copy(exported, tmp_path, config, state)
    with pytest.raises(ConfigError) as e:
        load_peft(folder, cfg, exported["one"]["shapes"])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_pickled_weights_are_never_read(exported, tmp_path):
    from emapg_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from emapg_megatron.checkpoint.peft_format import load_peft

    cfg, _ = model_config_from_hf(read_hf_config(exported["hf"]))
    folder = _copy(exported, tmp_path)
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.bin").write_bytes(b"not to be unpickled")
    with pytest.raises(ConfigError, match="no adapter_model.safetensors .* a .bin is never unpickled"):
        load_peft(folder, cfg, exported["one"]["shapes"])


@pytest.mark.parametrize("targets, megatron_targets, rank_each, needed", [
    (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
     ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], 2, 6),
    (["q_proj", "v_proj"], ["linear_qkv"], 2, 4),  # peft's default for Llama-like models
])
def test_an_adapter_peft_made_loads_exactly(exported, tmp_path, targets, megatron_targets, rank_each, needed):
    """peft's own adapters give each projection its own A: stacked, they load as a shared-A adapter
    of the stacked rank (alpha scaled alike) with exactly peft's logits, at one rank and at TP = 2;
    rows past the peft's are the run's initial A with B zero; a projection left out (k_proj) gets
    zero rows of B."""
    import peft
    import transformers
    from lora_workers import SEED
    from peft_workers import import_job, make_peft_adapter

    from emapg_megatron.checkpoint.peft_format import rank_needed
    from emapg_megatron.lora.apply import initial_A

    hf = exported["hf"]
    folder = make_peft_adapter(hf, str(tmp_path / "peft"), rank_each, 2.0 * rank_each, targets)
    assert rank_needed(folder) == needed
    rank = needed + 1  # one row more than needed: the run's own
    args = (hf, folder, rank, 2.0 * rank, megatron_targets)
    (one,) = run_distributed(import_job, 1, args=args, timeout=240)
    tp2 = run_distributed(import_job, 2, tp=2, args=args, timeout=240)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, folder).eval()
    with torch.no_grad():
        expected = model(exported["one"]["tokens"]).logits
        with model.disable_adapter():
            without = model(exported["one"]["tokens"]).logits
    assert (expected - without).abs().max() > 1e-2  # the adapter does change the model
    torch.testing.assert_close(one["logits"], expected, rtol=1e-4, atol=1e-4)
    for r in tp2:
        assert sorted(r["adapters"]) == sorted(one["adapters"])
        assert all(torch.equal(r["adapters"][k], v) for k, v in one["adapters"].items())
    qkv = "decoder.layers.0.self_attention.linear_qkv.lora"
    A, B = one["adapters"][f"{qkv}.A"], one["adapters"][f"{qkv}.B"]
    assert torch.equal(A[needed:], initial_A(SEED, f"{qkv}.A", rank, A.shape[1])[needed:])
    assert not B[:, needed:].any()
    if "k_proj" not in targets:  # per query group [q heads, k, v]: the k rows (16 per group) are zero
        groups = B.reshape(2, -1, rank)  # 2 query groups
        assert not groups[:, 32:48].any() and groups[:, :32].any() and groups[:, 48:].any()


def test_a_projection_left_out_loads_as_zero_rows_of_b_with_the_shared_a(exported, tmp_path):
    """Our export without layer 0's k_proj: q and v still share one A (rank 4, not stacked), and
    the k rows of linear_qkv's B are zero."""
    from emapg_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from emapg_megatron.checkpoint.peft_format import load_peft, rank_needed

    k = "base_model.model.model.layers.0.self_attn.k_proj.lora_{}.weight"
    folder = _copy(exported, tmp_path, change_state=lambda s: [s.pop(k.format(m)) for m in "AB"])
    assert rank_needed(folder) == 4
    cfg, _ = model_config_from_hf(read_hf_config(exported["hf"]))
    _, back = load_peft(folder, cfg, exported["one"]["shapes"])
    qkv, one = "decoder.layers.0.self_attention.linear_qkv.lora", exported["one"]["adapters"]
    assert torch.equal(back[f"{qkv}.A"], one[f"{qkv}.A"])
    groups, full = back[f"{qkv}.B"].reshape(2, 64, 4), one[f"{qkv}.B"].reshape(2, 64, 4)  # [q 32, k 16, v 16]
    assert not groups[:, 32:48].any()
    assert torch.equal(groups[:, :32], full[:, :32]) and torch.equal(groups[:, 48:], full[:, 48:])
