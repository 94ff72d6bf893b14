"""Training prompts: load and check them before any work, then a deterministic prompt order.

:func:`load_training_prompts` runs before the process group and the model exist. It loads the
task's rows (the data file, or the task's built-in rows), renders and tokenizes every prompt
exactly as the trainer's rollout does (``encode_text(tokenizer, task.prompt(row, tokenizer))``)
and refuses, with one :class:`~emapg_megatron.errors.ConfigError` line, everything that would
otherwise stop the run later with a traceback: a missing, unreadable or empty file (or not a
regular file), a file whose rows are all malformed, missing columns, a prompt that encodes to no
tokens, and prompts too long for ``--seq-length``.

A prompt that fits ``L`` tokens cannot be longer than ``L`` times the most characters one token
stands for (:func:`max_chars_per_token`): a longer one is too long without being tokenised (a
tokenizer fed a gigabyte aborts the process), and a jsonl row longer than such a prompt can take
in the file (:func:`max_row_bytes`) is not even parsed.

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
#: A token's vocabulary entry, in UTF-8 bytes, bounds the characters it decodes to; times this for
#: normalisers that fold several characters into one (NFKC: a 4-byte letter into a 1-byte one).
_NORMALIZER_FOLD = 4
#: A character of a prompt takes at most this many bytes in a JSON file (an escape: ``\u00e9``).
_JSON_BYTES_PER_CHAR = 6
#: Room in a row for its other columns (the answer, metadata).
_OTHER_COLUMNS_BYTES = 1 << 20


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


def max_chars_per_token(tokenizer) -> Optional[int]:
    """The most characters of text one token of ``tokenizer`` stands for (None: unknown, when it
    lists no vocabulary): its longest vocabulary entry in UTF-8 bytes (a byte-level or
    SentencePiece spelling takes at least as many bytes as the text it decodes to) times
    :data:`_NORMALIZER_FOLD`."""
    vocab = getattr(tokenizer, "get_vocab", None)
    entries = vocab() if callable(vocab) else None
    if not entries:
        return None
    return _NORMALIZER_FOLD * max(len(str(t).encode("utf-8", "surrogatepass")) for t in entries)


def max_row_bytes(max_prompt_chars: Optional[int]) -> Optional[int]:
    """The longest jsonl row that can hold a prompt of at most ``max_prompt_chars`` characters
    (escaped) and the row's other columns."""
    return None if max_prompt_chars is None else _JSON_BYTES_PER_CHAR * max_prompt_chars + _OTHER_COLUMNS_BYTES


@dataclass
class _Loaded:
    rows: Any
    source: str
    skipped_bad: int = 0
    too_large: list = field(default_factory=list)  # (row index, bytes): rows too long to read


def _load_rows(task, data_path: Optional[str], fields, log, row_bytes: Optional[int]) -> _Loaded:
    """The usable rows, how the messages name their source, malformed rows skipped and the rows
    longer than ``row_bytes`` (not read)."""
    builtin = task.builtin_rows()
    if builtin is not None:
        if len(builtin) == 0:
            raise ConfigError(f"--task {task.name} has no built-in rows")
        return _Loaded(list(builtin), f"the built-in {task.name} data")
    if data_path is None:
        raise ConfigError(f"--task {task.name} needs {DATA_FLAG}")
    path = os.fspath(data_path)
    if not os.path.exists(path):
        raise ConfigError(f"{DATA_FLAG} {path}: no such file")
    try:
        ds, reports = task.load(path, fields=fields, on_bad_row="skip", return_report=True,
                                warn=False, max_row_bytes=row_bytes)
    except DataFileError as e:
        raise ConfigError(f"{DATA_FLAG} {e.path}: {e.reason}") from None
    except MissingColumnError as e:
        raise ConfigError(f"{DATA_FLAG} {e}") from None
    except FileNotFoundError as e:
        raise ConfigError(f"{DATA_FLAG} {path}: {e}") from None
    total = sum(r.total for r in reports)
    bad = [b for r in reports for b in r.bad]
    too_large = [t for r in reports for t in r.too_large]
    if total == 0:
        raise ConfigError(f"{DATA_FLAG} {path} has no rows")
    if len(ds) == 0 and not too_large:
        mapping = {**task.default_fields, **(fields or {})}
        required = " and ".join(repr(mapping.get(n, n)) for n in task.required_fields)
        raise ConfigError(f"{DATA_FLAG} {path}: none of its {total} rows is usable (each needs "
                          f"non-empty {required}): {_format_bad(bad)}")
    if bad:
        log(f"{DATA_FLAG} {path}: skipped {len(bad)} of {total} malformed rows ({_format_bad(bad)})")
    return _Loaded(TableRows(ds.data.table), path, len(bad), too_large)


