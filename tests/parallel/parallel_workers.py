"""Rank functions and shared inputs for the vocab-parallel tests (spawned, so module level).

Every rank builds the same full logits from a fixed seed and keeps its vocabulary shard; the tests
recompute the single-device reference from the same inputs.
"""

from __future__ import annotations

import torch

from emapg_megatron.kl import ALL_DIVERGENCES, SAMPLED_ESTIMATORS, TOPK_TAILS

V = 37  # true vocabulary
PADDED = 40  # divisible by TP 1, 2, 4; columns 37..39 are Megatron-style padding
LEAD = (3, 5)  # [batch, seq]
KS = (0, 5, 25, V)  # 25 > V/TP at TP 2 and 4; V = exact KL
TOPK_KINDS = ("topk-reverse", "topk-forward")
FDIV_KS = (5, 25)
IW_CLIP = (0.0, 2.0)
ALPHA = 0.5


def make_inputs(k: int, dtype=torch.float64, seed: int = 0) -> dict:
    """Full padded logits [3, 5, 40] and everything the KL needs, identical on every rank."""
    g = torch.Generator().manual_seed(1000 * seed + k)
    logits = torch.randn(LEAD + (PADDED,), generator=g, dtype=torch.float64) * 2.0
    logits[..., V:] = 6.0  # above nearly every real logit (3 sigma): any leak of padding shows
    old = logits[..., :V] + 0.5 * torch.randn(LEAD + (V,), generator=g, dtype=torch.float64)
    old_lp = old.log_softmax(-1)
    q = old.topk(k, dim=-1).indices  # q from the sampling policy
    tokens = torch.multinomial(old_lp.exp().reshape(-1, V), 1, generator=g).view(LEAD)
    if 0 < k < V:  # one token surely inside q, one surely outside
        tokens[0, 0] = q[0, 0, 0]
        outside = torch.ones(V, dtype=torch.bool)
        outside[q[0, 1]] = False
        tokens[0, 1] = outside.nonzero()[0, 0]
    ref_lp = (logits[..., :V] + torch.randn(LEAD + (V,), generator=g, dtype=torch.float64)).log_softmax(-1)
    out = dict(
        logits=logits,
        tokens=tokens,
        q=q,
        ref_q=ref_lp.gather(-1, q),
        ref_y=ref_lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1),
        samp_y=old_lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1),
        w_kl=torch.randn(LEAD, generator=g, dtype=torch.float64),
        w_lp=torch.randn(LEAD, generator=g, dtype=torch.float64),
        w_ent=torch.randn(LEAD, generator=g, dtype=torch.float64),
    )
    return {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in out.items()}


#: the tails the layouts are checked on: truncate is none's code path (bit-identical, tests/kl)
LAYOUT_TAILS = [t for t in TOPK_TAILS if t != "truncate"]


def combos():
    """(name, kind, tail, k, off_policy, with_entropy): every estimator, direction and tail."""
    out = []
    for i, est in enumerate(SAMPLED_ESTIMATORS):
        out.append((f"{est}", est, "unbiased", 5, i % 2 == 0, i % 2 == 1))
    for kind in TOPK_KINDS:
        for tail in LAYOUT_TAILS:
            for j, k in enumerate(KS):
                out.append((f"{kind}/{tail}/k{k}", kind, tail, k, j % 2 == 0, j % 2 == 1))
    for div in ALL_DIVERGENCES:
        for tail in LAYOUT_TAILS:
            for j, k in enumerate(FDIV_KS):
                out.append((f"{div}/{tail}/k{k}", div, tail, k, j == 0, j == 1))
    return out


SMALL_V = 25  # at TP 4 (10 columns per rank) rank 3 owns no real column


def small_vocab_inputs() -> dict:
    """make_inputs(5) with tokens and q drawn from a 25-id vocabulary (ids >= 25 are padding)."""
    inp = make_inputs(5, seed=3)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, SMALL_V, LEAD, generator=g)
    rows = []
    for i, y in enumerate(tokens.reshape(-1).tolist()):
        perm = torch.randperm(SMALL_V, generator=g)
        if i % 2 == 0:  # every other token inside q
            perm = torch.cat([torch.tensor([y]), perm[perm != y]])
        rows.append(perm[:5])
    inp["tokens"], inp["q"] = tokens, torch.stack(rows).view(LEAD + (5,))
    return inp


