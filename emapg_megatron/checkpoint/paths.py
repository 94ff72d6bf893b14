"""Where a training run's checkpoints lie under its ``--save`` directory (Megatron-LM's layout)::

    SAVE/latest_checkpointed_iteration.txt   the tracker: the step of the latest whole checkpoint
    SAVE/iter_0000020/                       one torch_dist checkpoint per saved step

No Megatron here: the command line checks a ``--save`` directory before any work.
"""

from __future__ import annotations

import os
import re
import shutil

TRACKER = "latest_checkpointed_iteration.txt"
#: The keys of the model's own tensors in a checkpoint (the optimizer's, the EMA's ... carry prefixes).
MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")
_STEP_DIR = re.compile(r"iter_\d{7}")
_RUN_FILE = re.compile(r"\.?iter_\d{7}(\.tmp|\.old-\d+)?|latest_checkpointed_iteration\.txt(\.tmp)?")
"""What a save writes, also half-done: a step's directory being written (``.tmp``) or set aside."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def holds_checkpoint(root: str | None) -> bool:
    """Whether ``root`` holds a tracker or any ``iter_N`` directory (a run's checkpoints)."""
    if not root or not os.path.isdir(root):
        return False
    return any(name == TRACKER or _STEP_DIR.fullmatch(name) for name in os.listdir(root))


def run_files(root: str) -> list[str]:
    """The tracker and the ``iter_N`` directories under ``root`` (what --overwrite deletes)."""
    return sorted(os.path.join(root, n) for n in os.listdir(root) if _RUN_FILE.fullmatch(n))


def partial_saves(root: str) -> list[str]:
    """``iter_N.tmp`` directories: saves that never completed (not checkpoints)."""
    return sorted(n for n in os.listdir(root) if re.fullmatch(r"iter_\d{7}\.tmp", n))


def discard_partial_saves(root: str) -> None:
    """Delete what an interrupted save left (only when no run is writing ``root``)."""
    for name in partial_saves(root):
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def latest_complete(root: str) -> str | None:
    """The step directory the tracker names, when it is there, else None."""
    try:
        with open(os.path.join(root, TRACKER), "rb") as f:
            text = f.read(64).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    path = iteration_dir(root, int(text)) if text.isdigit() else None
    return path if path and os.path.isdir(path) else None
