"""Benchmark the built-in sampler: generated tokens/s against the response length, with the KV
cache (the default) and without it (the cache-free reference), side by side.

    python tools/bench_rollout.py --json                       # CPU, tiny model
    python tools/bench_rollout.py --device cuda --model small --uncached-max 2048 --json

Each length samples ``--batch`` sequences of exactly that many tokens (no eos) from one
``--prompt``-token prompt per sequence, after one short warm-up call; the sampler's buffers are
sized to prompt + length, as ``evaluate --load`` sizes them. The cache-free path recomputes
the whole sequence per token, so on a CPU it stops at ``--uncached-max`` (null beyond). The
check: the cached path's tokens/s at the longest length is at least half of its own at the
shortest.

    python tools/bench_rollout.py --compare-scheduling --json  # continuous batching vs waves

``--compare-scheduling`` samples ``--batch`` sequences of long-tailed lengths (every
``--slots``-th one ``--long`` tokens, the others at most ``--short``; no eos) over ``--slots``
slots of the fixed-shape decode step, in waves and continuously batched, and prints one JSON line
per schedule: decode forwards, generated tokens, tokens/s. The check: continuous batching needs
at least 1.5x fewer decode forwards for the same tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MODELS = {
    "tiny": dict(vocab_size=100, make_vocab_size_divisible_by=64, hidden_size=64, ffn_hidden_size=128,
                 num_layers=2, num_attention_heads=4, num_query_groups=2),
    "small": dict(vocab_size=32000, make_vocab_size_divisible_by=128, hidden_size=1024,
                  ffn_hidden_size=2816, num_layers=12, num_attention_heads=16, num_query_groups=4),
}


def _model(model_name: str, max_len: int):
    """One model (its config and chunks) every sampler of a measurement shares."""
    from emapg_megatron.models.config import ModelConfig
    from emapg_megatron.models.gpt import build_for_this_rank

    cfg = ModelConfig(**MODELS[model_name], max_position_embeddings=max_len)
    return cfg, [build_for_this_rank(cfg)]


def _sampler(model, seq_length: int, batch: int, **settings):
    """The built-in sampler (``settings``: its config's fields), buffers sized to ``seq_length``."""
    from emapg_megatron.rollout.config import SamplerConfig
    from emapg_megatron.rollout.megatron_sampler import MegatronSampler

    cfg, chunks = model
    return MegatronSampler(chunks, SamplerConfig(**settings).resolved(partial_rollouts=False),
                           vocab_size=cfg.vocab_size, eos_id=None, pad_id=0, seq_length=seq_length,
                           micro_batch_size=batch, seed=0)


PATHS = {"cached": True, "uncached": False}  # --rollout-kv-cache of each measured path


def _tokens_per_s(model, kv_cache: bool, prompts, length: int) -> float:
    import torch

    sampler = _sampler(model, len(prompts[0]) + length, len(prompts), kv_cache=kv_cache)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    batch = sampler.generate(prompts, 1, 1.0, 1.0, length)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return sum(len(r) for r in batch.responses) / elapsed


def measure(model_name: str, lengths: list[int], batch: int, prompt: int, uncached_max: int) -> list[dict]:
    """One row per length: tokens/s of both paths (one rank, spawned by run_distributed)."""
    import torch

    torch.manual_seed(0)
    prompts = [[(7 * s + i) % 90 + 1 for i in range(prompt)] for s in range(batch)]
    model = _model(model_name, prompt + max(lengths))
    for kv_cache in PATHS.values():
        _tokens_per_s(model, kv_cache, prompts, 8)  # warm-up: allocations, lazy imports
    rows = []
    for length in lengths:
        row = {"response_tokens": length, "batch": batch, "prompt_tokens": prompt}
        for name, kv_cache in PATHS.items():
            skip = name == "uncached" and length > uncached_max
            row[f"{name}_tokens_per_s"] = None if skip else round(_tokens_per_s(model, kv_cache, prompts, length), 1)
        rows.append(row)
    return rows


def tailed_budgets(batch: int, slots: int, long: int, short: int) -> list[int]:
    """Long-tailed response lengths: one sequence in each ``slots`` is ``long``, the rest between
    8 and ``short`` (so each wave of ``slots`` holds one long sequence)."""
    return [long if i % slots == 0 else 8 + (5 * i) % max(short - 7, 1) for i in range(batch)]


def compare_scheduling(model_name: str, batch: int, slots: int, long: int, short: int,
                       prompt: int) -> list[dict]:
    """Both schedules of the fixed-shape decoder on the same sequences (one rank)."""
    import torch

    torch.manual_seed(0)
    budgets = tailed_budgets(batch, slots, long, short)
    histories = [[(7 * s + i) % 90 + 1 for i in range(prompt)] for s in range(batch)]
    from emapg_megatron.rollout.decoders import Sampling

    model, rows, sampling = _model(model_name, prompt + long), [], Sampling(1.0, 1.0)
    for schedule in ("waves", "continuous"):
        sampler = _sampler(model, prompt + long, batch, fixed_shape=True, max_requests=slots,
                           continuous_batching=schedule == "continuous")
        sampler.decode_turns(histories[:slots], budgets[:slots], list(range(slots)), sampling)  # warm-up
        start = time.perf_counter()
        turns, decoded = sampler.decode_turns(histories, budgets, list(range(batch)), sampling)
        elapsed = time.perf_counter() - start
        stats, tokens = decoded.schedule, sum(len(t.token_ids) for t in turns)
        rows.append({"scheduling": schedule, "forwards": stats.decode_forwards, "generated_tokens": tokens,
                     "tokens_per_s": round(tokens / elapsed, 1), "prefill_forwards": stats.prefill_forwards,
                     "mean_live_slots": round(stats.mean_live_slots, 3), "slots": slots, "sequences": batch})
    return rows


def scheduling_check(rows: list[dict]) -> dict:
    by = {r["scheduling"]: r for r in rows}
    ratio = by["waves"]["forwards"] / by["continuous"]["forwards"]
    same = by["waves"]["generated_tokens"] == by["continuous"]["generated_tokens"]
    return {"check": "continuous batching: >= 1.5x fewer decode forwards than waves, same tokens",
            "forwards_ratio": round(ratio, 3), "pass": ratio >= 1.5 and same}


def summary(rows: list[dict]) -> dict:
    first, last = rows[0], rows[-1]
    ratio = last["cached_tokens_per_s"] / first["cached_tokens_per_s"]
    return {"check": f"cached tokens/s at {last['response_tokens']} >= half of at {first['response_tokens']}",
            "cached_ratio": round(ratio, 3), "pass": ratio >= 0.5}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--lengths", default="32,128,512,2048", help="comma-separated response lengths")
    p.add_argument("--batch", type=int, default=4, help="sequences per generate call")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
    p.add_argument("--uncached-max", type=int, default=512,
                   help="longest length the cache-free path runs (its cost grows with the square)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--compare-scheduling", action="store_true",
                   help="continuous batching against waves on long-tailed lengths (fixed-shape step)")
    p.add_argument("--slots", type=int, default=8, help="--compare-scheduling: decode slots")
    p.add_argument("--long", type=int, default=256, help="--compare-scheduling: the long sequences' tokens")
    p.add_argument("--short", type=int, default=32, help="--compare-scheduling: the others' at most")
    p.add_argument("--json", action="store_true", help="one JSON object: rows and the check")
    p.add_argument("--out", default=None, help="also write that JSON object to this file")
    return p


def main(argv=None) -> None:
    from emapg_megatron.multiprocess import run_distributed

    args = build_parser().parse_args(argv)
    if args.compare_scheduling:
        return main_scheduling(args)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    [rows] = run_distributed(measure, 1, device=args.device, timeout=3600,
                             args=(args.model, lengths, args.batch, args.prompt, args.uncached_max))
    result = {"model": args.model, "device": args.device, "rows": rows, **summary(rows)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'tokens':>7} {'cached tok/s':>13} {'uncached tok/s':>15}")
    for r in rows:
        print(f"{r['response_tokens']:>7} {r['cached_tokens_per_s']:>13} {str(r['uncached_tokens_per_s']):>15}")
    print(f"{result['check']}: ratio {result['cached_ratio']} ({'pass' if result['pass'] else 'FAIL'})")


def main_scheduling(args) -> None:
    """``--compare-scheduling``: one JSON line per schedule (``--json``) or a table; the check
    goes to stderr under ``--json``, so stdout stays one object per line."""
    from emapg_megatron.multiprocess import run_distributed

    batch = args.batch if args.batch != build_parser().get_default("batch") else 4 * args.slots
    [rows] = run_distributed(compare_scheduling, 1, device=args.device, timeout=3600,
                             args=(args.model, batch, args.slots, args.long, args.short, args.prompt))
    check = scheduling_check(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, **check}, f, indent=1)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        print(json.dumps(check), file=sys.stderr)
        return
    print(f"{'scheduling':>11} {'forwards':>9} {'tokens':>7} {'tok/s':>8} {'live slots':>11}")
    for r in rows:
        print(f"{r['scheduling']:>11} {r['forwards']:>9} {r['generated_tokens']:>7} {r['tokens_per_s']:>8} "
              f"{r['mean_live_slots']:>11}")
    print(f"{check['check']}: ratio {check['forwards_ratio']} ({'pass' if check['pass'] else 'FAIL'})")


if __name__ == "__main__":
    main()