def shard_cols(tp: int, rank: int) -> slice:
    width = PADDED // tp
    return slice(rank * width, (rank + 1) * width)


def policy_loss(terms, inp, kind, tail, off_policy, with_entropy, loss_mask=None):
    """The scalar the tests differentiate: weighted KL + weighted log pi(y) [+ weighted entropy]."""
    from emapg_megatron.parallel import kl_from_policy_terms

    kl = kl_from_policy_terms(
        terms, inp["tokens"], inp["q"], inp["ref_q"], inp["ref_y"], kind=kind, tail=tail,
        sampling_logprob=inp["samp_y"] if off_policy else None,
        iw_clip=IW_CLIP if off_policy else None,
        alpha=ALPHA if kind == "alpha" else None, loss_mask=loss_mask,
    )
    loss = (inp["w_kl"] * kl).sum() + (inp["w_lp"] * terms.logprob).sum()
    if with_entropy:
        loss = loss + (inp["w_ent"] * terms.entropy).sum()
    return kl, loss


def run_terms(inp, group, tp, rank, *, kind, tail, off_policy, with_entropy, inplace=False,
              chunk_size=None, loss_mask=None, dtype=None, counter=None, vocab_size=V):
    """Forward + backward on this rank's shard; values (replicated) and the gradient shard."""
    from emapg_megatron.parallel import CollectiveCounter, vocab_parallel_policy_terms

    shard = inp["logits"][..., shard_cols(tp, rank)].clone()
    if dtype is not None:
        shard = shard.to(dtype)
    shard.requires_grad_(True)
    counts = {}
    with CollectiveCounter() as cc:
        terms = vocab_parallel_policy_terms(
            shard, inp["tokens"], inp["q"], group=group, vocab_size=vocab_size, with_entropy=with_entropy,
            chunk_size=chunk_size, inplace_backward=inplace, loss_mask=loss_mask,
        )
        counts["forward"] = cc.count
        kl, loss = policy_loss(terms, inp, kind, tail, off_policy, with_entropy, loss_mask)
        cc.reset()
        loss.backward()
        counts["backward"] = cc.count
    out = dict(kl=kl.detach(), logprob=terms.logprob.detach(), logprob_topk=terms.logprob_topk.detach(),
               grad=shard.grad.detach().clone())
    if with_entropy:
        out["entropy"] = terms.entropy.detach()
    if counter is not None:
        counter.update(counts)
    return out


def _group(spec):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if spec == "world":
        return dist.group.WORLD
    return ps.get_tensor_model_parallel_group()


