"""Benchmark the vocab-parallel Top-k KL policy loss against the usual ways of computing it.

    python tools/bench_topk_kl.py --tp 2 --tokens 4096 --vocab 32000 --k 32 --json

prints one JSON object per method:

* ``emapg_fused``          - ours, saving the logits and recomputing the softmax in backward
* ``emapg_fused_inplace``  - ours, saving probabilities over the logits (``inplace_backward=True``)
* ``megatron_ce``          - Megatron's ``vocab_parallel_cross_entropy`` (log pi(y) only: a floor)
* ``gather_exact``         - all-gather the full logits, fp32 log-softmax, then the same KL
* ``fp32_softmax_saved``   - the common vocab-parallel autograd pattern: fp32 exp saved for
                             backward, dense fp32 gradient, tracked all-reduces

The policy methods all compute ``sum_t [-A_t log pi(y_t) + beta TopkReverseKL_t]`` (unbiased tail,
off-policy weight clipped to [0, 10]); ``megatron_ce`` computes ``sum_t -log pi(y_t)``. Fields:
``fwd_bwd_ms`` median over ``--repeats`` (methods interleaved within each repeat, so machine noise
hits all alike), ``saved_bytes_per_token`` (distinct storages saved for backward, counted with
``torch.autograd.graph.saved_tensors_hooks``), ``comm_bytes_per_token`` (payload of every collective
issued in forward + backward), ``max_abs_grad_err`` (logit gradient vs the fp64 single-device
library on the gathered logits). Runs on CPU with gloo, or on GPU with nccl (``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

METHODS = ("emapg_fused", "emapg_fused_inplace", "megatron_ce", "gather_exact", "fp32_softmax_saved")
BETA = 0.1
IW_CLIP = (0.0, 10.0)
REF_BLOCK = 256  # tokens per block of the fp64 reference (the loss is a sum over tokens)


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    m = divisible_by * tp
    return -(-vocab // m) * m


def make_data(cfg: dict, group, tp: int, rank: int, device) -> dict:
    """This rank's logit shard and the per-token inputs (identical on every rank)."""
    from emapg_megatron.parallel import vocab_parallel_logprobs_at, vocab_parallel_topk

    t, v, k = cfg["tokens"], cfg["vocab"], cfg["k"]
    width = padded_vocab(v, tp) // tp
    g = torch.Generator().manual_seed(1000 + rank)
    shard = torch.randn(t, width, generator=g) * 2.0
    # Padding columns at -inf, so Megatron's CE (which normalises over them) computes the same
    # distribution as the methods that drop them.
    shard[:, max(0, min(v - rank * width, width)):] = -float("inf")
    shard = shard.to(device=device, dtype=cfg["dtype"])
    g = torch.Generator().manual_seed(7)  # replicated per-token inputs
    tokens = torch.randint(0, v, (t,), generator=g).to(device)
    adv = torch.randn(t, generator=g).to(device)
    old = shard.float() + 0.3 * torch.randn(shard.shape, generator=torch.Generator().manual_seed(2000 + rank)).to(device)
    q, _ = vocab_parallel_topk(old, k, vocab_size=v, group=group)  # q = top-k of pi_old
    samp_y = vocab_parallel_logprobs_at(old, tokens, group=group, vocab_size=v)
    anchor = shard.float() + 0.5 * torch.randn(shard.shape, generator=torch.Generator().manual_seed(3000 + rank)).to(device)
    ref_q = vocab_parallel_logprobs_at(anchor, q, group=group, vocab_size=v)
    ref_y = vocab_parallel_logprobs_at(anchor, tokens, group=group, vocab_size=v)
    return dict(shard=shard, tokens=tokens, adv=adv, q=q, samp_y=samp_y, ref_q=ref_q, ref_y=ref_y)


def policy_objective(logprob, logprob_q, d):
    from emapg_megatron.kl import importance_weight, token_in_topk, topk_kl_from_gathered

    iw = importance_weight(logprob, d["samp_y"], IW_CLIP)
    kl = topk_kl_from_gathered(logprob_q, logprob, d["ref_q"], d["ref_y"], token_in_topk(d["tokens"], d["q"]),
                               direction="reverse", tail="unbiased", iw=iw)
    return (-d["adv"] * logprob + BETA * kl).sum()


