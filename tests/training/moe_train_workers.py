"""Rank functions for the MoE trainer tests (forked ranks, so module level).

A random init depends on the layout (each expert-parallel rank draws its local experts from its
own generator), so every layout starts from the one-rank model's weights: :func:`initial_weights`
takes them on one rank, keyed by global name (global layer and expert index), and
:func:`train_steps_from` copies this rank's share of them into its model in place of
--pretrained-checkpoint / --load-hf (before the EMA anchor is built from them), then trains.
"""

import torch


def _named(chunks) -> dict:
    from emapg_megatron.models.gpt import global_param_name, unwrap

    gpt = unwrap(chunks[0])
    return {global_param_name(gpt, n): p for n, p in gpt.named_parameters()}


def initial_weights(argv: list) -> dict:
    """The model the flags build on this (single) rank, fp32 on the CPU, by global name."""
    from emapg_megatron import build

    inputs = build.prepare(argv)
    trainer = build.build_trainer(inputs)
    return {k: p.detach().float().cpu().clone() for k, p in _named(trainer.model_chunks).items()}


def train_steps_from(argv: list, steps: int, weights: dict) -> dict:
    """``train_run_workers.train_steps`` from ``weights`` (TP=1: every tensor whole)."""
    from train_run_workers import train_steps

    from emapg_megatron import build

    def load(chunks, optimizer, cfg, model_cfg, base=None):
        with torch.no_grad():
            for key, p in _named(chunks).items():
                p.copy_(weights[key])
        optimizer.reload_model_params()

    real, build.load_initial_weights = build.load_initial_weights, load
    try:
        out = train_steps(argv, steps)
    finally:
        build.load_initial_weights = real
    out["expert_keys"] = sorted(k for k in out["params"] if ".local_experts." in k)
    return out


def run_from(argv: list, weights: dict) -> list:
    """The whole run (``emapg_megatron.train.run``: --save / --load, the loop, metrics.jsonl) from
    ``weights`` when it does not resume; returns its metrics.jsonl rows (every rank reads them)."""
    import os

    from emapg_megatron import build, train
    from emapg_megatron.run.metrics import read_jsonl

    def load(chunks, optimizer, cfg, model_cfg, base=None):
        with torch.no_grad():
            for key, p in _named(chunks).items():
                p.copy_(weights[key])
        optimizer.reload_model_params()

    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()  # train.run builds the run's own groups
    real, build.load_initial_weights = build.load_initial_weights, load
    try:
        assert train.run(argv) == 0
    finally:
        build.load_initial_weights = real
    return read_jsonl(os.path.join(argv[argv.index("--log-dir") + 1], "metrics.jsonl"))


def replay_against_a_perturbed_router() -> dict:
    """A MoE policy under routing replay: routes recorded by a forward-only pass; the router then
    perturbed; a forward without replay routes differently, one replaying the recorded routes
    routes exactly as recorded (read from the routers' routing maps by a forward hook)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from emapg_megatron.models.config import ModelConfig, MoEOptions
    from emapg_megatron.models.gpt import build_for_this_rank
    from emapg_megatron.models.routing_replay import ROUTES, route_dtype
    from emapg_megatron.training.schedule import forward_backward, forward_only

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, make_vocab_size_divisible_by=8, hidden_size=32, ffn_hidden_size=64,
                      num_layers=2, num_attention_heads=4, num_experts=8, moe_router_topk=2,
                      max_position_embeddings=16, qk_layernorm=True)
    model = build_for_this_rank(cfg, moe=MoEOptions(routing_replay="r2"))
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    maps = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: maps.append(out[1].detach().clone()))
             for r in routers]
    tokens = torch.randint(0, 32, (3, 12), generator=torch.Generator().manual_seed(1)).to(
        next(model.parameters()).device)
    mbs = [{"tokens": tokens}]
    recorded = forward_only([model], mbs, lambda out, mb: {"logits_sum": out.float().sum().view(1)},
                            record_routes=route_dtype(cfg.num_experts))[0][ROUTES]
    old_maps, maps[:] = list(maps), []
    with torch.no_grad():
        for r in routers:
            r.weight.add_(torch.randn_like(r.weight))
    forward_only([model], mbs, lambda out, mb: {})
    fresh_maps, maps[:] = list(maps), []
    forward_backward([model], [{"tokens": tokens, ROUTES: recorded}],
                     lambda out, mb: (out.float().square().mean(), {}))
    replayed_maps = list(maps)
    for h in hooks:
        h.remove()
    grads = {n: p.grad is not None or getattr(p, "main_grad", None) is not None
             for n, p in model.named_parameters() if ".router." in n}

    def disagreement(a, b):  # share of tokens whose expert set differs, per layer
        return [float((x != y).any(-1).float().mean()) for x, y in zip(a, b)]

    return {"shape": tuple(recorded.shape), "dtype": str(recorded.dtype),
            "fresh": disagreement(fresh_maps, old_maps), "replayed": disagreement(replayed_maps, old_maps),
            "router_grads": grads}
