"""GPU paths behind optional packages: the Transformer Engine spec, FP8 training and the vLLM rollout
engine. Each skips, saying why, when its package is missing or does not import."""

import pytest
import torch
from gpu_helpers import (
    FP8_HYBRID,
    TRAINER_BASE,
    check_common_metrics,
    compute_capability,
    output_tail,
    read_metrics,
    require_te,
    require_vllm,
    torchrun_train,
    vllm_flags,
)

from emapg_megatron.multiprocess import run_distributed

pytestmark = pytest.mark.gpu


def test_transformer_engine_spec_matches_hugging_face_logits(tmp_path):
    """HF Qwen2 weights (qkv bias, GQA, untied) loaded into a TE-spec GPTModel (fused layernorm
    names) give the HF logits, in fp32 and bf16; a TE forward/backward/optimizer step works."""
    require_te()
    from gpu_workers import te_spec_job, write_random_qwen2

    from emapg_megatron.checkpoint.verify import compare_logits, hf_logits

    hf = write_random_qwen2(str(tmp_path / "qwen2"))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    (out,) = run_distributed(te_spec_job, 1, device="cuda", args=(hf, tokens), timeout=600)
    ref = hf_logits(hf, tokens)  # transformers, fp32, on the CPU
    for label, min_cos, min_top1 in (("fp32", 0.9999, 0.95), ("bf16", 0.999, 0.85)):
        res = out[label]
        assert res["qkv_type"].startswith("TE") and res["fc1_type"].startswith("TE"), res
        assert any(n.endswith("linear_qkv.layer_norm_weight") for n in res["param_names"])
        c = compare_logits(res["logits"], ref)
        assert c["cosine_similarity"] >= min_cos, (label, c)
        assert c["top1_agreement"] >= min_top1, (label, c)
        assert c["max_abs_logit_diff"] <= (0.02 if label == "fp32" else 0.1) * ref.abs().max().item(), (label, c)
        assert res["step_ok"] and res["grad_norm"] > 0 and 0 < res["loss"] < 50, res


