"""Strict mode: device tags set and checked where torch functions run.

Plain mapping hides device-placement bugs: a module built without ``device=``, a
batch left on the host, a host tensor handed to an NCCL collective all work on
CPU and crash on a GPU. Strict mode keeps every tensor a real CPU tensor but
tags the ones that live on the emulated GPU (:mod:`.tags`), and raises
:class:`~.tags.DeviceMixError` where CUDA would raise. Collectives are checked
by :mod:`.collectives` (rule 6).

*Where tags are set.*

* the torch-function layer (:func:`handle_torch_function`, which
  :class:`~.mapping.CudaToCpuMode` hands every call to): factories given a CUDA
  ``device=`` (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``, an int as
  ``torch.cuda.current_device()`` returns), ``.cuda()`` / ``.to("cuda")`` /
  ``.to(int)`` / ``.to(device_tensor)`` / ``.type_as(device_tensor)`` of a host
  tensor (a tagged *copy*), and ``.cpu()`` / ``.to("cpu")`` of a device tensor (an
  untagged *copy*: new storage, as a real device-to-host transfer; differentiable,
  its backward hands the gradient back on the source side). Any other torch
  function with a device input tags its fresh outputs (outputs sharing an input's
  storage keep that input's tag);
* during backward passes, the aten ops autograd runs (:mod:`.strict_backward`).

*What a tagged tensor reports.* ``t.device`` is ``cuda:0`` (so the idiom
``torch.empty(n, device=x.device)`` / ``y.to(x.device)`` follows ``x`` as on a GPU),
``t.is_cuda`` is True, ``t.is_cpu`` False, ``t.get_device()`` 0 and ``t.type()`` is
``torch.cuda.*Tensor``; a host tensor reports the truth (``cpu``,
``torch.FloatTensor``: Megatron's ``param.type()`` asserts fire on a host
parameter as they would on a GPU). Inside the wrapped ``torch.distributed``
functions tensors report their real device (gloo and the coalescing manager key
on it). Code inside torch's own torch functions sees the real device too (a
``TorchFunctionMode`` is off while it handles a call).

*Rules* (mirroring CUDA):

1. A torch function (op, ``nn.functional`` call, tensor method) whose tensor
   arguments include both device tensors and host tensors raises, naming the op
   and the arguments. Host 0-dim tensors are allowed anywhere (CUDA's CPU-scalar
   rule; real CUDA allows them only in elementwise ops, here they pass
   everywhere). A device 0-dim tensor with a host tensor is a mix (as in CUDA).
2. Cross-device by nature, no check: ``copy_``, ``_foreach_copy_``, ``.to``,
   ``.cpu``, ``.cuda``, ``.type_as``, ``new_tensor``, ``t.data = other``,
   ``torch._has_compatible_shallow_copy_type``, ``is_same_size``; and ``expand_as``,
   ``view_as``, ``reshape_as``, ``resize_as_``, which read only the other tensor's
   shape (their result stays on ``self``'s side).
3. Indexing (``t[idx]``, ``t[idx] = v``, ``index_put(_)``): index tensors may be on
   the host or on ``t``'s side; a device index into a host tensor raises (CUDA:
   "indices should be either on cpu or on the same device"). Basic indexing
   (slices/ints only) assigns any value (a ``copy_``); advanced indexing needs the
   value on ``t``'s side or 0-dim. ``index_select`` / ``gather`` / ``scatter`` /
   ``embedding`` follow rule 1 (CUDA rejects host indices there).
4. ``generator=`` (always a CPU generator here) with a device factory or device
   tensors raises (CUDA: "Expected a 'cuda' device type for generator").
5. ``t.grad = g`` with ``g`` on the other side raises; ``.numpy()`` /
   ``__array__`` of a device tensor raises.
6. ``torch.distributed`` collectives: see :mod:`.collectives`.

Backward passes: see :mod:`.strict_backward`.

*Limitations.* Checks happen at the torch-function boundary (what Python code
calls), not inside aten composites or autograd formulas; 0-dim host tensors pass
every op (CUDA accepts them in elementwise ops only); code running in threads
other than the one that installed the layer is not seen (as for the plain
mapping); ``torch.load`` gives host tensors (as with ``map_location="cpu"``; on a
GPU a checkpoint of CUDA tensors loads onto the GPU). Because a device tensor
reports ``cuda:0``, code that feeds ``x.device`` to CUDA-only APIs behaves as on a
CUDA-less build: ``torch.Generator(device=x.device)`` raises,
``torch.autocast(x.device.type)`` disables itself with a warning, unpatched
``torch.cuda`` queries raise; ``torch.optim`` picks its ``foreach`` implementation
for device parameters (as on a GPU). Strict mode stays on for the rest of the
process once installed.
"""

