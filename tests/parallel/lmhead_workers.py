"""Rank functions for test_lmhead_terms.py (spawned, so module level): the fused output-layer op
against the unfused path (Megatron's ColumnParallelLinear function, then the logits ops), on raw
tensors at TP 1 / 2 (with and without sequence parallelism) and through a real GPTModel at PP 2 and
TP 2 + SP with the output-layer hook, tied and untied."""

from __future__ import annotations

import torch

S, B, H = 8, 3, 16  # [S, B, H] hidden states; S divisible by TP 2 (sequence parallelism)
V, PADDED, K = 37, 40, 5  # 3 padding rows of the output weight
CHUNK = 5  # tokens per chunk: 24 tokens -> 5 chunks, the last one short
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


def op_inputs() -> dict:
    """Full hidden states, output weight (padding rows included) and per-token inputs, fp64."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    weight = torch.randn(PADDED, H, generator=g, dtype=torch.float64) * 0.6
    weight[V:] = 0.5  # padding rows: any leak into the real vocabulary would show
    tokens = torch.randint(0, V, (B, S), generator=g)
    q = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * S)]).view(B, S, K)
    q[0, ::2, 0] = tokens[0, ::2]  # some tokens inside q
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 2] = mask[2, 5:] = False
    return dict(hidden=hidden, weight=weight, tokens=tokens, q=q, mask=mask,
                w_lp=torch.randn(B, S, generator=g, dtype=torch.float64),
                w_q=torch.randn(B, S, K, generator=g, dtype=torch.float64),
                w_ent=torch.randn(B, S, generator=g, dtype=torch.float64))


def weighted(terms, inp) -> torch.Tensor:
    """A loss with independent upstream gradients on every output (masked tokens hold 0)."""
    dt = terms.logprob.dtype
    return ((inp["w_lp"].to(dt) * terms.logprob).sum() + (inp["w_q"].to(dt) * terms.logprob_topk).sum()
            + (inp["w_ent"].to(dt) * terms.entropy).sum())


def unfused_logits(hidden, weight, group, sp: bool) -> torch.Tensor:
    """GPTModel's output layer: ColumnParallelLinear's function, then ``[S, B, V/TP] -> [B, S, V/TP]``."""
    from megatron.core.tensor_parallel.layers import (
        linear_with_grad_accumulation_and_async_allreduce,
    )

    if group is None:  # TP 1 in the test process: no parallel state
        return torch.matmul(hidden, weight.t()).transpose(0, 1).contiguous()
    tp = group.size()
    z = linear_with_grad_accumulation_and_async_allreduce(
        hidden, weight, None, gradient_accumulation_fusion=False, allreduce_dgrad=tp > 1 and not sp,
        sequence_parallel=sp, tp_group=group)
    return z.transpose(0, 1).contiguous()


def op_run(inp: dict, tag: str, group, tp: int, rank: int, sp: bool) -> dict:
    """Fused and unfused forward + backward on this rank's shards; no-grad scores of both."""
    from emapg_megatron.parallel import (
        lmhead_policy_terms,
        lmhead_scores,
        vocab_parallel_logprobs_at,
        vocab_parallel_logsumexp,
        vocab_parallel_policy_terms,
        vocab_parallel_topk,
    )

    dt = DTYPES[tag]
    width, seq = PADDED // tp, S // tp if sp else S
    h_local = inp["hidden"][rank * seq:(rank + 1) * seq] if sp else inp["hidden"]
    w_shard = inp["weight"][rank * width:(rank + 1) * width]
    kw = dict(group=group, vocab_size=V, with_entropy=True, chunk_size=CHUNK, loss_mask=inp["mask"])
    out = {}
    for path in ("fused", "unfused"):
        h = h_local.to(dt).clone().requires_grad_(True)
        w = w_shard.to(dt).clone().requires_grad_(True)
        if path == "fused":
            terms = lmhead_policy_terms(h, w, inp["tokens"], inp["q"], sequence_parallel=sp, **kw)
        else:
            terms = vocab_parallel_policy_terms(unfused_logits(h, w, group, sp), inp["tokens"], inp["q"], **kw)
        weighted(terms, inp).backward()
        out[path] = dict(logprob=terms.logprob.detach(), logprob_topk=terms.logprob_topk.detach(),
                         entropy=terms.entropy.detach(), grad_hidden=h.grad, grad_weight=w.grad)
    ids = torch.cat([inp["tokens"].unsqueeze(-1), inp["q"]], dim=-1)
    h, w = h_local.to(dt), w_shard.to(dt)
    s = lmhead_scores(h, w, ids, K, group=group, vocab_size=V, chunk_size=CHUNK, sequence_parallel=sp)
    out["scores/fused"] = dict(at=s.logprob, topk_ids=s.topk_ids, topk=s.topk_logprob, lse=s.lse)
    with torch.no_grad():
        z = unfused_logits(h, w, group, sp)
    ids_u, lp_u = vocab_parallel_topk(z, K, vocab_size=V, group=group)
    out["scores/unfused"] = dict(at=vocab_parallel_logprobs_at(z, ids, group=group, vocab_size=V), topk_ids=ids_u,
                                 topk=lp_u, lse=vocab_parallel_logsumexp(z, group, vocab_size=V))
    return out


