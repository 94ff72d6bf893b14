"""Benchmark the EMA anchor: update cost against an optimizer step, and its memory per parameter.

    python tools/bench_ema.py [--json] [--reps 7] [--models tiny,medium]

Time: a bf16 GPTModel with the distributed optimizer (DP=1, CPU), grads filled with noise;
each repetition times one ``optimizer.step()`` and then one EMA update (and a swap-in +
restore, and ``lag()``), side by side, so both see the same machine load. Reported: medians
and the median of the per-repetition ratios.

Memory: counted from the anchor's tensors and swap plan (``EmaAnchor.memory_report``), not
sampled, for plain / shard_over_dp / cpu_offload at DP=2 (the distributed optimizer's shards),
for a bf16 and an fp32 model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # CPUs that list AMX the VM disables

MODELS = {
    "tiny": dict(vocab_size=100, make_vocab_size_divisible_by=64, hidden_size=64, ffn_hidden_size=128,
                 num_layers=2, num_attention_heads=4, num_query_groups=2, max_position_embeddings=64),
    "medium": dict(vocab_size=8192, make_vocab_size_divisible_by=128, hidden_size=512, ffn_hidden_size=1536,
                   num_layers=8, num_attention_heads=8, num_query_groups=4, max_position_embeddings=256),
}
MODES = {"plain": {}, "shard_over_dp": {"shard_over_dp": True}, "cpu_offload": {"cpu_offload": True}}


def _build(model: str, bf16: bool, dist_opt: bool):
    from emapg_megatron.models.config import ModelConfig, PrecisionConfig
    from emapg_megatron.training.config import OptimConfig
    from emapg_megatron.training.model_and_optimizer import build_model_and_optimizer

    return build_model_and_optimizer(ModelConfig(**MODELS[model]),
                                     OptimConfig(lr=1e-5, use_distributed_optimizer=dist_opt),
                                     PrecisionConfig(bf16=bf16))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_update(model: str, reps: int) -> dict:
    import torch

    from emapg_megatron.anchor import EmaAnchor, EmaConfig

    chunks, opt = _build(model, bf16=True, dist_opt=True)
    anchor = EmaAnchor(chunks, opt, EmaConfig(eta=0.9, update_period=1))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for it in range(1, reps + 2):
        for buffer in chunks[0].buffers:
            buffer.grad_data.copy_(torch.randn(buffer.grad_data.shape, generator=gen) * 1e-3)
        row = {"optimizer_step": _timed(opt.step), "ema_update": _timed(lambda it=it: anchor.step(it))}

        def swap():
            with anchor.swapped_in():
                pass

        row["swap_in_and_restore"] = _timed(swap)
        row["lag"] = _timed(anchor.lag)
        if it > 1:  # the first repetition warms up allocators and kernels
            rows.append(row)
    out = {"params": anchor.layout.numel, "reps": reps}
    for key in ("optimizer_step", "ema_update", "swap_in_and_restore", "lag"):
        out[f"{key}_ms"] = round(1e3 * statistics.median(r[key] for r in rows), 3)
    for key in ("ema_update", "swap_in_and_restore", "lag"):
        out[f"{key}_over_step"] = round(statistics.median(r[key] / r["optimizer_step"] for r in rows), 4)
    return out


def count_memory(model: str) -> dict:
    from emapg_megatron.anchor import EmaAnchor, EmaConfig

    out = {}
    for bf16 in (True, False):
        chunks, opt = _build(model, bf16=bf16, dist_opt=True)
        for mode, kwargs in MODES.items():
            rep = EmaAnchor(chunks, opt, EmaConfig(**kwargs)).memory_report()
            out[f"{'bf16' if bf16 else 'fp32'}/{mode}"] = {
                k: round(v, 4) if isinstance(v, float) else v for k, v in rep.items()
                if k.endswith("per_param") or k in ("local_params", "staging_device_bytes")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--models", default="tiny,medium")
    args = parser.parse_args()

    from emapg_megatron.multiprocess import run_distributed

    result = {"device": "cpu", "torch_threads_per_rank": None, "models": {}}
    for model in args.models.split(","):
        if model not in MODELS:
            raise SystemExit(f"--models: unknown model {model!r} (choose from {sorted(MODELS)})")
        (timing,) = run_distributed(time_update, 1, args=(model, args.reps), timeout=1200)
        memory = run_distributed(count_memory, 2, args=(model,), timeout=1200)[0]  # DP=2, rank 0
        result["models"][model] = {"time_dp1_bf16_distopt": timing, "memory_dp2_rank0": memory}
    from emapg_megatron.multiprocess import threads_per_rank

    result["torch_threads_per_rank"] = threads_per_rank(1)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for model, res in result["models"].items():
        t = res["time_dp1_bf16_distopt"]
        print(f"{model}: {t['params']:,} params; optimizer step {t['optimizer_step_ms']} ms, EMA update "
              f"{t['ema_update_ms']} ms (ratio {t['ema_update_over_step']}), swap in+out "
              f"{t['swap_in_and_restore_ms']} ms, lag {t['lag_ms']} ms")
        for mode, mem in res["memory_dp2_rank0"].items():
            print(f"  {mode:22s} device {mem['ema_device_bytes_per_param']} B/param (+{mem['swap_device_bytes_per_param']} "
                  f"during a swap, + {mem['staging_device_bytes']} B staging), host "
                  f"{mem['ema_host_bytes_per_param']} B/param (+{mem['swap_host_bytes_per_param']} during a swap)")


if __name__ == "__main__":
    main()
