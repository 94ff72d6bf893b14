"""LoRA in the trainer (--lora-rank, docs/lora.md): the adapters are the only trainable parameters
(DDP's gradient buffers, the optimizer's main params and the EMA hold them alone), the base weights
do not move, the anchor averages the adapters (at --ema-eta 1 it is the base model, with no copy),
B = 0 makes the first step's policy the base model exactly, TP = 2 with sequence parallelism,
DP = 2 with the distributed optimizer (and the EMA sharded over DP) and PP = 2 train like one rank on the tiny Qwen2.5 (tied,
GQA with QKV bias) and Qwen3 (qk-layernorm) models, and each unsupported combination is refused
in one line before any process group."""

import contextlib
import hashlib
import io
import json
import math
import os
import shutil
import sys

import pytest
import safetensors.torch
import torch
from lora_train_workers import (
    build_only,
    continue_from_peft,
    export_merged,
    export_peft,
    lora_resume,
    lora_save_and_continue,
    lora_state,
    lora_states,
    pretrained_start,
)
from test_equivalence_matrix import BASE
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from trainer_launch import COMPARED

from emapg_megatron import train
from emapg_megatron.checkpoint.convert import (
    MODEL_KEY_PREFIXES,
    checkpoint_model_config,
    training_step_dir,
)
from emapg_megatron.checkpoint.safe_load import verify_checkpoint_metadata
from emapg_megatron.checkpoint.training import saved_lora_base
from emapg_megatron.errors import ConfigError
from emapg_megatron.lora.adapters import Sharding
from emapg_megatron.lora.config import is_adapter_name
from emapg_megatron.models.config import ModelConfig
from emapg_megatron.multiprocess import run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "tools"))
import lora_memory  # noqa: E402
import memory_plan  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 3
# one optimizer update per trainer step (the whole rollout is one mini-batch): the first step's
# passes all run on the starting policy, so its KL to the anchor is exactly 0
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--global-batch-size", "16"]
LAYOUTS = {  # arch, nproc, TP, PP, flags
    "qwen2-tp2-sp": ("qwen2-tied-gqa-bias", 2, 2, 1, ["--sequence-parallel"]),
    "qwen3-dp2-distopt": ("qwen3-tied-qknorm", 2, 1, 1, ["--use-distributed-optimizer", "--ema-shard-over-dp"]),
    "qwen3-pp2": ("qwen3-tied-qknorm", 2, 1, 2, []),
}


def argv(hf_dir: str, *extra) -> list:
    return [*BASE, "--load-hf", hf_dir, *LORA, *extra]


@pytest.fixture(scope="module")
def one_rank(hf_models):
    """Each architecture's one-rank LoRA run, with what its DDP, optimizer and anchor hold."""
    archs = sorted({arch for arch, *_ in LAYOUTS.values()})
    return {a: run_distributed(lora_state, 1, args=(argv(hf_models[a]), STEPS), timeout=300)[0] for a in archs}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_one_rank(layout, hf_models, one_rank, trainer_steps):
    arch, nproc, tp, pp, flags = LAYOUTS[layout]
    outs = trainer_steps(nproc, [*argv(hf_models[arch]), "--tensor-model-parallel-size", str(tp),
                                 "--pipeline-model-parallel-size", str(pp), *flags], STEPS, tp=tp, pp=pp)
    ref = one_rank[arch]["metrics"]
    for rank, out in enumerate(outs):
        for step, (m, r) in enumerate(zip(out["metrics"], ref), start=1):
            assert m["reward_mean"] == r["reward_mean"], (rank, step)  # identical samples
            for k in COMPARED:
                assert m[k] == pytest.approx(r[k], rel=1e-4, abs=1e-7), (k, rank, step)
        assert out["metrics"][0]["kl"] == 0.0  # B = 0: the policy is the anchor at the first step
    assert ref[-1]["ema_lag"] > 0 and ref[-1]["kl"] != 0  # the adapters really moved
    holders = {}
    for rank, out in enumerate(outs):
        for key, p in out["params"].items():
            holders.setdefault(key, []).append((rank, p))
    for key, copies in holders.items():  # replicated adapters (and base weights) equal on every rank
        for rank, p in copies[1:]:
            assert (p == copies[0][1]).all(), f"{key}: rank {rank} differs from rank {copies[0][0]}"
    adapters = {k for k in holders if ".lora." in k}
    assert adapters and all(k.split("|")[0].rsplit(".", 1)[-1] in ("A", "B") for k in adapters)


