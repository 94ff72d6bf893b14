"""Inverse-CDF sampling of logits: one uniform per token, so the same uniforms give the same
tokens on every path (cache-free, KV-cached, fixed-shape) and layout. Pure device ops (no host
synchronisation), so a captured CUDA graph of a decode step can sample too."""

from __future__ import annotations

import torch


def sample_from_logits(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float,
                       top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling of ``[S, V]`` logits; returns (ids, log-prob under the sampler).
    Temperature 0 is greedy (evaluation): the argmax, which that sampler draws with probability 1."""
    if temperature == 0:
        return logits.argmax(-1), torch.zeros(logits.shape[0], device=logits.device)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()  # mass strictly before each token
        sorted_lp = sorted_lp.masked_fill(before >= top_p, float("-inf"))
        logp = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_lp)
        logp = torch.log_softmax(logp, dim=-1)
    cdf = logp.exp().cumsum(-1)
    # A uniform of exactly 0 must not land on a leading token of zero mass (outside the nucleus).
    target = (uniforms * cdf[:, -1]).clamp_min(torch.finfo(cdf.dtype).tiny)
    ids = torch.searchsorted(cdf, target.unsqueeze(-1)).squeeze(-1)
    ids = ids.clamp_max(logits.shape[-1] - 1)
    return ids, logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
