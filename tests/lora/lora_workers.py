"""Rank functions for test_lora.py (forked ranks, so module level): LoRA on two tiny GPTModels, a
Qwen2.5-like one (tied embeddings, GQA with QKV bias) and a Qwen3-like one (qk-layernorm, untied,
query width 128 over a hidden width 64), built with the package's own model code.

One 2-rank job runs everything. First each rank runs the one-rank layout (the one
``run_distributed`` sets up: TP = 1, the two ranks are data-parallel and compute the same): the
base model's logits, the LoRA model's at B = 0, then with seeded random B the logits and adapter
gradients, then merged and unmerged. Then the parallel state is rebuilt at TP = 2 and the same
weights (the one-rank model's, through the HF mapping) and adapters run without and with sequence
parallelism, the same on Transformer Engine-like linears (``te_like``), and once with dropout; last, at PP = 2, each stage's adapters as initialised. A MoE model and a too-large rank give their refusal lines.
"""

from __future__ import annotations

import torch

SEED, BATCH, SEQ = 11, 2, 8
RANK, ALPHA = 4, 8.0
ARCHS = {
    "qwen2.5": dict(vocab_size=32, hidden_size=64, ffn_hidden_size=96, num_layers=2,
                    num_attention_heads=4, num_query_groups=2, kv_channels=16, add_qkv_bias=True,
                    tie_word_embeddings=True, max_position_embeddings=64,
                    make_vocab_size_divisible_by=8),
    "qwen3": dict(vocab_size=32, hidden_size=64, ffn_hidden_size=96, num_layers=2,
                  num_attention_heads=4, num_query_groups=2, kv_channels=32, qk_layernorm=True,
                  tie_word_embeddings=False, max_position_embeddings=64,
                  make_vocab_size_divisible_by=8),
}


def lora_config(**kw):
    from emapg_megatron.lora.config import LoRAConfig

    return LoRAConfig(**{"rank": RANK, "alpha": ALPHA, **kw})


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (torch.randint(0, vocab, (BATCH, SEQ), generator=g),
            torch.randint(0, vocab, (BATCH, SEQ), generator=g))


def forward(model, vocab: int, backward: bool = False) -> torch.Tensor:
    """This rank's vocab shard of the logits ``[B, S, V / TP]``; with ``backward``, the summed
    vocab-parallel cross-entropy's gradients too."""
    from megatron.core import tensor_parallel

    device = torch.device("cuda", torch.cuda.current_device())
    tokens, labels = (t.to(device) for t in batch(vocab))
    position_ids = torch.arange(SEQ, device=device).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=device), diagonal=1)
    with torch.set_grad_enabled(backward):
        logits = model(tokens, position_ids, mask)
        kept = logits.detach().cpu().clone()  # the cross-entropy shifts its input in place
        if backward:
            tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels).sum().backward()
    return kept


def perturbed_hf_weights(model, cfg) -> dict:
    """The model's weights as HF tensors, norms and biases moved off their init (so their paths
    matter)."""
    from emapg_megatron.checkpoint.weights import export_hf_weights

    g = torch.Generator().manual_seed(5)
    hf = {n: t.detach().cpu().clone() for n, t in export_hf_weights([model], cfg)}
    for name, t in hf.items():
        if "norm" in name or name.endswith(".bias"):
            t.add_(0.1 * torch.randn(t.shape, generator=g))
    return hf


def random_adapters(model) -> dict:
    """The one-rank adapter matrices: A as initialised, B seeded random (nonzero)."""
    from emapg_megatron.lora.apply import adapter_parameters

    g = torch.Generator().manual_seed(9)
    return {name: (p.detach().cpu().clone() if name.endswith(".A")
                   else 0.1 * torch.randn(p.shape, generator=g))
            for name, p, _ in adapter_parameters(model)}


