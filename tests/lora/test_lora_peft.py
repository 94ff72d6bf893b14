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
    (None, lambda s: s.__setitem__(Q_A, s[Q_A] + 1), "gives q_proj, k_proj, v_proj their own lora_A"),
    (None, lambda s: s.__setitem__(V_B, s[V_B][:, :2].contiguous()), "adapter shapes differ from this model's"),
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
