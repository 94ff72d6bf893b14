"""Run Megatron-Core on CPU by mapping its CUDA device requests to the CPU.

Megatron-Core assumes CUDA: it allocates with ``device="cuda"`` or
``torch.cuda.current_device()``, moves tensors with ``.cuda()``, forks the CUDA
RNG for tensor-parallel dropout, and checks ``Tensor.type()`` against
``"torch.cuda.FloatTensor"`` in the optimizers and grad clipping. On a machine
without a GPU we keep all of that code running unchanged and redirect it
(:mod:`.mapping`): :class:`CudaToCpuMode`, a ``TorchFunctionMode``, rewrites every
CUDA device request to the CPU and reports CPU tensors' ``type()`` under their
CUDA names, and :func:`install` patches the few ``torch.cuda`` functions that do
not go through torch functions (the current device, the RNG state,
synchronisation and streams).

This is a platform layer, not a mock: the real Megatron kernels, collectives
(gloo) and optimizers run. It is installed only when CPU mode is requested.

Strict mode
-----------
Plain mapping hides device-placement bugs: a module built without ``device=``,
a batch left on the host, a host tensor handed to an NCCL collective all work on
CPU and crash on a GPU. ``install(strict=True)`` (or ``EMAPG_STRICT_DEVICE=1`` in
the environment, which spawned ranks inherit) keeps every tensor a real CPU
tensor but remembers which ones live on the emulated GPU, and raises
:class:`DeviceMixError` where CUDA would raise:

* :mod:`.tags`: the mark of a tensor on the emulated GPU (an attribute on its storage);
* :mod:`.strict_mode`: where tags are set, what a tagged tensor reports, the
  rules for torch functions (rules 1-5), the limitations;
* :mod:`.strict_backward`: the same in backward passes (gradients on the device);
* :mod:`.collectives`: ``torch.distributed`` collectives refuse host tensors on
  emulated NCCL groups, gloo groups exempt (rule 6). (Its adaptations of calls that gloo
  takes otherwise than NCCL, e.g. ``all_to_all_single``'s split sizes, are installed with
  the plain mapping too.)

Strict mode stays on for the rest of the process once installed. :mod:`.state`
holds the layer's process-wide state.

API: :func:`install` ``(strict=None)``; :func:`installed`; :data:`STRICT_ENV`;
:func:`strict` (is it on); :func:`strict_requested` (does the environment ask for it);
:func:`is_device_tensor`; :func:`register_host_groups` (gloo groups that take host
tensors); :class:`DeviceMixError` (a ``RuntimeError``, like CUDA's own mismatch error).
"""

from __future__ import annotations

import os

from . import collectives, mapping, state, strict_backward, strict_mode
from .collectives import register_host_groups
from .mapping import CudaToCpuMode
from .tags import DeviceMixError, is_device_tensor

__all__ = [
    "STRICT_ENV", "CudaToCpuMode", "DeviceMixError", "install", "installed", "is_device_tensor",
    "register_host_groups", "strict", "strict_requested",
]

STRICT_ENV = "EMAPG_STRICT_DEVICE"


def install(strict: bool | None = None) -> None:
    """Map CUDA to CPU for the rest of this process (idempotent).

    ``strict=True`` (default: the ``EMAPG_STRICT_DEVICE`` environment variable) also turns on
    device-placement checking (see :mod:`.strict_mode`); it can be added to a plain install
    later, never removed, and sets the variable so that spawned ranks inherit it.
    """
    if strict is None:
        strict = strict_requested()
    if not state.installed:
        mapping.install()
        collectives.install(check=False)  # the collectives gloo takes otherwise than NCCL
    if strict and state.strict_torch_function is None:
        collectives.install()
        strict_backward.install()
        strict_mode.install()  # last: from here on CudaToCpuMode hands every call to strict mode
        os.environ[STRICT_ENV] = "1"  # ranks spawned from here run strict too


def installed() -> bool:
    """Whether the CUDA -> CPU mapping is in place in this process."""
    return state.installed


def strict() -> bool:
    """Whether strict device checking is on in this process."""
    return state.strict_torch_function is not None


def strict_requested() -> bool:
    """Whether the environment asks for strict mode (``EMAPG_STRICT_DEVICE`` set, not 0/false)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
