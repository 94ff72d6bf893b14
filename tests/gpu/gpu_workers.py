"""Rank functions of the GPU test set (spawned by ``run_distributed``, so module level).

Each returns plain tensors/numbers on the CPU; the tests assert on them. The functions place
tensors with ``runtime.device()``, so they also run in the CPU mode (gloo) for debugging their
own logic, but the tests call them with ``device="cuda"`` only.
"""

from __future__ import annotations

import traceback

import torch

# The model of the unit checks: small, GQA, qkv bias (Qwen2-like), a vocabulary that needs padding.
TINY = dict(vocab_size=1000, make_vocab_size_divisible_by=128, hidden_size=128, ffn_hidden_size=256,
            num_layers=2, num_attention_heads=4, num_query_groups=2, max_position_embeddings=128,
            add_qkv_bias=True)


def guarded(fn, *args, **kwargs) -> dict:
    """``fn``'s result, or ``{"error": traceback}``: one failing part does not hide the others."""
    try:
        return fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - reported to the test
        return {"error": traceback.format_exc()}


def _device() -> torch.device:
    from emapg_megatron import runtime

    return runtime.device()


def _reseed(seed: int) -> None:
    """The same initial weights for every model built after this call."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _build(dist_opt: bool = False, *, bf16: bool = True, seed: int = 5, lr: float = 1e-3, **overrides):
    from emapg_megatron.models.config import ModelConfig, PrecisionConfig
    from emapg_megatron.training.config import OptimConfig
    from emapg_megatron.training.model_and_optimizer import build_model_and_optimizer

    _reseed(seed)
    cfg = ModelConfig(**{**TINY, **overrides})
    chunks, opt = build_model_and_optimizer(
        cfg, OptimConfig(lr=lr, weight_decay=0.0, clip_grad=1.0, use_distributed_optimizer=dist_opt),
        PrecisionConfig(bf16=bf16))
    return cfg, chunks, opt


def _weights(chunks) -> dict[str, torch.Tensor]:
    from emapg_megatron.models.gpt import global_param_name, unwrap

    gpt = unwrap(chunks[0])
    return {global_param_name(gpt, n): p.detach().float().cpu().clone() for n, p in gpt.named_parameters()}


def _lm_batch(vocab: int, n: int = 8, seq: int = 32, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (n, seq + 1), generator=g)
    dev = _device()
    return {"tokens": t[:, :-1].contiguous().to(dev), "labels": t[:, 1:].contiguous().to(dev)}


def _lm_step(chunks, opt, microbatches) -> tuple[float, float, bool]:
    """One optimizer step of next-token cross-entropy through Megatron's pipeline schedule."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from emapg_megatron.training.model_and_optimizer import zero_grads
    from emapg_megatron.training.schedule import forward_backward

    def loss(logits, mb):
        value = vocab_parallel_cross_entropy(logits.float(), mb["labels"]).mean() / len(microbatches)
        return value, {"loss": value.detach() * len(microbatches)}

    zero_grads(chunks, opt)
    outs = forward_backward(chunks, microbatches, loss)
    if getattr(chunks[0].config, "finalize_model_grads_func", None) is None:
        chunks[0].finish_grad_sync()  # no hook in the schedule: reduce the grads here
    ok, grad_norm, _ = opt.step()
    mean_loss = sum(float(o["loss"]) for o in outs) / len(outs)
    return mean_loss, float(grad_norm) if grad_norm is not None else float("nan"), bool(ok)


