"""Sequence-level KL (eq. 10-12), checked by enumerating every sequence of a tiny autoregressive policy."""

import itertools
import math

import torch

from emapg_megatron.kl import (
    sequence_kl,
    sequence_kl_loss,
    sequence_kl_penalized_reward,
)

V, L = 3, 3


def _policy(params, prefix):
    """A tiny autoregressive policy: logits depend on the position and the previous token."""
    n = len(prefix)
    prev = prefix[-1] if prefix else V
    return torch.log_softmax(params[n, prev], -1)


def _all_sequences():
    return [list(s) for s in itertools.product(range(V), repeat=L)]


def _seq_logprobs(params, ys):
    return torch.stack([torch.stack([_policy(params, y[:n])[y[n]] for n in range(L)]) for y in ys])


def test_sequence_kl_loss_gradient_is_sequence_kl_gradient():
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(L, V + 1, V, generator=g, dtype=torch.float64, requires_grad=True)
    ref_params = torch.randn(L, V + 1, V, generator=g, dtype=torch.float64)
    ys = _all_sequences()
    lp = _seq_logprobs(theta, ys)  # [N, L]
    lr = _seq_logprobs(ref_params, ys)
    mask = torch.ones(len(ys), L, dtype=torch.bool)
    prob = lp.sum(-1).exp().detach()
    # exact sequence KL and its gradient
    kl_exact = (lp.sum(-1).exp() * (lp.sum(-1) - lr.sum(-1))).sum()
    (g_exact,) = torch.autograd.grad(kl_exact, theta, retain_graph=True)
    # E_y[sequence_kl] and E_y[grad sequence_kl_loss]
    val = (prob * sequence_kl(lp, lr, mask)).sum()
    assert abs(val.item() - kl_exact.item()) < 1e-12
    (g_est,) = torch.autograd.grad((prob * sequence_kl_loss(lp, lr, mask)).sum(), theta, retain_graph=True)
    assert (g_est - g_exact).abs().max().item() < 1e-12
    # REINFORCE with the shaped reward R - beta sg(KL_seq) (R = 0) gives -beta grad KL
    beta = 0.1
    shaped = sequence_kl_penalized_reward(torch.zeros(len(ys)), lp, lr, mask, beta)
    (g_pg,) = torch.autograd.grad((prob * shaped * lp.sum(-1)).sum(), theta)
    assert (g_pg + beta * g_exact).abs().max().item() < 1e-12


def test_mask_and_padding():
    lp = torch.tensor([[-1.0, -2.0, -math.inf]], requires_grad=True)
    lr = torch.tensor([[-1.5, -1.0, -math.inf]])
    mask = torch.tensor([[1, 1, 0]])
    out = sequence_kl(lp, lr, mask)
    assert torch.allclose(out, torch.tensor([0.5 - 1.0]))
    out.sum().backward()
    assert torch.equal(lp.grad, torch.tensor([[1.0, 1.0, 0.0]]))
    shaped = sequence_kl_penalized_reward(torch.tensor([1.0]), lp, lr, mask, 0.5)
    assert not shaped.requires_grad and torch.allclose(shaped, torch.tensor([1.25]))
    loss = sequence_kl_loss(lp, lr, mask)
    assert torch.allclose(loss.detach(), out.detach())