from __future__ import annotations

import torch

from . import state
from .mapping import is_cuda_device, is_device_like, map_device
from .tags import (
    TAG,
    DeviceMixError,
    collect_tensors,
    describe,
    is_tagged,
    labelled_tensors,
    set_side,
    storage_of,
)

_CUDA0 = torch.device("cuda", 0)
_DisableTorchFunction = torch._C.DisableTorchFunction


def _op_name(func) -> str:
    try:
        name = torch.overrides.resolve_name(func)
    except Exception:  # noqa: BLE001 - best effort for the message
        name = None
    return name or getattr(func, "__qualname__", None) or repr(func)


def _mix_error(func, args, kwargs, what: str = "mixes device (cuda) and host (cpu) tensors"):
    items: list = []
    labelled_tensors(tuple(args), "args", items)
    labelled_tensors(kwargs, "kwargs", items)
    listing = ", ".join(f"{label}: {describe(t)}" for label, t in items)
    return DeviceMixError(
        f"{_op_name(func)} {what} [{listing}]: this fails on a GPU "
        f"(strict CPU mode, emapg_megatron.cpu_device)"
    )


def _classify(tensors):
    """(has a device tensor, has a host tensor that is not 0-dim, input storages and their sides)."""
    dev = host = False
    storages = []
    for t in tensors:
        s = storage_of(t)
        on = is_tagged(s)
        storages.append((s, on))
        if on:
            dev = True
        elif t.dim() != 0:
            host = True
    return dev, host, storages


def _settle(out, on_device: bool, storages, force: bool):
    """Give ``out``'s tensors the side ``on_device``.

    A tensor sharing an input's storage keeps that input's side unless ``force`` (an explicit
    device request): then, if the sides differ, it is replaced by a copy (a real transfer).
    """
    if isinstance(out, torch.Tensor):
        s = storage_of(out)
        if s is None:
            return out
        for si, on in storages:
            if si is s:
                if force and on != on_device:
                    out = _transfer(out, on_device, on)
                return out
        setattr(s, TAG, on_device)
        return out
    if isinstance(out, (list, tuple)):
        for o in out:
            if isinstance(o, (torch.Tensor, list, tuple)):
                _settle(o, on_device, storages, False)
    return out


def _on_side_of(out, self):
    """``out``, made from ``self`` alone (a view, a dtype or shape change), is on ``self``'s side."""
    s = storage_of(self)
    return _settle(out, True, [(s, True)], False) if is_tagged(s) else out


class _Transfer(torch.autograd.Function):
    """A cross-device copy: new storage on the target side; its backward hands the gradient back
    on the source side (as CUDA's copy between devices does)."""

    @staticmethod
    def forward(ctx, x, to_device, from_device, memory_format):
        ctx.from_device = from_device
        out = x.clone(memory_format=memory_format)
        set_side(out, to_device)
        return out

    @staticmethod
    def backward(ctx, grad):
        with _DisableTorchFunction():
            g = grad.clone()
            set_side(g, ctx.from_device)
        return g, None, None, None


def _transfer(x, to_device: bool, from_device: bool, memory_format=torch.preserve_format):
    if x.requires_grad and torch.is_grad_enabled():
        return _Transfer.apply(x, to_device, from_device, memory_format)
    out = x.clone(memory_format=memory_format)
    set_side(out, to_device)
    return out


def _check_generator(func, args, kwargs, dev: bool, want) -> None:
    if kwargs.get("generator") is not None and (dev or want):
        raise _mix_error(func, args, kwargs,
                         "uses a CPU torch.Generator with device tensors (CUDA needs a cuda generator)")


def handle_torch_function(func, args, kwargs):
    """Strict mode's handling of every torch function (``CudaToCpuMode`` hands each call here)."""
    special = _SPECIAL.get(func)
    if special is not None:
        return special(func, args, kwargs)
    return _general(func, args, kwargs)


