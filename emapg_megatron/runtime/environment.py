"""Environment variables set for a block only (no torch: the launcher and the converter use it)."""

from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def environment(**values: str):
    """``values`` in this process's environment for the block (what it starts inherits them),
    then the environment as it was: a later launch must not inherit them."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