def _prompt_lengths(task, rows: list, tokenizer, source: str, max_chars: Optional[int]) -> list[Optional[int]]:
    """Tokens of each row's prompt; None for a prompt longer than ``max_chars`` characters (too
    long, and not tokenised). A prompt that encodes to no tokens is a ConfigError naming its row."""
    lengths: list[Optional[int]] = []
    for start in range(0, len(rows), _CHUNK):
        chunk = rows[start:start + _CHUNK]
        texts = []
        for k, row in enumerate(chunk, start):
            try:
                texts.append(task.prompt(row, tokenizer))
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"cannot build the prompt of row {_row_index(row, k)} of "
                                  f"{source}: {e}") from None
        fits = [max_chars is None or len(t) <= max_chars for t in texts]
        ids = iter(_encode(tokenizer, [t for t, ok in zip(texts, fits) if ok], chunk, start, source))
        lengths.extend(len(next(ids)) if ok else None for ok in fits)
    empty = next((k for k, n in enumerate(lengths) if n == 0), None)
    if empty is not None:
        raise ConfigError(f"the prompt of row {_row_index(rows[empty], empty)} of {source} encodes to no "
                          "tokens (an empty prompt, or a tokenizer without its vocabulary): the sampler "
                          "needs at least one")
    return lengths


def _encode(tokenizer, texts: list[str], chunk: list, start: int, source: str) -> list[list[int]]:
    try:
        return encode_many(tokenizer, texts)
    except (ValueError, KeyError, TypeError):
        for k, (row, text) in enumerate(zip(chunk, texts), start):  # find the row
            try:
                encode_text(tokenizer, text)
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"cannot tokenize the prompt of row {_row_index(row, k)} of "
                                  f"{source}: {e}") from None
        raise


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
    per_token = max_chars_per_token(tokenizer)
    max_chars = None if per_token is None else limit * per_token
    loaded = _load_rows(task, data_path, fields, log, max_row_bytes(max_chars))
    rows, source = loaded.rows, loaded.source
    from_file = task.builtin_rows() is None
    lengths = _prompt_lengths(task, rows, tokenizer, source, max_chars)
    over = [k for k, n in enumerate(lengths) if n is None or n > limit]
    total = len(rows) + len(loaded.too_large)
    result = TrainingPrompts(rows, lengths, limit, total, skipped_bad=loaded.skipped_bad)
    if not over and not loaded.too_large:
        return result
    # each over-long prompt's row index -> its size, as found
    sizes = {_row_index(rows[k], k): (f"{lengths[k]} tokens" if lengths[k] is not None
                                      else f"more than {max_chars} characters") for k in over}
    sizes.update((i, f"a row of {n} bytes") for i, n in loaded.too_large)
    what = (f"longer than --seq-length {seq_length} - {budget_flag} {budget} = {limit} tokens")
    known = [k for k in over if lengths[k] is not None]  # those encoded: their length in tokens
    if len(known) == len(sizes):  # every size known: the settings that fit them all
        fits = _what_fits(max(lengths[k] for k in known), seq_length, budget, budget_flag)
    else:  # a row too large to encode: its length in tokens is not known
        fits = f"{'shorten them, raise' if from_file else 'raise'} --seq-length or lower {budget_flag}"
    if len(sizes) == total:
        if known:
            k = min(known, key=lambda j: lengths[j])
            i = _row_index(rows[k], k)
        else:
            i = min(sizes)
        raise ConfigError(f"all {total} prompts in {source} are {what} (shortest: 0-based row "
                          f"{i}, {sizes[i]}); {fits}")
    first = f"first: 0-based row {min(sizes)}, {sizes[min(sizes)]}"
    if long_prompts == "error":
        raise ConfigError(f"{len(sizes)} of {total} prompts in {source} are {what} ({first}); "
                          f"{fits}, or pass {LONG_PROMPTS_FLAG} drop to drop them")
    drop = set(over)
    kept = [j for j in range(len(rows)) if j not in drop]
    result.dropped = sorted(sizes)
    result.rows = rows.select(kept) if isinstance(rows, TableRows) else [rows[j] for j in kept]
    result.prompt_lengths = [lengths[j] for j in kept]
    log(f"{LONG_PROMPTS_FLAG} drop: dropped {len(sizes)} of {total} prompts in {source} "
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
