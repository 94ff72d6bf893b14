"""The CPU device layer's process-wide state, in one place.

The submodules read and set it here; none keeps a copy. The package's
:func:`~emapg_megatron.cpu_device.install` decides what is installed when.
"""

from __future__ import annotations

import threading

# The plain mapping is in place (CudaToCpuMode active, torch.cuda patched): mapping.install.
installed = False

# Strict mode's handler of every torch function, once strict mode is on (strict_mode.install);
# None under the plain mapping. CudaToCpuMode hands each call to it. Set once, never cleared.
strict_torch_function = None

# Strict mode's check of torch.distributed collectives (rule 6) is on (collectives.install with
# check=True). The wrappers also carry gloo adaptations, installed by the plain mapping too.
strict_collectives = False

_thread = threading.local()


def collective_depth() -> int:
    """How many wrapped ``torch.distributed`` calls this thread is inside (0: none)."""
    return getattr(_thread, "collective_depth", 0)


def set_collective_depth(depth: int) -> None:
    _thread.collective_depth = depth
