"""Rank functions and inputs for test_masked_vocab.py (spawned, so module level): logits with masked
vocabulary columns, -inf or the dtype's lowest finite value, through the fused policy-terms op in
every backward variant, and through the fused LM head with output rows whose logits are ~ -finfo.max.

Every rank builds the same full inputs from a fixed seed and keeps its shard; the test recomputes
the single-device fp64 reference with the masked columns at -inf.
"""

from __future__ import annotations

import itertools

import torch

V, PADDED, LEAD, K, H = 37, 40, (3, 5), 5, 8  # TP 2: rank 0 owns ids 0..19, rank 1 ids 20..39
MASKED = (2, 7, 19, 20, 33)  # on both shards at TP 2
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
FILLS = ("-inf", "min")  # a masked logit: -inf, or torch.finfo(dtype).min (masked_fill's usual value)
CHUNK = 2  # tokens per chunk: 15 tokens -> 8 chunks


def variants():
    """(dtype tag, fill, with_entropy, inplace, loss-masked): every backward variant."""
    return itertools.product(DTYPES, FILLS, (False, True), (False, True), (False, True))


def name_of(tag, fill, ent, inplace, masked) -> str:
    return f"{tag}/{fill}/ent{int(ent)}/inplace{int(inplace)}/mask{int(masked)}"


def vocab_mask() -> torch.Tensor:
    """``[*LEAD, V]`` bool, the masked ids: MASKED everywhere, plus every real id of rank 1 (TP 2) in
    token (1, 2) and every id of rank 0 in token (2, 3), so a shard may hold no finite logit."""
    mask = torch.zeros(LEAD + (V,), dtype=torch.bool)
    mask[..., list(MASKED)] = True
    mask[1, 2, PADDED // 2:] = True
    mask[2, 3, : PADDED // 2] = True
    return mask


def loss_mask_pattern() -> torch.Tensor:
    mask = torch.ones(LEAD, dtype=torch.bool)
    mask[0, 3] = mask[2, 0] = False
    return mask


def masked_inputs(fill: str = "-inf") -> dict:
    """fp64 logits ``[*LEAD, PADDED]`` (real columns finite, the masked ones set by the caller), q
    (for ``fill`` -inf with masked ids in two tokens, which the anchor masks too: zero mass on both
    sides; a finite fill is mass to the KL library, infinite KL against the anchor's -inf), tokens
    sampled from pi_old (never masked), the anchor's and pi_old's log-probs and the loss weights."""
    g = torch.Generator().manual_seed(23)
    mask = vocab_mask()
    logits = torch.randn(LEAD + (PADDED,), generator=g, dtype=torch.float64) * 2.0
    logits[..., V:] = 6.0  # padding above every real logit: a leak shows

    def masked_lp(z):
        return z.masked_fill(mask, -float("inf")).log_softmax(-1)

    old_lp = masked_lp(logits[..., :V] + 0.5 * torch.randn(LEAD + (V,), generator=g, dtype=torch.float64))
    ref_lp = masked_lp(logits[..., :V] + torch.randn(LEAD + (V,), generator=g, dtype=torch.float64))
    q = old_lp.topk(K, dim=-1).indices.clone()
    if fill == "-inf":
        q[0, 0, -2:] = torch.tensor([2, 33])
        q[1, 2, -1] = 30
    tokens = torch.multinomial(old_lp.exp().reshape(-1, V), 1, generator=g).view(LEAD)
    return dict(
        logits=logits, mask=mask, tokens=tokens, q=q,
        ref_q=ref_lp.gather(-1, q), ref_y=ref_lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1),
        samp_y=old_lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1),
        w_kl=torch.randn(LEAD, generator=g, dtype=torch.float64),
        w_lp=torch.randn(LEAD, generator=g, dtype=torch.float64),
        w_ent=torch.randn(LEAD, generator=g, dtype=torch.float64) * 3.0,  # |g_H| > 1: w g_H overflowed
    )


def masked_logits(inp: dict, tag: str, fill: str) -> torch.Tensor:
    """The logits in ``tag``'s dtype with the masked real columns at ``fill``."""
    dt = DTYPES[tag]
    value = -float("inf") if fill == "-inf" else torch.finfo(dt).min
    full = torch.cat([inp["mask"], torch.zeros(LEAD + (PADDED - V,), dtype=torch.bool)], dim=-1)
    return inp["logits"].to(dt).masked_fill(full, value)


