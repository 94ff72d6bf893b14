"""What went wrong, by kind. Each is reported as one ``error:`` line without a traceback.

* :class:`ConfigError`: the user's input (flags, YAML, data, a checkpoint to read) cannot run;
  found before any work where possible. Exit code 2.
* :class:`RunError` and its kinds: the run started and then failed (weights that exploded, a
  checkpoint that could not be written, a peer that died, too many skipped steps). Exit code 1.

An error that every rank of a run raises alike (a decision rank 0 made and shared, a check whose
result is reduced over all ranks) is marked :func:`agreed`: only rank 0 prints it.

This module imports nothing of the package: every layer may raise these.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in the configuration or the input: reported as one line, exit code 2."""


class RunError(RuntimeError):
    """The run failed after it started: reported as one line on every rank, exit code 1."""


class WeightsError(RunError):
    """The weights became non-finite or exploded: nothing is saved from them."""


class CheckpointWriteError(RunError):
    """A checkpoint could not be written; the previous one is kept."""


class SkippedStepsError(RunError):
    """More steps than allowed were skipped for a non-finite loss or gradient."""


class CollectiveError(RunError):
    """A collective failed: a peer process died or stopped responding."""


def shown(value, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters: a hostile value in a message stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def agreed(error: BaseException) -> BaseException:
    """Mark ``error`` as raised alike on every rank: only rank 0 reports it."""
    error.agreed = True
    return error
