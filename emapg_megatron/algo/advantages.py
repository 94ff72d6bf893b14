"""GRPO advantages from per-sequence rewards (prompt-major groups of n samples)."""

from __future__ import annotations

import torch


def compute_advantages(rewards: torch.Tensor, n: int, mode: str = "group",
                       eps: float = 1e-6) -> torch.Tensor:
    """``rewards`` ``[B*n]``, grouped by prompt. Returns one advantage per sequence.

    * ``group``: (R - mean) / (std + eps) within each prompt's group (GRPO);
    * ``global``: the group-centred advantages A = R - group mean, z-scored over the flattened
      batch, (A - mean(A)) / (std(A) + eps) (Appendix B; no per-prompt std);
    * ``none``: R - group mean, no std division (Dr. GRPO style).
    """
    if rewards.numel() % n != 0:
        raise ValueError(f"{rewards.numel()} rewards are not groups of {n}")
    r = rewards.float().view(-1, n)
    centred = r - r.mean(dim=1, keepdim=True)
    if mode == "group":
        adv = centred / (r.std(dim=1, keepdim=True, unbiased=True) + eps)
    elif mode == "global":
        adv = (centred - centred.mean()) / (centred.std(unbiased=True) + eps)
    elif mode == "none":
        adv = centred
    else:
        raise ValueError(f"unknown advantage normalisation {mode!r}")
    return adv.flatten()