def adapter_grads(model) -> tuple[dict, dict, list]:
    """(local adapter gradients, their shardings ``(dim, blocks)``, names of base parameters that
    got a gradient) by global name."""
    from emapg_megatron.lora.apply import adapter_parameters

    grads, shardings, adapter_ids = {}, {}, set()
    for name, p, sharding in adapter_parameters(model):
        grads[name], shardings[name] = p.grad.detach().cpu().clone(), (sharding.dim, sharding.blocks)
        adapter_ids.add(id(p))
    base = [n for n, p in model.named_parameters() if id(p) not in adapter_ids and p.grad is not None]
    return grads, shardings, base


def build(cfg, sequence_parallel: bool = False):
    from emapg_megatron.models.gpt import build_for_this_rank

    return build_for_this_rank(cfg, sequence_parallel=sequence_parallel)


def refusal(fn) -> str:
    from emapg_megatron.errors import ConfigError

    try:
        fn()
    except ConfigError as e:
        return str(e)
    return "no error"


def one_rank(cfg) -> tuple[dict, dict, dict]:
    """(results, the HF weights, the one-rank adapters) at TP = 1."""
    from emapg_megatron.checkpoint.weights import load_hf_weights
    from emapg_megatron.lora.apply import apply_lora, merge_lora, set_adapter_weights, unmerge_lora

    model = build(cfg)
    hf = perturbed_hf_weights(model, cfg)
    load_hf_weights([model], cfg, hf)
    out = {"base": forward(model, cfg.vocab_size)}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["adapted"] = apply_lora(model, lora_config(), seed=SEED)
    out["b0"] = forward(model, cfg.vocab_size)
    full = random_adapters(model)
    out["init_A"] = {n: t for n, t in full.items() if n.endswith(".A")}
    set_adapter_weights(model, full)
    out["logits"] = forward(model, cfg.vocab_size, backward=True)
    out["grads"], _, out["base_with_grad"] = adapter_grads(model)
    out["frozen"] = [n for n, p in model.named_parameters() if p.requires_grad and ".lora." not in n]
    merge_lora(model)
    out["merged"] = forward(model, cfg.vocab_size)
    unmerge_lora(model)
    out["unmerged"] = forward(model, cfg.vocab_size)
    out["unmerge_weight_error"] = max((p.detach() - weights[n]).abs().max().item()
                                      for n, p in model.named_parameters() if n in weights)
    return out, hf, full


def tensor_parallel_run(cfg, hf: dict, full: dict, sequence_parallel: bool) -> dict:
    """At the current TP: the adapters as initialised, then with ``full`` the logits and the
    adapter gradients (this rank's shards), then merged."""
    from emapg_megatron.checkpoint.weights import load_hf_weights
    from emapg_megatron.lora.apply import (
        adapter_parameters,
        apply_lora,
        merge_lora,
        set_adapter_weights,
    )

    model = build(cfg, sequence_parallel)
    load_hf_weights([model], cfg, hf)
    apply_lora(model, lora_config(), seed=SEED)
    out = {"init": {n: p.detach().cpu().clone() for n, p, _ in adapter_parameters(model)}}
    set_adapter_weights(model, full)
    out["logits"] = forward(model, cfg.vocab_size, backward=True)
    out["grads"], out["shardings"], out["base_with_grad"] = adapter_grads(model)
    merge_lora(model)
    out["merged"] = forward(model, cfg.vocab_size)
    return out


def dropout_run(cfg, hf: dict, full: dict) -> dict:
    """At the current TP with dropout: this rank's adapter gradients (every replicated one must
    be the same on every TP rank: the same dropout mask on an input all of them hold)."""
    from emapg_megatron.checkpoint.weights import load_hf_weights
    from emapg_megatron.lora.apply import apply_lora, set_adapter_weights

    model = build(cfg)
    load_hf_weights([model], cfg, hf)
    apply_lora(model, lora_config(dropout=0.5), seed=SEED)
    set_adapter_weights(model, full)
    forward(model, cfg.vocab_size, backward=True)
    grads, shardings, _ = adapter_grads(model)
    return {"grads": grads, "shardings": shardings}


