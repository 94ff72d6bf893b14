"""Run Megatron-Core on CPU by mapping its CUDA device requests to the CPU.

Megatron-Core assumes CUDA: it allocates with ``device="cuda"`` or
``torch.cuda.current_device()``, moves tensors with ``.cuda()``, forks the CUDA
RNG for tensor-parallel dropout, and checks ``Tensor.type()`` against
``"torch.cuda.FloatTensor"`` in the optimizers and grad clipping. On a machine
without a GPU we keep all of that code running unchanged and redirect it:

* :class:`CudaToCpuMode`, a ``TorchFunctionMode``, rewrites every ``device=``
  argument and ``Tensor.cuda()`` / ``Tensor.to("cuda")`` to the CPU, and
  reports CPU tensors' ``type()`` under their CUDA names.
* :func:`install` patches the few ``torch.cuda`` functions that do not go
  through torch functions: the current device, the RNG state (mapped to the
  CPU generator, so Megatron's RNG tracker forks the generator dropout really
  uses), synchronisation and streams (no-ops on CPU).

This is a platform layer, not a mock: the real Megatron kernels, collectives
(gloo) and optimizers run. It is installed only when CPU mode is requested.

Strict mode
-----------
Plain mapping hides device-placement bugs: a module built without ``device=``,
a batch left on the host, a host tensor handed to an NCCL collective all work on
CPU and crash on a GPU. ``install(strict=True)`` (or ``EMAPG_STRICT_DEVICE=1`` in
the environment, which spawned ranks inherit) keeps every tensor a real CPU
tensor but remembers which ones live on the emulated GPU, and raises
:class:`DeviceMixError` where CUDA would raise.

API: :func:`install` ``(strict=None)``; :data:`STRICT_ENV`; :func:`strict` (is it on);
:func:`is_device_tensor`; :func:`register_host_groups` (gloo groups that take host
tensors); :class:`DeviceMixError` (a ``RuntimeError``, like CUDA's own mismatch error).

*Mechanism.* The tag is an attribute on the tensor's ``UntypedStorage`` Python
object. torch preserves that object for the storage's whole life (PyObject
preservation), so views, ``nn.Parameter(t)``, ``.data``, ``set_`` and in-place
ops share the tag for free, and a freed storage takes its tag with it (no
registry, nothing stale, no ``data_ptr`` reuse). Tags are set by:

* the torch-function layer: factories given a CUDA ``device=`` (``"cuda"``,
  ``"cuda:0"``, ``torch.device("cuda")``, an int as ``torch.cuda.current_device()``
  returns), ``.cuda()`` / ``.to("cuda")`` / ``.to(int)`` / ``.to(device_tensor)`` /
  ``.type_as(device_tensor)`` of a host tensor (a tagged *copy*), and ``.cpu()`` /
  ``.to("cpu")`` of a device tensor (an untagged *copy*: new storage, as a real
  device-to-host transfer; differentiable, its backward hands the gradient back on
  the source side). Any other torch function with a device input tags its fresh
  outputs (outputs sharing an input's storage keep that input's tag);
* during backward passes only (``Variable._execution_engine`` is wrapped), a
  ``TorchDispatchMode`` that does the same for every aten op autograd runs, so
  gradients (``p.grad``, the ``grad_output`` a custom ``autograd.Function`` gets)
  are device tensors as on a GPU. The implicit ``1`` of ``loss.backward()`` is made
  on the loss's side. The forward does without it (it costs ~10 us per aten op);
  the torch-function layer is also re-entered for the backward, so custom
  ``backward`` code and gradient hooks are mapped and checked like the forward.

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
6. ``torch.distributed`` tensor collectives (all_reduce, all_gather(_into_tensor),
   reduce_scatter(_tensor), broadcast, reduce, gather, scatter, all_to_all(_single),
   send/recv/isend/irecv, batch_isend_irecv, the coalesced and ``_base``
   variants) refuse any host tensor (0-dim included) on an emulated NCCL group.
   Host groups are exempt: groups created with ``backend="gloo"`` (Megatron's
   ``*_GLOO`` groups are found automatically, both through ``new_group`` and by
   scanning ``parallel_state``) and groups given to :func:`register_host_groups`.
   Object collectives (``all_gather_object``, ``broadcast_object_list``, ...) are
   exempt, including the tensor collectives they run inside.

Backward: a gradient passed for a device output must be a device tensor and
vice versa (the engine's "invalid gradient ... expected device" check); the
implicit ``1`` of ``loss.backward()`` is made on the loss's side.

*Limitations.* Checks happen at the torch-function boundary (what Python code
calls), not inside aten composites or autograd formulas; 0-dim host tensors pass
every op (CUDA accepts them in elementwise ops only); code running in threads
other than the one that installed the layer is not seen (as for the plain
mapping); collectives called as ``ProcessGroup`` methods bypass the check;
``torch.load`` gives host tensors (as with ``map_location="cpu"``; on a GPU a
checkpoint of CUDA tensors loads onto the GPU). Because a device tensor reports
``cuda:0``, code that feeds ``x.device`` to CUDA-only APIs behaves as on a
CUDA-less build: ``torch.Generator(device=x.device)`` raises,
``torch.autocast(x.device.type)`` disables itself with a warning, unpatched
``torch.cuda`` queries raise; ``torch.optim`` picks its ``foreach`` implementation
for device parameters (as on a GPU). Strict mode stays on for the rest of the
process once installed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import threading

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import random as mrandom
from torch.autograd.variable import Variable
from torch.distributed import distributed_c10d as c10d
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_CPU = torch.device("cpu")
_CUDA0 = torch.device("cuda", 0)
_installed = False
_strict = False

STRICT_ENV = "EMAPG_STRICT_DEVICE"
_TAG = "_emapg_on_device"  # attribute on a storage's Python object: True = emulated GPU memory


class DeviceMixError(RuntimeError):
    """Strict CPU mode: an operation that would fail on a GPU because of tensor placement."""


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # Megatron passes torch.cuda.current_device() (an int) as a device.
    return isinstance(device, int) and not isinstance(device, bool)


def _map_device(device):
    return _CPU if _is_cuda(device) else device


def _is_device_like(obj) -> bool:
    return isinstance(obj, (str, torch.device)) or (isinstance(obj, int) and not isinstance(obj, bool))


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests made through torch functions to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _strict:
            return _strict_torch_function(func, args, kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron asserts 'torch.cuda.FloatTensor' etc.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:  # .to("cuda") and .to(device, dtype)
            args = (args[0], _map_device(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Strict mode: device tags on storages.

_tls = threading.local()  # .coll_depth: inside a wrapped torch.distributed call


def _storage(t):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None  # sparse / nested / storage-less tensors: treated as host


def _tagged_storage(s) -> bool:
    return s is not None and getattr(s, _TAG, False)


def _set_side(t: torch.Tensor, on_device: bool) -> None:
    s = _storage(t)
    if s is not None:
        setattr(s, _TAG, on_device)


def is_device_tensor(t) -> bool:
    """Strict mode: whether ``t`` lives on the emulated GPU (False for non-tensors)."""
    if not isinstance(t, torch.Tensor):
        return False
    with torch._C.DisableTorchFunction():
        return _tagged_storage(_storage(t))


def strict() -> bool:
    """Whether strict device checking is on in this process."""
    return _strict


def _collect(obj, out: list) -> None:
    """Append every tensor in ``obj`` (nested lists/tuples) to ``out``."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            if isinstance(o, torch.Tensor):
                out.append(o)
            elif isinstance(o, (list, tuple)):
                _collect(o, out)


