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

    python tools/bench_rollout.py --compare-decoders --device cuda --model qwen2.5-0.5b --bf16 \
        --batch 128 --prompt 64 --lengths 1024 --json      # the three KV-cached decode paths

``--compare-decoders`` samples ``--batch`` sequences of exactly the (single) ``--lengths`` tokens
with each decode path of ``--paths``: ``graphs`` (the fixed-shape step replayed from CUDA graphs;
on a CPU it runs eagerly, so only its plumbing is exercised), ``fixed`` (the fixed-shape step,
eager) and ``lockstep`` (Megatron-Core's static context): generated tokens/s of one generate call
(after a warm-up call), whose graphs path includes capturing its graphs (``capture_s`` says how
long a capture of every bucket takes). Then milliseconds per decode step at each batch of
``--step-batches``: the fixed-shape paths time ``--step-tokens`` calls of the decoder's step
(host bookkeeping included); the lockstep path a generate of that many tokens divided by them
(one prefill included). The graphed paths' tokens equal the eager ones' (``same_tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MODELS = {
    "tiny": dict(vocab_size=100, make_vocab_size_divisible_by=64, hidden_size=64, ffn_hidden_size=128,
                 num_layers=2, num_attention_heads=4, num_query_groups=2),
    "small": dict(vocab_size=32000, make_vocab_size_divisible_by=128, hidden_size=1024,
                  ffn_hidden_size=2816, num_layers=12, num_attention_heads=16, num_query_groups=4),
    # Qwen2.5-0.5B's shapes (its config.json), random weights
    "qwen2.5-0.5b": dict(vocab_size=151936, make_vocab_size_divisible_by=128, hidden_size=896,
                         ffn_hidden_size=4864, num_layers=24, num_attention_heads=14, num_query_groups=2,
                         add_qkv_bias=True, tie_word_embeddings=True, rotary_base=1000000.0),
}
DECODERS = {  # --compare-decoders: the sampler settings of each path
    "graphs": dict(fixed_shape=True, cuda_graphs=True),
    "fixed": dict(fixed_shape=True, cuda_graphs=False),
    "lockstep": dict(fixed_shape=False),
}


def _model(model_name: str, max_len: int, bf16: bool = False):
    """One model (its config and chunks) every sampler of a measurement shares."""
    from emapg_megatron.models.config import ModelConfig, PrecisionConfig
    from emapg_megatron.models.gpt import build_for_this_rank

    cfg = ModelConfig(**MODELS[model_name], max_position_embeddings=max_len)
    return cfg, [build_for_this_rank(cfg, PrecisionConfig(bf16=bf16, transformer_impl="local"))]


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


def _synchronize() -> float:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def _timed_generate(model, settings: dict, prompts, length: int) -> tuple[float, list, object]:
    """Seconds of one generate call after a short warm-up call, its responses and stats."""
    sampler = _sampler(model, len(prompts[0]) + length, len(prompts), max_requests=len(prompts), **settings)
    sampler.generate(prompts, 1, 1.0, 1.0, min(4, length))  # warm-up: allocations, lazy imports, kernels
    start = _synchronize()
    batch = sampler.generate(prompts, 1, 1.0, 1.0, length)
    return _synchronize() - start, batch.responses, batch.stats


def _step_ms(model, graphs: bool, prompts, steps: int) -> tuple[float, float]:
    """Milliseconds per fixed-shape decode step over ``len(prompts)`` live slots (after three
    untimed steps), and the seconds capturing the graphs took (0 when eager)."""
    import torch

    from emapg_megatron.rollout.static_decode import StaticDecoder

    cfg, chunks = model
    slots, live = len(prompts), list(range(len(prompts)))
    chunks[0].eval()
    with torch.no_grad():
        start = _synchronize()
        dec = StaticDecoder(chunks[0], slots, len(prompts[0]) + steps + 4, cfg.vocab_size, 1.0, 1.0,
                            cuda_graphs=graphs)
        capture_s = _synchronize() - start if graphs else 0.0
        dec.extend(live, prompts, [0] * slots, [0.5] * slots)
        for _ in range(3):
            dec.step(live, [0.5] * slots)
        start = _synchronize()
        for t in range(steps):
            dec.step(live, [((7 * t + s) % 10) / 10 + 0.05 for s in live])
        elapsed = _synchronize() - start
    return 1000 * elapsed / steps, capture_s


def compare_decoders(model_name: str, batch: int, prompt: int, length: int, paths: list[str],
                     step_batches: list[int], step_tokens: int, bf16: bool, out: str | None = None) -> dict:
    """The decode paths on the same prompts (one rank): tokens/s, ms per step, capture time.
    ``out``: the figures so far are written there after each measurement (a run cut short by its
    time limit keeps them)."""
    import torch

    from emapg_megatron import runtime

    torch.manual_seed(0)
    graphs_possible = runtime.hardware() == "cuda"
    model = _model(model_name, prompt + max(length, step_tokens + 4), bf16)
    prompts = [[(7 * s + i) % 90 + 1 for i in range(prompt)] for s in range(batch)]
    rows, responses, steps = [], {}, []
    head = {"model": model_name, "bf16": bf16, "device": runtime.hardware(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}

    def save(done: bool = False) -> None:
        if out:
            with open(out + ".tmp", "w") as f:
                json.dump({**head, "rows": rows, "step_ms": steps, "complete": done}, f, indent=1)
            os.replace(out + ".tmp", out)

    for name in paths:
        elapsed, responses[name], stats = _timed_generate(model, DECODERS[name], prompts, length)
        tokens = sum(len(r) for r in responses[name])
        rows.append({"path": name, "graphs": name == "graphs" and graphs_possible, "batch": batch,
                     "prompt_tokens": prompt, "new_tokens": length, "generated_tokens": tokens,
                     "seconds": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 1),
                     "forwards": stats.forwards(), "graph_memory_mib": round(stats.graph_memory / 2**20, 1)})
        save()
    for b in step_batches:
        row = {"batch": b}
        for name in paths:
            if name == "lockstep":
                elapsed, _, _ = _timed_generate(model, DECODERS[name], prompts[:b], step_tokens)
                row["lockstep_ms"] = round(1000 * elapsed / step_tokens, 3)
            else:
                ms, capture_s = _step_ms(model, name == "graphs" and graphs_possible, prompts[:b], step_tokens)
                row[f"{name}_ms"] = round(ms, 3)
                if name == "graphs":
                    row["capture_s"] = round(capture_s, 3)
        steps.append(row)
        save()
    eager = "fixed" if "fixed" in responses else None
    same = {name: responses[name] == responses[eager] for name in responses if eager and name != eager}
    by = {r["path"]: r["tokens_per_s"] for r in rows}
    ratios = {f"{a}_over_{b}": round(by[a] / by[b], 3) for a, b in (("graphs", "fixed"), ("graphs", "lockstep"),
                                                                    ("fixed", "lockstep")) if a in by and b in by}
    return {**head, "rows": rows, "step_ms": steps, "step_tokens": step_tokens, "ratios": ratios,
            "same_tokens_as_fixed": same, "complete": True}


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
    p.add_argument("--compare-decoders", action="store_true",
                   help="the KV-cached decode paths (--paths) side by side: tokens/s and ms per step")
    p.add_argument("--paths", default="graphs,fixed,lockstep",
                   help=f"--compare-decoders: comma-separated paths of {sorted(DECODERS)}")
    p.add_argument("--step-batches", default="1,16,128", help="--compare-decoders: batches timed per step")
    p.add_argument("--step-tokens", type=int, default=64, help="--compare-decoders: steps timed per batch")
    p.add_argument("--bf16", action="store_true", help="bf16 weights and activations (default fp32)")
    p.add_argument("--json", action="store_true", help="one JSON object: rows and the check")
    p.add_argument("--out", default=None, help="also write that JSON object to this file")
    return p


def main(argv=None) -> None:
    from emapg_megatron.multiprocess import run_distributed

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compare_scheduling:
        return main_scheduling(args)
    if args.compare_decoders:
        return main_decoders(parser, args)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    [rows] = run_distributed(measure, 1, device=args.device, timeout=3600,
                             args=(args.model, lengths, args.batch, args.prompt, args.uncached_max))
    result = {"model": args.model, "device": args.device, "rows": rows, **summary(rows)}
    if emit(result, args):
        return
    print(f"{'tokens':>7} {'cached tok/s':>13} {'uncached tok/s':>15}")
    for r in rows:
        print(f"{r['response_tokens']:>7} {r['cached_tokens_per_s']:>13} {str(r['uncached_tokens_per_s']):>15}")
    print(f"{result['check']}: ratio {result['cached_ratio']} ({'pass' if result['pass'] else 'FAIL'})")


def emit(result: dict, args) -> bool:
    """Write ``result`` to ``--out`` if given; print it as one JSON line under ``--json`` (True:
    nothing else to print)."""
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result))
    return args.json


def main_decoders(parser: argparse.ArgumentParser, args) -> None:
    """``--compare-decoders``: one JSON object (``--json``) or a table."""
    from emapg_megatron.multiprocess import run_distributed

    paths = [p for p in args.paths.split(",") if p]
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.step_batches.split(",")]
    if not paths or set(paths) - set(DECODERS) or len(lengths) != 1 or max(batches) > args.batch:
        parser.error(f"--compare-decoders: --paths of {sorted(DECODERS)}, one --lengths, "
                     f"--step-batches up to --batch")
    [result] = run_distributed(compare_decoders, 1, device=args.device, timeout=3600,
                               args=(args.model, args.batch, args.prompt, lengths[0], paths, batches,
                                     args.step_tokens, args.bf16, os.path.abspath(args.out) if args.out else None))
    if emit(result, args):
        return
    for r in result["rows"]:
        print(f"{r['path']:>9}: {r['tokens_per_s']:>10} tok/s ({r['generated_tokens']} tokens, {r['seconds']} s)")
    for r in result["step_ms"]:
        print("batch", r["batch"], {k: v for k, v in r.items() if k != "batch"})
    print("ratios", result["ratios"], "same tokens as the eager fixed-shape step:", result["same_tokens_as_fixed"])


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
