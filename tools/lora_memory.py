#!/usr/bin/env python3
"""Memory per rank with and without LoRA (--lora-rank), from tools/memory_plan.py's arithmetic.

For each model and layout, the bytes per rank of the weights, gradients, fp32 main params, Adam
moments and the fp32 EMA anchor of a full fine-tune and of a LoRA run (adapters on linear_qkv,
linear_proj, linear_fc1 and linear_fc2 of every layer; the base frozen: weights only). Activations,
the KV cache and the rest are as in memory_plan.py (not counted here). tests/training/
test_lora_trainer.py checks the LoRA arithmetic against the tensors a tiny LoRA run allocates.

    python tools/lora_memory.py                                  # Qwen2.5-0.5B and 7B, rank 16, one GPU
    python tools/lora_memory.py --model qwen2.5-7b --rank 64 --tp 2 --dp 4 --distributed-optimizer
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import memory_plan as mp  # noqa: E402

PARTS = ("weights", "grads", "main_params", "adam", "ema_device", "total_device")


def checkpoint_bytes(part: dict, saved_weights: int) -> int:
    """What a rank's checkpoint holds: ``saved_weights`` bytes of model weights, then the fp32
    main params (bf16 runs), Adam's moments and the EMA of what trains."""
    return saved_weights + part["main_params"] + part["adam"] + part["ema_device"] + part.get("ema_host", 0)


def compare(cfg, layout: mp.Layout, rank: int) -> dict:
    """``{"full": bytes, "lora": bytes, "saved": full - lora}`` per part, the trainable counts, and
    the checkpoint's bytes per rank: a full run saves every weight, a LoRA run on a base from files
    the adapters alone (docs/lora.md: the base is named by its sha256)."""
    full, lora = mp.memory(cfg, layout), mp.memory(cfg, layout, lora_rank=rank)
    adapters = lora["trainable_per_rank"] * (2 if layout.bf16 else 4)
    return {"params_per_rank": full["params_per_rank"], "adapter_params_per_rank": lora["trainable_per_rank"],
            "full": {k: full[k] for k in PARTS}, "lora": {k: lora[k] for k in PARTS},
            "saved": {k: full[k] - lora[k] for k in PARTS},
            "checkpoint": {"full": checkpoint_bytes(full, full["weights"]),
                           "lora_adapters_only": checkpoint_bytes(lora, adapters)}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", choices=sorted(mp.QWEN25),
                   help="a Qwen2.5 shape (repeatable; default: qwen2.5-0.5b and qwen2.5-7b)")
    p.add_argument("--rank", type=int, default=16, help="--lora-rank (default 16)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--ema", choices=mp.EMA_MODES, default="plain")
    p.add_argument("--fp32", action="store_true", help="an fp32 model (no --bf16)")
    a = p.parse_args(argv)
    layout = mp.Layout(a.tp, a.pp, a.dp, a.distributed_optimizer, a.ema, not a.fp32)
    rows = [{"model": name, "layout": layout.name(), "lora_rank": a.rank,
             **compare(mp.qwen25(name), layout, a.rank)}
            for name in a.model or ("qwen2.5-0.5b", "qwen2.5-7b")]
    print(json.dumps(rows, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