def _labelled(obj, label: str, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((label, obj))
    elif isinstance(obj, (list, tuple)):
        for i, o in enumerate(obj):
            _labelled(o, f"{label}[{i}]", out)
    elif isinstance(obj, dict):
        for k, o in obj.items():
            _labelled(o, f"{label}[{k!r}]", out)


def _op_name(func) -> str:
    try:
        name = torch.overrides.resolve_name(func)
    except Exception:  # noqa: BLE001 - best effort for the message
        name = None
    return name or getattr(func, "__qualname__", None) or repr(func)


def _describe(t: torch.Tensor) -> str:
    side = "cuda" if _tagged_storage(_storage(t)) else "cpu"
    return f"{side} {str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def _mix_error(func, args, kwargs, what: str = "mixes device (cuda) and host (cpu) tensors"):
    items: list = []
    _labelled(tuple(args), "args", items)
    _labelled(kwargs, "kwargs", items)
    listing = ", ".join(f"{label}: {_describe(t)}" for label, t in items)
    return DeviceMixError(
        f"{_op_name(func)} {what} [{listing}]: this fails on a GPU "
        f"(strict CPU mode, emapg_megatron.cpu_device)"
    )


def _classify(tensors):
    """(has a device tensor, has a host tensor that is not 0-dim, input storages and their sides)."""
    dev = host = False
    storages = []
    for t in tensors:
        s = _storage(t)
        on = _tagged_storage(s)
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
        s = _storage(out)
        if s is None:
            return out
        for si, on in storages:
            if si is s:
                if force and on != on_device:
                    out = _transfer(out, on_device, on)
                return out
        setattr(s, _TAG, on_device)
        return out
    if isinstance(out, (list, tuple)):
        for o in out:
            if isinstance(o, (torch.Tensor, list, tuple)):
                _settle(o, on_device, storages, False)
    return out


class _Transfer(torch.autograd.Function):
    """A cross-device copy: new storage on the target side; its backward hands the gradient back
    on the source side (as CUDA's copy between devices does)."""

    @staticmethod
    def forward(ctx, x, to_device, from_device, memory_format):
        ctx.from_device = from_device
        out = x.clone(memory_format=memory_format)
        _set_side(out, to_device)
        return out

    @staticmethod
    def backward(ctx, grad):
        with _DisableTorchFunction():
            g = grad.clone()
            _set_side(g, ctx.from_device)
        return g, None, None, None


def _transfer(x, to_device: bool, from_device: bool, memory_format=torch.preserve_format):
    if x.requires_grad and torch.is_grad_enabled():
        return _Transfer.apply(x, to_device, from_device, memory_format)
    out = x.clone(memory_format=memory_format)
    _set_side(out, to_device)
    return out


def _check_generator(func, args, kwargs, dev: bool, want) -> None:
    if kwargs.get("generator") is not None and (dev or want):
        raise _mix_error(func, args, kwargs,
                         "uses a CPU torch.Generator with device tensors (CUDA needs a cuda generator)")


def _strict_torch_function(func, args, kwargs):
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
            want = _is_cuda(d)
            kwargs["device"] = _map_device(d)
    tensors: list = []
    _collect(args, tensors)
    if kwargs:
        _collect(tuple(kwargs.values()), tensors)
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
    return getattr(_tls, "coll_depth", 0) > 0


def _sp_device(func, args, kwargs):
    if not _real_devices() and _tagged_storage(_storage(args[0])):
        return _CUDA0
    return func(*args, **kwargs)


def _sp_is_cuda(func, args, kwargs):
    if _real_devices():
        return func(*args, **kwargs)
    return _tagged_storage(_storage(args[0]))


def _sp_is_cpu(func, args, kwargs):
    if _real_devices():
        return func(*args, **kwargs)
    return not _tagged_storage(_storage(args[0]))


def _sp_get_device(func, args, kwargs):
    if not _real_devices() and _tagged_storage(_storage(args[0])):
        return 0
    return func(*args, **kwargs)


def _sp_type(func, args, kwargs):
    if len(args) == 1 and not kwargs:
        name = func(*args)
        if _tagged_storage(_storage(args[0])):
            return name.replace("torch.", "torch.cuda.", 1)
        return name
    return _general(func, args, kwargs)


def _sp_cuda(func, args, kwargs):
    self = args[0]
    if _tagged_storage(_storage(self)):
        return self
    return _transfer(self, True, False, kwargs.get("memory_format", torch.preserve_format))


def _sp_cpu(func, args, kwargs):
    self = args[0]
    if not _tagged_storage(_storage(self)):
        return func(*args, **kwargs)
    return _transfer(self, False, True, kwargs.get("memory_format", torch.preserve_format))


def _sp_to(func, args, kwargs):
    self = args[0]
    rest = list(args[1:])
    target = None
    if rest:
        a = rest[0]
        if isinstance(a, torch.Tensor):  # .to(other): other's device and dtype
            target = _tagged_storage(_storage(a))
            rest[0] = a.dtype
        elif _is_device_like(a):
            target = _is_cuda(a)
            rest[0] = _map_device(a)
    if kwargs.get("other") is not None:
        other = kwargs.pop("other")
        target = _tagged_storage(_storage(other))
        kwargs["dtype"] = other.dtype
    if kwargs.get("device") is not None:
        target = _is_cuda(kwargs["device"])
        kwargs["device"] = _map_device(kwargs["device"])
    s = _storage(self)
    on = _tagged_storage(s)
    out = func(self, *rest, **kwargs)
    if target is None or target == on:  # a dtype / layout change: the copy stays on self's side
        return _settle(out, on, [(s, on)], False) if on else out
    return _transfer(out, target, on)


def _sp_type_as(func, args, kwargs):
    self, other = args[0], args[1]
    on, target = _tagged_storage(_storage(self)), _tagged_storage(_storage(other))
    out = func(*args, **kwargs)
    if on == target:
        return _settle(out, on, [(_storage(self), on)], False) if on else out
    return _transfer(out, target, on)


def _sp_new_tensor(func, args, kwargs):
    self = args[0]
    want = _tagged_storage(_storage(self))
    if kwargs.get("device") is not None:
        want = _is_cuda(kwargs["device"])
        kwargs["device"] = _map_device(kwargs["device"])
    tensors: list = []
    _collect(args[1:], tensors)
    _, _, storages = _classify(tensors)
    return _settle(func(*args, **kwargs), want, storages, True)


def _sp_deepcopy(func, args, kwargs):
    out = func(*args, **kwargs)
    if isinstance(out, torch.Tensor):
        _set_side(out, _tagged_storage(_storage(args[0])))
    return out


def _sp_numpy(func, args, kwargs):
    if _tagged_storage(_storage(args[0])):
        raise DeviceMixError(
            f"{_op_name(func)} of a device (cuda) tensor: on a GPU this raises 'can't convert "
            f"cuda:0 device type tensor to numpy'; call .cpu() first (strict CPU mode)"
        )
    return func(*args, **kwargs)


def _sp_grad_set(func, args, kwargs):
    self, value = args[0], args[1] if len(args) > 1 else None
    if isinstance(value, torch.Tensor) and (
        _tagged_storage(_storage(self)) != _tagged_storage(_storage(value))
    ):
        raise _mix_error(func, args, kwargs, "assigns a gradient on the other device")
    return func(*args, **kwargs)


def _sp_cross_device(func, args, kwargs):
    return func(*args, **kwargs)


def _sp_shape_of_other(func, args, kwargs):
    """``x.expand_as(y)`` and kin read only ``y``'s shape: legal across devices, on ``x``'s side."""
    self = args[0]
    s = _storage(self)
    on = _tagged_storage(s)
    out = func(*args, **kwargs)
    return _settle(out, True, [(s, on)], False) if on else out


def _is_advanced(idx) -> bool:
    if isinstance(idx, (torch.Tensor, list)):
        return True
    return isinstance(idx, tuple) and any(isinstance(i, (torch.Tensor, list)) for i in idx)


def _check_index(func, args, kwargs, self, idx, value=None, advanced=None) -> None:
    on = _tagged_storage(_storage(self))
    index_tensors: list = []
    _collect(idx if isinstance(idx, (list, tuple)) else (idx,), index_tensors)
    if not on and any(_tagged_storage(_storage(t)) for t in index_tensors):
        raise _mix_error(func, args, kwargs,
                         "indexes a host tensor with device indices (CUDA: indices must be on cpu "
                         "or on the indexed tensor's device)")
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        if advanced is None:
            advanced = _is_advanced(idx)
        if advanced and _tagged_storage(_storage(value)) != on:
            raise _mix_error(func, args, kwargs,
                             "puts values from the other device through advanced indexing")


def _sp_getitem(func, args, kwargs):
    self, idx = args[0], args[1]
    _check_index(func, args, kwargs, self, idx)
    out = func(*args, **kwargs)
    if _tagged_storage(_storage(self)):
        return _settle(out, True, [(_storage(self), True)], False)
    return out


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
    out = func(*args, **kwargs)
    if _tagged_storage(_storage(self)):
        return _settle(out, True, [(_storage(self), True)], False)
    return out


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


_SPECIAL: dict = {}


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
        # internals of composite ops and of autograd formulas (rule 1 is for what Python calls).
        with _DisableTorchFunction():
            out = func(*args, **kwargs) if kwargs else func(*args)
            ins: list = []
            _collect(args, ins)
            if kwargs:
                _collect(tuple(kwargs.values()), ins)
            in_ids = set()
            tagged = False
            for t in ins:
                s = _storage(t)
                if s is not None:
                    in_ids.add(id(s))
                    if not tagged and getattr(s, _TAG, False):
                        tagged = True
            if not tagged:
                return out
            outs: list = []
            _collect(out if isinstance(out, (list, tuple)) else (out,), outs)
            for t in outs:
                s = _storage(t)
                if s is not None and id(s) not in in_ids and not getattr(s, _TAG, False):
                    setattr(s, _TAG, True)
        return out


_DisableTorchFunction = torch._C.DisableTorchFunction


class _MappingEngine:
    """Stands in for ``Variable._execution_engine`` in CPU mode: backward passes run mapped too.

    ``Tensor.backward`` and ``torch.autograd.backward`` are torch functions, and handling one
    pops the mode for its whole duration, backward pass included. Megatron allocates in backward
    (``torch.empty(..., device=torch.cuda.current_device())`` in sequence-parallel linear layers),
    so the mode is put back for the engine's run.
    """

    def __init__(self, engine):
        self._engine = engine

    def run_backward(self, *args, **kwargs):
        if torch._C._len_torch_function_stack() == 0:
            with CudaToCpuMode():
                return self._engine.run_backward(*args, **kwargs)
        return self._engine.run_backward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class _TaggingEngine:
    """Stands in for ``Variable._execution_engine``: runs backward passes under the tag propagation.

    Every Python entry to the autograd engine (``Tensor.backward``, ``torch.autograd.backward`` /
    ``grad``, Megatron's ``custom_backward``) calls ``Variable._execution_engine.run_backward``.
    """

    def __init__(self, engine):
        self._engine = engine

    def run_backward(self, *args, **kwargs):
        if torch._C._len_torch_function_stack() == 0:
            # Entered from a torch function (Tensor.backward, torch.autograd.backward / grad),
            # whose handling pops the mode: put it back so that custom autograd Functions'
            # backward and the gradient hooks are mapped and checked like the forward.
            with CudaToCpuMode():
                return self._run(args, kwargs)
        return self._run(args, kwargs)

    def _run(self, args, kwargs):
        outputs = args[0] if args else kwargs.get("tensors", ())
        grads = args[1] if len(args) > 1 else kwargs.get("grad_tensors", ())
        with _DisableTorchFunction():
            for i, (out, g) in enumerate(zip(outputs, grads)):
                if isinstance(out, torch.Tensor) and isinstance(g, torch.Tensor) and (
                    _tagged_storage(_storage(out)) != _tagged_storage(_storage(g))
                ):
                    raise DeviceMixError(
                        f"backward: gradient {i} is on {'cuda' if _tagged_storage(_storage(g)) else 'cpu'} "
                        f"but its output on {'cuda' if _tagged_storage(_storage(out)) else 'cpu'} "
                        f"(on a GPU: 'invalid gradient - expected device'; strict CPU mode)"
                    )
        with _PropagateDeviceTags():
            return self._engine.run_backward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)