@pytest.mark.parametrize("arch", ["qwen2-tied-gqa-bias", "qwen3-tied-qknorm"])
def test_only_adapters_train_and_the_base_does_not_move(arch, one_rank):
    out = one_rank[arch]
    adapters, numel = out["adapter_names"], out["adapter_numel"]
    assert out["trainable"] == adapters and len(adapters) == 2 * 4 * 2  # A, B x 4 linears x 2 layers
    # DDP: gradient buffers for the adapters only; the base has no main_grad; the optimizer's
    # main params (fp32 here: the params themselves) are the adapters' elements only
    assert out["ddp_params_are_adapters"] and out["grad_buffer_numel"] == numel
    assert not out["base_has_main_grad"] and out["optimizer_main_numel"] == numel
    assert numel < out["base_numel"] / 5
    assert out["base_unchanged"] and out["base_after_equal_base"]
    assert out["moved"] == adapters and out["policy_moved_from_base"]


def test_the_ema_holds_the_adapters_only(one_rank):
    out = one_rank["qwen2-tied-gqa-bias"]
    assert out["anchor"] == "EmaAnchor"
    assert out["ema_numel"] == out["adapter_numel"] and out["ema_names"] == out["adapter_names"]


def test_b_zero_starts_at_the_base_model(one_rank):
    for out in one_rank.values():
        assert out["start_equal_base"] and out["start_equal_anchor"]  # torch.equal of the logits
        assert out["metrics"][0]["kl"] == 0.0


def test_the_memory_arithmetic_is_what_a_lora_run_allocates(one_rank):
    """tools/memory_plan.py's LoRA bytes (fp32 model, one rank) against the tensors counted after
    three steps: weights (base + adapters), gradient buffers, extra main params (none: fp32), Adam's
    moments and the EMA, each of the adapters only."""
    for out in one_rank.values():
        cfg = ModelConfig.from_dict(out["model_cfg"])
        plan = memory_plan.memory(cfg, memory_plan.Layout(bf16=False), lora_rank=4)
        assert {k: plan[k] for k in out["counted"]} == out["counted"]
        assert plan["trainable_per_rank"] == out["adapter_numel"]
    rows = {r["model"]: r for r in json.loads(_stdout(lora_memory.main, []))}
    assert rows["qwen2.5-0.5b"]["adapter_params_per_rank"] == 7766016  # peft's 8.8 M less the shared A's
    for row in rows.values():
        assert row["lora"]["total_device"] < row["full"]["total_device"] / 5


