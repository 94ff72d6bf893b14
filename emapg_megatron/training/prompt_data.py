"""Training prompts: load and check them before any work, then a deterministic prompt order.

:func:`load_training_prompts` runs before the process group and the model exist. It loads the
task's rows (the data file, or the task's built-in rows), renders and tokenizes every prompt
exactly as the trainer's rollout does (``encode_text(tokenizer, task.prompt(row, tokenizer))``)
and refuses, with one :class:`~emapg_megatron.errors.ConfigError` line, everything that would
otherwise stop the run later with a traceback: a missing, unreadable or empty file, a file whose
rows are all malformed, missing columns, and prompts too long for ``--seq-length``.

:class:`PromptSchedule` then orders the rows: step i of any run (fresh or resumed) sees the same.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from emapg_megatron.errors import ConfigError
from emapg_megatron.tasks.base import encode_many, encode_text
from emapg_megatron.tasks.config import LONG_PROMPT_MODES
from emapg_megatron.tasks.data import DataFileError, MissingColumnError, TableRows

#: the training CLI's flags named in the messages
DATA_FLAG = "--data-path"
LONG_PROMPTS_FLAG = "--long-prompts"
_CHUNK = 1024  # rows rendered and tokenized at a time


@dataclass
class TrainingPrompts:
    """The rows to train on and what loading them found.

    ``rows``: a sequence of dicts (canonical fields plus ``_index`` / ``_file`` for file data: a
    :class:`~emapg_megatron.tasks.data.TableRows`; a list for built-in rows).
    ``prompt_lengths[k]``: tokens of ``rows[k]``'s prompt as the trainer encodes it.
    ``max_prompt_tokens``: the longest prompt allowed (``seq_length`` minus the response budget).
    ``total``: usable rows before long prompts were dropped. ``dropped``: row indices (as in the
    messages: the 0-based row of the file, or the position among built-in rows) of the prompts
    dropped as too long. ``skipped_bad``: malformed rows skipped while loading the file.
    """

    rows: list
    prompt_lengths: list[int]
    max_prompt_tokens: int
    total: int
    dropped: list[int] = field(default_factory=list)
    skipped_bad: int = 0


def _log_rank0(msg: str) -> None:
    # Called before the process group exists: torchrun's RANK tells rank 0 apart.
    if os.environ.get("RANK", "0") == "0":
        print(msg, flush=True)


def _row_index(row: Any, position: int) -> int:
    try:
        return int(row["_index"])
    except (KeyError, TypeError, ValueError):
        return position


def _format_bad(bad: Sequence[tuple[int, str]], limit: int = 3) -> str:
    parts = [f"row {i}: {why}" for i, why in bad[:limit]]
    if len(bad) > limit:
        parts.append(f"... {len(bad) - limit} more")
    return "; ".join(parts)


def _load_rows(task, data_path: Optional[str], fields, log) -> tuple[list, str, int]:
    """(rows, how the messages name their source, malformed rows skipped)."""
    builtin = task.builtin_rows()
    if builtin is not None:
        if len(builtin) == 0:
            raise ConfigError(f"--task {task.name} has no built-in rows")
        return list(builtin), f"the built-in {task.name} data", 0
    if data_path is None:
        raise ConfigError(f"--task {task.name} needs {DATA_FLAG}")
    path = os.fspath(data_path)
    if not os.path.exists(path):
        raise ConfigError(f"{DATA_FLAG} {path}: no such file")
    try:
        ds, reports = task.load(path, fields=fields, on_bad_row="skip", return_report=True,
                                warn=False)
    except DataFileError as e:
        raise ConfigError(f"{DATA_FLAG} {e.path}: {e.reason}") from None
    except MissingColumnError as e:
        raise ConfigError(f"{DATA_FLAG} {e}") from None
    except FileNotFoundError as e:
        raise ConfigError(f"{DATA_FLAG} {path}: {e}") from None
    total = sum(r.total for r in reports)
    bad = [b for r in reports for b in r.bad]
    if total == 0:
        raise ConfigError(f"{DATA_FLAG} {path} has no rows")
    if len(ds) == 0:
        mapping = {**task.default_fields, **(fields or {})}
        required = " and ".join(repr(mapping.get(n, n)) for n in task.required_fields)
        raise ConfigError(f"{DATA_FLAG} {path}: none of its {total} rows is usable (each needs "
                          f"non-empty {required}): {_format_bad(bad)}")
    if bad:
        log(f"{DATA_FLAG} {path}: skipped {len(bad)} of {total} malformed rows ({_format_bad(bad)})")
    return TableRows(ds.data.table), path, len(bad)


def _prompt_lengths(task, rows: list, tokenizer, source: str) -> list[int]:
    lengths: list[int] = []
    for start in range(0, len(rows), _CHUNK):
        chunk = rows[start:start + _CHUNK]
        texts = []
        for k, row in enumerate(chunk, start):
            try:
                texts.append(task.prompt(row, tokenizer))
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"cannot build the prompt of row {_row_index(row, k)} of "
                                  f"{source}: {e}") from None
        try:
            ids = encode_many(tokenizer, texts)
        except (ValueError, KeyError, TypeError):
            for k, (row, text) in enumerate(zip(chunk, texts), start):  # find the row
                try:
                    encode_text(tokenizer, text)
                except (ValueError, KeyError, TypeError) as e:
                    raise ConfigError(f"cannot tokenize the prompt of row {_row_index(row, k)} of "
                                      f"{source}: {e}") from None
            raise
        lengths.extend(len(x) for x in ids)
    return lengths


def response_budget(task, max_new_tokens: int) -> tuple[int, str]:
    """Tokens a prompt must leave free, and the flag that sets them.

    Single turn: ``--max-new-tokens`` (the sampler refuses prompt + new tokens > --seq-length).
    Multi turn: the first model turn's budget, ``--max-turn-tokens`` (falling back to
    ``--max-new-tokens`` as the sampler does); later turns and observations are cut at
    ``--seq-length`` by the episode, so only the first turn must fit in full.
    """
    turn = task.max_turn_tokens if task.multi_turn else None
    if turn:
        return int(turn), "--max-turn-tokens"
    return int(max_new_tokens), "--max-new-tokens"


def load_training_prompts(task, data_path: Optional[str], tokenizer, *, seq_length: int,
                          max_new_tokens: int, long_prompts: str = "error", fields=None,
                          log: Optional[Callable[[str], None]] = None) -> TrainingPrompts:
    """Load the training rows and check every prompt fits; raise ConfigError (one line) if not.

    ``data_path``: the ``--data-path`` file; ignored by tasks with built-in rows
    (``synthetic-copy``). ``long_prompts``: ``"error"`` refuses prompts longer than
    ``seq_length`` minus the response budget (:func:`response_budget`) with their count and the
    first one; ``"drop"`` drops them and logs the count (an error still when none is left).
    ``fields``: column overrides for :meth:`Task.load`. ``log``: where notes go (default: stdout
    on rank 0, read from ``RANK`` since no process group exists yet).
    """
    log = log or _log_rank0
    if long_prompts not in LONG_PROMPT_MODES:
        raise ConfigError(f"{LONG_PROMPTS_FLAG} must be one of {', '.join(LONG_PROMPT_MODES)} "
                          f"(got {long_prompts!r})")
    budget, budget_flag = response_budget(task, max_new_tokens)
    limit = seq_length - budget
    if limit < 1:
        raise ConfigError(f"{budget_flag} {budget} leaves no room for a prompt in --seq-length "
                          f"{seq_length}")
    rows, source, skipped = _load_rows(task, data_path, fields, log)
    lengths = _prompt_lengths(task, rows, tokenizer, source)
    over = [k for k, n in enumerate(lengths) if n > limit]
    result = TrainingPrompts(rows, lengths, limit, len(rows), skipped_bad=skipped)
    if not over:
        return result
    what = (f"longer than --seq-length {seq_length} - {budget_flag} {budget} = {limit} tokens")
    fits = _what_fits(max(lengths[j] for j in over), seq_length, budget, budget_flag)
    if len(over) == len(rows):
        k = min(over, key=lambda j: lengths[j])
        raise ConfigError(f"all {len(rows)} prompts in {source} are {what} (shortest: 0-based row "
                          f"{_row_index(rows[k], k)}, {lengths[k]} tokens); {fits}")
    k = over[0]
    first = f"first: 0-based row {_row_index(rows[k], k)}, {lengths[k]} tokens"
    if long_prompts == "error":
        raise ConfigError(f"{len(over)} of {len(rows)} prompts in {source} are {what} ({first}); "
                          f"{fits}, or pass {LONG_PROMPTS_FLAG} drop to drop them")
    drop = set(over)
    kept = [j for j in range(len(rows)) if j not in drop]
    result.dropped = [_row_index(rows[j], j) for j in over]
    result.rows = rows.select(kept) if isinstance(rows, TableRows) else [rows[j] for j in kept]
    result.prompt_lengths = [lengths[j] for j in kept]
    log(f"{LONG_PROMPTS_FLAG} drop: dropped {len(over)} of {len(rows)} prompts in {source} "
        f"{what} ({first}); training on {len(result.rows)}")
    return result


def _what_fits(longest: int, seq_length: int, budget: int, budget_flag: str) -> str:
    """The settings that make room for a prompt of ``longest`` tokens (only what would work)."""
    fixes = [f"--seq-length {longest + budget}"]
    if longest < seq_length:  # a smaller response budget leaves room too
        fixes.append(f"{budget_flag} {seq_length - longest}")
    return f"{' or '.join(fixes)} fits them all (the longest is {longest} tokens)"


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
            # keep two epochs in memory: partial rollouts' pool may straddle an epoch's end
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = order
        return self._perms[epoch]

    def row_at(self, pos: int):
        """The row at position ``pos`` of the data order (epoch after epoch)."""
        epoch, idx = divmod(pos, len(self.rows))
        return self.rows[self._perm(epoch)[idx]]

    def rows_for_step(self, step: int, batch_size: int) -> list:
        return [self.row_at(pos) for pos in range(step * batch_size, (step + 1) * batch_size)]