# --- the Megatron optimizer on the GPU ----------------------------------------------------------
def optimizer_check(dist_opt: bool, steps: int = 6) -> dict:
    """Build model + Megatron optimizer (bf16, fp32 main params) under nccl, then train a fixed batch."""
    import torch.distributed as dist

    from emapg_megatron.models.gpt import unwrap

    cfg, chunks, opt = _build(dist_opt)
    gpt = unwrap(chunks[0])
    inner = getattr(opt, "chained_optimizers", [opt])
    mains = [p for g in opt.param_groups for p in g["params"]]
    out = {
        "backend": dist.get_backend(),
        "optimizers": sorted({type(o).__name__ for o in inner}),
        "param_devices": sorted({str(p.device) for p in gpt.parameters()}),
        "param_dtypes": sorted({str(p.dtype) for p in gpt.parameters()}),
        "main_devices": sorted({str(p.device) for p in mains}),
        "main_dtypes": sorted({str(p.dtype) for p in mains}),
        "weights_before": _weights(chunks),
    }
    mbs = [_lm_batch(cfg.vocab_size, seed=s) for s in (0, 1)]  # two micro-batches, fixed data
    losses, norms, oks = [], [], []
    for _ in range(steps):
        loss, norm, ok = _lm_step(chunks, opt, mbs)
        losses.append(loss)
        norms.append(norm)
        oks.append(ok)
    out.update(losses=losses, grad_norms=norms, step_ok=oks, weights_after=_weights(chunks),
               param_dtypes_after=sorted({str(p.dtype) for p in gpt.parameters()}),
               max_memory_allocated=torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0)
    return out


# --- the built-in sampler on the GPU ------------------------------------------------------------
def sampler_check() -> dict:
    from emapg_megatron.checkpoint.verify import megatron_logits
    from emapg_megatron.models.gpt import unwrap
    from emapg_megatron.rollout.config import SamplerConfig
    from emapg_megatron.rollout.megatron_sampler import MegatronSampler

    cfg, chunks, _ = _build(False, seed=11)
    seq, new = 48, 16
    def sampler_of(**settings):
        return MegatronSampler(chunks, SamplerConfig(**settings).resolved(False), vocab_size=cfg.vocab_size,
                               eos_id=None, pad_id=0, seq_length=seq, micro_batch_size=8, seed=7)

    sampler = sampler_of()
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [18]]
    b1 = sampler.generate(prompts, 4, 1.0, 1.0, new, rng_step=3)
    b2 = sampler.generate(prompts, 4, 1.0, 1.0, new, rng_step=3)
    b3 = sampler.generate(prompts, 4, 1.0, 1.0, new, rng_step=4)
    nucleus = sampler.generate(prompts, 4, 1.0, 0.5, new, rng_step=3)

    def teacher_forced(batch):
        """log pi(token) from one forward pass over the finished sequences, token-aligned."""
        logits = megatron_logits(chunks, batch.tokens)[..., :cfg.vocab_size].float()
        lp = torch.log_softmax(logits, dim=-1)
        tokens = batch.tokens.to(lp.device)
        out = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=lp.device)
        out[:, 1:] = lp[:, :-1].gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        return out.cpu()

    auto_waves = nucleus.stats.cache_waves  # sized by the free GPU memory: all 16 fit
    b_waves = sampler_of(max_requests=5).generate(prompts, 4, 1.0, 1.0, new, rng_step=3)
    b_split = sampler_of(max_forward_tokens=8).generate(prompts, 4, 1.0, 1.0, new, rng_step=3)  # prefill: 16 x 1 > 8
    tf1, tf_nucleus = teacher_forced(b1), teacher_forced(nucleus)
    sel = b1.loss_mask > 0
    sel_n = nucleus.loss_mask > 0
    return {
        "param_devices": sorted({str(p.device) for p in unwrap(chunks[0]).parameters()}),
        "response_lengths": sorted({len(r) for r in b1.responses}),
        "max_token": int(b1.tokens.max()),
        "same_seed_same_tokens": bool(torch.equal(b1.tokens, b2.tokens)),
        "same_seed_logprob_diff": (b1.sampling_logprobs - b2.sampling_logprobs).abs().max().item(),
        "other_step_differs": not torch.equal(b1.tokens, b3.tokens),
        "n_sampled": int(sel.sum()),
        "distinct_sampled": len(set(b1.tokens[sel].tolist())),
        "sampled_logprob_diff": (b1.sampling_logprobs[sel] - tf1[sel]).abs(),
        "sampled_logprob_mean": float(b1.sampling_logprobs[sel].mean()),
        # top-p 0.5 renormalises over the nucleus: log pi_top-p(y) = log pi(y) - log mass >= log pi(y)
        "nucleus_minus_full": nucleus.sampling_logprobs[sel_n] - tf_nucleus[sel_n],
        **_cache_memory(chunks, seq, auto_waves, b_waves, b1),
        "split_same_responses": sum(a == b for a, b in zip(b_split.responses, b1.responses)),
    }


