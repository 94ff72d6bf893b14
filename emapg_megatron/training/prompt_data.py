"""Deterministic prompt order: step i of any run (fresh or resumed) sees the same rows."""

from __future__ import annotations

import random


class PromptSchedule:
    """Rows of epoch e in a permutation seeded by (seed, e); step i takes rows [i*B, (i+1)*B)."""

    def __init__(self, rows, seed: int):
        if len(rows) == 0:
            raise ValueError("the training data has no rows")
        self.rows = rows
        self.seed = seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            order = list(range(len(self.rows)))
            random.Random(self.seed * 7919 + epoch).shuffle(order)
            self._perms = {epoch: order}  # keep one epoch in memory
        return self._perms[epoch]

    def rows_for_step(self, step: int, batch_size: int) -> list:
        out = []
        for pos in range(step * batch_size, (step + 1) * batch_size):
            epoch, idx = divmod(pos, len(self.rows))
            out.append(self.rows[self._perm(epoch)[idx]])
        return out
