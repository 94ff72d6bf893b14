"""Distributed runtime: torch.distributed, Megatron parallel_state, seeding, CPU mode.

* :class:`ParallelConfig` (``config.py``): the layout, device and process groups a run asks for;
  light (no torch, no Megatron), so the CLI checks it first.
* ``distributed.py``: :func:`initialize` brings a process from ``torchrun`` (or the test harness)
  to a state where Megatron-Core models can be built, and :func:`device`, :func:`hardware`,
  :func:`destroy`, ... Loaded on first use of one of its names, so importing the config stays light.
"""

import importlib

from emapg_megatron.runtime.config import ParallelConfig

_DISTRIBUTED = ("initialize", "destroy", "device", "hardware", "collective_failure",
                "end_child_processes", "model_parallel_options", "quiet_expected_warnings")

__all__ = ["ParallelConfig", *_DISTRIBUTED]


def __getattr__(name: str):
    if name in _DISTRIBUTED:
        return getattr(importlib.import_module(f"{__name__}.distributed"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
