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

    def load(chunks, optimizer, cfg, model_cfg):
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

    def load(chunks, optimizer, cfg, model_cfg):
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
