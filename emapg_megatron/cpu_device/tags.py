"""Strict mode's device tags: which CPU tensors live on the emulated GPU.

The tag is an attribute on the tensor's ``UntypedStorage`` Python object. torch
preserves that object for the storage's whole life (PyObject preservation), so
views, ``nn.Parameter(t)``, ``.data``, ``set_`` and in-place ops share the tag
for free, and a freed storage takes its tag with it (no registry, nothing stale,
no ``data_ptr`` reuse). :mod:`.strict_mode` sets the tags; this module reads and
writes them, finds the tensors in an op's arguments, and describes them in
:class:`DeviceMixError` messages.
"""

from __future__ import annotations

import torch

TAG = "_emapg_on_device"  # attribute on a storage's Python object: True = emulated GPU memory


class DeviceMixError(RuntimeError):
    """Strict CPU mode: an operation that would fail on a GPU because of tensor placement."""

    __module__ = "emapg_megatron.cpu_device"  # its public home, as tracebacks and pickles name it


def storage_of(t):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None  # sparse / nested / storage-less tensors: treated as host


def is_tagged(s) -> bool:
    """Whether storage ``s`` (None: no storage) is emulated GPU memory."""
    return s is not None and getattr(s, TAG, False)


def set_side(t: torch.Tensor, on_device: bool) -> None:
    s = storage_of(t)
    if s is not None:
        setattr(s, TAG, on_device)


def is_device_tensor(t) -> bool:
    """Strict mode: whether ``t`` lives on the emulated GPU (False for non-tensors)."""
    if not isinstance(t, torch.Tensor):
        return False
    with torch._C.DisableTorchFunction():
        return is_tagged(storage_of(t))


def collect_tensors(obj, out: list) -> None:
    """Append every tensor in ``obj`` (nested lists/tuples) to ``out``."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            if isinstance(o, torch.Tensor):
                out.append(o)
            elif isinstance(o, (list, tuple)):
                collect_tensors(o, out)


def labelled_tensors(obj, label: str, out: list) -> None:
    """Append ``(label, tensor)`` for every tensor in ``obj`` (nested lists/tuples/dicts) to ``out``."""
    if isinstance(obj, torch.Tensor):
        out.append((label, obj))
    elif isinstance(obj, (list, tuple)):
        for i, o in enumerate(obj):
            labelled_tensors(o, f"{label}[{i}]", out)
    elif isinstance(obj, dict):
        for k, o in obj.items():
            labelled_tensors(o, f"{label}[{k!r}]", out)


def side_name(t: torch.Tensor) -> str:
    return "cuda" if is_tagged(storage_of(t)) else "cpu"


def describe(t: torch.Tensor) -> str:
    return f"{side_name(t)} {str(t.dtype).replace('torch.', '')}{list(t.shape)}"