def _stdout(fn, *args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(*args)
    return out.getvalue()


def _without_ema(flags: list) -> list:
    """``flags`` less the --ema-* ones and their values (a teacher replaces the EMA)."""
    out = []
    for i, a in enumerate(flags):
        if not a.startswith("--ema-") and not (i and flags[i - 1].startswith("--ema-")):
            out.append(a)
    return out


@pytest.fixture(scope="module")
def variants(hf_models):
    """Two-step one-rank LoRA runs of the Qwen2.5 model: at --ema-eta 1, in bf16, and distilling
    from a full teacher (the base model itself)."""
    flags = argv(hf_models["qwen2-tied-gqa-bias"])
    eta = flags.index("--ema-eta") + 1
    runs = {"eta1": [*flags[:eta], "1", *flags[eta + 1:]], "bf16": [*flags, "--bf16"],
            "teacher": [*_without_ema(flags), "--teacher-load-hf", hf_models["qwen2-tied-gqa-bias"]]}
    return dict(zip(runs, run_distributed(lora_states, 1, args=(list(runs.values()), 2), timeout=300)[0]))


def test_eta_one_anchor_is_the_base_model_without_a_copy(variants):
    out = variants["eta1"]
    assert out["anchor"] == "FrozenBaseAnchor" and out["ema_numel"] == 0 and out["counted"]["ema_device"] == 0
    assert out["start_equal_anchor"] and out["metrics"][0]["kl"] == 0.0
    assert out["metrics"][1]["kl"] != 0.0 and out["base_unchanged"]  # the anchor stays the base


def test_bf16_keeps_fp32_main_params_of_the_adapters_only(variants):
    out = variants["bf16"]
    plan = memory_plan.memory(ModelConfig.from_dict(out["model_cfg"]), memory_plan.Layout(), lora_rank=4)
    assert {k: plan[k] for k in out["counted"]} == out["counted"] and out["counted"]["main_params"] > 0
    assert out["base_unchanged"] and out["start_equal_base"]


def test_a_lora_student_distils_from_a_full_teacher(variants):
    out = variants["teacher"]
    assert out["anchor"] == "Teacher" and out["ema_numel"] == 0
    assert out["start_equal_anchor"] and out["metrics"][0]["kl"] == 0.0  # the teacher is the base here
    assert out["metrics"][1]["kl"] != 0.0 and out["base_unchanged"] and out["moved"] == out["adapter_names"]


TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


@pytest.fixture(scope="module")
def saved(hf_models, tmp_path_factory):
    """A TP = 2 (SP) LoRA run of the Qwen2.5 model saved after step 2 (the trainer's save), then
    on to step 3; its checkpoint folder."""
    ckpt = str(tmp_path_factory.mktemp("lora_ckpt") / "save")
    outs = run_distributed(lora_save_and_continue, 2, tp=2,
                           args=([*argv(hf_models["qwen2-tied-gqa-bias"]), *TP2_SP], ckpt, 2, 3), timeout=300)
    return ckpt, outs


def test_a_lora_checkpoint_resumes_bit_exactly(hf_models, saved):
    """Adapters (their TP shards, the gated fc1's B as [gate_r; up_r]), Adam and the EMA of the
    adapters come back: step 3 after a resume is step 3 of the uninterrupted run, bit for bit."""
    ckpt, before = saved
    after = run_distributed(lora_resume, 2, tp=2, args=([*argv(hf_models["qwen2-tied-gqa-bias"]), *TP2_SP], ckpt, 3),
                            timeout=300)
    for b, a in zip(before, after):
        assert [{k: m[k] for k in COMPARED} for m in a["metrics"]] == \
            [{k: m[k] for k in COMPARED} for m in b["metrics"]]
        assert a["params"].keys() == b["params"].keys() and a["ema"].keys() == b["ema"].keys()
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in b["params"])
        assert all(torch.equal(a["ema"][k], b["ema"][k]) for k in b["ema"]) and b["ema"]


def _sharding(name: str) -> Sharding:
    """How TP splits the adapter matrix ``name`` (docs/lora.md; the tiny models' MLP is gated)."""
    column, matrix = any(t in name for t in ("linear_qkv", "linear_fc1")), name.rsplit(".", 1)[-1]
    if matrix == "A":
        return Sharding(None if column else 1)
    return Sharding(0, 2 if "linear_fc1" in name else 1) if column else Sharding(None)


def test_a_lora_checkpoint_reshards_to_one_rank(saved, resumed_at_one_rank):
    """The TP = 2 checkpoint resumed at one rank: its adapters are the TP shards put together, and
    step 3 gives the uninterrupted TP = 2 run's metrics."""
    _, before = saved
    one = resumed_at_one_rank
    names = {k.split("|")[0] for k in before[0]["saved"] if ".lora." in k}
    assert names and {k.split("|")[0] for k in one["resumed"] if ".lora." in k} == names
    for name in names:
        sharding = _sharding(name)
        shards = [b["saved"][f"{name}|tp{r if sharding.dim is not None else '*'}"] for r, b in enumerate(before)]
        key = next(k for k in one["resumed"] if k.split("|")[0] == name)
        assert torch.equal(one["resumed"][key], sharding.full(shards)), name
    for k in COMPARED:
        assert one["metrics"][0][k] == pytest.approx(before[0]["metrics"][0][k], rel=1e-4, abs=1e-7), k


def test_a_pp2_lora_checkpoint_reshards_to_one_rank(hf_models, tmp_path):
    """PP = 2 (Qwen3, qk-layernorm): the adapters-only checkpoint of step 2 resumed at one rank
    holds both stages' adapters under their global names, bit for bit, and step 3 gives the
    uninterrupted PP = 2 run's metrics."""
    ckpt, flags = str(tmp_path / "save"), argv(hf_models["qwen3-tied-qknorm"])
    before = run_distributed(lora_save_and_continue, 2, pp=2, args=([*flags, "--pipeline-model-parallel-size", "2"],
                                                                    ckpt, 2, 3), timeout=300)
    (one,) = run_distributed(lora_resume, 1, args=(flags, ckpt, 3), timeout=300)
    stages = {k.split("|")[0]: v for b in before for k, v in b["saved"].items() if ".lora." in k}
    resumed = {k.split("|")[0]: v for k, v in one["resumed"].items() if ".lora." in k}
    assert stages and stages.keys() == resumed.keys()
    assert all(torch.equal(stages[k], resumed[k]) for k in stages)
    for k in COMPARED:  # every stage logs the step's metrics
        assert one["metrics"][0][k] == pytest.approx(before[0]["metrics"][0][k], rel=1e-4, abs=1e-7), k


