"""Single-process checks of the fused op's contract: saved-for-backward memory, one backward for the
in-place variant, clear errors on bad input, the reference clamps reaching every estimator (the
multi-rank maths is in test_parallel_vocab.py)."""

import itertools

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


def _binding_anchor_and_sampler(logits, tokens):
    """log ref(y) and log pi_sampling(y) at offsets from log pi(y) that make every reference clamp
    bind on some tokens (|log w| > 20, a K3 value > 10, |log s| > 20)."""
    lp_y = torch.log_softmax(logits[:, :V].double(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    cycle = torch.arange(T) % 5
    log_w = torch.tensor([-30.0, -12.0, 0.5, 6.0, 25.0], dtype=torch.float64)[cycle]
    log_s = torch.tensor([25.0, 0.3, -26.0, 1.0, -0.2], dtype=torch.float64)[cycle]
    return lp_y + log_w, lp_y - log_s


@pytest.mark.parametrize("clamps", [False, True])
def test_reference_clamps_reach_every_estimator(clamps):
    """``kl_from_policy_terms(reference_clamps=...)`` equals the single-device library with the same
    flag: sampled_kl, topk_kl; for the f-divergences (no reference counterpart) only the weight
    is clamped. Off, it is bit-identical to not passing it."""
    from emapg_megatron.kl import (
        LOSS_TYPE_NAMES,
        SAMPLED,
        TOPK_KL,
        importance_weight,
        loss_type,
        sampled_kl,
        token_in_topk,
        topk_fdiv_from_gathered,
        topk_kl,
    )

    logits, tokens, q, ref_q, _ = _inputs(torch.float64)
    ref_y, samp_y = _binding_anchor_and_sampler(logits, tokens)
    for kind, clip in itertools.product(LOSS_TYPE_NAMES, (None, (0.0, 10.0))):  # None: log s = 25 binds
        entry = loss_type(kind)
        alpha = 0.7 if entry.needs_alpha else None
        x = logits.clone().requires_grad_(True)
        terms = vocab_parallel_policy_terms(x, tokens, q, group=None, vocab_size=V)
        kw = dict(kind=kind, alpha=alpha, sampling_logprob=samp_y, iw_clip=clip)
        got = kl_from_policy_terms(terms, tokens, q, ref_q, ref_y, reference_clamps=clamps, **kw)
        (g_got,) = torch.autograd.grad(got.sum(), x)
        z = logits[:, :V].clone().requires_grad_(True)
        if entry.family == SAMPLED:
            lp_y = torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)
            want = sampled_kl(lp_y, ref_y, kind, sampling_logprob=samp_y, iw_clip=clip, reference_clamps=clamps)
        elif entry.family == TOPK_KL:
            want = topk_kl(z, tokens, q, ref_q, ref_y, direction=entry.selector, sampling_logprob=samp_y,
                           iw_clip=clip, reference_clamps=clamps)
        else:
            lp = torch.log_softmax(z, -1)
            lp_y = lp.gather(-1, tokens[:, None]).squeeze(-1)
            iw = importance_weight(lp_y, samp_y, clip, reference_clamps=clamps)
            want = topk_fdiv_from_gathered(lp.gather(-1, q), lp_y, ref_q, ref_y, token_in_topk(tokens, q),
                                           iw=iw, **entry.kwargs(alpha))
        (g_want,) = torch.autograd.grad(want.sum(), z)
        scale = max(1.0, want.abs().max().item())
        assert (got - want).abs().max().item() <= 1e-10 * scale, (kind, clip)
        assert (g_got[:, :V] - g_want).abs().max().item() <= 1e-10 * max(1.0, g_want.abs().max().item()), kind
        if not clamps:
            assert torch.equal(got, kl_from_policy_terms(terms, tokens, q, ref_q, ref_y, **kw)), kind