# -- torch.distributed ---------------------------------------------------------------------------

_TENSOR_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "send", "recv", "isend",
    "irecv", "batch_isend_irecv", "all_to_all", "all_to_all_single", "gather", "scatter",
    "all_reduce_coalesced", "all_gather_coalesced",
)
_OBJECT_COLLECTIVES = (
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
    "send_object_list", "recv_object_list",
)
_host_groups: dict = {}  # id -> group (kept alive so the id stays unique)
_dist_originals: dict = {}  # id(original) -> wrapper


def register_host_groups(groups) -> None:
    """Declare process groups that are gloo (host) groups in the GPU setup too.

    Collectives on them take host tensors. Accepts one group or an iterable; ``None`` entries are
    ignored. Groups created with ``backend="gloo"`` (Megatron's ``*_GLOO`` groups) are registered
    automatically.
    """
    if groups is None:
        return
    if not isinstance(groups, (list, tuple, set, frozenset)):
        groups = (groups,)
    for g in groups:
        if g is not None:
            _host_groups[id(g)] = g


def _megatron_gloo_groups():
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        return ()
    found = []
    for name, value in vars(ps).items():
        if name.endswith("_GLOO") and value is not None:
            found.extend(value if isinstance(value, (list, tuple)) else (value,))
    return found


