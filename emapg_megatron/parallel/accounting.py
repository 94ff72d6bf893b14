"""Accounting for the tests and ``tools/bench_topk_kl.py``: collectives and saved-for-backward bytes.

:class:`CollectiveCounter` counts the torch.distributed collectives a block issues and their payload
bytes (collectives per chunk, none in backward; communication bytes per token). It wraps the collective functions both in the ``torch.distributed``
namespace and in ``torch.distributed.distributed_c10d`` (whose functions call each other by global
name, e.g. ``all_gather_into_tensor`` -> ``all_gather_single``), so calls through aliases bound
at import time (Megatron's ``dist_all_gather_func``) are seen too. Nested calls count once.

Payload bytes of one call: the size of the collective's full buffer on one rank: the reduced
tensor of an all-reduce, the gathered output of an all-gather, the input of a reduce-scatter
(``max`` over tensor arguments, a list argument counting as the sum of its tensors).
"""

from __future__ import annotations

import functools
import threading
from typing import List, Tuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["CollectiveCounter", "SavedTensorBytes"]

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "barrier",
)


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CollectiveCounter:
    """``with CollectiveCounter() as cc: ...`` then ``cc.calls`` = [(name, bytes), ...]."""

    def __init__(self) -> None:
        self.calls: List[Tuple[str, int]] = []
        self._saved: list = []
        self._depth = threading.local()

    @property
    def count(self) -> int:
        return len(self.calls)

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.calls)

    def reset(self) -> None:
        self.calls.clear()

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                payload = max([_nbytes(a) for a in args] + [_nbytes(v) for v in kwargs.values()] + [0])
                self.calls.append((name, payload))
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def __enter__(self) -> "CollectiveCounter":
        originals = {}
        for name in _COLLECTIVES:
            fn = getattr(c10d, name, None)
            if fn is not None:
                originals[name] = fn
        for name, fn in originals.items():
            wrapped = self._wrap(name, fn)
            for mod in (c10d, dist):
                if getattr(mod, name, None) is fn:
                    self._saved.append((mod, name, fn))
                    setattr(mod, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)
        self._saved.clear()


class SavedTensorBytes:
    """``with SavedTensorBytes() as sb: loss = f(x)`` then ``sb.bytes``: the memory autograd keeps
    alive for backward, i.e. the distinct storages of every tensor saved (by built-in ops and by
    ``ctx.save_for_backward``) while the block builds the graph. A saved view counts its whole
    storage, since that is what stays allocated."""

    def __init__(self) -> None:
        self.storages: dict = {}
        self._hooks = None

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        self.storages[(t.device, st.data_ptr())] = st.nbytes()
        return t

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