def saved_bytes(tag: str) -> dict:
    """Saved-for-backward bytes per token of the fused op at two vocabulary sizes (TP 1, no group)."""
    from emapg_megatron.parallel import SavedTensorBytes, lmhead_policy_terms

    dt, t, hid, k = DTYPES[tag], 64, 32, 8
    g = torch.Generator().manual_seed(1)
    h = torch.randn(t, hid, generator=g).to(dt).requires_grad_(True)
    tokens = torch.randint(0, 1000, (t,), generator=g)
    q = torch.stack([torch.randperm(1000, generator=g)[:k] for _ in range(t)])
    res = {}
    for v in (1000, 4000):
        w = (torch.randn(v, hid, generator=g) * 0.1).to(dt).requires_grad_(True)
        with SavedTensorBytes() as sb:
            terms = lmhead_policy_terms(h, w, tokens, q, group=None, vocab_size=v, with_entropy=True, chunk_size=16)
        sb.storages.pop((w.device, w.untyped_storage().data_ptr()))  # the weight: a parameter, alive anyway
        res[v] = sb.bytes / t
        weighted_sum = terms.logprob.sum() + terms.logprob_topk.sum() + terms.entropy.sum()
        weighted_sum.backward()  # the graph is usable
    return dict(per_token=res, hidden=hid, k=k, elt=h.element_size())


def tp_job(sp_cases: tuple) -> dict:
    """One spawned job at TP = world size: every dtype, with and without sequence parallelism,
    then the GPTModel through the hook (TP 2 + sequence parallelism)."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    inp = op_inputs()
    res = {f"{tag}/sp{int(sp)}": op_run(inp, tag, group, tp, rank, sp) for tag in DTYPES for sp in sp_cases}
    if tp > 1:
        res["gpt/sp/fp32"] = gpt_compare(tied=False, bf16=False, sequence_parallel=True)
    return res


# --- a real GPTModel: the hook under the pipeline schedule ------------------------------------------

GPT_VOCAB = 100  # the tiny config pads it to 128


def gpt_microbatches(n: int = 2, b: int = 2, seq: int = 8) -> list:
    g = torch.Generator().manual_seed(9)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, GPT_VOCAB, (b, seq + 1), generator=g)
        labels = tokens[:, 1:].contiguous()
        q = torch.stack([torch.randperm(GPT_VOCAB, generator=g)[:4] for _ in range(b * seq)]).view(b, seq, 4)
        q[:, ::3, 0] = labels[:, ::3]
        mask = torch.ones(b, seq, dtype=torch.bool)
        mask[1, -2:] = False
        out.append(dict(tokens=tokens[:, :-1].contiguous(), labels=labels, q=q, mask=mask,
                        ref_q=torch.randn(b, seq, 4, generator=g).log_softmax(-1) - 1.0,
                        ref_y=torch.randn(b, seq, generator=g) - 3.0, adv=torch.randn(b, seq, generator=g)))
    return out


def policy_loss(terms, mb):
    """The trainer's shape of loss: PG term + Top-k reverse KL - entropy bonus, masked mean."""
    from emapg_megatron.parallel import kl_from_policy_terms

    mask = mb["mask"]
    kl = kl_from_policy_terms(terms, mb["labels"], mb["q"], mb["ref_q"], mb["ref_y"], kind="topk-reverse",
                              loss_mask=mask)
    per_token = -mb["adv"] * terms.logprob + 0.5 * kl - 0.01 * terms.entropy
    loss = (per_token * mask).sum() / mask.sum()
    return loss, {"loss": loss.detach()}