def vocab_parallel_checks(group_spec: str = "tp") -> dict:
    """Everything of the equivalence suite for one TP size, in one spawned job."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from emapg_megatron.parallel import (
        CollectiveCounter,
        vocab_parallel_logprobs_at,
        vocab_parallel_logsumexp,
        vocab_parallel_topk,
    )

    group = _group(group_spec)
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    res = {"tp": tp}
    # 1. every estimator / direction / tail / k, fp64 and fp32, recompute backward
    for dtype, tag in ((torch.float64, "fp64"), (torch.float32, "fp32")):
        for name, kind, tail, k, off, ent in combos():
            inp = make_inputs(k, dtype)
            res[f"{tag}/{name}"] = run_terms(inp, group, tp, rank, kind=kind, tail=tail,
                                             off_policy=off, with_entropy=ent)
    # 2. save-probs (in place) backward, fp64 and bf16; recompute in bf16
    for k in KS:
        inp = make_inputs(k)
        res[f"inplace/fp64/k{k}"] = run_terms(inp, group, tp, rank, kind="topk-forward", tail="unbiased",
                                              off_policy=True, with_entropy=True, inplace=True)
    for inplace in (False, True):
        inp = make_inputs(5, seed=7)
        inp["logits"][..., 3] += 12.0  # a confident token: p near 1, where g - G p cancels
        inp["tokens"][...] = 3
        for ent in (False, True):
            res[f"bf16/inplace{inplace}/ent{ent}"] = run_terms(
                inp, group, tp, rank, kind="topk-reverse", tail="unbiased", off_policy=False,
                with_entropy=ent, inplace=inplace, dtype=torch.bfloat16)
    # 3. chunk sizes and collective counts (15 tokens: chunk 4 -> 4 chunks)
    inp = make_inputs(25)
    for cs in (1, 4, None):
        counts = {}
        res[f"chunk/{cs}"] = run_terms(inp, group, tp, rank, kind="topk-reverse", tail="unbiased",
                                       off_policy=True, with_entropy=True, chunk_size=cs, counter=counts)
        res[f"chunk/{cs}/counts"] = counts
    counts = {}
    run_terms(inp, group, tp, rank, kind="topk-reverse", tail="unbiased", off_policy=True,
              with_entropy=True, chunk_size=4, inplace=True, counter=counts)
    res["chunk/4/inplace/counts"] = counts
    # 4. loss mask: masked tokens carry garbage ids and NaN anchor values
    inp = make_inputs(5)
    mask = loss_mask_pattern()
    inp["tokens"] = torch.where(mask, inp["tokens"], torch.full_like(inp["tokens"], -1))
    inp["q"] = torch.where(mask.unsqueeze(-1), inp["q"], torch.zeros_like(inp["q"]))  # duplicates
    inp["ref_q"] = torch.where(mask.unsqueeze(-1), inp["ref_q"], torch.full_like(inp["ref_q"], float("nan")))
    for inplace in (False, True):
        res[f"mask/inplace{inplace}"] = run_terms(inp, group, tp, rank, kind="topk-reverse", tail="unbiased",
                                                 off_policy=True, with_entropy=True, inplace=inplace,
                                                 loss_mask=mask, chunk_size=2)
    # 4b. a vocabulary so small that the last rank(s) hold only padding (TP 4: rank 3 has none)
    inp = small_vocab_inputs()
    res["small_vocab"] = run_terms(inp, group, tp, rank, kind="topk-reverse", tail="unbiased", off_policy=True,
                                   with_entropy=True, vocab_size=SMALL_V)
    res["small_vocab/inplace"] = run_terms(inp, group, tp, rank, kind="topk-reverse", tail="unbiased",
                                           off_policy=True, with_entropy=True, inplace=True, vocab_size=SMALL_V)
    small = inp["logits"][..., shard_cols(tp, rank)].contiguous()
    res["small_vocab/topk"] = vocab_parallel_topk(small, SMALL_V, vocab_size=SMALL_V, group=group)[0]
    # 5. no-grad primitives: top-k, log-normaliser, log-probs at ids
    inp = make_inputs(5)
    shard = inp["logits"][..., shard_cols(tp, rank)].contiguous()
    for k in (1, 5, 25, V):
        with CollectiveCounter() as cc:
            ids, lp = vocab_parallel_topk(shard, k, vocab_size=V, group=group, chunk_size=4)
        res[f"topk/k{k}"] = dict(ids=ids, logprobs=lp, collectives=cc.count)
        ids32, lp32 = vocab_parallel_topk(shard.float(), k, vocab_size=V, group=group)
        res[f"topk/k{k}/fp32"] = dict(ids=ids32, logprobs=lp32)
    res["lse"] = vocab_parallel_logsumexp(shard, group, vocab_size=V)
    res["logprobs_at"] = vocab_parallel_logprobs_at(shard, inp["q"], group=group, vocab_size=V)
    res["logprobs_at_token"] = vocab_parallel_logprobs_at(shard, inp["tokens"], group=group, vocab_size=V)
    # 6. -Megatron's vocab_parallel_cross_entropy (fp32 inside; the Megatron TP group), value and
    #    gradient: padding as real columns (vocab_size = PADDED), and padding at -inf (vocab_size = V)
    if tp == ps.get_tensor_model_parallel_world_size():
        from emapg_megatron.parallel import vocab_parallel_policy_terms

        ce_res = {}
        tp_group = ps.get_tensor_model_parallel_group()
        for padded_real in (True, False):
            full = inp["logits"].float()
            if not padded_real:
                full[..., V:] = -float("inf")
            mine = full[..., shard_cols(tp, rank)].contiguous()
            theirs = mine.clone().requires_grad_(True)
            ce = vocab_parallel_cross_entropy(theirs * 1.0, inp["tokens"])  # CE overwrites its input
            (ce * inp["w_lp"].float()).sum().backward()
            ours_in = mine.clone().requires_grad_(True)
            ours = vocab_parallel_policy_terms(ours_in, inp["tokens"], None, group=tp_group,
                                               vocab_size=PADDED if padded_real else V).logprob
            (-ours * inp["w_lp"].float()).sum().backward()
            ce_res[f"padded_real={padded_real}"] = dict(
                value=(ours + ce).abs().max().detach(),
                grad=(ours_in.grad - theirs.grad).abs().max())
        res["megatron_ce"] = ce_res
    return res


def loss_mask_pattern() -> torch.Tensor:
    mask = torch.ones(LEAD, dtype=torch.bool)
    mask[0, 1] = mask[1, 3] = mask[2, 0] = mask[2, 4] = False
    return mask


# --- Megatron GPTModel: the fused op + a KL loss inside forward_backward_func -----------------------

def _policy_loss(logits, mb):
    """A policy loss of one micro-batch from the vocab-sharded logits ``[b, s, V/TP]``."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.parallel import (
        kl_from_policy_terms,
        vocab_parallel_policy_terms,
    )

    labels, q, mask = mb["labels"], mb["q"], mb["mask"]
    terms = vocab_parallel_policy_terms(
        logits, labels, q, group=ps.get_tensor_model_parallel_group(), vocab_size=GPT_VOCAB,
        with_entropy=True, loss_mask=mask, chunk_size=8)
    kl = kl_from_policy_terms(terms, labels, q, mb["ref_q"], mb["ref_y"], kind="topk-reverse", loss_mask=mask)
    per_token = -mb["adv"] * terms.logprob + 0.5 * kl - 0.01 * terms.entropy
    loss = (per_token * mask).sum() / mask.sum()
    return loss, {"loss": loss.detach()}