def _cache_memory(chunks, seq, auto_waves, b_waves, b1) -> dict:
    """The KV cache's memory sizing on a real GPU: free memory, the per-sequence size (bf16), the
    waves of ``--inference-max-requests`` and of free memory."""
    from emapg_megatron.rollout import kv_cache_decoding as kv

    same = [a == b for a, b in zip(b_waves.responses, b1.responses)]
    return {"free_bytes": kv.free_device_bytes(), "total_bytes": torch.cuda.get_device_properties(0).total_memory,
            "bytes_per_row": kv.cache_bytes_per_row(chunks[0], seq), "auto_waves": auto_waves,
            "max_requests_waves": b_waves.stats.cache_waves, "max_rows_fed": max(b_waves.stats.rows_fed),
            "waves_same_responses": sum(same)}


# --- the fused vocab-parallel Top-k KL op on the GPU --------------------------------------------
KL_V = 32000  # true vocabulary
KL_PADDED = 32128  # Megatron-style padding columns 32000..32127
KL_K = 32
KL_IW_CLIP = (0.0, 2.0)


def kl_inputs(tokens: int, seed: int = 0) -> dict:
    """Padded logits [T, 32128] and the per-token KL inputs, built in fp64 on the CPU."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, KL_PADDED, generator=g, dtype=torch.float64) * 2.0
    logits[:, KL_V:] = 6.0  # padding above nearly every real logit: a leak into the sums shows
    old = logits[:, :KL_V] + 0.5 * torch.randn(tokens, KL_V, generator=g, dtype=torch.float64)
    old_lp = old.log_softmax(-1)
    q = old.topk(KL_K, dim=-1).indices
    tok = torch.multinomial(old_lp.exp(), 1, generator=g).squeeze(-1)
    tok[0] = q[0, 0]  # one token surely inside q
    ref_lp = (logits[:, :KL_V] + torch.randn(tokens, KL_V, generator=g, dtype=torch.float64)).log_softmax(-1)
    return dict(logits=logits, tokens=tok, q=q, ref_q=ref_lp.gather(-1, q),
                ref_y=ref_lp.gather(-1, tok.unsqueeze(-1)).squeeze(-1),
                samp_y=old_lp.gather(-1, tok.unsqueeze(-1)).squeeze(-1),
                w_kl=torch.randn(tokens, generator=g, dtype=torch.float64),
                w_lp=torch.randn(tokens, generator=g, dtype=torch.float64),
                w_ent=torch.randn(tokens, generator=g, dtype=torch.float64))


def _kl_reference(x64: torch.Tensor, d: dict, kind: str, with_entropy: bool) -> dict:
    """The single-device library (``emapg_megatron.kl``) in fp64 on the same device."""
    from emapg_megatron.kl import topk_kl

    direction = {"topk-reverse": "reverse", "topk-forward": "forward"}[kind]
    x = x64[:, :KL_V].clone().requires_grad_(True)
    lp = torch.log_softmax(x, -1)
    logprob = lp.gather(-1, d["tokens"].unsqueeze(-1)).squeeze(-1)
    kl = topk_kl(x, d["tokens"], d["q"], d["ref_q"], d["ref_y"], direction=direction, tail="unbiased",
                 sampling_logprob=d["samp_y"], iw_clip=KL_IW_CLIP)
    entropy = -(lp.exp() * lp).sum(-1)
    loss = (d["w_kl"] * kl).sum() + (d["w_lp"] * logprob).sum()
    if with_entropy:
        loss = loss + (d["w_ent"] * entropy).sum()
    loss.backward()
    return dict(kl=kl.detach(), logprob=logprob.detach(), entropy=entropy.detach(), grad=x.grad)


def topk_kl_check(dtype_name: str, tokens: int = 1024) -> dict:
    """``vocab_parallel_policy_terms`` + ``kl_from_policy_terms`` on the device against the library.

    Cases vary the direction, the chunking (one chunk or many), the entropy and the in-place
    (save-probabilities) backward. Returned: max abs errors and the scales they are judged by.
    """
    from emapg_megatron.parallel import (
        kl_from_policy_terms,
        vocab_parallel_policy_terms,
    )

    dtype = getattr(torch, dtype_name)
    dev = _device()
    base = kl_inputs(tokens)
    logits = base["logits"].to(dtype)  # the values the op sees; the reference gets them exactly
    d = {n: (t.to(dev, torch.float32) if t.is_floating_point() else t.to(dev))
         for n, t in base.items() if n != "logits"}
    d64 = {n: (t.double() if t.is_floating_point() else t) for n, t in d.items()}
    cases = {
        "reverse/auto-chunk/entropy": ("topk-reverse", None, True, False),
        "forward/chunk128/entropy": ("topk-forward", 128, True, False),
        "reverse/chunk96/inplace": ("topk-reverse", 96, False, True),
    }
    out = {"device": str(dev)}
    for name, (kind, chunk, with_entropy, inplace) in cases.items():
        x = logits.to(dev).clone().requires_grad_(True)
        terms = vocab_parallel_policy_terms(x, d["tokens"], d["q"], group=None, vocab_size=KL_V,
                                            with_entropy=with_entropy, chunk_size=chunk,
                                            inplace_backward=inplace)
        kl = kl_from_policy_terms(terms, d["tokens"], d["q"], d["ref_q"], d["ref_y"], kind=kind,
                                  tail="unbiased", sampling_logprob=d["samp_y"], iw_clip=KL_IW_CLIP)
        loss = (d["w_kl"] * kl).sum() + (d["w_lp"] * terms.logprob).sum()
        if with_entropy:
            loss = loss + (d["w_ent"] * terms.entropy).sum()
        loss.backward()
        ref = _kl_reference(logits.to(dev).double(), d64, kind, with_entropy)
        grad = x.grad
        row = {
            "grad_dtype": str(grad.dtype),
            "grad_device": str(grad.device),
            "kl_err": (kl.double() - ref["kl"]).abs().max().item(),
            "logprob_err": (terms.logprob.double() - ref["logprob"]).abs().max().item(),
            "kl_scale": ref["kl"].abs().max().item(),
            "padding_grad_max": grad[:, KL_V:].abs().max().item(),
            # per element: |err| - bf16 rounding of the reference value (<= 0 means within it)
            "grad_err": (grad[:, :KL_V].double() - ref["grad"]).abs().max().item(),
            "grad_scale": ref["grad"].abs().max().item(),
            "grad_excess_over_rounding": ((grad[:, :KL_V].double() - ref["grad"]).abs()
                                          - 2.0 ** -8 * ref["grad"].abs()).max().item(),
        }
        if with_entropy:
            row["entropy_err"] = (terms.entropy.double() - ref["entropy"]).abs().max().item()
        out[name] = row
        del x, terms, kl, loss, ref, grad
    return out


def units_job() -> dict:
    """Everything the unit checks need, in one spawned rank (one CUDA start-up for all)."""
    return {
        "optimizer/plain": guarded(optimizer_check, False),
        "optimizer/distributed": guarded(optimizer_check, True),
        "sampler": guarded(sampler_check),
        "topk_kl/float32": guarded(topk_kl_check, "float32"),
        "topk_kl/bfloat16": guarded(topk_kl_check, "bfloat16"),
    }


# --- the trainer, in process ------------------------------------------------------------------
def build_trainer(argv: list):
    """The Trainer ``emapg_megatron.train.run(argv)`` builds (``build.prepare`` then
    ``build.build_trainer``), after the process group that run_distributed set up."""
    from emapg_megatron import build

    inputs = build.prepare(list(argv))
    _reseed(inputs.config.loop.seed)  # the RNG state runtime.initialize left: every build in a process starts alike
    return build.build_trainer(inputs)


def trainer_job(argv: list, steps: int = 2) -> dict:
    """Build the run exactly as ``emapg_megatron.train`` does from ``argv``; record the EMA anchor,
    the weights and the metrics around each of ``steps`` trainer steps."""
    from emapg_megatron.models.gpt import unwrap

    trainer = build_trainer(argv)
    anchor = trainer.state.anchor
    gpt = unwrap(trainer.model_chunks[0])
    stores = getattr(anchor, "stores", [])
    out = {
        "ema_devices": sorted({str(s.data.device) for s in stores}),
        "ema_pinned": [bool(s.data.is_pinned()) for s in stores if s.data.device.type == "cpu"],
        "memory_report": anchor.memory_report(),
        "param_devices": sorted({str(p.device) for p in gpt.parameters()}),
        "param_dtypes": sorted({str(p.dtype) for p in gpt.parameters()}),
        "fp8": getattr(gpt.config, "fp8", None),
        "qkv_type": type(gpt.decoder.layers[0].self_attention.linear_qkv).__name__,
        "ema": [anchor.gathered()],
        "weights": [_weights(trainer.model_chunks)],
        "metrics": [],
    }
    for it in range(1, steps + 1):
        out["metrics"].append({"step": it, **trainer.step(it).metrics})
        out["ema"].append(anchor.gathered())
        out["weights"].append(_weights(trainer.model_chunks))
    # TE modules (Megatron's TE wrappers subclass them) carry fp8_meta; ``fp8`` is set on each forward.
    te_modules = [m for m in gpt.modules() if isinstance(getattr(m, "fp8_meta", None), dict)]
    out["te_modules"] = len(te_modules)
    out["te_modules_ran_fp8"] = sum(bool(getattr(m, "fp8", False)) for m in te_modules)
    return out


def trainer_modes_job(base: list, modes: dict, steps: int = 2) -> dict:
    """``trainer_job`` for ``base + flags`` of each mode, one after the other in this rank."""
    out = {}
    for mode, flags in modes.items():
        out[mode] = guarded(trainer_job, list(base) + list(flags), steps)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


# --- the Transformer Engine spec against Hugging Face -------------------------------------------
QWEN2_TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)


def write_random_qwen2(path: str, seed: int = 0) -> str:
    """A small random Qwen2 (every tensor random: biases and norms too), saved in fp32."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**QWEN2_TINY))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if "norm" in name else 0.0
            p.copy_(centre + torch.randn(p.shape, generator=g) * (0.1 if p.ndim > 1 else 0.2))
    model.save_pretrained(path)
    return path


