"""Rank functions for test_routing_replay_r3.py (forked ranks, so module level): one trainer
step of the tiny MoE preset under each case, with what the step saw of the sampler's log-probs."""

import torch

PERTURB_SEED = 5


def _perturb_routers(chunks, scale: float) -> None:
    """Add noise to every router's weight (the same on every rank: the routers are replicated)."""
    from megatron.core.transformer.moe.router import TopKRouter

    g = torch.Generator().manual_seed(PERTURB_SEED)
    with torch.no_grad():
        for m in chunks[0].modules():
            if isinstance(m, TopKRouter):
                m.weight.add_(scale * torch.randn(m.weight.shape, generator=g).to(m.weight))


def one_step(argv: list, perturb: float = 0.0) -> dict:
    """Build the run, take one step; with ``perturb`` the routers change between sampling and the
    passes. Returns the step's route metrics and the largest |sampler - old| log-prob gap."""
    from emapg_megatron import build

    trainer = build.build_trainer(build.prepare(argv))
    seen = {}
    if perturb:
        collect = trainer.collector.collect

        def perturbed(step):
            rollout = collect(step)
            _perturb_routers(trainer.model_chunks, perturb)
            return rollout

        trainer.collector.collect = perturbed
    mismatch = trainer.rollout_mismatch

    def spy(batch):
        sel = batch["mask"] > 0
        seen["max_abs_diff"] = float((batch["old_logprob"] - batch["sampling_logprob"])[sel].abs().max())
        seen["trained_tokens"] = int(sel.sum())
        return mismatch(batch)

    trainer.rollout_mismatch = spy
    m = trainer.step(1).metrics
    keys = ("moe_route_agreement", "rollout_logprob_diff", "moe_load_max_over_mean", "kl")
    return {**{k: m.get(k) for k in keys}, **seen}


def partial_steps(argv: list, steps: int) -> list[dict]:
    """``steps`` trainer steps of a run (partial rollouts): per step its route and pool metrics
    and the largest |sampler - old| log-prob gap over its trained tokens."""
    from emapg_megatron import build

    trainer = build.build_trainer(build.prepare(argv))
    mismatch, seen = trainer.rollout_mismatch, {}

    def spy(batch):
        sel = batch["mask"] > 0
        seen["max_abs_diff"] = float((batch["old_logprob"] - batch["sampling_logprob"])[sel].abs().max())
        return mismatch(batch)

    trainer.rollout_mismatch = spy
    out = []
    for step in range(1, steps + 1):
        m = trainer.step(step).metrics
        out.append({**{k: m.get(k) for k in ("moe_route_agreement", "rollout_logprob_diff", "partial/carried",
                                             "partial/policy_lag_max")}, **seen})
    return out


def cases(base: list, runs: dict) -> dict:
    """:func:`one_step` of each ``name: (extra flags, perturbation)``, in one process."""
    return {name: one_step([*base, *extra], perturb) for name, (extra, perturb) in runs.items()}


def sampler_routes_against_a_full_forward() -> dict:
    """A MoE model sampled on each cached decode path (the cache-free one: the trainer tests),
    single-turn and as multi-turn episodes (whose environments cut turns: restarts); the routes each batch carries against those of one
    cache-free forward of its tokens, at every position the sampler fed: (agreeing, positions)
    per case. The routes of a token depend only on its prefix, so they must agree."""
    from kv_cache_workers import PROMPTS, CountingEnv

    from emapg_megatron.models.config import ModelConfig
    from emapg_megatron.models.gpt import build_for_this_rank
    from emapg_megatron.models.routing_replay import ROUTES, route_agreement, route_dtype
    from emapg_megatron.rollout.config import SamplerConfig
    from emapg_megatron.rollout.megatron_sampler import MegatronSampler
    from emapg_megatron.training.schedule import forward_only

    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=40, make_vocab_size_divisible_by=8, hidden_size=64, ffn_hidden_size=128,
                      num_layers=2, num_attention_heads=4, num_query_groups=2, max_position_embeddings=64,
                      qk_layernorm=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64)
    model = build_for_this_rank(cfg)
    dtype = route_dtype(cfg.num_experts)
    paths = {"lockstep": dict(kv_cache=True, max_forward_tokens=-1),
             "lockstep_row_batches": dict(kv_cache=True, max_forward_tokens=6),
             "fixed_shape": dict(kv_cache=True, fixed_shape=True, max_requests=3, max_forward_tokens=-1)}
    prompts, out = PROMPTS[:3], {}
    for name, kwargs in paths.items():
        sampler = MegatronSampler([model], SamplerConfig(**kwargs).resolved(partial_rollouts=False),
                                  vocab_size=40, eos_id=None, pad_id=0, seq_length=64, micro_batch_size=3,
                                  seed=7, route_dtype=dtype)
        single = sampler.generate(prompts, 2, 1.0, 1.0, 4, rng_step=1)
        batches = [("single", single, [len(prompts[s // 2]) + len(r) for s, r in enumerate(single.responses)])]
        if name != "lockstep_row_batches":  # its split forwards are the prefill's, alike in both
            envs = [CountingEnv(i, cut=i % 3 == 1) for i in range(len(prompts) * 2)]
            multi, episodes = sampler.generate_episodes(prompts, 2, envs, tokenizer=None, temperature=1.0,
                                                        top_p=1.0, max_new_tokens=4, rng_step=2)
            batches.append(("episodes", multi, [len(e.history()) for e in episodes]))
        if name == "fixed_shape":  # partial rollouts: carried prefixes continued, and routed anew
            batches += _continued_and_rerouted(sampler, prompts, single)
        for kind, batch, lengths in batches:
            full = forward_only([model], [{"tokens": batch.tokens.to(next(model.parameters()).device)}],
                                lambda o, mb: {}, record_routes=dtype)[0][ROUTES].cpu()
            fed = torch.arange(batch.tokens.shape[1]) < torch.tensor(lengths).unsqueeze(1) - 1
            out[f"{name}/{kind}"] = route_agreement(full, batch.routes, fed)
    return out


def _continued_and_rerouted(sampler, prompts, single) -> list:
    """The partial-rollout calls on ``single``'s sequences: each continued from its first two
    tokens by two more (``continue_sequences``, its carried prefix prefilled again), and each
    whole sequence routed by one forward (``route_histories``); as (kind, batch, fed lengths)."""
    from types import SimpleNamespace

    from emapg_megatron.rollout.route_recording import lay_routes

    seqs = [SimpleNamespace(prompt=prompts[s // 2], tokens=r[:2], logprobs=[-1.0, -1.0], rng_step=3, row=s)
            for s, r in enumerate(single.responses)]
    done = sampler.continue_sequences(seqs, temperature=1.0, top_p=1.0, max_new_tokens=4)
    histories = [q.prompt + t.token_ids for q, t in zip(seqs, done.turns)]
    width = max(len(h) for h in histories)
    tokens = torch.tensor([h + [0] * (width - len(h)) for h in histories])
    continued = SimpleNamespace(tokens=tokens, routes=lay_routes(done.routes, width))
    rerouted = SimpleNamespace(tokens=tokens, routes=lay_routes(sampler.route_histories(histories), width))
    lengths = [len(h) for h in histories]
    return [("continued", continued, lengths), ("rerouted", rerouted, [n + 1 for n in lengths])]
