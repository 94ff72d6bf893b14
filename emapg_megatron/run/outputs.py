"""A run's outputs: checkpoints under ``--save``, metrics and curves under ``--log-dir``.

A run started without ``--load`` where an earlier one left its outputs is refused before any work
(``arguments.validate``); with ``--overwrite`` they are deleted here first, on global rank 0 after
the run holds the ``--save`` lock.
"""

from __future__ import annotations

import os
import shutil

from emapg_megatron.checkpoint.paths import run_files
from emapg_megatron.run.config import CheckpointConfig, LogConfig


def clear_earlier_run(ckpt: CheckpointConfig, log: LogConfig) -> list[str]:
    """Delete an earlier run's checkpoints and logs (--overwrite); returns what was deleted."""
    paths = (run_files(ckpt.save) if ckpt.save and os.path.isdir(ckpt.save) else []) + log.earlier_run_files()
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    return paths
