"""Trainer throughput on one GPU: a Qwen2.5-0.5B-shaped model, bf16, random init, N steps.

    python tools/bench_gpu_train.py --out runs/gpu_check/bench_train.json

Runs ``torchrun --nproc_per_node 1 -m emapg_megatron.train`` on the built-in copy task with the
shapes of Qwen2.5-0.5B (hidden 896, FFN 4864, 24 layers, 14 heads, 2 KV groups, vocabulary 151936,
tied embeddings, qkv bias, RoPE base 1e6), set by the trainer's model flags (``--vocab-size``
gives the random-init model the 151936-way embedding and output layer; the copy task still uses
its 13-token alphabet), and reads its ``metrics.jsonl``: step time, generated tokens/s, rollout
and update time, and peak GPU memory (``max_memory_allocated_gib``, the trainer's
``torch.cuda.max_memory_allocated``). Steps before ``--warmup`` are left out of the summary.
Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TOOLS)
sys.path[:0] = [TOOLS, REPO]  # run_gpu_checks; emapg_megatron without an install

from run_gpu_checks import child_env, run_logged  # noqa: E402

# Qwen2.5-0.5B (config.json of the released model), random weights.
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)


def param_count(s: dict) -> int:
    """Parameters of a Qwen2 model with these shapes (qkv bias, SwiGLU, RMSNorm)."""
    h, ffn, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    head = h // s["num_attention_heads"]
    qkv_out = h + 2 * s["num_key_value_heads"] * head
    per_layer = h * qkv_out + qkv_out + h * h + 3 * h * ffn + 2 * h
    embed = s["vocab_size"] * h * (1 if s["tie_word_embeddings"] else 2)
    return layers * per_layer + embed + h


def model_args(shapes: dict = QWEN25_05B) -> list[str]:
    """The trainer's model flags for these shapes (random init)."""
    argv = ["--num-layers", str(shapes["num_hidden_layers"]), "--hidden-size", str(shapes["hidden_size"]),
            "--ffn-hidden-size", str(shapes["intermediate_size"]),
            "--num-attention-heads", str(shapes["num_attention_heads"]),
            "--num-query-groups", str(shapes["num_key_value_heads"]),
            "--vocab-size", str(shapes["vocab_size"]), "--add-qkv-bias",
            "--rotary-base", str(shapes["rope_theta"]), "--norm-epsilon", str(shapes["rms_norm_eps"]),
            "--max-position-embeddings", str(shapes["max_position_embeddings"])]
    if not shapes["tie_word_embeddings"]:
        argv.append("--untie-embeddings-and-output-weights")
    return argv


def trainer_argv(a, log_dir: str) -> list[str]:
    return [
        "--task", "synthetic-copy", "--device", "cuda", "--bf16", "--transformer-impl", a.transformer_impl,
        "--seed", "1234", *model_args(),
        "--train-iters", str(a.steps), "--seq-length", str(a.seq_length), "--max-new-tokens", str(a.max_new_tokens),
        "--rollout-batch-size", str(a.rollout_batch_size), "--num-samples-per-prompt", str(a.num_samples_per_prompt),
        "--micro-batch-size", str(a.micro_batch_size), "--global-batch-size", str(a.global_batch_size),
        "--lr", "1e-6", "--kl-loss-type", "topk-reverse", "--kl-topk-tokens", str(a.kl_topk_tokens),
        "--ema-eta", "0.9", "--ema-update-period", "1", "--log-interval", "1", "--log-dir", log_dir,
        *(["--fp8-format", a.fp8_format] if a.fp8_format else []),
    ]


PER_STEP_KEYS = ("step", "step_time_s", "tokens_per_s", "rollout_time_s", "update_time_s", "reward_mean", "kl",
                 "skipped", "max_memory_allocated_gib")


def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a timeout
    return rows


def summarize(rows: list[dict], warmup: int, sequences_per_step: int) -> dict:
    timed = [r for r in rows if r.get("step", 0) > warmup] or rows
    if not timed:
        return {}

    def stat(key):
        vals = [float(r[key]) for r in timed if isinstance(r.get(key), (int, float))]
        return {"median": statistics.median(vals), "mean": statistics.fmean(vals), "min": min(vals),
                "max": max(vals)} if vals else None

    out = {k: stat(k) for k in ("step_time_s", "tokens_per_s", "rollout_time_s", "rollout_tokens_per_s",
                                "update_time_s", "response_len")}
    out["steps_timed"] = [r.get("step") for r in timed]
    if out["step_time_s"]:
        out["sequences_per_s"] = sequences_per_step / out["step_time_s"]["median"]
    out["max_memory_allocated_gib"] = max(r["max_memory_allocated_gib"] for r in rows)  # peak of the run
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON result file")
    p.add_argument("--work-dir", default=None, help="trainer log and metrics (default: next to --out)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the summary")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rollout-batch-size", type=int, default=16)
    p.add_argument("--num-samples-per-prompt", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--kl-topk-tokens", type=int, default=32)
    p.add_argument("--transformer-impl", default="auto", choices=("auto", "local", "transformer_engine"),
                   help="the trainer's layer implementation (auto: Transformer Engine when it imports)")
    p.add_argument("--fp8-format", default=None, choices=("e4m3", "hybrid"),
                   help="FP8 GEMMs through Transformer Engine (the trainer's flag; needs the TE spec)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the trainer run (then killed)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the trainer command, run nothing")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.steps < 1 or a.warmup < 0 or a.timeout <= 0:
        raise SystemExit("--steps >= 1, --warmup >= 0 and --timeout > 0 please")
    from emapg_megatron.multiprocess import free_port

    work = os.path.abspath(a.work_dir or os.path.join(os.path.dirname(os.path.abspath(a.out)), "bench_train"))
    log_dir = os.path.join(work, "log")
    argv_train = trainer_argv(a, log_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
           str(free_port()), "-m", "emapg_megatron.train", *argv_train]
    result = {"benchmark": "trainer_qwen2.5-0.5b_shapes_" + (f"fp8_{a.fp8_format}" if a.fp8_format else "bf16"),
              "model": {**QWEN25_05B, "params": param_count(QWEN25_05B), "init": "random"},
              "config": {k: v for k, v in vars(a).items() if k not in ("out", "dry_run")},
              "trainer_argv": argv_train}
    if a.dry_run:
        print(json.dumps(result, indent=1))
        return 0
    os.makedirs(work, exist_ok=True)
    shutil.rmtree(log_dir, ignore_errors=True)
    log_path = os.path.join(work, "train.log")
    t0 = time.monotonic()
    rc = run_logged(cmd, log_path, a.timeout, child_env())
    rows = read_metrics(os.path.join(log_dir, "metrics.jsonl"))
    result.update(returncode=rc, run_s=round(time.monotonic() - t0, 1), steps_logged=len(rows),
                  summary=summarize(rows, a.warmup, a.rollout_batch_size * a.num_samples_per_prompt),
                  per_step=[{k: r.get(k) for k in PER_STEP_KEYS} for r in rows])
    ok = rc == 0 and len(rows) == a.steps
    if not ok:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            result["log_tail"] = f.read()[-6000:]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    s = result["summary"]
    if s.get("step_time_s"):
        print(f"{len(rows)} steps; step {s['step_time_s']['median']:.2f} s (median of steps {s['steps_timed'][0]}.."
              f"{s['steps_timed'][-1]}), {s['tokens_per_s']['median']:.0f} generated tokens/s, "
              f"peak memory allocated {s['max_memory_allocated_gib']:.2f} GiB")
    print(f"wrote {a.out} (returncode {rc})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
