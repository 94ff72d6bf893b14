"""Update-phase throughput, padded vs packed micro-batches, on a long-tailed length mix.

    python tools/bench_packing.py --json                  # CPU: a tiny model, local spec
    python tools/bench_packing.py --json --device cuda    # GPU: a small model, TE spec (THD)

Sequence lengths are log-normal around ``--median`` and cut at ``--cap`` x the median. The padded
mode splits the batch into ``--micro-batch-size`` rows padded to the batch's longest sequence (what
the trainer runs without packing); the packed mode plans token-budget micro-batches (``--max-tokens``,
by default the token slots of one padded micro-batch, as in the trainer) and
packs them (``training.packing``). Both run forward + backward of a per-token policy loss through
the vocab-parallel fused op (``training.schedule.forward_backward``), as the update phase does.
One JSON line per mode: ``padding_fraction`` (computed slots that hold no sequence token) and
``tokens_per_s`` (sequence tokens per second of forward + backward, median of ``--iters``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SHAPES = {  # (hidden, ffn, layers, heads, query groups, vocab)
    "cpu": (128, 256, 2, 4, 2, 1024),
    "cuda": (1024, 2816, 8, 16, 4, 32000),
}


def lengths_mix(n: int, median: int, cap: float, seed: int) -> list[int]:
    """Log-normal lengths (sigma 1) around ``median``, cut to [4, cap x median]."""
    rng = random.Random(seed)
    return [max(4, min(int(cap * median), round(median * rng.lognormvariate(0.0, 1.0)))) for _ in range(n)]


def make_batch(lengths: list[int], vocab: int) -> dict:
    """Right-padded to the longest sequence; every token after the first is a loss position."""
    import torch

    from emapg_megatron import runtime

    S, L = len(lengths), max(lengths)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, vocab, (S, L), generator=g)
    mask = torch.zeros(S, L)
    for i, n in enumerate(lengths):
        tokens[i, n:] = 0
        mask[i, :n - 1] = 1.0
    labels = torch.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    return {k: v.to(runtime.device()) for k, v in dict(tokens=tokens, labels=labels, mask=mask).items()}


def token_loss(vocab: int):
    from megatron.core import parallel_state as ps

    from emapg_megatron.parallel import vocab_parallel_policy_terms

    def loss(logits, mb):
        terms = vocab_parallel_policy_terms(logits, mb["labels"], None, vocab_size=vocab, with_entropy=True,
                                            group=ps.get_tensor_model_parallel_group(), loss_mask=mb["mask"])
        return -(terms.logprob * mb["mask"]).sum() * 1e-3, {}

    return loss


def timed(chunks, opt, mbs, loss, iters: int) -> float:
    """Median seconds of one forward + backward over ``mbs`` (after one warm-up)."""
    import torch

    from emapg_megatron.training.model_and_optimizer import zero_grads
    from emapg_megatron.training.schedule import forward_backward

    times = []
    for _ in range(iters + 1):
        zero_grads(chunks, opt)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        forward_backward(chunks, mbs, loss)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def bench(a: dict) -> list[dict]:
    """Both modes in this process (same weights); one result dict per mode."""
    from emapg_megatron.models.config import ModelConfig, PrecisionConfig
    from emapg_megatron.models.gpt import has_local_attention
    from emapg_megatron.training import packing
    from emapg_megatron.training.config import OptimConfig
    from emapg_megatron.training.microbatches import split_microbatches
    from emapg_megatron.training.model_and_optimizer import build_model_and_optimizer

    hidden, ffn, layers, heads, groups, vocab = SHAPES[a["device"]]
    lengths = lengths_mix(a["sequences"], a["median"], a["cap"], a["seed"])
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers,
                      num_attention_heads=heads, num_query_groups=groups,
                      max_position_embeddings=max(lengths) + 8)
    chunks, opt = build_model_and_optimizer(cfg, OptimConfig(), PrecisionConfig(bf16=a["bf16"]))
    batch = make_batch(lengths, vocab)
    plan = packing.plan(batch, a["max_tokens"] or a["micro_batch_size"] * max(lengths), lengths=lengths)
    S, L = batch["tokens"].shape
    modes = {"padded": (split_microbatches(batch, a["micro_batch_size"]), 1.0 - sum(lengths) / (S * L)),
             "packed": (packing.pack(batch, plan), plan.padding_fraction)}
    common = {"sequences": S, "real_tokens": sum(lengths), "median_len": a["median"], "max_len": L,
              "device": a["device"], "attention": "mask" if has_local_attention(chunks[0]) else "thd",
              "bf16": a["bf16"], "model": dict(hidden=hidden, layers=layers, vocab=vocab)}
    out = []
    for mode, (mbs, padding) in modes.items():
        seconds = timed(chunks, opt, mbs, token_loss(vocab), a["iters"])
        out.append({"mode": mode, "padding_fraction": round(padding, 4),
                    "tokens_per_s": round(sum(lengths) / seconds, 1), "microbatches": len(mbs),
                    "tokens_per_microbatch": sorted({mb["tokens"].numel() for mb in mbs}), **common})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON line per mode (else a table)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--sequences", type=int, default=None, help="default: 32 (CPU), 128 (GPU)")
    p.add_argument("--median", type=int, default=None, help="median length; default: 24 (CPU), 256 (GPU)")
    p.add_argument("--cap", type=float, default=16.0, help="longest length, x the median")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="packed token budget; default: --micro-batch-size x the longest sequence, the "
                        "token slots of one padded micro-batch and the trainer's default "
                        "(--micro-batch-size x --seq-length)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="padded mode: sequences per micro-batch")
    p.add_argument("--bf16", action="store_true", help="bf16 model (GPU)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = vars(p.parse_args(argv))
    gpu = a["device"] == "cuda"
    a["sequences"] = a["sequences"] or (128 if gpu else 32)
    a["median"] = a["median"] or (256 if gpu else 24)

    from emapg_megatron.multiprocess import run_distributed

    (results,) = run_distributed(bench, 1, args=(a,), device=a["device"], timeout=1800)
    for r in results:
        print(json.dumps(r) if a["json"] else
              f"{r['mode']:>7}: padding {r['padding_fraction']:.1%}, {r['tokens_per_s']:.0f} tokens/s")


if __name__ == "__main__":
    main()