def method_fn(name: str, cfg: dict, d: dict, group, tp: int, rank: int):
    """``x -> scalar loss`` for one method (x: this rank's logit shard, requires grad)."""
    from megatron.core.tensor_parallel import (
        gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
        vocab_parallel_cross_entropy)

    from emapg_megatron.parallel import kl_from_policy_terms, vocab_parallel_policy_terms

    v = cfg["vocab"]

    if name in ("emapg_fused", "emapg_fused_inplace"):
        def fn(x):
            terms = vocab_parallel_policy_terms(x, d["tokens"], d["q"], group=group, vocab_size=v,
                                                chunk_size=cfg["chunk_size"],
                                                inplace_backward=name == "emapg_fused_inplace")
            kl = kl_from_policy_terms(terms, d["tokens"], d["q"], d["ref_q"], d["ref_y"], kind="topk-reverse",
                                      sampling_logprob=d["samp_y"], iw_clip=IW_CLIP)
            return (-d["adv"] * terms.logprob + BETA * kl).sum()
        return fn
    if name == "megatron_ce":
        return lambda x: vocab_parallel_cross_entropy(x, d["tokens"]).sum()
    if name == "gather_exact":
        def fn(x):
            full = gather_from_tensor_model_parallel_region(x)[:, :v]
            logp = torch.log_softmax(full.float(), dim=-1)
            return policy_objective(logp.gather(-1, d["tokens"].unsqueeze(-1)).squeeze(-1),
                                    logp.gather(-1, d["q"]), d)
        return fn
    if name == "fp32_softmax_saved":
        width = d["shard"].shape[-1]
        start = rank * width
        n_real = min(max(v - start, 0), width)

        def picked(z, ids):  # logits at global ids: each owned by one rank, summed over ranks
            lid = ids - start
            own = (lid >= 0) & (lid < n_real)
            vals = z.gather(-1, torch.where(own, lid, torch.zeros_like(lid)))
            return reduce_from_tensor_model_parallel_region(torch.where(own, vals, torch.zeros_like(vals)))

        def fn(x):
            z = x[:, :n_real].float()
            m = z.max(dim=-1, keepdim=True).values.detach()
            if tp > 1:
                torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
            e = torch.exp(z - m)  # fp32 [T, V/TP], saved by exp for backward
            lse = m + reduce_from_tensor_model_parallel_region(e.sum(dim=-1, keepdim=True)).log()
            # lse is subtracted after the reduction: inside it, the lse gradient of the ids a rank
            # does not own would be dropped (the classic silent cross-shard error).
            return policy_objective(picked(z, d["tokens"].unsqueeze(-1)).squeeze(-1) - lse.squeeze(-1),
                                    picked(z, d["q"]) - lse, d)
        return fn
    raise ValueError(f"unknown method {name!r}")