def test_a_lora_checkpoint_holding_its_base_resumes_from_it(hf_models, tmp_path):
    """A LoRA checkpoint that holds its base weights (a random base's, or one saved before
    checkpoints held the adapters alone) resumed under --load with --load-hf: the base comes from
    the checkpoint, not from the folder (here a changed copy, never read), and step 3 is the
    uninterrupted run's, bit for bit."""
    hf = hf_models["qwen2-tied-gqa-bias"]
    ckpt, changed = str(tmp_path / "save"), _changed_copy(hf, tmp_path / "changed")
    (before,) = run_distributed(lora_save_and_continue, 1, args=(argv(hf), ckpt, 2, 3, False), timeout=300)
    (after,) = run_distributed(lora_resume, 1, args=([*argv(changed), "--load", ckpt], ckpt, 3), timeout=300)
    assert [{k: m[k] for k in COMPARED} for m in after["metrics"]] == \
        [{k: m[k] for k in COMPARED} for m in before["metrics"]]
    assert all(torch.equal(after["params"][k], before["params"][k]) for k in before["params"])


def test_a_lora_checkpoint_resumes_only_with_lora(hf_models, saved):
    ckpt, _ = saved
    full = [*BASE, "--load-hf", hf_models["qwen2-tied-gqa-bias"], "--global-batch-size", "16"]
    with pytest.raises(Exception) as e:
        run_distributed(lora_resume, 1, args=(full, ckpt, 3), timeout=300)
    assert ("the checkpoint was saved with LoRA adapters and this run is without them: resume with the "
            "--lora-* flags of the run that saved it") in str(e.value)


@pytest.fixture(scope="module")
def resumed_at_one_rank(hf_models, saved):
    ckpt, _ = saved
    return run_distributed(lora_resume, 1, args=(argv(hf_models["qwen2-tied-gqa-bias"]), ckpt, 3), timeout=300)[0]


def test_a_lora_checkpoint_exports_merged(saved, resumed_at_one_rank, tmp_path):
    """emapg-convert mcore-to-hf of a LoRA run's checkpoint merges the adapters: transformers
    computes the adapted model's logits from the exported folder."""
    ckpt, _ = saved
    hf = run_distributed(export_merged, 1, args=(ckpt, str(tmp_path / "hf"), 16), timeout=300)[0]
    ours, base = resumed_at_one_rank["logits"][..., :16], resumed_at_one_rank["base_logits"][..., :16]
    assert (hf - ours).abs().max() <= 1e-4 * ours.abs().max()
    assert (ours - base).abs().max() > 100 * (hf - ours).abs().max()  # the adapters moved the logits


def test_a_lora_checkpoint_exports_to_peft_and_training_continues_from_it(hf_models, saved,
                                                                         resumed_at_one_rank, tmp_path):
    """emapg-convert lora-to-peft: peft on the HF base model computes the adapted model's logits;
    --lora-peft-init starts a run from the folder with exactly those adapters, and it trains."""
    ckpt, _ = saved
    hf, adapter = hf_models["qwen2-tied-gqa-bias"], str(tmp_path / "adapter")
    logits = run_distributed(export_peft, 1, args=(ckpt, adapter, hf, 16), timeout=300)[0]
    ours = resumed_at_one_rank["logits"][..., :16]
    assert (logits - ours).abs().max() <= 1e-4 * ours.abs().max()
    (out,) = run_distributed(continue_from_peft, 1, args=([*argv(hf), "--lora-peft-init", adapter], 1),
                             timeout=300)
    assert torch.equal(out["logits"], resumed_at_one_rank["logits"])  # the checkpoint's adapters exactly
    assert out["metrics"][0]["kl"] == 0 and out["metrics"][0]["ema_lag"] > 0  # the EMA starts from them


