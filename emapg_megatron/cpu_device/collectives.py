"""CPU mode's ``torch.distributed`` layer: wrappers around the collectives Megatron calls.

:func:`install` replaces collectives in ``torch.distributed`` (and in
``distributed_c10d``, and wherever a Megatron or emapg module imported before it
keeps a reference) with a wrapper around the original. The wrappers are the one
place where this layer meets ``torch.distributed``, so an adaptation of a call
that gloo takes differently from NCCL belongs in them too (:data:`_ADAPTATIONS`).
The plain mapping installs the wrappers of the adapted collectives only
(``install(check=False)``); strict mode installs all of them and turns the check
below on for every wrapper, those installed before included.

Adaptations (plain and strict):

* ``all_to_all_single``: gloo's (the C++ binding's) split sizes must be sequences of
  ints; Megatron's MoE ``alltoall`` token dispatcher passes 1-D tensors (it moves
  them to numpy with ``.cpu().numpy()`` only when they are CUDA tensors, which they
  are not on the CPU), and the binding refuses them ("incompatible function
  arguments"). The wrapper passes them as lists of ints.

Rule 6 of strict mode (:mod:`.strict_mode` has rules 1-5): ``torch.distributed``
tensor collectives (all_reduce, all_gather(_into_tensor), reduce_scatter(_tensor),
broadcast, reduce, gather, scatter, all_to_all(_single), send/recv/isend/irecv,
batch_isend_irecv, the coalesced and ``_base`` variants) refuse any host tensor
(0-dim included) on an emulated NCCL group. Host groups are exempt: groups
created with ``backend="gloo"`` (Megatron's ``*_GLOO`` groups are found
automatically, both through ``new_group`` and by scanning ``parallel_state``) and
groups given to :func:`register_host_groups`. Object collectives
(``all_gather_object``, ``broadcast_object_list``, ...) are exempt, including the
tensor collectives they run inside.

Inside a wrapped call tensors report their real device (gloo and the coalescing
manager key on it; :func:`.state.collective_depth` tells strict mode).
Collectives called as ``ProcessGroup`` methods bypass the wrappers, hence the check.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import state
from .tags import DeviceMixError, describe, is_tagged, labelled_tensors, storage_of

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
#: name -> function adapting (args, kwargs) for gloo; its wrapper is installed by the plain mapping
_ADAPTATIONS: dict = {}
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
    listing = ", ".join(f"{label}: {describe(t)}" for label, t in labelled)
    return DeviceMixError(
        f"torch.distributed.{name} on an NCCL process group got host (cpu) tensors [{listing}]. "
        f"NCCL takes device tensors only; move them to the device, or use a gloo group "
        f"(Megatron's *_GLOO groups; cpu_device.register_host_groups) (strict CPU mode)"
    )


def _check_collective(name: str, sig, args, kwargs) -> None:
    if name == "batch_isend_irecv":
        ops = args[0] if args else kwargs.get("p2p_op_list", ())
        for i, op in enumerate(ops):
            if not _is_host_group(op.group) and not is_tagged(storage_of(op.tensor)):
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
            labelled_tensors(value, pname, labelled)
    host = [(label, t) for label, t in labelled if not is_tagged(storage_of(t))]
    if host:
        raise _collective_error(name, group, host)


def _split_sizes_as_lists(sig, args, kwargs):
    """``all_to_all_single`` with its split sizes (tensor, numpy array, any sequence) as int lists."""
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return args, kwargs  # the original raises its own error
    changed = False
    for pname in ("output_split_sizes", "input_split_sizes"):
        sizes = bound.arguments.get(pname)
        if sizes is not None and not (isinstance(sizes, list)
                                      and all(type(x) is int for x in sizes)):
            if torch.is_tensor(sizes):
                with torch._C.DisableTorchFunction():
                    sizes = sizes.tolist()
            bound.arguments[pname] = [int(x) for x in sizes]
            changed = True
    return (bound.args, bound.kwargs) if changed else (args, kwargs)


_ADAPTATIONS["all_to_all_single"] = _split_sizes_as_lists


def _wrap_collective(name: str, orig, check: bool):
    sig = inspect.signature(orig)
    adapt = _ADAPTATIONS.get(name)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        depth = state.collective_depth()
        if adapt is not None:
            args, kwargs = adapt(sig, args, kwargs)
        if check and state.strict_collectives and depth == 0:
            with torch._C.DisableTorchFunction():
                _check_collective(name, sig, args, kwargs)
        state.set_collective_depth(depth + 1)
        try:
            return orig(*args, **kwargs)
        finally:
            state.set_collective_depth(depth)

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


def install(check: bool = True) -> None:
    """Wrap ``torch.distributed``'s collectives and ``new_group`` (idempotent); ``check=False``
    (the plain mapping) wraps only the collectives gloo needs adapted, and checks nothing.

    ``check=True`` turns strict mode's check (rule 6) on for the rest of the process, in the
    wrappers a plain install put in place too."""
    names = (_TENSOR_COLLECTIVES + _OBJECT_COLLECTIVES + ("new_group",) if check
             else tuple(_ADAPTATIONS))
    if check:
        state.strict_collectives = True
    for name in names:
        orig = getattr(c10d, name, None)
        if orig is None or hasattr(orig, "_emapg_original"):
            continue
        if name == "new_group":
            wrapper = _wrap_new_group(orig)
        else:
            wrapper = _wrap_collective(name, orig, check=name in _TENSOR_COLLECTIVES)
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