def te_like_run(cfg, hf: dict, full: dict, sequence_parallel: bool) -> dict:
    """At the current TP, the model built on Transformer Engine-like linears (``te_like``: the
    norms fused into ``linear_qkv`` / ``linear_fc1``): the base logits, the logits at B = 0 and
    with the adapters switched off, then with ``full`` the logits and adapter gradients, merged."""
    from unittest import mock

    from te_like import TELikeLayerNormColumnParallelLinear, te_like_layer_spec

    from emapg_megatron.checkpoint.weights import load_hf_weights
    from emapg_megatron.lora.apply import adapters_off, apply_lora, merge_lora, set_adapter_weights

    with mock.patch("emapg_megatron.models.gpt.layer_spec", te_like_layer_spec):
        model = build(cfg, sequence_parallel)
    fused = [type(m) is TELikeLayerNormColumnParallelLinear for m in model.modules()].count(True)
    load_hf_weights([model], cfg, hf)
    out = {"fused_norm_layers": fused, "base": forward(model, cfg.vocab_size)}
    apply_lora(model, lora_config(), seed=SEED)
    out["b0"] = forward(model, cfg.vocab_size)
    set_adapter_weights(model, full)
    with adapters_off([model]):
        out["off"] = forward(model, cfg.vocab_size)
    out["logits"] = forward(model, cfg.vocab_size, backward=True)
    out["grads"], out["shardings"], out["base_with_grad"] = adapter_grads(model)
    merge_lora(model)
    out["merged"] = forward(model, cfg.vocab_size)
    return out


def relayout(tp: int, pp: int = 1) -> None:
    """Rebuild Megatron's parallel state at TP = ``tp``, PP = ``pp`` on the same ranks, seeded
    again."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from emapg_megatron.runtime.config import ParallelConfig
    from emapg_megatron.runtime.distributed import model_parallel_options

    ps.destroy_model_parallel()
    layout = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    ps.initialize_model_parallel(**model_parallel_options(layout))
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)


def lora_job() -> dict:
    """Every arch at one rank, then at TP = 2 without and with sequence parallelism; and the
    refusals that need a model."""
    from emapg_megatron.lora.apply import adapter_parameters, apply_lora
    from emapg_megatron.models.config import ModelConfig

    out, inputs = {}, {}
    for arch, shape in ARCHS.items():
        cfg = ModelConfig(**shape)
        out[arch], hf, full = one_rank(cfg)
        inputs[arch] = cfg, hf, full
    twice = build(ModelConfig(**ARCHS["qwen2.5"]))
    apply_lora(twice, lora_config())
    out["refused"] = {
        "twice": refusal(lambda: apply_lora(twice, lora_config())),
        "rank_above_width": refusal(lambda: apply_lora(build(ModelConfig(**ARCHS["qwen3"])),
                                                       lora_config(rank=65))),
        "rank_0": refusal(lambda: apply_lora(build(ModelConfig(**ARCHS["qwen3"])), lora_config(rank=0))),
        "experts": refusal(lambda: apply_lora(build(ModelConfig(**ARCHS["qwen3"], num_experts=2)),
                                              lora_config(target_modules=("linear_fc1",)))),
    }
    relayout(2)
    for arch, (cfg, hf, full) in inputs.items():
        for sp in (False, True):
            out[arch][f"tp2{'-sp' if sp else ''}"] = tensor_parallel_run(cfg, hf, full, sp)
            out[arch][f"te-like-tp2{'-sp' if sp else ''}"] = te_like_run(cfg, hf, full, sp)
    cfg, hf, full = inputs["qwen2.5"]
    out["dropout"] = dropout_run(cfg, hf, full)
    relayout(1, pp=2)  # each stage's adapters under their global names, A as at one rank
    stage = build(inputs["qwen3"][0])
    apply_lora(stage, lora_config(), seed=SEED)
    out["pp2_init"] = {n: p.detach().cpu().clone() for n, p, _ in adapter_parameters(stage)}
    return out
