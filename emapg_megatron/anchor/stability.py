"""Stability of the EMA anchor (paper §4, Lemma 4.2, Appendix C).

Near the quasi-steady state the lag δ = θ − θ_ema evolves as
δ ← (η·I − α·β·F)·δ + α·g, stable iff α·β·λ_max(F) < 1 + η, oscillatory when
α·β·λ_max > η. The Fisher's largest eigenvalue is bounded by its trace (eq. 28):

    λ_max ≤ tr(F) = E_{x, y∼π_θ} ‖∇_θ log π_θ(y|x)‖²,

which we estimate from a few sampled sequences, one backward pass each, with
the gradient norm taken over the whole model (TP shards summed, TP-duplicated
parameters such as layer norms and the tied copy of the embedding counted
once; per-sequence grads are completed the way Megatron finalises them:
sequence-parallel / qk-layernorm grads summed over TP, tied embedding grads
summed over the first and last stage).

α is the learning rate. The analysis is for SGD on the KL-regularised
objective; with Adam and per-token loss normalisation the margin is an
indicator, not a guarantee. Since tr(F) ≥ λ_max, the reported margin is
conservative.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed.finalize_model_grads import (
    _allreduce_non_tensor_model_parallel_grads,
    _allreduce_word_embedding_grads,
)
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared
from megatron.core.utils import get_model_config

from emapg_megatron.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class StabilityEstimate:
    fisher_trace: float  # λ̂: mean over sequences (all DP ranks) of ‖∇ log π(y|x)‖²
    margin: float  # 1 + η − α·β·λ̂; negative: the lag dynamics may diverge
    regime: str  # "monotone" (αβλ̂ ≤ η), "oscillatory" (η < αβλ̂ < 1 + η), "unstable"
    num_sequences: int  # over all DP ranks
    per_sequence: list[float] = field(default_factory=list)  # this DP rank's squared norms

    def as_log(self, prefix: str = "ema/") -> dict[str, float]:
        return {f"{prefix}fisher_trace": self.fisher_trace, f"{prefix}stability_margin": self.margin}


def _zero_grads(model_chunks) -> None:
    for chunk in model_chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        for param in chunk.parameters():
            param.grad = None


def _grad(param) -> torch.Tensor | None:
    return param.main_grad if hasattr(param, "main_grad") else param.grad  # DDP accumulates in main_grad


def _finalize_sequence_grads(model_chunks) -> None:
    """The cross-rank completions Megatron's finalize_model_grads does, without the DP reduction."""
    if not hasattr(model_chunks[0], "ddp_config"):
        return
    config = get_model_config(model_chunks[0])
    _allreduce_non_tensor_model_parallel_grads(model_chunks, config, ps.get_tensor_model_parallel_group())
    _allreduce_word_embedding_grads(model_chunks, config)


@contextmanager
def _without_schedule_grad_hooks(model_chunks):
    """A trainer may let Megatron's schedule finalise (DP-reduce) grads; not for per-sequence grads."""
    config = get_model_config(model_chunks[0])
    names = ("finalize_model_grads_func", "grad_sync_func", "param_sync_func")
    saved = {n: getattr(config, n, None) for n in names}
    for n in names:
        setattr(config, n, None)
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(config, n, v)


def _local_sq_norm(model_chunks) -> torch.Tensor:
    total = None
    for chunk in model_chunks:
        for param in chunk.parameters():
            grad = _grad(param)
            if grad is None or not param_is_not_shared(param):
                continue
            if not param_is_not_tensor_parallel_duplicate(param):
                continue
            sq = torch.linalg.vector_norm(grad.detach()).double().square()  # no param-sized temporary
            total = sq if total is None else total + sq
    if total is None:
        device = next(model_chunks[0].parameters()).device
        total = torch.zeros((), dtype=torch.float64, device=device)
    return total


