"""A run's outputs: checkpoints under ``--save``, metrics and curves under ``--log-dir``.

A run started without ``--load`` where an earlier one left its outputs is refused before any work
(``arguments.validate``); with ``--overwrite`` they are deleted here first, on global rank 0 after
the run holds the ``--save`` lock.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from emapg_megatron.checkpoint.paths import run_files
from emapg_megatron.run.config import CheckpointConfig, LogConfig


def clear_earlier_run(ckpt: CheckpointConfig, log: LogConfig) -> Cleared:
    """Delete an earlier run's checkpoints and logs (--overwrite); returns what was deleted."""
    saved = run_files(ckpt.save) if ckpt.save and os.path.isdir(ckpt.save) else []
    logs = log.earlier_run_files()
    for path in saved + logs:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    return Cleared(saved, logs)


@dataclass
class Cleared:
    """What --overwrite deleted: the --save entries (steps, tracker) and the log files."""

    saved: list[str]
    logs: list[str]

    def __bool__(self) -> bool:
        return bool(self.saved or self.logs)

    def __str__(self) -> str:
        steps = [p for p in self.saved if os.path.basename(p).startswith("iter_")]
        parts = ([f"{len(steps)} checkpoint{'s' if len(steps) != 1 else ''}"] if steps else []) + \
                ([f"{len(self.logs)} log file{'s' if len(self.logs) != 1 else ''}"] if self.logs else [])
        return " and ".join(parts) or f"{len(self.saved)} checkpoint file(s)"
