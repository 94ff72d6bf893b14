"""Strict mode in backward passes: gradients are device tensors where they are on a GPU.

The forward's tags are set where torch functions run (:mod:`.strict_mode`), but
the tensors the autograd engine makes (gradients, the ``grad_output`` a custom
``autograd.Function`` gets) pass no torch function. So during backward passes only
(``Variable._execution_engine`` is wrapped: :class:`_TaggingEngine`), a
``TorchDispatchMode`` tags the fresh outputs of every aten op autograd runs with a
device input, and ``p.grad`` is a device tensor as on a GPU. The forward does
without it (it costs ~10 us per aten op); the torch-function layer is also
re-entered for the backward, so custom ``backward`` code and gradient hooks are
mapped and checked like the forward.

A gradient passed for a device output must be a device tensor and vice versa
(the engine's "invalid gradient ... expected device" check); the implicit ``1``
of ``loss.backward()`` is made on the loss's side.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.variable import Variable
from torch.utils._python_dispatch import TorchDispatchMode

from .mapping import MappingEngine
from .tags import TAG, DeviceMixError, collect_tensors, is_tagged, set_side, side_name, storage_of

_DisableTorchFunction = torch._C.DisableTorchFunction


class _PropagateDeviceTags(TorchDispatchMode):
    """Every aten op with a device input tags its fresh outputs.

    Active only while autograd runs a backward pass (see :class:`_TaggingEngine`): the forward
    ops go through the torch-function layer, which propagates tags itself, but the tensors the
    engine makes (gradients, the ``grad_output`` of a custom ``autograd.Function``) do not.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no torch._disable_dynamo wrapper around every call: nothing here compiles

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Without the torch-function layer: these are aten ops, whose arguments include the
        # internals of composite ops and of autograd formulas (strict_mode's rule 1 is for what
        # Python calls).
        with _DisableTorchFunction():
            out = func(*args, **kwargs) if kwargs else func(*args)
            ins: list = []
            collect_tensors(args, ins)
            if kwargs:
                collect_tensors(tuple(kwargs.values()), ins)
            in_ids = set()
            tagged = False
            for t in ins:
                s = storage_of(t)
                if s is not None:
                    in_ids.add(id(s))
                    if not tagged and getattr(s, TAG, False):
                        tagged = True
            if not tagged:
                return out
            outs: list = []
            collect_tensors(out if isinstance(out, (list, tuple)) else (out,), outs)
            for t in outs:
                s = storage_of(t)
                if s is not None and id(s) not in in_ids and not getattr(s, TAG, False):
                    setattr(s, TAG, True)
        return out


class _TaggingEngine(MappingEngine):
    """Stands in for ``Variable._execution_engine``: runs backward passes under the tag propagation.

    Every Python entry to the autograd engine (``Tensor.backward``, ``torch.autograd.backward`` /
    ``grad``, Megatron's ``custom_backward``) calls ``Variable._execution_engine.run_backward``;
    like the plain :class:`~.mapping.MappingEngine` it runs under the mode.
    """

    def _run(self, args, kwargs):
        outputs = args[0] if args else kwargs.get("tensors", ())
        grads = args[1] if len(args) > 1 else kwargs.get("grad_tensors", ())
        _check_gradient_sides(outputs, grads)
        with _PropagateDeviceTags():
            return super()._run(args, kwargs)


def _check_gradient_sides(outputs, grads) -> None:
    """A gradient passed for an output is on the output's side (the engine's check on a GPU)."""
    with _DisableTorchFunction():
        for i, (out, g) in enumerate(zip(outputs, grads)):
            if isinstance(out, torch.Tensor) and isinstance(g, torch.Tensor) and (
                is_tagged(storage_of(out)) != is_tagged(storage_of(g))
            ):
                raise DeviceMixError(
                    f"backward: gradient {i} is on {side_name(g)} but its output on {side_name(out)} "
                    f"(on a GPU: 'invalid gradient - expected device'; strict CPU mode)"
                )


def _make_grads_on_device(orig):
    """``torch.autograd``'s implicit ``1`` gradient of a device output is a device tensor."""

    @functools.wraps(orig)
    def _make_grads(outputs, grads, *args, **kwargs):
        new_grads = orig(outputs, grads, *args, **kwargs)
        with _DisableTorchFunction():
            for out, given, made in zip(outputs, grads, new_grads):
                if (given is None and isinstance(made, torch.Tensor) and isinstance(out, torch.Tensor)
                        and is_tagged(storage_of(out))):
                    set_side(made, True)
        return new_grads

    _make_grads._emapg_original = orig
    return _make_grads


def install() -> None:
    """Run backward passes under the tag propagation and checks (idempotent)."""
    if not isinstance(Variable._execution_engine, _TaggingEngine):
        Variable._execution_engine = _TaggingEngine(Variable._execution_engine)
    if not hasattr(torch.autograd._make_grads, "_emapg_original"):
        torch.autograd._make_grads = _make_grads_on_device(torch.autograd._make_grads)