def test_lora_on_transformer_engine_linears_matches_local_linears(tmp_path):
    """LoRA adapters on the TE spec's linears (TE's LayerNormLinear returning its norm's output to
    the adapter) against the local spec's, fp32, the same HF weights and adapters: B = 0 gives the
    base model, the adapted logits and the adapters' gradients agree, no base weight trains. (The
    CPU suite checks the same on stand-ins with TE's contract, tests/lora/te_like.py.)"""
    require_te()
    from gpu_workers import lora_te_job, write_random_qwen2

    from emapg_megatron.checkpoint.verify import compare_logits

    hf = write_random_qwen2(str(tmp_path / "qwen2"))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    (out,) = run_distributed(lora_te_job, 1, device="cuda", args=(hf, tokens), timeout=600)
    local, te = out["local"], out["transformer_engine"]
    assert te["qkv_type"] == "TELayerNormColumnParallelLinear", te["qkv_type"]
    for res in (local, te):
        assert not res["base_with_grad"], res["base_with_grad"]
    assert not torch.equal(te["logits"], te["b0"])  # the random B does change the model
    c = compare_logits(te["logits"], local["logits"])
    assert c["cosine_similarity"] >= 0.9999 and c["max_abs_logit_diff"] <= 0.02 * local["logits"].abs().max().item(), c
    assert abs(te["loss"] - local["loss"]) <= 1e-3 * abs(local["loss"]), (te["loss"], local["loss"])
    assert set(te["grads"]) == set(local["grads"])
    for name, g in local["grads"].items():
        rel = ((te["grads"][name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert rel <= 2e-2, (name, rel)


def test_transformer_engine_thd_packing_matches_padded():
    """--sequence-packing on the TE spec takes Megatron's THD path (PackedSeqParams, cu_seqlens)
    into TE's fused attention: passes, losses and gradients of a long-tailed batch equal the
    padded run's within bf16 rounding (the CPU suite checks the same plumbing exactly in fp32
    with a reference attention, tests/training/test_packing_thd.py)."""
    require_te()
    from gpu_workers import te_packing_job
    from packing_workers import AGG_MODES
    from test_packing import LENGTHS

    (out,) = run_distributed(te_packing_job, 1, device="cuda", timeout=600,
                             args=(LENGTHS, 48, 40, "topk-reverse", False, True))

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

    pad, pk = out["padded_passes"], out["packed_passes"]
    m = pad["mask"].bool()
    for k in ("old_logprob", "ref_logprob"):
        assert rel(pk[k][m], pad[k][m]) <= 2e-2, k
    for agg in AGG_MODES:
        (pad_sums, pad_grads), (pk_sums, pk_grads) = out[agg]["padded"], out[agg]["packed"]
        assert abs(pk_sums["pg_loss"] - pad_sums["pg_loss"]) <= 2e-2 * abs(pad_sums["pg_loss"]) + 1e-3, agg
        worst = max(rel(pk_grads[n], g) for n, g in pad_grads.items() if g.abs().sum() > 0)
        assert worst <= 5e-2, (agg, worst)


def test_fp8_hybrid_trainer_steps(tmp_path):
    """--transformer-impl transformer_engine --fp8-format hybrid (delayed scaling): the model is on
    the TE spec with fp8 set, FP8 GEMMs
    run, and two trainer steps stay finite with sampler and trainer log-probs close."""
    require_te()
    if compute_capability() < (9, 0):
        pytest.skip(f"FP8 needs a Hopper (sm90) or newer GPU; this one is sm{''.join(map(str, compute_capability()))}")
    from gpu_workers import trainer_job

    (res,) = run_distributed(trainer_job, 1, device="cuda", timeout=600,
                             args=(TRAINER_BASE + FP8_HYBRID, 2))
    assert res["fp8"] == "hybrid" and res["qkv_type"].startswith("TE"), (res["fp8"], res["qkv_type"])
    assert res["te_modules"] > 0 and res["te_modules_ran_fp8"] > 0, res["te_modules_ran_fp8"]
    # FP8 activations, delayed scaling (scales move between the sampler's and the trainer's passes)
    # on a 64-wide model: the mean |log-prob difference| was 0.151 on an H100 (2026-11-27), where
    # a model left on the CPU or another device's weights differ by O(1)
    check_common_metrics(res["metrics"], logprob_tol=0.3)
    assert res["param_dtypes"] == ["torch.bfloat16"], res["param_dtypes"]  # FP8 compute, bf16 weights
    assert all(e.dtype == torch.float32 for e in res["ema"][-1].values())  # and an fp32 EMA
    for name, w in res["weights"][-1].items():
        assert torch.isfinite(w).all(), name
    # Step 1: policy == anchor, so only FP8 quantization (scales move between passes) separates them.
    assert abs(res["metrics"][0]["kl"]) < 0.05, res["metrics"][0]["kl"]


def test_fp8_lora_trainer_steps(tmp_path):
    """--lora-rank 8 with --fp8-format hybrid on the TE spec: the base's GEMMs run in FP8, the
    adapters in bf16; two trainer steps stay finite, the adapters move and the base does not."""
    require_te()
    if compute_capability() < (9, 0):
        pytest.skip(f"FP8 needs a Hopper (sm90) or newer GPU; this one is sm{''.join(map(str, compute_capability()))}")
    from gpu_workers import trainer_job

    (res,) = run_distributed(trainer_job, 1, device="cuda", timeout=600,
                             args=(TRAINER_BASE + FP8_HYBRID + ["--lora-rank", "8", "--lora-alpha", "16"], 2))
    assert res["fp8"] == "hybrid" and res["qkv_type"] == "TELayerNormColumnParallelLinear", res["qkv_type"]
    assert res["te_modules_ran_fp8"] > 0, res["te_modules_ran_fp8"]
    check_common_metrics(res["metrics"], logprob_tol=0.3)  # FP8 activations, as test_fp8_hybrid_trainer_steps
    first, last = res["weights"][0], res["weights"][-1]
    moved = {n for n in first if not torch.equal(first[n], last[n])}
    assert moved and all(".lora." in n for n in moved), sorted(moved)[:5]
    assert set(res["ema"][-1]) and all(".lora." in n for n in res["ema"][-1]), sorted(res["ema"][-1])[:5]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from tiny_hf import (
        build_tiny_hf,  # tests/tiny_hf.py: byte-level BPE + random Qwen2, no downloads
    )

    return build_tiny_hf(str(tmp_path_factory.mktemp("tiny_hf")))


def test_vllm_rollout_engine_trainer_round_trip(tiny_hf, tmp_path):
    """--rollout-engine vllm: each step syncs the trainer's weights into vLLM (sleep mode), samples
    with processed log-probs, and the trainer's recomputed log-probs agree with vLLM's."""
    require_vllm()
    r = torchrun_train(TRAINER_BASE + vllm_flags(tiny_hf), tmp_path, timeout=600)
    assert r.returncode == 0, output_tail(r)
    ms = read_metrics(tmp_path)
    check_common_metrics(ms)
    for m in ms:
        assert m["weight_sync_s"] > 0 and m["weight_sync_gb"] > 0, m
    assert abs(ms[0]["kl"]) < 1e-4 and ms[1]["kl"] > 1e-7, (ms[0]["kl"], ms[1]["kl"])


def test_vllm_lora_rollouts_sync_adapters_only(tiny_hf, tmp_path):
    """--rollout-engine vllm --lora-rank 8 --vllm-sleep-level 1: vLLM gets the frozen base once (its
    LoRA-wrapped linears under base_layer names) and after each step only the adapters, as a peft
    folder through a LoRA request; vLLM's log-probs of the adapted policy agree with the trainer's.
    (Written with the CPU fake of tests/rollout/test_vllm_lora.py; not yet run on a GPU.)"""
    require_vllm()
    r = torchrun_train(TRAINER_BASE + vllm_flags(tiny_hf) + [
        "--lora-rank", "8", "--lora-alpha", "16", "--vllm-sleep-level", "1", "--train-iters", "3"],
        tmp_path, timeout=600)
    assert r.returncode == 0, output_tail(r)
    ms = read_metrics(tmp_path)
    check_common_metrics(ms, steps=3)
    for m in ms:  # each step's sync (after its update) moved the adapters alone
        assert m["weight_sync_adapter_mb"] > 0, m
        assert m["weight_sync_gb"] * 1e3 == pytest.approx(m["weight_sync_adapter_mb"]), m
    assert abs(ms[0]["kl"]) < 1e-4, ms[0]["kl"]  # the anchor starts at the policy (B = 0: the base)
