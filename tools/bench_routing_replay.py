"""Rollout/training routing agreement without routing replay and under R3, side by side
(CPU, gloo; ``--preset moe-tiny-cpu``: a Qwen3-MoE-shaped policy, 4 experts, top-2, EP=2 on two
processes):

    python tools/bench_routing_replay.py --steps 50

Trains ``--steps`` steps from the same seed twice, with ``--moe-routing-replay none`` and ``r3``,
and reports per step and as medians ``moe_route_agreement`` (the share of trained tokens whose
expert set in the old-policy pass equals the sampler's, in every MoE layer) and
``rollout_logprob_diff`` (mean |sampler - old-pass log-prob| over trained tokens). Under R3 the
passes replay the sampler's routes, so the agreement is 1 by construction and the log-prob gap is
the rounding of the cached against the full forward; without replay it shows how often the
trainer's forward routes a token differently from the rollout. One JSON object on stdout.

On a CPU in fp32 the sampler's forwards and the trainer's agree to rounding, so without replay the
routes agree too. ``--sampler-router-noise S`` stands in for a sampler whose numerics differ (another
kernel, bf16, an inference engine): the routers' weights get N(0, S^2) noise while each rollout
is sampled (the same noise in both runs, removed before the passes).
"""

from __future__ import annotations

import argparse
import json
import statistics

KEYS = ("moe_route_agreement", "rollout_logprob_diff")


def with_noisy_routers(collect, chunks, scale: float):
    """``collect`` run with noise on the routers' weights (keyed by the step), restored after."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in chunks[0].modules() if isinstance(m, TopKRouter)]

    def noisy(step):
        g = torch.Generator().manual_seed(step)
        kept = [r.weight.detach().clone() for r in routers]
        with torch.no_grad():
            for r in routers:
                r.weight.add_(scale * torch.randn(r.weight.shape, generator=g).to(r.weight))
        try:
            return collect(step)
        finally:
            with torch.no_grad():
                for r, w in zip(routers, kept):
                    r.weight.copy_(w)

    return noisy


def steps_of(argv: list, steps: int, noise: float = 0.0) -> list[dict]:
    """The trainer as ``emapg_megatron.train`` builds it, ``steps`` steps; their route metrics."""
    from emapg_megatron import build

    trainer = build.build_trainer(build.prepare(argv))
    if noise:
        trainer.collector.collect = with_noisy_routers(trainer.collector.collect, trainer.model_chunks, noise)
    rows = []
    for i in range(1, steps + 1):
        metrics = trainer.step(i).metrics
        rows.append({k: metrics.get(k) for k in KEYS})
    return rows


def measure(steps: int, ep: int, seed: int, noise: float, extra: list) -> dict:
    from emapg_megatron.multiprocess import run_distributed

    out = {}
    for mode in ("none", "r3"):
        argv = ["--preset", "moe-tiny-cpu", "--train-iters", str(steps), "--seed", str(seed),
                "--expert-model-parallel-size", str(ep), "--moe-routing-replay", mode, *extra]
        rows = run_distributed(steps_of, 2, ep=ep, args=(argv, steps, noise), timeout=3600)[0]
        out[mode] = {"per_step": {k: [r[k] for r in rows] for k in KEYS},
                     "median": {k: statistics.median(r[k] for r in rows) for k in KEYS}}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ep", type=int, choices=(1, 2), default=2,
                   help="expert parallelism over the two processes (1: data parallelism only)")
    p.add_argument("--sampler-router-noise", type=float, default=0.0,
                   help="std of the noise on the router weights while sampling (see above)")
    a, extra = p.parse_known_args(argv)  # further trainer flags pass through
    if a.steps < 1:
        p.error("--steps must be >= 1")
    from seed_report import machine

    print(json.dumps({**measure(a.steps, a.ep, a.seed, a.sampler_router_noise, extra), "steps": a.steps,
                      "seed": a.seed, "ep": a.ep, "sampler_router_noise": a.sampler_router_noise,
                      "extra_flags": extra, "machine": machine()}))


if __name__ == "__main__":
    main()
