"""The built-in sampler on a LoRA model: adapters applied in the forward (unmerged) against merged
into the weights for the rollout and taken out after it, side by side (docs/lora.md, "Rollouts").

    python tools/bench_lora_sampling.py --json                              # CPU, "small" model
    python tools/bench_lora_sampling.py --model qwen2.5-0.5b --rank 16 --bf16 --json

One rank (spawned). The model of ``tools/bench_rollout.py``'s ``--model`` gets rank-``--rank``
adapters on every linear with seeded random B (so the adapters change the logits). Each path
samples ``--batch`` sequences of exactly ``--length`` tokens from ``--prompt``-token prompts,
``--repeats`` times after a warm-up call, alternating the paths (medians reported):

* ``unmerged``: ``generate`` with the adapters in the forward (what the trainer does);
* ``merged``: ``merge_lora`` (W += (alpha/r) B A per linear), ``generate``, ``unmerge_lora``: the
  rollout's cost including the merge and unmerge every step needs (the base weights are shared
  with training);
* ``base``: the base model alone (adapters off), the floor either path could reach.

Also, deterministic counts: how far one merge-unmerge cycle moves the frozen base weights (max
abs change; a cycle per step accumulates it), and on the unmerged path's sampled sequences the
largest and mean |log p_merged - log p_unmerged| of the sampled tokens (teacher-forced forward):
what merged sampling would cost the importance weights in this dtype. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _token_logprobs(chunks, sequences, prompt: int):
    """log p of each sequence's response tokens under the model (one teacher-forced forward)."""
    import torch

    from emapg_megatron.models.gpt import unwrap

    tokens = torch.tensor(sequences, dtype=torch.long)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        logits = unwrap(chunks[0])(tokens, positions, None).float()
    logp = torch.log_softmax(logits[:, prompt - 1:-1], dim=-1)
    return logp.gather(-1, tokens[:, prompt:, None])[..., 0]


def measure(model_name: str, rank: int, alpha: float, batch: int, prompt: int, length: int,
            repeats: int, bf16: bool) -> dict:
    import torch
    from bench_rollout import _model, _sampler

    from emapg_megatron.lora.apply import (
        adapters_off,
        apply_lora,
        merge_lora,
        named_adapters,
        unmerge_lora,
    )
    from emapg_megatron.lora.config import LoRAConfig

    torch.manual_seed(0)
    cfg, chunks = model = _model(model_name, prompt + length, bf16=bf16)
    apply_lora(chunks[0], LoRAConfig(rank=rank, alpha=alpha), seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, adapter in named_adapters(chunks[0]):  # B != 0: the adapters move the logits
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=gen) * 0.02)
    prompts = [[(7 * s + i) % 90 + 1 for i in range(prompt)] for s in range(batch)]
    sampler = _sampler(model, prompt + length, batch)

    def generate():
        return sampler.generate(prompts, 1, 1.0, 1.0, length)

    def merged():
        merge_lora(chunks[0])
        try:
            return generate()
        finally:
            unmerge_lora(chunks[0])

    def base():
        with adapters_off(chunks):
            return generate()

    paths = {"unmerged": generate, "merged": merged, "base": base}
    for fn in paths.values():
        fn()  # warm-up: allocations, lazy imports
    seconds = {name: [] for name in paths}
    sampled = None
    for _ in range(repeats):
        for name, fn in paths.items():
            start = time.perf_counter()
            out = fn()
            seconds[name].append(time.perf_counter() - start)
            if name == "unmerged":
                sampled = [p + r for p, r in zip(prompts, out.responses)]
    median = {name: statistics.median(s) for name, s in seconds.items()}

    weights = {n: p.detach().clone() for n, p in chunks[0].named_parameters() if not p.requires_grad}
    merge_lora(chunks[0])
    logp_merged = _token_logprobs(chunks, sampled, prompt)
    unmerge_lora(chunks[0])
    drift = max((p.detach().float() - weights[n].float()).abs().max().item()
                for n, p in chunks[0].named_parameters() if n in weights)
    diff = (logp_merged - _token_logprobs(chunks, sampled, prompt)).abs()
    tokens = batch * length
    return {
        "model": model_name, "dtype": "bf16" if bf16 else "fp32", "lora_rank": rank, "batch": batch,
        "prompt_tokens": prompt, "response_tokens": length, "repeats": repeats,
        "tokens_per_s": {name: round(tokens / s, 1) for name, s in median.items()},
        "seconds": {name: round(s, 4) for name, s in median.items()},
        "merged_over_unmerged_time": round(median["merged"] / median["unmerged"], 3),
        "unmerged_over_base_time": round(median["unmerged"] / median["base"], 3),
        "merge_unmerge_base_drift_max": drift,
        "merged_logprob_diff_max": diff.max().item(), "merged_logprob_diff_mean": diff.mean().item(),
    }


def main(argv=None) -> None:
    from bench_rollout import MODELS

    from emapg_megatron.multiprocess import run_distributed

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--rank", type=int, default=16, help="--lora-rank (default 16)")
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object (the default prints it indented)")
    a = p.parse_args(argv)
    [result] = run_distributed(measure, 1, timeout=3600,
                               args=(a.model, a.rank, a.alpha, a.batch, a.prompt, a.length, a.repeats, a.bf16))
    print(json.dumps(result) if a.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
