"""Benchmark the vocab-parallel Top-k KL policy loss against the usual ways of computing it.

    python tools/bench_topk_kl.py --tp 2 --tokens 4096 --vocab 32000 --k 32 --json

prints one JSON object per method:

* ``emapg_fused``          - ours, saving the logits and recomputing the softmax in backward
* ``emapg_fused_inplace``  - ours, saving probabilities over the logits (``inplace_backward=True``)
* ``megatron_ce``          - Megatron's ``vocab_parallel_cross_entropy`` (log pi(y) only: a floor)
* ``gather_exact``         - all-gather the full logits, fp32 log-softmax, then the same KL
* ``fp32_softmax_saved``   - the common vocab-parallel autograd pattern: fp32 exp saved for
                             backward, dense fp32 gradient, tracked all-reduces
* ``emapg_fused_lmhead``   - with ``--hidden H`` only: ours from the final hidden states ``[T, H]`` and
                             the output weight shard ``[V/TP, H]`` (:mod:`emapg_megatron.parallel.lmhead_terms`),
                             the logits formed chunk by chunk and never kept

With ``--hidden H`` every method starts from the hidden states and the weight shard: the others form
the logits as Megatron's output layer does (``h W^T`` in the input dtype, ``dh`` all-reduced over TP)
and then run as above. ``max_abs_grad_err`` is then over the gradients of ``h`` and of ``W``
(``max_abs_grad_err_hidden`` / ``_weight``) against the fp64 library on ``h W^T``, and
``saved_bytes_per_token`` leaves out the weight (a parameter: alive anyway, saving it costs nothing).

The policy methods all compute ``sum_t [-A_t log pi(y_t) + beta TopkReverseKL_t]`` (unbiased tail,
off-policy weight clipped to [0, 10]); ``megatron_ce`` computes ``sum_t -log pi(y_t)``. Fields:
``fwd_bwd_ms`` median over ``--repeats`` (methods interleaved within each repeat, so machine noise
hits all alike), ``saved_bytes_per_token`` (distinct storages saved for backward, counted with
``torch.autograd.graph.saved_tensors_hooks``), ``comm_bytes_per_token`` (payload of every collective
issued in forward + backward), ``max_abs_grad_err`` (logit gradient vs the fp64 single-device
library on the gathered logits). Runs on CPU with gloo, or on GPU with nccl (``--device cuda``).

On a GPU each row also has ``peak_mem_bytes`` (``torch.cuda.max_memory_allocated`` during one
forward + backward, minus what was allocated before it: the op's own memory, the logit gradient
included), and ``hbm_fraction``: the compulsory HBM traffic of the op (``hbm_floor_bytes`` = 3 x
the logit shard: forward reads the logits, backward reads them again and writes their gradient)
over ``fwd_bwd_ms``, as a fraction of the bandwidth a device-to-device copy reaches in the same run
(``hbm_copy_gbps``, counting read + write). ``--out FILE`` writes everything as one JSON object.

    python tools/bench_topk_kl.py --device cuda --tokens 16384 --vocab 151936 --dtype bfloat16 --out topk.json
    python tools/bench_topk_kl.py --device cuda --tokens 16384 --vocab 151936 --hidden 896 --dtype bfloat16 \
        --out topk_lmhead.json
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

METHODS = ("emapg_fused", "emapg_fused_inplace", "megatron_ce", "gather_exact", "fp32_softmax_saved",
           "emapg_fused_lmhead")
HIDDEN_ONLY = ("emapg_fused_lmhead",)
BETA = 0.1
IW_CLIP = (0.0, 10.0)
REF_BLOCK = 256  # tokens per block of the fp64 reference (the loss is a sum over tokens)


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    m = divisible_by * tp
    return -(-vocab // m) * m


def on_gpu() -> bool:
    """Whether this rank really computes on a GPU (not Megatron's CPU mode)."""
    from emapg_megatron import cpu_device

    return torch.cuda.is_available() and not cpu_device.installed()


def _randn(shape, seed: int, device, gpu: bool) -> torch.Tensor:
    """Large random tensors: drawn on the GPU there (the CPU would take a minute at 16k x 152k)."""
    if gpu:
        return torch.randn(shape, generator=torch.Generator(device=device).manual_seed(seed), device=device)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def make_data(cfg: dict, group, tp: int, rank: int, device) -> dict:
    """This rank's logit shard and the per-token inputs (identical on every rank)."""
    from emapg_megatron.parallel import vocab_parallel_logprobs_at, vocab_parallel_topk

    t, v, k = cfg["tokens"], cfg["vocab"], cfg["k"]
    gpu = on_gpu()
    width = padded_vocab(v, tp) // tp
    n_real = max(0, min(v - rank * width, width))
    extra = {}
    if cfg["hidden"]:  # h replicated, W this rank's rows; logits of spread 2 as below
        hid = cfg["hidden"]
        extra["hidden"] = _randn((t, hid), 500, device, gpu).to(cfg["dtype"])
        extra["weight"] = (_randn((width, hid), 1000 + rank, device, gpu) * (2.0 / hid ** 0.5)).to(cfg["dtype"])
        shard = output_logits(extra["hidden"], extra["weight"])
    else:
        shard = _randn((t, width), 1000 + rank, device, gpu) * 2.0
    # Padding columns at -inf, so Megatron's CE (which normalises over them) computes the same
    # distribution as the methods that drop them.
    shard[:, n_real:] = -float("inf")
    shard = shard.to(device=device, dtype=cfg["dtype"])
    g = torch.Generator().manual_seed(7)  # replicated per-token inputs
    tokens = torch.randint(0, v, (t,), generator=g).to(device)
    adv = torch.randn(t, generator=g).to(device)
    old = shard.float() + 0.3 * _randn(shard.shape, 2000 + rank, device, gpu)
    q, _ = vocab_parallel_topk(old, k, vocab_size=v, group=group)  # q = top-k of pi_old
    samp_y = vocab_parallel_logprobs_at(old, tokens, group=group, vocab_size=v)
    del old
    anchor = shard.float() + 0.5 * _randn(shard.shape, 3000 + rank, device, gpu)
    ref_q = vocab_parallel_logprobs_at(anchor, q, group=group, vocab_size=v)
    ref_y = vocab_parallel_logprobs_at(anchor, tokens, group=group, vocab_size=v)
    return dict(shard=shard, tokens=tokens, adv=adv, q=q, samp_y=samp_y, ref_q=ref_q, ref_y=ref_y, **extra)


def output_logits(h, w):
    from emapg_megatron.parallel.lmhead_terms import output_logits as logits

    return logits(h, w)


def policy_objective(logprob, logprob_q, d):
    from emapg_megatron.kl import (
        importance_weight,
        token_in_topk,
        topk_kl_from_gathered,
    )

    iw = importance_weight(logprob, d["samp_y"], IW_CLIP)
    kl = topk_kl_from_gathered(logprob_q, logprob, d["ref_q"], d["ref_y"], token_in_topk(d["tokens"], d["q"]),
                               direction="reverse", tail="unbiased", iw=iw)
    return (-d["adv"] * logprob + BETA * kl).sum()


def method_fn(name: str, cfg: dict, d: dict, group, tp: int, rank: int):
    """``x -> scalar loss`` for one method: x is this rank's logit shard, or with ``--hidden`` the pair
    (hidden states, weight shard), all requiring grad."""
    if cfg["hidden"]:
        return hidden_method_fn(name, cfg, d, group, tp, rank)
    return logits_method_fn(name, cfg, d, group, tp, rank)


def _policy_loss_from_terms(terms, d):
    from emapg_megatron.parallel import kl_from_policy_terms

    kl = kl_from_policy_terms(terms, d["tokens"], d["q"], d["ref_q"], d["ref_y"], kind="topk-reverse",
                              sampling_logprob=d["samp_y"], iw_clip=IW_CLIP)
    return (-d["adv"] * terms.logprob + BETA * kl).sum()


def hidden_method_fn(name: str, cfg: dict, d: dict, group, tp: int, rank: int):
    """``(h, W) -> scalar loss``: ours from the hidden states, or the output layer then a logits method."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    from emapg_megatron.parallel import lmhead_policy_terms

    if name == "emapg_fused_lmhead":
        def fn(x):
            terms = lmhead_policy_terms(x[0], x[1], d["tokens"], d["q"], group=group, vocab_size=cfg["vocab"],
                                        chunk_size=cfg["chunk_size"])
            return _policy_loss_from_terms(terms, d)
        return fn
    on_logits = logits_method_fn(name, cfg, d, group, tp, rank)
    width = d["weight"].shape[0]
    n_real = max(0, min(cfg["vocab"] - rank * width, width))

    def fn(x):
        h = copy_to_tensor_model_parallel_region(x[0], group=group) if tp > 1 else x[0]  # dh all-reduced
        z = output_logits(h, x[1])
        if n_real < width:  # padding at -inf, as in logits mode (Megatron's CE normalises over it)
            z = torch.cat([z[:, :n_real], torch.full_like(z[:, n_real:], -float("inf"))], dim=-1)
        return on_logits(z)
    return fn


def logits_method_fn(name: str, cfg: dict, d: dict, group, tp: int, rank: int):
    """``x -> scalar loss`` for one method (x: this rank's logit shard, requires grad)."""
    from megatron.core.tensor_parallel import (
        gather_from_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
        vocab_parallel_cross_entropy,
    )

    from emapg_megatron.parallel import vocab_parallel_policy_terms

    v = cfg["vocab"]

    if name in ("emapg_fused", "emapg_fused_inplace"):
        def fn(x):
            terms = vocab_parallel_policy_terms(x, d["tokens"], d["q"], group=group, vocab_size=v,
                                                chunk_size=cfg["chunk_size"],
                                                inplace_backward=name == "emapg_fused_inplace")
            return _policy_loss_from_terms(terms, d)
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


def reference_block_grad(logits_block: torch.Tensor, blk: dict, vocab: int, objective: str) -> torch.Tensor:
    """fp64 single-device library on one block of tokens of the gathered logits (real columns)."""
    x = logits_block[:, :vocab].double().requires_grad_(True)
    blk = {n: (t.double() if t.is_floating_point() else t) for n, t in blk.items()}
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
    return x.grad


def grad_errors(grads: dict, full_logits: torch.Tensor, d: dict, cfg: dict) -> dict:
    """max |grad - reference| per method, block by block over tokens on the logits' device.

    ``grads``: method -> gathered logit gradient (any device). The reference gradient of the padding
    columns is 0. Each block's references are computed once and compared with every method, so no
    full-size fp64 gradient is ever held (at 16k x 152k it would be 20 GB).
    """
    v, dev = cfg["vocab"], full_logits.device
    errs = dict.fromkeys(grads, 0.0)
    for t0 in range(0, full_logits.shape[0], REF_BLOCK):
        sl = slice(t0, t0 + REF_BLOCK)
        blk = {n: t[sl].to(dev) for n, t in d.items() if n != "shard"}
        refs = {}
        for m, grad in grads.items():
            objective = "ce" if m == "megatron_ce" else "policy"
            if objective not in refs:
                refs[objective] = reference_block_grad(full_logits[sl], blk, v, objective)
            g = grad[sl].to(dev)
            err = (g[:, :v].double() - refs[objective]).abs().max().item()
            if g.shape[-1] > v:
                err = max(err, g[:, v:].double().abs().max().item())
            errs[m] = max(errs[m], err)
    return errs


def hidden_grad_errors(grads: dict, hidden: torch.Tensor, weight: torch.Tensor, d: dict, cfg: dict) -> dict:
    """max |grad - reference| of ``h`` and of ``W`` per method (``grads``: method -> (dh, full dW)).

    The reference is the fp64 library on ``h W^T`` (the given, possibly bf16, ``h`` and ``W`` in
    fp64), block by block over tokens: ``dh = dz W`` per block, ``dW = sum dz^T h``.
    """
    v, dev = cfg["vocab"], hidden.device
    w64 = weight[:v].double()
    errs = {m: dict(hidden=0.0) for m in grads}
    dw_ref = {}
    for t0 in range(0, hidden.shape[0], REF_BLOCK):
        sl = slice(t0, t0 + REF_BLOCK)
        h64 = hidden[sl].double()
        blk = {n: t[sl].to(dev) for n, t in d.items() if n not in ("hidden", "weight")}
        refs = {}
        for m, (dh, _) in grads.items():
            objective = "ce" if m == "megatron_ce" else "policy"
            if objective not in refs:
                dz = reference_block_grad(h64 @ w64.t(), blk, v, objective)
                refs[objective] = dz @ w64
                dw_ref[objective] = dw_ref.get(objective, 0) + dz.t() @ h64
            errs[m]["hidden"] = max(errs[m]["hidden"], (dh[sl].to(dev).double() - refs[objective]).abs().max().item())
    for m, (_, dw) in grads.items():
        dw = dw.to(dev).double()
        err = (dw[:v] - dw_ref["ce" if m == "megatron_ce" else "policy"]).abs().max().item()
        if dw.shape[0] > v:  # padding rows: zero probability, zero gradient
            err = max(err, dw[v:].abs().max().item())
        errs[m].update(weight=err, all=max(err, errs[m]["hidden"]))
    return errs


def measure_hbm_bandwidth(device, nbytes: int = 2 << 30, repeats: int = 10) -> dict:
    """Device-to-device copy bandwidth (read + write counted), median of ``repeats``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    seconds = statistics.median(times)
    return {"hbm_copy_bytes": nbytes, "hbm_copy_s": seconds, "hbm_copy_gbps": 2 * nbytes / seconds / 1e9}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _all_gather(x: torch.Tensor, group, tp: int, dim: int = -1) -> torch.Tensor:
    """The ranks' shards concatenated along ``dim`` (logit columns: -1; weight rows: 0)."""
    if tp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp)]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


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
    gpu = on_gpu()
    group = ps.get_tensor_model_parallel_group()
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    hbm = measure_hbm_bandwidth(device) if gpu else {}  # before the data fills the memory
    d = make_data(cfg, group, tp, rank, device)
    t = cfg["tokens"]
    fns = {m: method_fn(m, cfg, d, group, tp, rank) for m in cfg["methods"]}

    hidden_mode = bool(cfg["hidden"])
    if hidden_mode:
        del d["shard"]  # the methods start from (h, W); the logits were only needed for q and the anchor

    def fresh():
        if hidden_mode:
            return tuple(d[n].clone().requires_grad_(True) for n in ("hidden", "weight"))
        return d["shard"].clone().requires_grad_(True)

    # Timed runs, methods interleaved (first, while nothing else is held: peak memory is the op's).
    times = {m: [] for m in fns}
    peaks = {m: [] for m in fns}
    for fn in fns.values():  # warm-up: kernels, autotuning, the caching allocator's first blocks
        x = fresh()
        fn(x).backward()
        del x
    for _ in range(cfg["repeats"]):
        for m, fn in fns.items():
            x = fresh()
            if tp > 1:
                dist.barrier(group=group)
            _sync(device)
            if gpu:
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            fn(x).backward()
            _sync(device)
            times[m].append((time.perf_counter() - t0) * 1e3)
            if gpu:
                peaks[m].append(torch.cuda.max_memory_allocated() - before)
            del x
    # One accounted (untimed) run per method: saved bytes, collectives, gradient error.
    stats = {}
    grads = {}
    for m, fn in fns.items():
        x = fresh()
        with CollectiveCounter() as cc:
            with SavedTensorBytes() as sb:
                loss = fn(x)
            loss.backward()
        saved = sb.bytes
        if hidden_mode:  # the weight is a parameter: alive anyway, saving it costs nothing
            ptr = x[1].untyped_storage().data_ptr()
            saved = sum(b for key, b in sb.storages.items() if key[1] != ptr)
            grad = (x[0].grad, _all_gather(x[1].grad, group, tp, dim=0))  # dh is replicated (all-reduced)
        else:
            grad = _all_gather(x.grad, group, tp)
        stats[m] = dict(saved=saved / t, comm=cc.bytes / t, collectives=cc.count)
        if rank == 0 and cfg.get("grad_check", True):
            # host copies: five full gradients would not fit beside the data
            grads[m] = tuple(g.cpu() for g in grad) if hidden_mode else grad.cpu()
        del x, grad, loss
    errs = {}
    if cfg.get("grad_check", True):
        if hidden_mode:
            full = _all_gather(d["weight"], group, tp, dim=0)  # a collective: every rank takes part
            if rank == 0:
                errs = hidden_grad_errors(grads, d["hidden"], full, d, cfg)
        else:
            full = _all_gather(d["shard"], group, tp)
            if rank == 0:
                errs = {m: dict(all=e) for m, e in grad_errors(grads, full, d, cfg).items()}
        del full, grads
    if rank != 0:
        return {}
    width = d["weight"].shape[0] if hidden_mode else d["shard"].shape[-1]
    elt = cfg["dtype"].itemsize
    floor_bytes = 3 * t * width * elt  # read the logits (fwd), read them again + write the grad (bwd)
    rows = []
    for m in fns:
        ms = statistics.median(times[m])
        row = dict(
            method=m, tp=tp, tokens=t, vocab=cfg["vocab"], k=cfg["k"],
            fwd_bwd_ms=round(ms, 2),
            saved_bytes_per_token=round(stats[m]["saved"], 1),
            comm_bytes_per_token=round(stats[m]["comm"], 1),
            max_abs_grad_err=errs.get(m, {}).get("all"),
            collectives=stats[m]["collectives"],
            logits_row_bytes=width * elt,
            dtype=str(cfg["dtype"]).replace("torch.", ""), device="cuda" if gpu else "cpu",
            chunk_size=cfg["chunk_size"], repeats=cfg["repeats"], threads=torch.get_num_threads(),
            fwd_bwd_ms_all=[round(x, 1) for x in times[m]],
        )
        if hidden_mode:
            row.update(hidden=cfg["hidden"], max_abs_grad_err_hidden=errs.get(m, {}).get("hidden"),
                       max_abs_grad_err_weight=errs.get(m, {}).get("weight"))
        if gpu:
            peak = max(peaks[m])
            row.update(peak_mem_bytes=peak, peak_mem_bytes_per_token=round(peak / t, 1),
                       peak_mem_over_logits=round(peak / (t * width * elt), 3), **hbm)
            if not hidden_mode:  # the floor counts logits traffic: a logits-mode notion
                row.update(hbm_floor_bytes=floor_bytes,
                           hbm_fraction=round(floor_bytes / (ms / 1e3) / (hbm["hbm_copy_gbps"] * 1e9), 4))
        rows.append(row)
    meta = {"device_name": torch.cuda.get_device_name() if gpu else "cpu", "hardware": "cuda" if gpu else "cpu",
            "torch": str(torch.__version__), **hbm}
    return {"rows": rows, "meta": meta}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--hidden", type=int, default=0,
                   help="start from hidden states [T, H] and the output weight shard (0: from logits); "
                        "adds emapg_fused_lmhead")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default: auto)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per rank (0: cores / TP). On a shared machine 1 keeps OpenMP barrier "
                        "stalls of busy cores out of the comparison")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                   help="default: all (emapg_fused_lmhead with --hidden only)")
    p.add_argument("--json", action="store_true", help="one JSON object per method")
    p.add_argument("--out", default=None, help="also write {meta, rows} as one JSON object to this file")
    p.add_argument("--no-grad-check", dest="grad_check", action="store_false",
                   help="skip the fp64 reference gradient (max_abs_grad_err is null)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are killed")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.tp < 1 or args.tokens < 1 or args.vocab < 1 or not 0 <= args.k <= args.vocab or args.repeats < 1:
        p.error("need --tp, --tokens, --vocab, --repeats >= 1 and 0 <= --k <= --vocab")
    if args.hidden < 0:
        p.error("--hidden must be >= 0")
    methods = args.methods or [m for m in METHODS if args.hidden or m not in HIDDEN_ONLY]
    if not args.hidden and any(m in HIDDEN_ONLY for m in methods):
        p.error(f"{', '.join(HIDDEN_ONLY)} needs --hidden")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and torch.cuda.device_count() < args.tp:
        p.error(f"--tp {args.tp} needs {args.tp} GPUs, {torch.cuda.device_count()} visible")
    from emapg_megatron.multiprocess import run_distributed

    cfg = dict(tokens=args.tokens, vocab=args.vocab, k=args.k, repeats=args.repeats, dtype=args.dtype,
               chunk_size=args.chunk_size, methods=methods, threads=args.threads, hidden=args.hidden,
               grad_check=args.grad_check)
    result = run_distributed(bench_worker, args.tp, tp=args.tp, args=(cfg,), device=device,
                             timeout=args.timeout)[0]
    rows = result["rows"]
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"benchmark": "topk_kl", "args": vars(args), "meta": result["meta"], "rows": rows}, f, indent=1)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    ce = next((r["fwd_bwd_ms"] for r in rows if r["method"] == "megatron_ce"), None)
    gpu = "peak_mem_bytes" in rows[0]
    print(f"{'method':22s} {'ms':>9s} {'x CE':>6s} {'saved B/tok':>12s} {'comm B/tok':>11s} {'grad err':>9s}"
          + (f" {'peak GiB':>9s} {'HBM frac':>8s}" if gpu else ""))
    for r in rows:
        ratio = f"{r['fwd_bwd_ms'] / ce:6.2f}" if ce else "     -"
        err = f"{r['max_abs_grad_err']:9.2e}" if r["max_abs_grad_err"] is not None else f"{'-':>9s}"
        print(f"{r['method']:22s} {r['fwd_bwd_ms']:9.1f} {ratio} {r['saved_bytes_per_token']:12.1f} "
              f"{r['comm_bytes_per_token']:11.1f} {err}"
              + (f" {r['peak_mem_bytes'] / 2**30:9.2f} {r.get('hbm_fraction', float('nan')):8.3f}" if gpu else ""))
    if gpu:
        print(f"device-to-device copy: {rows[0]['hbm_copy_gbps']:.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