GPT_VOCAB = 100  # padded to 128 at TP 1 and 2: 28 padding columns


def gpt_microbatches(n: int = 2, b: int = 2, seq: int = 16, k: int = 4):
    from megatron_workers import batch

    out = []
    for s in range(n):
        tokens, labels = batch(s + 1, n=b, seq=seq, vocab=GPT_VOCAB)
        g = torch.Generator().manual_seed(50 + s)
        rows = []
        for i, y in enumerate(labels.reshape(-1).tolist()):
            perm = torch.randperm(GPT_VOCAB, generator=g)
            if i % 3 == 0:  # every third label inside q
                perm = torch.cat([torch.tensor([y]), perm[perm != y]])
            rows.append(perm[:k])
        q = torch.stack(rows).view(b, seq, k)
        ref_q = torch.randn(b, seq, k, generator=g).log_softmax(-1) - 1.0
        ref_y = torch.randn(b, seq, generator=g) - 3.0
        adv = torch.randn(b, seq, generator=g)
        mask = torch.ones(b, seq, dtype=torch.bool)
        mask[1, -3:] = False
        out.append(dict(tokens=tokens, labels=labels, q=q, ref_q=ref_q, ref_y=ref_y, adv=adv, mask=mask))
    return out


def gpt_policy_run(ckpt_dir: str, save: bool) -> dict:
    """Parameter gradients of a tiny GPTModel under the fused policy loss, from fixed weights,
    through the trainer's pipeline pass (``training.schedule.forward_backward``)."""
    from megatron_workers import grads_by_global_name, save_or_load, tiny_config

    from emapg_megatron.models.gpt import global_param_name, unwrap
    from emapg_megatron.training.config import OptimConfig
    from emapg_megatron.training.model_and_optimizer import (
        build_model_and_optimizer,
        zero_grads,
    )
    from emapg_megatron.training.schedule import forward_backward

    chunks, opt = build_model_and_optimizer(tiny_config(), OptimConfig(lr=1e-2))
    gpt = unwrap(chunks[0])
    save_or_load(chunks, opt, ckpt_dir, save)
    zero_grads(chunks, opt)
    # The schedule ends with Megatron's finalize_model_grads (the model config's hook).
    losses = [d["loss"] for d in forward_backward(chunks, gpt_microbatches(), _policy_loss)]
    dims = {}
    for name, p in gpt.named_parameters():  # how TP shards each parameter (-1: replicated)
        dims[global_param_name(gpt, name)] = p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1
    return dict(losses=torch.stack(losses) if losses else torch.empty(0), grads=grads_by_global_name(chunks[0]),
                partition_dims=dims)


def tp_job(ckpt_dir: str, save: bool) -> dict:
    """One spawned job at TP = world size: the equivalence suite and the GPT run."""
    res = vocab_parallel_checks("tp")
    res["gpt"] = gpt_policy_run(ckpt_dir, save)
    return res