def _is_host_group(group) -> bool:
    if group is None:
        group = c10d._get_default_group() if c10d.is_initialized() else None
        if group is None:
            return False
    if id(group) in _host_groups and _host_groups[id(group)] is group:
        return True
    return any(g is group for g in _megatron_gloo_groups())


def _collective_error(name: str, group, labelled) -> DeviceMixError:
    listing = ", ".join(f"{label}: {_describe(t)}" for label, t in labelled)
    return DeviceMixError(
        f"torch.distributed.{name} on an NCCL process group got host (cpu) tensors [{listing}]. "
        f"NCCL takes device tensors only; move them to the device, or use a gloo group "
        f"(Megatron's *_GLOO groups; cpu_device.register_host_groups) (strict CPU mode)"
    )


def _check_collective(name: str, sig, args, kwargs) -> None:
    if name == "batch_isend_irecv":
        ops = args[0] if args else kwargs.get("p2p_op_list", ())
        for i, op in enumerate(ops):
            if not _is_host_group(op.group) and not _tagged_storage(_storage(op.tensor)):
                raise _collective_error(f"batch_isend_irecv (op {i}: {getattr(op.op, '__name__', op.op)})",
                                        op.group, [(f"p2p_op_list[{i}].tensor", op.tensor)])
        return
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return  # the original raises its own error
    group = bound.arguments.get("group")
    if _is_host_group(group):
        return
    labelled: list = []
    for pname, value in bound.arguments.items():
        if pname != "group":
            _labelled(value, pname, labelled)
    host = [(label, t) for label, t in labelled if not _tagged_storage(_storage(t))]
    if host:
        raise _collective_error(name, group, host)