def test_a_run_continues_from_an_adapter_peft_made(hf_models, tmp_path):
    """An adapter made by peft itself (each of the seven projections its own A, rank 2, alpha 4)
    starts a run at --lora-rank 6 --lora-alpha 12 (stacked, the same scale): the run's first logits
    are peft's on the HF base, its first step's KL to the anchor is 0, and it trains."""
    import peft
    import transformers

    hf = hf_models["qwen2-tied-gqa-bias"]
    torch.manual_seed(4)
    made = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32),
        peft.LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    folder = str(tmp_path / "peft")
    made.save_pretrained(folder)
    tokens = (torch.arange(16).view(2, 8) * 7 + 3) % 16  # lora_train_workers._local_logits' batch
    with torch.no_grad():
        expected = made.eval()(tokens).logits.float()
    (out,) = run_distributed(continue_from_peft, 1, timeout=300, args=(
        [*argv(hf), "--lora-peft-init", folder, "--lora-rank", "6", "--lora-alpha", "12"], 2))
    ours = out["logits"][..., :16]
    assert (expected - ours).abs().max() <= 1e-4 * ours.abs().max()
    assert out["metrics"][0]["kl"] == 0 and all(math.isfinite(m["pg_loss"]) for m in out["metrics"])
    assert out["metrics"][1]["kl"] != 0  # it trained


