"""Shared helpers for the KL estimators: dtype policy, stop-gradient, importance weights, index checks.

Everything here is per token and pure torch (no distributed code); a vocab-parallel implementation
can call these helpers on the gathered per-token quantities unchanged.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .catalog import check_name as _check_name  # noqa: F401  (the estimators' name check)

__all__ = [
    "IWClip",
    "LogWRange",
    "REFERENCE_LOG_CLAMP",
    "clamp_log_w",
    "compute_dtype",
    "upcast",
    "sg",
    "importance_weight",
    "check_unique_indices",
    "token_in_topk",
    "gather_last",
    "log_renormalize",
]

IWClip = Optional[Tuple[Optional[float], Optional[float]]]
#: ``(lo, hi)`` clamp of a log-ratio; ``None`` leaves that side open.
LogWRange = Tuple[Optional[float], Optional[float]]
NO_CLAMP: LogWRange = (None, None)
#: The reference code's clamp of a log-ratio before ``exp`` ("numerical stability"): log w in its
#: K3, K3++ and K5, and log(pi/pi_sampling) in its importance weight. Ours only with
#: ``reference_clamps=True`` (``--kl-reference-clamps``): it biases wherever it binds.
REFERENCE_LOG_CLAMP: LogWRange = (-20.0, 20.0)


def compute_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    """The dtype the maths runs in: fp64 if any floating input is fp64, otherwise fp32.

    Half-precision inputs (bf16/fp16) are always upcast; results are returned in this dtype.
    """
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def upcast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Cast a floating tensor to ``dtype`` (autograd-transparent); ``None`` passes through."""
    if t is None:
        return None
    if not t.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got {t.dtype}")
    return t if t.dtype == dtype else t.to(dtype)


def sg(t: torch.Tensor) -> torch.Tensor:
    """Stop-gradient, the paper's ``sg(.)``."""
    return t.detach()


def importance_weight(
    logprob: torch.Tensor,
    sampling_logprob: Optional[torch.Tensor] = None,
    iw_clip: IWClip = None,
    reference_clamps: bool = False,
) -> torch.Tensor:
    """Off-policy weight ``s = clip(sg(pi_theta(y) / pi_sampling(y)), s_min, s_max)`` per token.

    ``logprob`` is log pi_theta(y) (its gradient is stopped here), ``sampling_logprob`` is
    log pi_sampling(y). Without ``sampling_logprob`` the sampling is on-policy and s = 1 (still
    clipped, so a clip range that excludes 1 is honoured). ``iw_clip = (s_min, s_max)``; either bound
    may be ``None``. With no clip the weight is exact and the corrected estimators stay unbiased
    under y ~ pi_sampling; clipping trades that for variance (Fig. 9 of the paper).
    ``reference_clamps`` clamps log s to :data:`REFERENCE_LOG_CLAMP` before ``exp``, as the reference
    code does (s in [2e-9, 4.9e8] before the clip).
    """
    lp = sg(logprob)
    if sampling_logprob is None:
        s = torch.ones_like(lp)
    else:
        log_s = lp - sampling_logprob.to(lp.dtype).detach()
        s = torch.exp(clamp_log_w(log_s, REFERENCE_LOG_CLAMP if reference_clamps else NO_CLAMP))
    if iw_clip is not None:
        if len(iw_clip) != 2:
            raise ValueError(f"iw_clip must be (s_min, s_max), got {iw_clip!r}")
        lo, hi = iw_clip
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"iw_clip lower bound {lo} exceeds upper bound {hi}")
        s = s.clamp(min=lo, max=hi)
    return s


def clamp_log_w(log_w: torch.Tensor, bounds: LogWRange) -> torch.Tensor:
    """``log_w`` (a log-ratio, or an estimate) clamped to ``bounds = (lo, hi)`` (``torch.clamp``: no
    gradient flows beyond a bound); itself for ``NO_CLAMP``."""
    lo, hi = bounds
    return log_w if lo is None and hi is None else log_w.clamp(lo, hi)


def check_unique_indices(topk_index: torch.Tensor) -> None:
    """Raise ``ValueError`` if any row of ``topk_index`` ([..., k]) holds a repeated vocabulary id.

    A repeated id would count its exact term twice (and mis-mask the tail), silently biasing every
    estimator. Cost: one sort along k and a neighbour comparison (one host sync).
    """
    if topk_index.is_floating_point() or topk_index.dtype == torch.bool:
        raise TypeError(f"topk_index must be an integer tensor, got {topk_index.dtype}")
    if topk_index.shape[-1] < 2:
        return
    srt = topk_index.sort(dim=-1).values
    dup = srt[..., 1:] == srt[..., :-1]
    if bool(dup.any()):
        n_rows = int(dup.any(dim=-1).sum())
        raise ValueError(
            f"topk_index has duplicate vocabulary ids within a row ({n_rows} row(s) affected); "
            "the index set q must hold k distinct ids"
        )


def token_in_topk(token: torch.Tensor, topk_index: torch.Tensor) -> torch.Tensor:
    """Boolean ``[...]``: whether the sampled token lies in the index set q (``[..., k]``)."""
    if topk_index.shape[-1] == 0:
        return torch.zeros(token.shape, dtype=torch.bool, device=token.device)
    return (topk_index == token.unsqueeze(-1)).any(dim=-1)


def gather_last(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[..., index]`` along the last dim; ``index`` is ``[...]`` (one id) or ``[..., k]``."""
    if index.dim() == x.dim() - 1:
        return x.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return x.gather(-1, index)


def log_renormalize(logprob_q: torch.Tensor) -> torch.Tensor:
    """Log-probs ``[..., k]`` renormalised over their last dim: ``log p(j) - log sum_{i in q} p(i)``.

    A row without mass (every entry ``-inf``, or k = 0) stays as it is: it has no distribution to
    renormalise, and leaving it ``-inf`` keeps the zero-mass conventions of the terms downstream
    (and NaN out of the gradient, which ``logsumexp`` of an all ``-inf`` row would produce).
    """
    empty = ~torch.isfinite(logprob_q).any(dim=-1, keepdim=True)
    zero = torch.zeros((), dtype=logprob_q.dtype, device=logprob_q.device)
    log_mass = torch.logsumexp(torch.where(empty, zero, logprob_q), dim=-1, keepdim=True)
    return logprob_q - torch.where(empty, zero, log_mass)