def _wrap_collective(name: str, orig, check: bool):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        depth = getattr(_tls, "coll_depth", 0)
        if check and depth == 0:
            with torch._C.DisableTorchFunction():
                _check_collective(name, sig, args, kwargs)
        _tls.coll_depth = depth + 1
        try:
            return orig(*args, **kwargs)
        finally:
            _tls.coll_depth = depth

    wrapper._emapg_original = orig
    return wrapper


def _wrap_new_group(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def new_group(*args, **kwargs):
        group = orig(*args, **kwargs)
        try:
            backend = sig.bind(*args, **kwargs).arguments.get("backend")
        except TypeError:
            backend = None
        if backend is not None and str(backend).lower() == "gloo":
            register_host_groups(group)
        return group

    new_group._emapg_original = orig
    return new_group


def _patch_distributed() -> None:
    wrappers = {}
    for name in _TENSOR_COLLECTIVES + _OBJECT_COLLECTIVES + ("new_group",):
        orig = getattr(c10d, name, None)
        if orig is None or hasattr(orig, "_emapg_original"):
            continue
        if name == "new_group":
            wrapper = _wrap_new_group(orig)
        else:
            wrapper = _wrap_collective(name, orig, check=name in _TENSOR_COLLECTIVES)
        wrappers[name] = wrapper
        _dist_originals[id(orig)] = wrapper
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is orig:
            setattr(dist, name, wrapper)
    # Modules imported before install() may hold the originals (Megatron keeps
    # `dist_all_gather_func = torch.distributed.all_gather_into_tensor`): rebind them.
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(("megatron", "emapg_megatron")):
            continue
        for attr, value in list(vars(mod).items()):
            wrapper = _dist_originals.get(id(value)) if callable(value) else None
            if wrapper is not None and getattr(wrapper, "_emapg_original", None) is value:
                setattr(mod, attr, wrapper)


def _make_grads_on_device(orig):
    """``torch.autograd``'s implicit ``1`` gradient of a device output is a device tensor."""

    @functools.wraps(orig)
    def _make_grads(outputs, grads, *args, **kwargs):
        new_grads = orig(outputs, grads, *args, **kwargs)
        with _DisableTorchFunction():
            for out, given, made in zip(outputs, grads, new_grads):
                if (given is None and isinstance(made, torch.Tensor) and isinstance(out, torch.Tensor)
                        and _tagged_storage(_storage(out))):
                    _set_side(made, True)
        return new_grads

    _make_grads._emapg_original = orig
    return _make_grads


def _install_strict() -> None:
    global _strict, _SPECIAL
    _SPECIAL = _build_specials()
    cuda = torch.cuda
    # torch.cuda.device(x.device) for a device tensor: nothing to switch on CPU.
    cuda._exchange_device = lambda device: 0
    cuda._maybe_exchange_device = lambda device: 0
    _patch_distributed()
    if not isinstance(Variable._execution_engine, _TaggingEngine):
        Variable._execution_engine = _TaggingEngine(Variable._execution_engine)
    if not hasattr(torch.autograd._make_grads, "_emapg_original"):
        torch.autograd._make_grads = _make_grads_on_device(torch.autograd._make_grads)
    _strict = True
    os.environ[STRICT_ENV] = "1"  # ranks spawned from here run strict too


# ---------------------------------------------------------------------------------------------

def _cpu_rng_state(device=None):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=None, graph_safe=False):
    torch.set_rng_state(new_state)