def te_spec_job(hf_dir: str, tokens: torch.Tensor) -> dict:
    """The HF weights in Megatron models built on the TE spec (``transformer_impl`` pinned to
    Transformer Engine; fp32 and bf16): logits, one training step (fwd + bwd + optimizer) on each."""
    from emapg_megatron.checkpoint import hf_config, weights
    from emapg_megatron.checkpoint.verify import megatron_logits
    from emapg_megatron.models.config import PrecisionConfig
    from emapg_megatron.models.gpt import unwrap
    from emapg_megatron.training.config import OptimConfig
    from emapg_megatron.training.model_and_optimizer import build_model_and_optimizer

    cfg, _ = hf_config.model_config_from_hf(hf_config.read_hf_config(hf_dir))
    out = {}
    for label, bf16 in (("fp32", False), ("bf16", True)):
        _reseed(3)
        chunks, opt = build_model_and_optimizer(cfg, OptimConfig(lr=1e-4, weight_decay=0.0),
                                                PrecisionConfig(bf16=bf16, transformer_impl="transformer_engine"))
        gpt = unwrap(chunks[0])
        weights.load_hf_weights(chunks, cfg, hf_dir)
        opt.reload_model_params()
        logits = megatron_logits(chunks, tokens)[..., :cfg.vocab_size].float().cpu()
        loss, norm, ok = _lm_step(chunks, opt, [_lm_batch(cfg.vocab_size, n=4, seq=32, seed=9)])
        out[label] = {
            "logits": logits,
            "qkv_type": type(gpt.decoder.layers[0].self_attention.linear_qkv).__name__,
            "fc1_type": type(gpt.decoder.layers[0].mlp.linear_fc1).__name__,
            "param_names": sorted(n for n, _ in gpt.named_parameters()),
            "loss": loss, "grad_norm": norm, "step_ok": ok,
        }
    return out