def _passes(fused: bool, sequence_parallel: bool):
    """(no-grad pass, loss) on the logits, or on the hidden states and weight the production
    schedule hands over with ``fused_lmhead`` (``HiddenAndWeight``)."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.parallel import (
        lmhead_policy_terms,
        lmhead_scores,
        vocab_parallel_logprobs_at,
        vocab_parallel_policy_terms,
        vocab_parallel_topk,
    )

    group = ps.get_tensor_model_parallel_group()
    kw = dict(group=group, vocab_size=GPT_VOCAB)

    def no_grad_pass(out, mb):  # the old / anchor passes: log pi(y), log pi(q), top-k
        ids = torch.cat([mb["labels"].unsqueeze(-1), mb["q"]], dim=-1)
        if fused:
            s = lmhead_scores(out.hidden, out.weight, ids, 4, sequence_parallel=sequence_parallel,
                              chunk_size=5, **kw)
            return dict(at=s.logprob, topk_ids=s.topk_ids, topk=s.topk_logprob)
        top_ids, top = vocab_parallel_topk(out, 4, **kw)
        return dict(at=vocab_parallel_logprobs_at(out, ids, **kw), topk_ids=top_ids, topk=top)

    def loss(out, mb):
        args = (mb["labels"], mb["q"])
        opts = dict(with_entropy=True, loss_mask=mb["mask"], chunk_size=5, **kw)
        if fused:
            terms = lmhead_policy_terms(out.hidden, out.weight, *args, sequence_parallel=sequence_parallel,
                                        **opts)
        else:
            terms = vocab_parallel_policy_terms(out, *args, **opts)
        return policy_loss(terms, mb)

    return no_grad_pass, loss


def gpt_compare(tied: bool, bf16: bool, sequence_parallel: bool = False) -> dict:
    """One model, both paths: the no-grad outputs and the parameter gradients (after Megatron's
    finalize_model_grads: DP, the tied-embedding sum over stages, TP sums under SP)."""
    from megatron_workers import grads_by_global_name, tiny_config

    from emapg_megatron.models.config import PrecisionConfig
    from emapg_megatron.models.gpt import unwrap
    from emapg_megatron.models.hidden_output import output_layer_bypassed
    from emapg_megatron.training.config import OptimConfig
    from emapg_megatron.training.model_and_optimizer import (
        build_model_and_optimizer,
        zero_grads,
    )
    from emapg_megatron.training.schedule import forward_backward, forward_only

    chunks, opt = build_model_and_optimizer(tiny_config(tie_word_embeddings=tied, hidden_size=32, ffn_hidden_size=64),
                                            OptimConfig(lr=1e-2), PrecisionConfig(bf16=bf16),
                                            sequence_parallel=sequence_parallel)
    mbs = gpt_microbatches()
    out = {}
    for fused in (False, True):
        name = "fused" if fused else "unfused"
        no_grad_pass, loss = _passes(fused, sequence_parallel)
        nograd = forward_only(chunks, mbs, no_grad_pass, fused_lmhead=fused)
        zero_grads(chunks, opt)
        losses = forward_backward(chunks, mbs, loss, fused_lmhead=fused)
        out[name] = dict(nograd=nograd, losses=[d["loss"] for d in losses], grads=grads_by_global_name(chunks[0]))
    gpt = unwrap(chunks[0])
    out["restored"] = not gpt.post_process or "forward" not in gpt.output_layer.__dict__  # the hook is undone
    with output_layer_bypassed(chunks[0]) as cap:  # how: megatron-core's output_processor, or a patch
        out["hook"] = {"last_stage": gpt.post_process, "model_kwargs": sorted(cap.model_kwargs),
                       "patched": gpt.post_process and "forward" in gpt.output_layer.__dict__}
    return out


def pp_job(cases: tuple) -> dict:
    return {f"tied{int(tied)}/{'bf16' if bf16 else 'fp32'}": gpt_compare(tied, bf16) for tied, bf16 in cases}