# --- precision under a constant logit offset (test_parallel_precision.py) ---------------------------

PREC_T, PREC_V, PREC_PADDED, PREC_K = 24, 500, 512, 8  # 12 padding columns (all on the last rank)
PREC_OFFSETS = (0.0, 1e4)
PREC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PREC_SMALL_V = PREC_PADDED // 2  # at TP 2 the last rank holds only padding


def precision_inputs(offset: float, tag: str) -> dict:
    """Logits ``offset + 3 randn`` rounded to ``tag``'s dtype (the reference uses these rounded
    values), padding columns above every real logit; tokens, q (k distinct ids) and loss weights."""
    g = torch.Generator().manual_seed(17)
    logits = torch.randn(PREC_T, PREC_PADDED, generator=g, dtype=torch.float64) * 3.0
    logits[:, PREC_V:] = 15.0
    tokens = torch.randint(0, PREC_V, (PREC_T,), generator=g)
    q = torch.stack([torch.randperm(PREC_V, generator=g)[:PREC_K] for _ in range(PREC_T)])
    q[::2, 0] = tokens[::2]  # every other token inside q
    return dict(
        logits=(logits + offset).to(PREC_DTYPES[tag]), tokens=tokens, q=q,
        w_lp=torch.randn(PREC_T, generator=g, dtype=torch.float64),
        w_q=torch.randn(PREC_T, PREC_K, generator=g, dtype=torch.float64),
        w_ent=torch.randn(PREC_T, generator=g, dtype=torch.float64),
    )


def precision_checks(group_spec=None) -> dict:
    """Every entry point on this rank's shard, for each dtype and offset (``None``: TP = 1, no group)."""
    import torch.distributed as dist

    from emapg_megatron.parallel import (
        vocab_parallel_logprobs_at,
        vocab_parallel_policy_terms,
        vocab_parallel_topk,
    )

    group = None if group_spec is None else _group(group_spec)
    tp, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    width = PREC_PADDED // tp
    out = {}
    for tag in PREC_DTYPES:
        for offset in PREC_OFFSETS:
            inp = precision_inputs(offset, tag)
            shard = inp["logits"][:, rank * width:(rank + 1) * width].contiguous()
            res = {}
            res["topk_ids"], res["topk"] = vocab_parallel_topk(shard, PREC_K, vocab_size=PREC_V, group=group)
            res["at_q"] = vocab_parallel_logprobs_at(shard, inp["q"], group=group, vocab_size=PREC_V)
            res["at_token"] = vocab_parallel_logprobs_at(shard, inp["tokens"], group=group, vocab_size=PREC_V)
            for inplace in (False, True):
                x = shard.clone().requires_grad_(True)
                terms = vocab_parallel_policy_terms(x, inp["tokens"], inp["q"], group=group, vocab_size=PREC_V,
                                                    with_entropy=True, inplace_backward=inplace, chunk_size=8)
                loss = ((inp["w_lp"].float() * terms.logprob).sum() + (inp["w_q"].float() * terms.logprob_topk).sum()
                        + (inp["w_ent"].float() * terms.entropy).sum())
                loss.backward()
                res[f"terms{int(inplace)}"] = dict(
                    logprob=terms.logprob.detach(), logprob_topk=terms.logprob_topk.detach(),
                    entropy=terms.entropy.detach(), grad=x.grad)
            out[f"{tag}/{offset:g}"] = res
    # Logits far below 0 and a vocabulary that leaves the last rank only padding (at TP 2): that rank's
    # empty partial must weigh nothing (exp(0 - M) x 0 was inf x 0 = NaN).
    inp = precision_inputs(-1e4, "fp32")
    x = inp["logits"][:, rank * width:(rank + 1) * width].contiguous().requires_grad_(True)
    terms = vocab_parallel_policy_terms(x, inp["tokens"] % PREC_SMALL_V, None, group=group,
                                        vocab_size=PREC_SMALL_V, with_entropy=True)
    ((inp["w_lp"].float() * terms.logprob).sum() + (inp["w_ent"].float() * terms.entropy).sum()).backward()
    out["small_vocab"] = dict(logprob=terms.logprob.detach(), entropy=terms.entropy.detach(), grad=x.grad)
    return out