def policy_loss(terms, inp, ent: bool, loss_mask):
    from emapg_megatron.parallel import kl_from_policy_terms

    dt = terms.logprob.dtype
    kl = kl_from_policy_terms(terms, inp["tokens"], inp["q"], inp["ref_q"].to(dt), inp["ref_y"].to(dt),
                              kind="topk-reverse", sampling_logprob=inp["samp_y"].to(dt), loss_mask=loss_mask)
    loss = (inp["w_kl"].to(dt) * kl).sum() + (inp["w_lp"].to(dt) * terms.logprob).sum()
    if ent:
        loss = loss + (inp["w_ent"].to(dt) * terms.entropy).sum()
    return kl, loss


def terms_run(inp, group, tp, rank, tag, fill, ent, inplace, masked) -> dict:
    from emapg_megatron.parallel import vocab_parallel_policy_terms

    width = PADDED // tp
    x = masked_logits(inp, tag, fill)[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
    loss_mask = loss_mask_pattern() if masked else None
    terms = vocab_parallel_policy_terms(x * 1.0, inp["tokens"], inp["q"], group=group, vocab_size=V,
                                        with_entropy=ent, inplace_backward=inplace, chunk_size=CHUNK,
                                        loss_mask=loss_mask)
    kl, loss = policy_loss(terms, inp, ent, loss_mask)
    loss.backward()
    return dict(kl=kl.detach(), logprob=terms.logprob.detach(), logprob_topk=terms.logprob_topk.detach(),
                entropy=None if terms.entropy is None else terms.entropy.detach(), grad=x.grad)


# --- the fused LM head: output rows whose logits are ~ -finfo.max ---------------------------------

LM_TAGS = ("fp64", "fp32")


def lmhead_inputs(tag: str) -> dict:
    """``h [T, H]`` with ``h[:, 0] = 1`` and an output weight whose masked rows are ``(-c, 0, ..., 0)``:
    their logit is exactly ``-c = -finfo.max / 2`` for every token (no GEMM can make -inf without NaN)."""
    dt = DTYPES[tag]
    g = torch.Generator().manual_seed(29)
    t = LEAD[0] * LEAD[1]
    hidden = torch.randn(t, H, generator=g, dtype=torch.float64)
    hidden[:, 0] = 1.0
    weight = torch.randn(PADDED, H, generator=g, dtype=torch.float64) * 0.6
    weight[V:] = 0.5
    weight[list(MASKED)] = 0.0
    weight[list(MASKED), 0] = -torch.finfo(dt).max / 2
    inp = masked_inputs()
    return dict(hidden=hidden.to(dt), weight=weight.to(dt), tokens=inp["tokens"].reshape(t),
                q=inp["q"].reshape(t, K)[:, :3],  # ids of unmasked columns only
                w_lp=inp["w_lp"].reshape(t), w_q=torch.randn(t, 3, generator=g, dtype=torch.float64),
                w_ent=inp["w_ent"].reshape(t))


def lmhead_run(group, tp, rank, tag, ent) -> dict:
    from emapg_megatron.parallel import lmhead_policy_terms

    inp = lmhead_inputs(tag)
    width = PADDED // tp
    h = inp["hidden"].clone().requires_grad_(True)
    w = inp["weight"][rank * width:(rank + 1) * width].clone().requires_grad_(True)
    terms = lmhead_policy_terms(h, w, inp["tokens"], inp["q"], group=group, vocab_size=V, with_entropy=ent,
                                chunk_size=CHUNK)
    dt = terms.logprob.dtype
    loss = (inp["w_lp"].to(dt) * terms.logprob).sum() + (inp["w_q"].to(dt) * terms.logprob_topk).sum()
    if ent:
        loss = loss + (inp["w_ent"].to(dt) * terms.entropy).sum()
    loss.backward()
    return dict(logprob=terms.logprob.detach(), logprob_topk=terms.logprob_topk.detach(),
                entropy=None if terms.entropy is None else terms.entropy.detach(), grad_hidden=h.grad,
                grad_weight=w.grad)


def masked_checks(group_spec=None) -> dict:
    """Every variant on this rank's shard (``None``: TP = 1 in process, no group)."""
    import torch.distributed as dist

    group = None
    if group_spec is not None:
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
    tp, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    res = {name_of(*v): terms_run(masked_inputs(v[1]), group, tp, rank, *v) for v in variants()}
    for tag in LM_TAGS:
        for ent in (False, True):
            res[f"lmhead/{tag}/ent{int(ent)}"] = lmhead_run(group, tp, rank, tag, ent)
    return res