def test_a_lora_checkpoint_holds_the_adapters_and_names_its_base(hf_models, saved, one_rank):
    """The base came from --load-hf: the checkpoint's model, optimizer and EMA entries are the
    adapters' alone, their bytes what tools/lora_memory.py counts, and its common state names the
    base by folder and each weight file's sha256."""
    ckpt, _ = saved
    step, hf = training_step_dir(ckpt), hf_models["qwen2-tied-gqa-bias"]
    checkpoint = verify_checkpoint_metadata(step)
    stored = checkpoint.metadata.state_dict_metadata
    tensor_bytes = sum(math.prod(m.size) * m.properties.dtype.itemsize for k, m in stored.items()
                       if isinstance(m, TensorStorageMetadata) and not k.startswith("rng_state"))
    plan = memory_plan.memory(ModelConfig.from_dict(one_rank["qwen2-tied-gqa-bias"]["model_cfg"]),
                              memory_plan.Layout(bf16=False), lora_rank=4)
    assert tensor_bytes == lora_memory.checkpoint_bytes(plan, plan["trainable_per_rank"] * 4)
    keys = [k for k in stored if isinstance(k, str)]
    weights = [k for k in keys if k.startswith(MODEL_KEY_PREFIXES)]
    assert weights and all(is_adapter_name(k) for k in weights)
    assert any(".lora." in k and "ema" in k for k in keys) and any(".lora." in k and "optimizer" in k for k in keys)
    assert not any(k.endswith(("linear_qkv.weight", "word_embeddings.weight")) for k in keys)
    record = saved_lora_base(checkpoint)
    with open(os.path.join(hf, "model.safetensors"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    assert (record.flag, record.path, record.files) == ("--load-hf", os.path.abspath(hf), {"model.safetensors": digest})


def _changed_copy(hf: str, out) -> str:
    """A copy of the HF model ``hf`` with one weight changed by 1e-3 (the same names and shapes)."""
    shutil.copytree(hf, out)
    weights = safetensors.torch.load_file(os.path.join(out, "model.safetensors"))
    name = next(n for n in sorted(weights) if n.endswith("q_proj.weight"))
    weights[name] = weights[name] + 1e-3
    safetensors.torch.save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def test_a_lora_checkpoint_resumes_only_on_the_base_it_names(hf_models, saved, resumed_at_one_rank, tmp_path):
    """The same base files elsewhere resume exactly as in place; a base with one weight changed is
    refused in one line naming the file (at emapg-train's early check, before the model is built
    or any weight read); a run that gives no base file is told which one."""
    ckpt, _ = saved
    hf = hf_models["qwen2-tied-gqa-bias"]
    moved = shutil.copytree(hf, tmp_path / "moved")
    (out,) = run_distributed(lora_resume, 1, args=(argv(str(moved)), ckpt, 3), timeout=300)
    assert [{k: m[k] for k in COMPARED} for m in out["metrics"]] == \
        [{k: m[k] for k in COMPARED} for m in resumed_at_one_rank["metrics"]]
    assert torch.equal(out["logits"], resumed_at_one_rank["logits"])
    changed = _changed_copy(hf, tmp_path / "changed")
    with pytest.raises(Exception) as e:
        run_distributed(build_only, 1, args=([*argv(changed), "--load", ckpt, "--train-iters", "3"],), timeout=300)
    step = training_step_dir(ckpt)
    assert (f"--load {step}: its adapters were trained on the base of --load-hf {hf} (sha256 ") in str(e.value)
    assert (f"; --load-hf {changed} (sha256 ") in str(e.value)
    assert ("differs from it (model.safetensors): resume with --load-hf of the base it records") in str(e.value)
    with pytest.raises(Exception) as e:
        run_distributed(lora_resume, 1, args=([*BASE, *LORA], ckpt, 3), timeout=300)
    assert (f"--load {step}: the checkpoint holds the adapters only; their base is --load-hf {hf} "
            f"(sha256 ") in str(e.value) and f"): resume with --load-hf {hf}" in str(e.value)


def test_an_adapters_only_checkpoint_exports_its_base_checked(hf_models, saved, tmp_path):
    """mcore-to-hf reads the base the checkpoint names; --lora-base gives it from another folder,
    whose files must be the recorded ones (one line otherwise)."""
    ckpt, _ = saved
    hf = hf_models["qwen2-tied-gqa-bias"]
    moved = str(shutil.copytree(hf, tmp_path / "moved"))
    there = run_distributed(export_merged, 1, args=(ckpt, str(tmp_path / "a"), 16), timeout=300)[0]
    elsewhere = run_distributed(export_merged, 1, args=(ckpt, str(tmp_path / "b"), 16, 8, moved), timeout=300)[0]
    assert torch.equal(there, elsewhere)
    changed = _changed_copy(hf, tmp_path / "changed")
    with pytest.raises(Exception) as e:
        run_distributed(export_merged, 1, args=(ckpt, str(tmp_path / "c"), 16, 8, changed), timeout=300)
    assert ("differs from it (model.safetensors): pass --lora-base with the folder of the base it "
            "records") in str(e.value)
    assert not os.path.exists(tmp_path / "c")


def test_a_lora_checkpoint_is_refused_where_it_would_lose_its_adapters(saved):
    """--teacher-checkpoint and --pretrained-checkpoint read a checkpoint as a model: a LoRA
    run's is refused in one line."""
    ckpt, _ = saved
    with pytest.raises(ConfigError) as e:
        checkpoint_model_config(training_step_dir(ckpt))
    assert str(e.value) == (f"{training_step_dir(ckpt)} is a LoRA run's checkpoint (--lora-rank 4): it "
                            "cannot be loaded into another model yet (docs/lora.md); emapg-train --load "
                            "resumes it and emapg-convert mcore-to-hf exports it merged")


def test_pretrained_checkpoint_loads_the_base_and_keeps_the_adapters(tmp_path):
    """--pretrained-checkpoint holds no adapter: the base weights load, the adapters keep their
    init (B = 0), so the run starts at the checkpoint's model."""
    model = ["--preset", "tiny-cpu", "--tensor-model-parallel-size", "1", "--seed", "7"]  # not the run's init
    out = run_distributed(pretrained_start, 1, args=(str(tmp_path / "init"), model, BASE, LORA), timeout=300)[0]
    assert torch.equal(out["base_logits"], out["full"]) and out["start_equal_base"]


def _dry_run(*extra):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            train.main(["--preset", "tiny-cpu", "--dry-run", "--world-size", "2", "--lora-rank", "8", *extra])
            code = 0
        except SystemExit as e:
            code = e.code
    return code, err.getvalue().strip()


@pytest.mark.parametrize("extra, line", [
    (["--rollout-engine", "vllm", "--lora-rank", "513"],
     "--lora-rank 513 is above vLLM's largest max_lora_rank (512): use the built-in sampler or a lower rank"),
    (["--num-experts", "4", "--moe-router-topk", "2"],
     "--lora-rank 8 does not support mixture-of-experts models yet: this one has 4 experts per layer"),
    (["--lora-target-modules", "q_proj"],
     "--lora-target-modules q_proj: q_proj, k_proj, v_proj are one fused Megatron layer (linear_qkv) "
     "and its adapter covers all of them: name all of them or linear_qkv"),
])
def test_each_refusal_is_one_line_before_any_work(extra, line):
    assert _dry_run(*extra) == (2, f"error: {line}")


@pytest.mark.parametrize("config, extra, line", [
    ({"r": 4, "lora_alpha": 32}, [], "--lora-peft-init {d} is rank 4, alpha 32: give --lora-rank 4 --lora-alpha 32 "
     "(or a larger rank with alpha / rank 8)"),
    ({"r": 8, "lora_alpha": 32}, ["--ema-eta", "1"], "--lora-peft-init with --ema-eta 1: that anchor is the base "
     "model without adapters, which is the start only when B = 0; use --ema-eta below 1 (the EMA starts from "
     "the adapter)"),
    ({"r": 8, "lora_alpha": 32, "peft_type": "IA3"}, [], "{d}/adapter_config.json: peft_type 'IA3', not LORA"),
    ({"r": 8, "lora_alpha": 32, "use_dora": True}, [],
     "{d}/adapter_config.json: use_dora=True is not supported (plain LoRA only)"),
])
def test_a_peft_init_it_cannot_continue_is_one_line_before_any_work(tmp_path, config, extra, line):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    assert _dry_run("--lora-peft-init", str(tmp_path), *extra) == (2, "error: " + line.format(d=tmp_path))


FP8_SHAPES = ["--make-vocab-size-divisible-by", "32"]  # every GEMM dimension a multiple of 16 at TP = 2


@pytest.mark.parametrize("extra", [["--transformer-impl", "transformer_engine"],
                                   ["--bf16", "--fp8-format", "e4m3", "--transformer-impl", "transformer_engine",
                                    *FP8_SHAPES],
                                   ["--bf16", "--fp8-format", "hybrid", *FP8_SHAPES]])
def test_lora_on_transformer_engine_and_fp8_passes_the_checks_a_cpu_can_make(extra):
    """Adapters go on Transformer Engine's linears (docs/lora.md), so LoRA no longer refuses TE or
    FP8; what needs a GPU is checked when the run starts on one."""
    assert _dry_run(*extra) == (0, "")


def test_a_peft_adapter_with_an_a_per_projection_asks_for_the_stacked_rank(tmp_path):
    """peft's usual adapters (q_proj, k_proj, v_proj each with its own A) load stacked: the dry run
    names the rank they need before any work (the file's A tensors read, nothing else)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    prefix = "base_model.model.model.layers.0."
    state = {f"{prefix}self_attn.{p}.lora_A.weight": torch.randn(8, 64, generator=g)
             for p in ("q_proj", "k_proj", "v_proj")}
    for p in ("gate_proj", "up_proj"):  # shared: counted once
        state[f"{prefix}mlp.{p}.lora_A.weight"] = torch.ones(8, 64)
    save_file(state, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 32}))
    assert _dry_run("--lora-peft-init", str(tmp_path)) == (2, (
        f"error: --lora-peft-init {tmp_path} gives the projections of a fused layer their own lora_A (rank 8 "
        "each): stacked, they load as one adapter of rank 24 per layer; give --lora-rank 24 --lora-alpha 96 "
        "(alpha / rank 4, as peft's)"))
    assert _dry_run("--lora-peft-init", str(tmp_path), "--lora-rank", "24", "--lora-alpha", "96")[0] == 0


def _dry_run_summary(*argv) -> str:
    """What ``emapg-train ARGV --dry-run --world-size 2`` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        with contextlib.suppress(SystemExit):
            train.main([*argv, "--dry-run", "--world-size", "2"])
    return out.getvalue()


def test_the_lora_demo_preset_passes_every_check(tmp_path):
    """examples/lora_tiny_cpu.sh's --preset lora-tiny-cpu, on its 2 ranks, with its --save."""
    assert ("LoRA rank 8 (alpha 16) on linear_qkv linear_proj linear_fc1 linear_fc2, base frozen"
            in _dry_run_summary("--preset", "lora-tiny-cpu", "--save", str(tmp_path / "ckpt")))


def test_lora_dry_run_says_what_trains():
    assert ("LoRA rank 8 (alpha 32) on linear_qkv linear_proj linear_fc1 linear_fc2, base frozen"
            in _dry_run_summary("--preset", "tiny-cpu", "--lora-rank", "8"))
