"""A sampled token the reference (a distillation teacher) gives no mass: its -inf log-prob makes
the forward tail's w log w 0 (its limit), not NaN, so the trainer does not refuse the update
(issue 39, distillation)."""

import math

import torch

from emapg_megatron.kl import sampled_kl, topk_kl_from_gathered


def _inputs():
    lp_q = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5]], dtype=torch.float64), -1)[..., :2].requires_grad_()
    lp_y = torch.tensor([-2.5], dtype=torch.float64, requires_grad=True)
    ref_q = torch.log(torch.tensor([[0.6, 0.3]], dtype=torch.float64))
    return lp_q, lp_y, ref_q


def test_the_forward_tail_at_zero_reference_mass_is_its_limit():
    for tail in ("unbiased", "paper"):
        lp_q, lp_y, ref_q = _inputs()
        out = topk_kl_from_gathered(lp_q, lp_y, ref_q, torch.tensor([-math.inf], dtype=torch.float64),
                                    torch.tensor([False]), direction="forward", tail=tail)
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(lp_q.grad).all() and torch.isfinite(lp_y.grad).all()
        # the limit w -> 0 of the same estimator, taken with a tiny reference mass
        lp_q2, lp_y2, _ = _inputs()
        near = topk_kl_from_gathered(lp_q2, lp_y2, ref_q, torch.tensor([-700.0], dtype=torch.float64),
                                     torch.tensor([False]), direction="forward", tail=tail)
        torch.testing.assert_close(out, near, rtol=0, atol=1e-12)


def test_sampled_k5_at_zero_reference_mass():
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-math.inf, -0.5], dtype=torch.float64)
    out = sampled_kl(lp, ref, "k5")
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(lp.grad).all()
    assert out[0].item() == 0.0  # w log w = 0 and log r = 0 in value