def lora_te_job(hf_dir: str, tokens: torch.Tensor, impls=("local", "transformer_engine")) -> dict:
    """LoRA (rank 8) on the same HF weights and the same adapters (B seeded random) in a model of
    each of ``impls``, fp32: the base logits, the logits at B = 0, the adapted logits, the loss's
    adapter gradients, and whether any base weight got a gradient."""
    from emapg_megatron.checkpoint import hf_config, weights
    from emapg_megatron.checkpoint.verify import megatron_logits
    from emapg_megatron.lora.apply import adapter_parameters, set_adapter_weights
    from emapg_megatron.lora.config import LoRAConfig
    from emapg_megatron.models.config import PrecisionConfig
    from emapg_megatron.models.gpt import unwrap
    from emapg_megatron.training.config import OptimConfig
    from emapg_megatron.training.model_and_optimizer import build_model_and_optimizer

    cfg, _ = hf_config.model_config_from_hf(hf_config.read_hf_config(hf_dir))
    out, full = {}, None
    for impl in impls:
        _reseed(3)
        chunks, opt = build_model_and_optimizer(cfg, OptimConfig(lr=0.0, weight_decay=0.0),
                                                PrecisionConfig(transformer_impl=impl),
                                                lora=LoRAConfig(rank=8, alpha=16.0), seed=7)
        gpt = unwrap(chunks[0])
        weights.load_hf_weights(chunks, cfg, hf_dir)
        opt.reload_model_params()
        res = {"qkv_type": type(gpt.decoder.layers[0].self_attention.linear_qkv).__name__,
               "b0": megatron_logits(chunks, tokens)[..., :cfg.vocab_size].float().cpu()}
        if full is None:  # the first model's A, a seeded random B: the same adapters in every model
            g = torch.Generator().manual_seed(9)
            full = {n: p.detach().cpu().clone() if n.endswith(".A") else 0.05 * torch.randn(p.shape, generator=g)
                    for n, p, _ in adapter_parameters(gpt)}
        set_adapter_weights(gpt, {n: t.to(_device()) for n, t in full.items()})
        res["logits"] = megatron_logits(chunks, tokens)[..., :cfg.vocab_size].float().cpu()
        res["loss"], _, _ = _lm_step(chunks, opt, [_lm_batch(cfg.vocab_size, n=4, seq=32, seed=9)])
        res["grads"] = {n: p.main_grad.float().cpu().clone() for n, p, _ in adapter_parameters(gpt)}
        res["base_with_grad"] = [n for n, p in gpt.named_parameters()
                                 if ".lora." not in n and (p.requires_grad or p.grad is not None)]
        out[impl] = res
        del chunks, opt
    return out


def _on_host(x):
    """``x`` with every tensor (in dicts, lists and tuples) moved to the CPU."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: _on_host(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_on_host(v) for v in x)
    return x


def te_packing_job(*args) -> dict:
    """``packing_workers.packed_vs_padded`` on the GPU (the TE spec when TE imports), on the host."""
    from packing_workers import packed_vs_padded

    return _on_host(packed_vs_padded(*args))