def sequence_grad_sq_norms(model_chunks: list, sequences, logprob_fn: Callable) -> torch.Tensor:
    """‖∇_θ log π_θ(y|x)‖² for each sequence, over the whole model-parallel model.

    ``logprob_fn(sequence)`` either returns the sequence's summed log-prob as a
    scalar tensor with its graph (PP = 1; we call ``backward``) or runs the
    forward and backward itself and returns None (e.g. through Megatron's
    pipeline schedule when PP > 1). Gradients accumulate in DDP's grad buffers,
    which are zeroed before each sequence and left zeroed: call it outside the
    gradient accumulation of a training step.
    """
    norms = []
    try:
        for seq in sequences:
            _zero_grads(model_chunks)
            with ExitStack() as stack:  # per-sequence grads stay local: no DP reduction anywhere
                stack.enter_context(_without_schedule_grad_hooks(model_chunks))
                for chunk in model_chunks:
                    if hasattr(chunk, "no_sync"):
                        stack.enter_context(chunk.no_sync())
                out = logprob_fn(seq)
                if out is not None:
                    out.backward()
            _finalize_sequence_grads(model_chunks)
            norms.append(_local_sq_norm(model_chunks))
    finally:
        _zero_grads(model_chunks)
    if not norms:
        return torch.zeros(0, dtype=torch.float64)
    local = torch.stack(norms)
    group = ps.get_model_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(local, group=group)
    return local


def assess(fisher_trace: float, eta: float, lr: float, beta: float, *, num_sequences: int = 0,
           per_sequence: list[float] | None = None) -> StabilityEstimate:
    """Lemma 4.2 with λ_max bounded by ``fisher_trace``; logs, and warns when the margin is negative."""
    load = lr * beta * fisher_trace
    regime = "monotone" if load <= eta else "oscillatory" if load < 1 + eta else "unstable"
    est = StabilityEstimate(fisher_trace, 1 + eta - load, regime, num_sequences, per_sequence or [])
    logger.info("EMA stability: tr(F)~%.4g, lr*beta*tr(F)=%.4g, margin 1+eta-lr*beta*tr(F)=%.4g (%s)",
                fisher_trace, load, est.margin, regime)
    if est.margin < 0:
        logger.warning("EMA anchor may be unstable: lr*beta*tr(F) = %.4g >= 1 + eta = %.4g "
                       "(paper Lemma 4.2); lower lr or beta, or raise eta", load, 1 + eta)
    return est


class StabilityMonitor:
    """Estimates α·β·λ_max against 1 + η every ``interval`` trainer steps and warns on a bad margin."""

    def __init__(self, eta: float, interval: int, *, lr: float | None = None, beta: float | None = None):
        self.eta, self.interval, self.lr, self.beta = eta, interval, lr, beta
        self.last: StabilityEstimate | None = None

    @classmethod
    def from_config(cls, cfg, *, lr: float | None = None, beta: float | None = None) -> StabilityMonitor:
        return cls(cfg.eta, cfg.stability_interval, lr=lr, beta=beta)

    def due(self, iteration: int) -> bool:
        return self.interval > 0 and iteration % self.interval == 0

    def estimate(self, model_chunks: list, sequences, logprob_fn: Callable, *,
                 lr: float | None = None, beta: float | None = None) -> StabilityEstimate:
        """λ̂ from ``sequences`` (this DP rank's share) and the margin ``1 + η − lr·β·λ̂``."""
        lr = self.lr if lr is None else lr
        beta = self.beta if beta is None else beta
        if lr is None or beta is None:
            raise ConfigError("the stability monitor needs the learning rate and the KL coefficient")
        norms = sequence_grad_sq_norms(model_chunks, sequences, logprob_fn)
        device = next(model_chunks[0].parameters()).device
        acc = torch.tensor([norms.sum().item(), float(norms.numel())], dtype=torch.float64, device=device)
        dp = ps.get_data_parallel_group()
        if dist.get_world_size(dp) > 1:
            dist.all_reduce(acc, group=dp)
        total, count = acc.tolist()
        if count == 0:
            raise ConfigError("the stability monitor got no sequences")
        est = assess(total / count, self.eta, lr, beta, num_sequences=int(count), per_sequence=norms.tolist())
        self.last = est
        return est
