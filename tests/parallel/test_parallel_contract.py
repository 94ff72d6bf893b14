"""Single-process checks of the fused op's contract: saved-for-backward memory, one backward for the
in-place variant, clear errors on bad input (the multi-rank maths is in test_parallel_vocab.py)."""

import pytest
import torch

from emapg_megatron.parallel import (
    SavedTensorBytes,
    kl_from_policy_terms,
    vocab_parallel_logprobs_at,
    vocab_parallel_policy_terms,
    vocab_parallel_topk,
)

T, VS, V, K = 64, 512, 500, 8  # shard width 512, 12 padding columns


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(T, VS, generator=g).to(dtype)
    tokens = torch.randint(0, V, (T,), generator=g)
    q = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(T)])
    ref_q = torch.randn(T, K, generator=g).log_softmax(-1)
    ref_y = torch.randn(T, generator=g) - 4
    return logits, tokens, q, ref_q, ref_y


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saves_one_logits_row_per_token_plus_o_k(dtype, inplace):
    logits, tokens, q, ref_q, ref_y = _inputs(dtype)
    x = logits.clone().requires_grad_(True)
    with SavedTensorBytes() as sb:
        terms = vocab_parallel_policy_terms(x, tokens, q, group=None, vocab_size=V, with_entropy=True,
                                            inplace_backward=inplace, chunk_size=16)
    row = VS * logits.element_size()
    # the logits (or the probabilities over them) in their own dtype, ids (8 (k + 1)), lse, entropy
    # and local max (12), and for bf16 probabilities the exact picked log-probs (4 (k + 1))
    assert sb.bytes / T <= row + 12 * (K + 1) + 12, sb.bytes / T
    assert sb.bytes / T >= row
    with SavedTensorBytes() as sb_kl:
        kl = kl_from_policy_terms(terms, tokens, q, ref_q, ref_y, kind="topk-reverse")
    assert sb_kl.bytes / T <= 64 * (K + 1)  # the KL maths on [T, k] is O(k) per token
    kl.sum().backward()
    assert x.grad.dtype == dtype


def test_inplace_backward_runs_once():
    logits, tokens, q, _, _ = _inputs()
    x = logits.clone().requires_grad_(True)
    lp = vocab_parallel_policy_terms(x * 1.0, tokens, q, group=None, vocab_size=V, inplace_backward=True).logprob
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward runs once"):
        lp.sum().backward()


def test_inplace_overwrites_logits_with_unnormalised_probabilities():
    logits, tokens, q, _, _ = _inputs()
    x = logits.clone().requires_grad_(True)
    y = x * 1.0
    vocab_parallel_policy_terms(y, tokens, q, group=None, vocab_size=V, inplace_backward=True)
    e = y[:, :V].detach()  # exp(z - max): the probabilities up to a per-token factor
    torch.testing.assert_close(e.amax(-1), torch.ones(T))
    torch.testing.assert_close(e / e.sum(-1, keepdim=True), torch.softmax(logits[:, :V], -1))


def test_bad_inputs_raise_one_line_errors():
    logits, tokens, q, ref_q, ref_y = _inputs()
    kw = dict(group=None, vocab_size=V)
    with pytest.raises(ValueError, match="tokens holds ids outside"):
        vocab_parallel_policy_terms(logits, torch.full_like(tokens, V), q, **kw)  # a padding id
    with pytest.raises(ValueError, match="topk_index holds ids outside"):
        vocab_parallel_policy_terms(logits, tokens, q - 1000, **kw)
    with pytest.raises(ValueError, match="topk_index shape"):
        vocab_parallel_policy_terms(logits, tokens, q[:-1], **kw)
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_policy_terms(logits, tokens, q, group=None, vocab_size=VS + 1)
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_policy_terms(logits, tokens, q, chunk_size=0, **kw)
    with pytest.raises(ValueError, match="k=501"):
        vocab_parallel_topk(logits, V + 1, **kw)
    with pytest.raises(ValueError, match="ids shape"):
        vocab_parallel_logprobs_at(logits, q[:-1], **kw)
    terms = vocab_parallel_policy_terms(logits, tokens, None, **kw)
    with pytest.raises(ValueError, match="unknown KL kind"):
        kl_from_policy_terms(terms, tokens, q, ref_q, ref_y, kind="k6")
    with pytest.raises(ValueError, match="needs topk_index"):
        kl_from_policy_terms(terms, tokens, q, ref_q, ref_y, kind="topk-forward")
    dup = q.clone()
    dup[0, 1] = dup[0, 0]
    terms = vocab_parallel_policy_terms(logits, tokens, dup, **kw)  # the op itself allows duplicates
    with pytest.raises(ValueError, match="duplicate"):
        kl_from_policy_terms(terms, tokens, dup, ref_q, ref_y, kind="topk-reverse")


def test_masked_tokens_may_hold_padding_ids_and_padding_q_ids_have_zero_mass():
    logits, tokens, q, _, _ = _inputs(torch.float64)
    mask = torch.ones(T, dtype=torch.bool)
    mask[::3] = False
    tokens = torch.where(mask, tokens, torch.full_like(tokens, -1))
    q = q.clone()
    q[1, 0] = V + 3  # a padding id inside q: log-prob -inf, no gradient
    x = logits.clone().requires_grad_(True)
    terms = vocab_parallel_policy_terms(x, tokens, q, group=None, vocab_size=V, loss_mask=mask)
    assert terms.logprob_topk[1, 0].item() == -float("inf")
    want = torch.log_softmax(logits[:, :V], -1)
    torch.testing.assert_close(terms.logprob_topk[1, 1:], want[1].gather(-1, q[1, 1:]), rtol=0, atol=1e-12)
    finite = torch.where(torch.isinf(terms.logprob_topk), torch.zeros_like(terms.logprob_topk), terms.logprob_topk)
    (terms.logprob.sum() + finite.sum()).backward()
    assert torch.all(x.grad[~mask] == 0) and torch.all(x.grad[:, V:] == 0)
