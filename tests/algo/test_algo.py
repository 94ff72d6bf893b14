import torch

from emapg_megatron.algo.advantages import compute_advantages
from emapg_megatron.algo.config import LossConfig
from emapg_megatron.algo.policy_loss import (
    normaliser,
    per_sequence_weights,
    policy_loss_terms,
    ppo_clip,
)
from emapg_megatron.rollout.megatron_sampler import sample_from_logits


def test_group_global_and_no_std_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5])
    g = compute_advantages(r, 4, "group", eps=0.0)
    for i in range(2):
        grp = r[4 * i:4 * i + 4]
        torch.testing.assert_close(g[4 * i:4 * i + 4], (grp - grp.mean()) / grp.std())
    glob = compute_advantages(r, 4, "global", eps=0.0)
    means = r.view(2, 4).mean(1).repeat_interleave(4)
    a = r - means  # Appendix B: z-score of the flattened group-centred advantages
    torch.testing.assert_close(glob, (a - a.mean()) / a.std())
    torch.testing.assert_close(compute_advantages(r, 4, "none"), r - means)
    # A group with identical rewards has zero advantage, not NaN.
    assert torch.equal(compute_advantages(torch.ones(4), 4, "group"), torch.zeros(4))


def test_ppo_clip_higher_is_asymmetric():
    old = torch.zeros(4)
    lp = torch.log(torch.tensor([0.5, 1.5, 1.25, 0.7]))
    adv = torch.tensor([-1.0, 1.0, 1.0, -1.0])
    loss, clipped = ppo_clip(lp, old, adv, 0.2, 0.28)
    # ratio 1.5 > 1.28 with A>0 -> clipped at 1.28; 1.25 inside; 0.5 < 0.8 with A<0 -> clipped.
    torch.testing.assert_close(loss, torch.tensor([0.8, -1.28, -1.25, 0.8]))
    assert clipped.tolist() == [1.0, 1.0, 0.0, 1.0]


def test_aggregation_modes_match_their_definitions():
    torch.manual_seed(0)
    per_tok = torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.float)
    tm = (per_tok * per_sequence_weights(mask, "token-mean")).sum() / normaliser(mask, "token-mean")
    torch.testing.assert_close(tm, (per_tok * mask).sum() / mask.sum())
    smtm = (per_tok * per_sequence_weights(mask, "seq-mean-token-mean")).sum() / normaliser(
        mask, "seq-mean-token-mean")
    expect = ((per_tok[0, :2].mean()) + per_tok[1, :4].mean()) / 2  # empty sequence excluded
    torch.testing.assert_close(smtm, expect)
    smts = (per_tok * per_sequence_weights(mask, "seq-mean-token-sum")).sum() / normaliser(
        mask, "seq-mean-token-sum")
    torch.testing.assert_close(smts, (per_tok[0, :2].sum() + per_tok[1, :4].sum()) / 2)


def test_policy_loss_gradient_masks_non_model_tokens():
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    total, m = policy_loss_terms(lp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.zeros(2, 3),
                                 None, mask, LossConfig())
    total.backward()
    assert torch.equal(lp.grad == 0, mask == 0)
    assert m["tokens"].item() == 3


def test_inverse_cdf_sampling_is_exact_and_top_p_logprob_is_the_truncated_one():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = torch.softmax(logits, -1)[0]
    u = (torch.arange(10000) + 0.5) / 10000  # a fine grid of uniforms = the exact distribution
    ids, lp = sample_from_logits(logits.expand(10000, 4), u, 1.0, 1.0)
    freq = torch.bincount(ids, minlength=4).float() / 10000
    torch.testing.assert_close(freq, p, atol=1e-4, rtol=0)
    torch.testing.assert_close(lp, p.log()[ids])
    ids, lp = sample_from_logits(logits.expand(10000, 4), u, 1.0, 0.8)
    keep = p[:2] / p[:2].sum()  # p0 + p1 = 0.91 >= 0.8: the nucleus is {0, 1}
    assert set(ids.tolist()) == {0, 1}
    torch.testing.assert_close(lp, keep.log()[ids])


def test_a_zero_uniform_never_draws_a_token_of_zero_mass():
    """torch.rand can return exactly 0: it must pick the first token the sampler can draw, not a
    leading one outside the nucleus (whose sampling log-prob is -inf)."""
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])  # token 0 is outside the top-0.5 nucleus
    ids, lp = sample_from_logits(logits, torch.zeros(1), 1.0, 0.5)
    assert ids.tolist() == [1] and torch.isfinite(lp).all()
    ids, lp = sample_from_logits(torch.tensor([[-200.0, 0.0]]), torch.zeros(1), 1.0, 1.0)
    assert ids.tolist() == [1] and torch.isfinite(lp).all()  # exp(-200) is 0 in fp32


def test_temperature_zero_is_greedy():
    """Evaluation's greedy decoding: the argmax, drawn with probability 1 (log-prob 0)."""
    logits = torch.tensor([[0.0, 3.0, 2.0], [5.0, 1.0, 4.9]])
    ids, lp = sample_from_logits(logits, torch.tensor([0.99, 0.5]), 0.0, 1.0)
    assert ids.tolist() == [1, 0] and lp.tolist() == [0.0, 0.0]