def reference_grad(full_logits: torch.Tensor, d: dict, cfg: dict, objective: str) -> torch.Tensor:
    """fp64 single-device library on the gathered logits, block by block over tokens."""
    v = cfg["vocab"]
    grad = torch.zeros(full_logits.shape, dtype=torch.float64)
    for t0 in range(0, full_logits.shape[0], REF_BLOCK):
        sl = slice(t0, t0 + REF_BLOCK)
        x = full_logits[sl, :v].double().requires_grad_(True)
        blk = {n: (t[sl].double() if t.is_floating_point() else t[sl]) for n, t in d.items() if n != "shard"}
        logp = torch.log_softmax(x, dim=-1)
        lp_y = logp.gather(-1, blk["tokens"].unsqueeze(-1)).squeeze(-1)
        if objective == "ce":
            loss = -lp_y.sum()
        else:
            from emapg_megatron.kl import topk_kl

            kl = topk_kl(x, blk["tokens"], blk["q"], blk["ref_q"], blk["ref_y"], direction="reverse",
                         tail="unbiased", sampling_logprob=blk["samp_y"], iw_clip=IW_CLIP)
            loss = (-blk["adv"] * lp_y + BETA * kl).sum()
        loss.backward()
        grad[sl, :v] = x.grad
    return grad


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _all_gather_cols(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    if tp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp)]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def bench_worker(cfg: dict) -> list:
    """Runs on every rank (spawned by run_distributed); rank 0 returns the rows."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from emapg_megatron import runtime
    from emapg_megatron.parallel import CollectiveCounter, SavedTensorBytes

    cfg = dict(cfg, dtype=getattr(torch, cfg["dtype"]))
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    device = runtime.device()
    group = ps.get_tensor_model_parallel_group()
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    d = make_data(cfg, group, tp, rank, device)
    t = cfg["tokens"]
    fns = {m: method_fn(m, cfg, d, group, tp, rank) for m in cfg["methods"]}

    def fresh():
        return d["shard"].clone().requires_grad_(True)

    # One accounted (untimed) run per method: saved bytes, collectives, gradient error.
    full = _all_gather_cols(d["shard"], group, tp).cpu()
    full = full if rank == 0 else None
    refs = {}
    stats = {}
    for m, fn in fns.items():
        x = fresh()
        with CollectiveCounter() as cc:
            with SavedTensorBytes() as sb:
                loss = fn(x)
            loss.backward()
        grad = _all_gather_cols(x.grad, group, tp)
        row = dict(saved=sb.bytes / t, comm=cc.bytes / t, collectives=cc.count)
        if rank == 0:
            objective = "ce" if m == "megatron_ce" else "policy"
            if objective not in refs:
                refs[objective] = reference_grad(full, {n: v.cpu() for n, v in d.items()}, cfg, objective)
            row["err"] = (grad.cpu().double() - refs[objective]).abs().max().item()
        stats[m] = row
        del x, grad, loss
    # Timed runs, methods interleaved.
    times = {m: [] for m in fns}
    for _ in range(cfg["repeats"]):
        for m, fn in fns.items():
            x = fresh()
            if tp > 1:
                dist.barrier(group=group)
            _sync(device)
            t0 = time.perf_counter()
            fn(x).backward()
            _sync(device)
            times[m].append((time.perf_counter() - t0) * 1e3)
            del x
    if rank != 0:
        return []
    width = d["shard"].shape[-1]
    rows = []
    for m in fns:
        rows.append(dict(
            method=m, tp=tp, tokens=t, vocab=cfg["vocab"], k=cfg["k"],
            fwd_bwd_ms=round(statistics.median(times[m]), 2),
            saved_bytes_per_token=round(stats[m]["saved"], 1),
            comm_bytes_per_token=round(stats[m]["comm"], 1),
            max_abs_grad_err=stats[m]["err"],
            collectives=stats[m]["collectives"],
            logits_row_bytes=width * d["shard"].element_size(),
            dtype=str(cfg["dtype"]).replace("torch.", ""), device=device.type,
            chunk_size=cfg["chunk_size"], repeats=cfg["repeats"], threads=torch.get_num_threads(),
            fwd_bwd_ms_all=[round(x, 1) for x in times[m]],
        ))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default: auto)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per rank (0: cores / TP). On a shared machine 1 keeps OpenMP barrier "
                        "stalls of busy cores out of the comparison")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--json", action="store_true", help="one JSON object per method")
    args = p.parse_args(argv)
    if args.tp < 1 or args.tokens < 1 or args.vocab < 1 or not 0 <= args.k <= args.vocab or args.repeats < 1:
        p.error("need --tp, --tokens, --vocab, --repeats >= 1 and 0 <= --k <= --vocab")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and torch.cuda.device_count() < args.tp:
        p.error(f"--tp {args.tp} needs {args.tp} GPUs, {torch.cuda.device_count()} visible")
    from emapg_megatron.multiprocess import run_distributed

    cfg = dict(tokens=args.tokens, vocab=args.vocab, k=args.k, repeats=args.repeats, dtype=args.dtype,
               chunk_size=args.chunk_size, methods=args.methods, threads=args.threads)
    rows = run_distributed(bench_worker, args.tp, tp=args.tp, args=(cfg,), device=device, timeout=3600)[0]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    ce = next((r["fwd_bwd_ms"] for r in rows if r["method"] == "megatron_ce"), None)
    print(f"{'method':22s} {'ms':>9s} {'x CE':>6s} {'saved B/tok':>12s} {'comm B/tok':>11s} {'grad err':>9s}")
    for r in rows:
        ratio = f"{r['fwd_bwd_ms'] / ce:6.2f}" if ce else "     -"
        print(f"{r['method']:22s} {r['fwd_bwd_ms']:9.1f} {ratio} {r['saved_bytes_per_token']:12.1f} "
              f"{r['comm_bytes_per_token']:11.1f} {r['max_abs_grad_err']:9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