def _general(func, args, kwargs):
    """Rules 1 and 4, then the output side: requested by ``device=``, else inherited from inputs."""
    want = None
    if "device" in kwargs:
        d = kwargs["device"]
        if d is not None:
            want = is_cuda_device(d)
            kwargs["device"] = map_device(d)
    tensors: list = []
    collect_tensors(args, tensors)
    if kwargs:
        collect_tensors(tuple(kwargs.values()), tensors)
    if not tensors:
        if want and kwargs.get("generator") is not None:
            _check_generator(func, args, kwargs, False, want)
        out = func(*args, **kwargs)
        return out if want is None else _settle(out, want, (), False)
    dev, host, storages = _classify(tensors)
    if dev and host:
        raise _mix_error(func, args, kwargs)
    if "generator" in kwargs:
        _check_generator(func, args, kwargs, dev, want)
    out = func(*args, **kwargs)
    if want is not None:
        return _settle(out, want, storages, True)
    if dev:
        return _settle(out, True, storages, False)
    return out


# -- special torch functions ------------------------------------------------------------------

def _real_devices() -> bool:
    return state.collective_depth() > 0


def _sp_device(func, args, kwargs):
    if not _real_devices() and is_tagged(storage_of(args[0])):
        return _CUDA0
    return func(*args, **kwargs)


def _sp_is_cuda(func, args, kwargs):
    if _real_devices():
        return func(*args, **kwargs)
    return is_tagged(storage_of(args[0]))


def _sp_is_cpu(func, args, kwargs):
    if _real_devices():
        return func(*args, **kwargs)
    return not is_tagged(storage_of(args[0]))


def _sp_get_device(func, args, kwargs):
    if not _real_devices() and is_tagged(storage_of(args[0])):
        return 0
    return func(*args, **kwargs)


def _sp_type(func, args, kwargs):
    if len(args) == 1 and not kwargs:
        name = func(*args)
        if is_tagged(storage_of(args[0])):
            return name.replace("torch.", "torch.cuda.", 1)
        return name
    return _general(func, args, kwargs)


def _sp_cuda(func, args, kwargs):
    self = args[0]
    if is_tagged(storage_of(self)):
        return self
    return _transfer(self, True, False, kwargs.get("memory_format", torch.preserve_format))


def _sp_cpu(func, args, kwargs):
    self = args[0]
    if not is_tagged(storage_of(self)):
        return func(*args, **kwargs)
    return _transfer(self, False, True, kwargs.get("memory_format", torch.preserve_format))


def _sp_to(func, args, kwargs):
    self = args[0]
    rest = list(args[1:])
    target = None
    if rest:
        a = rest[0]
        if isinstance(a, torch.Tensor):  # .to(other): other's device and dtype
            target = is_tagged(storage_of(a))
            rest[0] = a.dtype
        elif is_device_like(a):
            target = is_cuda_device(a)
            rest[0] = map_device(a)
    if kwargs.get("other") is not None:
        other = kwargs.pop("other")
        target = is_tagged(storage_of(other))
        kwargs["dtype"] = other.dtype
    if kwargs.get("device") is not None:
        target = is_cuda_device(kwargs["device"])
        kwargs["device"] = map_device(kwargs["device"])
    on = is_tagged(storage_of(self))
    out = func(self, *rest, **kwargs)
    if target is None or target == on:  # a dtype / layout change: the copy stays on self's side
        return _on_side_of(out, self)
    return _transfer(out, target, on)


def _sp_type_as(func, args, kwargs):
    self, other = args[0], args[1]
    on, target = is_tagged(storage_of(self)), is_tagged(storage_of(other))
    out = func(*args, **kwargs)
    if on == target:
        return _on_side_of(out, self)
    return _transfer(out, target, on)


def _sp_new_tensor(func, args, kwargs):
    self = args[0]
    want = is_tagged(storage_of(self))
    if kwargs.get("device") is not None:
        want = is_cuda_device(kwargs["device"])
        kwargs["device"] = map_device(kwargs["device"])
    tensors: list = []
    collect_tensors(args[1:], tensors)
    _, _, storages = _classify(tensors)
    return _settle(func(*args, **kwargs), want, storages, True)


def _sp_deepcopy(func, args, kwargs):
    out = func(*args, **kwargs)
    if isinstance(out, torch.Tensor):
        set_side(out, is_tagged(storage_of(args[0])))
    return out


def _sp_numpy(func, args, kwargs):
    if is_tagged(storage_of(args[0])):
        raise DeviceMixError(
            f"{_op_name(func)} of a device (cuda) tensor: on a GPU this raises 'can't convert "
            f"cuda:0 device type tensor to numpy'; call .cpu() first (strict CPU mode)"
        )
    return func(*args, **kwargs)


