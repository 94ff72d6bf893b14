"""The MoE demo's figures over seeds (``examples/moe_tiny_cpu.sh``).

    python tools/moe_report.py OUT --seeds 1 2 3 4 5

Reads OUT/seed-<S>/metrics.jsonl of each seed. Per seed: the mean reward over the first and over
the last 10 logged steps, the expert load (the most-loaded expert over the mean, averaged over the
MoE layers: 1 is perfectly balanced) and the load-balancing loss over the last 10 steps, and the
mean |log-prob difference| between the sampler and the trainer's old-policy pass over all steps.
Writes OUT/moe_seeds.png (reward, and the expert load of each layer) and prints, as its last line,
one JSON object with each figure's per-seed values, median, min and max, and the machine.

The route agreement between rollout and training (``moe_route_agreement``: the share of trained
tokens the old-policy pass routed to the sampler's experts, logged wherever the sampler records its
routes) is reported over all steps too; null, with the reason, for runs that did not log it.
"""

from __future__ import annotations

import os

from seed_report import WINDOW, distribution, figure, machine, mean, plot_band, report_main

from emapg_megatron.run.metrics import read_jsonl

LOAD = "moe_load_max_over_mean"
AGREEMENT = "moe_route_agreement"


def series(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]


def seed_rows(out: str, seed: int) -> list[dict]:
    path = os.path.join(out, f"seed-{seed}", "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"error: {path} does not exist (did that run finish?)")
    rows = [r for r in read_jsonl(path) if "reward_mean" in r]
    if not rows or not series(rows, LOAD):
        raise SystemExit(f"error: {path} has no logged steps of a MoE run (no {LOAD})")
    return rows


def report(out: str, seeds: list[int]) -> dict:
    runs = [seed_rows(out, s) for s in seeds]
    rewards = [series(rows, "reward_mean") for rows in runs]
    layers = sorted({k for rows in runs for r in rows for k in r if k.startswith(f"{LOAD}/layer")},
                    key=lambda k: int(k.rsplit("layer", 1)[1]))
    fig, ax = figure(height=6.0)
    plot_band(ax, rewards, "reward", color="black")
    ax.legend(loc="upper left")
    load_ax = ax.twinx()
    load_ax.set_ylabel("expert load: max / mean tokens per expert")
    for i, key in enumerate(layers):
        plot_band(load_ax, [series(rows, key) for rows in runs], key.rsplit("/", 1)[1], color=f"C{i + 1}")
    load_ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "moe_seeds.png"), dpi=100)
    last = {key: distribution([mean(series(rows, key)[-WINDOW:]) if series(rows, key) else None
                               for rows in runs]) for key in (LOAD, "moe_aux_loss")}
    return {"out": out, "seeds": seeds, "steps": min(len(r) for r in rewards),
            f"reward_first_{WINDOW}": distribution([mean(r[:WINDOW]) for r in rewards]),
            f"reward_last_{WINDOW}": distribution([mean(r[-WINDOW:]) for r in rewards]),
            f"expert_load_last_{WINDOW}": last[LOAD],
            f"moe_aux_loss_last_{WINDOW}": last["moe_aux_loss"],
            "rollout_logprob_diff_mean": distribution([mean(series(rows, "rollout_logprob_diff")) for rows in runs],
                                                      digits=10),
            "routing_replay": "r2 (the old-policy pass's routes, replayed in the training passes)",
            **route_agreement(runs),
            "machine": machine()}


def route_agreement(runs: list[list[dict]]) -> dict:
    """``moe_route_agreement`` over all steps per seed, or null with the reason."""
    per_seed = [series(rows, AGREEMENT) for rows in runs]
    if not all(per_seed):
        return {"rollout_route_agreement": None,
                "rollout_route_agreement_missing": f"a run logged no {AGREEMENT} (the sampler records "
                                                   "routes only at PP = 1, without packing, sequence "
                                                   "parallelism or partial rollouts)"}
    return {"rollout_route_agreement": distribution([mean(s) for s in per_seed], digits=6)}


def main(argv=None) -> None:
    report_main(report, __doc__, "moe_seeds.png", argv)


if __name__ == "__main__":
    main()