def _patch_torch_cuda():
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.device_count = lambda: 1
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.get_rng_state = _cpu_rng_state
    cuda.set_rng_state = _set_cpu_rng_state
    cuda.random.get_rng_state = _cpu_rng_state
    cuda.random.set_rng_state = _set_cpu_rng_state
    # torch.manual_seed itself calls cuda.manual_seed_all: seed the CPU generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0


def _patch_megatron_rng():
    # Megatron's tracker reads and writes the CUDA generator directly.
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = _set_cpu_rng_state
    # The tracker warns when the CPU state changes inside a fork; on CPU that is the point.
    logging.getLogger(mrandom.__name__).addFilter(
        lambda record: "CPU RNG state changed" not in record.getMessage()
    )


class _NullStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return _NullEvent()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def strict_requested() -> bool:
    """Whether the environment asks for strict mode (``EMAPG_STRICT_DEVICE`` set, not 0/false)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def install(strict: bool | None = None) -> None:
    """Map CUDA to CPU for the rest of this process (idempotent).

    ``strict=True`` (default: the ``EMAPG_STRICT_DEVICE`` environment variable) also turns on
    device-placement checking (see the module docstring); it can be added to a plain install
    later, never removed, and sets the variable so that spawned ranks inherit it.
    """
    global _installed
    if strict is None:
        strict = strict_requested()
    if not _installed:
        # Some VMs advertise AMX without enabling it: oneDNN's bf16 matmul then dies with SIGILL.
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
        _patch_torch_cuda()
        _patch_megatron_rng()
        Variable._execution_engine = _MappingEngine(Variable._execution_engine)
        CudaToCpuMode().__enter__()  # stays active for the process lifetime
        _installed = True
    if strict and not _strict:
        _install_strict()


def installed() -> bool:
    return _installed
