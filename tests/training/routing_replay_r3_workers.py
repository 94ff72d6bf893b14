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


def cases(base: list, runs: dict) -> dict:
    """:func:`one_step` of each ``name: (extra flags, perturbation)``, in one process."""
    return {name: one_step([*base, *extra], perturb) for name, (extra, perturb) in runs.items()}
