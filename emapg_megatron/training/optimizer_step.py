"""The gradient step: finite check, clip and step, and the health of the weights it leaves.

Gradients arrive complete: Megatron's ``finalize_model_grads`` (set as the model config's hook
in :mod:`.model_and_optimizer`) runs at the end of every forward-backward schedule.
"""

from __future__ import annotations

import math

import torch

from emapg_megatron.errors import ConfigError, WeightsError, agreed
from emapg_megatron.training.collectives import all_true, reduce_max

#: Weights beyond this magnitude have exploded: a transformer's weights are O(1), and activations
#: computed from weights this large overflow bf16 / fp32 in the next forward pass.
EXPLODED_WEIGHT = 1e6


@torch.no_grad()
def _max_abs(tensors: list) -> float:
    """max |x| over ``tensors`` (NaN when any element is NaN), with one device sync."""
    tensors = [t for t in tensors if t.numel()]
    return float(torch.stack(torch._foreach_norm(tensors, float("inf"))).max()) if tensors else 0.0


def local_grads_finite(model_chunks) -> bool:
    grads = [g for chunk in model_chunks for p in chunk.parameters()
             if (g := getattr(p, "main_grad", None)) is not None]
    return math.isfinite(_max_abs(grads))


def step_if_finite(model_chunks, optimizer, scheduler, loss_values) -> tuple[bool, float | None]:
    """Clip and step when every gradient on every rank and every loss value is finite.

    Returns whether the update was applied (a refused update changes no weight and no state) and
    the gradient norm Megatron's optimizer computed for it (over every model-parallel group, experts
    included; None when it computed none: an fp32/fp16 optimizer without --clip-grad).
    """
    ok = local_grads_finite(model_chunks) and all(math.isfinite(v) for v in loss_values)
    if not all_true(ok):
        return False, None
    _, grad_norm, _ = optimizer.step()
    scheduler.step(increment=1)
    return True, (float(grad_norm) if grad_norm is not None else None)


def largest_weight(model_chunks) -> float:
    """max |w| over the whole model (inf when any weight is non-finite), on every rank."""
    return reduce_max(_max_abs([p.detach() for chunk in model_chunks for p in chunk.parameters()]))


def weights_problem(model_chunks, *, exploded_limit: float = EXPLODED_WEIGHT) -> str | None:
    """What is wrong with the weights ("non-finite", "exploded ..."), or None; same on every rank."""
    largest = largest_weight(model_chunks)
    if not math.isfinite(largest):
        return "non-finite"
    if largest > exploded_limit:
        return f"exploded (max |w| = {largest:.3g} > {exploded_limit:.0e})"
    return None


def check_weights(model_chunks, when: str) -> None:
    """Stop with one line when the weights are non-finite or exploded (before the EMA and saving)."""
    problem = weights_problem(model_chunks)
    if problem:
        raise agreed(WeightsError(f"stopping {when}: the weights are {problem}; no checkpoint written "
                                  "and the EMA anchor not updated from them (lower --lr, or set --clip-grad)"))


def check_loaded_weights(model_chunks, source: str) -> None:
    """Refuse initial weights that are non-finite (a corrupt or poisoned checkpoint)."""
    if weights_problem(model_chunks, exploded_limit=math.inf):
        raise agreed(ConfigError(f"{source} holds non-finite weights: refusing to train from it"))