def _sp_grad_set(func, args, kwargs):
    self, value = args[0], args[1] if len(args) > 1 else None
    if isinstance(value, torch.Tensor) and (
        is_tagged(storage_of(self)) != is_tagged(storage_of(value))
    ):
        raise _mix_error(func, args, kwargs, "assigns a gradient on the other device")
    return func(*args, **kwargs)


def _sp_cross_device(func, args, kwargs):
    return func(*args, **kwargs)


def _sp_shape_of_other(func, args, kwargs):
    """``x.expand_as(y)`` and kin read only ``y``'s shape: legal across devices, on ``x``'s side."""
    return _on_side_of(func(*args, **kwargs), args[0])


def _is_advanced(idx) -> bool:
    if isinstance(idx, (torch.Tensor, list)):
        return True
    return isinstance(idx, tuple) and any(isinstance(i, (torch.Tensor, list)) for i in idx)


def _check_index(func, args, kwargs, self, idx, value=None, advanced=None) -> None:
    on = is_tagged(storage_of(self))
    index_tensors: list = []
    collect_tensors(idx if isinstance(idx, (list, tuple)) else (idx,), index_tensors)
    if not on and any(is_tagged(storage_of(t)) for t in index_tensors):
        raise _mix_error(func, args, kwargs,
                         "indexes a host tensor with device indices (CUDA: indices must be on cpu "
                         "or on the indexed tensor's device)")
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        if advanced is None:
            advanced = _is_advanced(idx)
        if advanced and is_tagged(storage_of(value)) != on:
            raise _mix_error(func, args, kwargs,
                             "puts values from the other device through advanced indexing")


def _sp_getitem(func, args, kwargs):
    self, idx = args[0], args[1]
    _check_index(func, args, kwargs, self, idx)
    return _on_side_of(func(*args, **kwargs), self)


def _sp_setitem(func, args, kwargs):
    self, idx, value = args[0], args[1], args[2]
    _check_index(func, args, kwargs, self, idx, value)
    return func(*args, **kwargs)


def _sp_index_put(func, args, kwargs):
    self = args[0]
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    values = args[2] if len(args) > 2 else kwargs.get("values")
    _check_index(func, args, kwargs, self, tuple(i for i in indices if i is not None), values,
                 advanced=True)
    return _on_side_of(func(*args, **kwargs), self)


def _sp_record_stream(func, args, kwargs):
    """A device tensor's use on a side stream: CPU has one stream, so nothing to record (Megatron's
    MoE dispatcher records its device-to-host copies); a host tensor has no stream, as on a GPU."""
    if not is_tagged(storage_of(args[0])):
        raise DeviceMixError(f"{_op_name(func)} of a host (cpu) tensor: only device tensors have "
                             "streams (strict CPU mode)")
    return None


def _build_specials() -> dict:
    T = torch.Tensor
    sp = {
        T.device.__get__: _sp_device,
        T.is_cuda.__get__: _sp_is_cuda,
        T.is_cpu.__get__: _sp_is_cpu,
        T.get_device: _sp_get_device,
        T.type: _sp_type,
        T.cuda: _sp_cuda,
        T.cpu: _sp_cpu,
        T.to: _sp_to,
        T.type_as: _sp_type_as,
        T.new_tensor: _sp_new_tensor,
        T.__deepcopy__: _sp_deepcopy,
        T.numpy: _sp_numpy,
        T.record_stream: _sp_record_stream,
        T.__array__: _sp_numpy,
        T.grad.__set__: _sp_grad_set,
        T.data.__set__: _sp_cross_device,
        T.copy_: _sp_cross_device,
        T.__getitem__: _sp_getitem,
        T.__setitem__: _sp_setitem,
        T.index_put_: _sp_index_put,
        T.index_put: _sp_index_put,
        torch.index_put: _sp_index_put,
    }
    for f in (T.expand_as, T.view_as, T.reshape_as, T.resize_as_):
        sp[f] = _sp_shape_of_other
    for name in ("_foreach_copy_", "_has_compatible_shallow_copy_type", "is_same_size"):
        f = getattr(torch, name, None)
        if f is not None:
            sp[f] = _sp_cross_device
    return sp


_SPECIAL = _build_specials()


def install() -> None:
    """Check every torch function from now on (once: the package's install checks)."""
    cuda = torch.cuda
    # torch.cuda.device(x.device) for a device tensor: nothing to switch on CPU.
    cuda._exchange_device = lambda device: 0
    cuda._maybe_exchange_device = lambda device: 0
    state.strict_torch_function = handle_torch_function
