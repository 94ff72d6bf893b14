"""Loading task data from local parquet / jsonl / json files into a ``datasets.Dataset``.

Nothing is downloaded: files are read with pyarrow (parquet) or line by line (jsonl), validated
row by row in Python, and the good rows are turned into a ``datasets.Dataset`` in memory (no
cache files are written).

Field names are configurable: ``fields`` maps a canonical name (what the task reads, e.g.
``question``) to a column in the file (e.g. ``problem``). A dotted column reaches into nested
structs, e.g. ``reward_model.ground_truth`` for verl-style parquet files.

Bad rows (a required field missing, null or empty; a jsonl line that is not a JSON object or is
nested deeper than :data:`MAX_JSON_DEPTH` levels; a field holding a lone UTF-16 surrogate such
as ``"\\ud800"``, which no tokenizer or file can encode, so it is refused, not replaced; a
value the task cannot normalise) are never dropped silently: with ``on_bad_row="skip"`` they are
skipped and a warning names their indices and the count; with ``on_bad_row="error"`` loading
fails with :class:`BadRowError` listing them. The index is the 0-based row number in the file
(for jsonl: the 0-based line number, blank lines included). Every loaded row keeps it in the
``_index`` column.

Configuration errors are not bad rows: a file that cannot be read (a .json document nested
deeper than :data:`MAX_JSON_DEPTH` levels included; anything but a regular file, links resolved:
a named pipe would block the read and a device such as ``/dev/zero`` never ends) raises
:class:`DataFileError`,
and a required column that no row has (for parquet: that the schema lacks, so an empty parquet is
checked too) raises :class:`MissingColumnError` naming the columns found and the ones expected.

With ``max_row_bytes``, a jsonl line longer than that is neither parsed nor kept in memory (it is
read in bounded blocks to its end): it is reported in :attr:`LoadReport.too_large` (a caller whose
rows must fit a bound, such as the trainer's prompts, says what to do with it).

A column whose values mix strings with numbers or bools across rows (e.g. a ``data_source`` of
``"gsm8k"`` in one file and ``3`` in another) is loaded as strings; other mixes (a list in one
row, a string in the next) raise :class:`DataFileError` naming the column.
"""
from __future__ import annotations

import json
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from datasets.table import InMemoryTable

logger = logging.getLogger(__name__)

__all__ = ["BadRowError", "DataFileError", "MissingColumnError", "LoadReport", "load_rows",
           "read_records", "get_field", "json_too_deep", "INDEX_COLUMN", "MAX_JSON_DEPTH"]

INDEX_COLUMN = "_index"
#: Deepest nesting of lists and objects in one row (the row's object counts). Parsing and
#: converting nested values recurses (``datasets`` pickles an arrow type ~17 frames a level: a
#: RecursionError past ~55 levels); real rows nest a few levels.
MAX_JSON_DEPTH = 32
_MISSING = object()
# A JSON string; an unterminated one runs to the end (so a match never fails: linear time).
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NESTING_STEP = np.zeros(256, np.int8)  # byte -> change of nesting depth
_NESTING_STEP[[ord("["), ord("{")]] = 1
_NESTING_STEP[[ord("]"), ord("}")]] = -1
_DEPTH_BLOCK = 1 << 20
_SKIP_BLOCK = 1 << 20  # an over-long line is read to its end in blocks of this many bytes


class BadRowError(ValueError):
    """Raised with ``on_bad_row='error'`` when rows lack required fields."""

    def __init__(self, path: str, bad: list[tuple[int, str]]):
        self.path = path
        self.bad = bad
        super().__init__(f"{len(bad)} bad row(s) in {path}: {_format_bad(bad)}")


class DataFileError(ValueError):
    """A data file that cannot be read at all (unsupported type, corrupt, not UTF-8, ...)."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"cannot read {path}: {reason}")


class MissingColumnError(KeyError):
    """Required columns that the file does not have (a configuration error, not bad data).

    A ``KeyError`` for backward compatibility, but ``str()`` is the plain one-line message.
    ``missing``: ``(canonical field, column)`` pairs; ``found``: the file's columns;
    ``expected``: the columns of all required fields.
    """

    def __init__(self, path: str, missing: list[tuple[str, str]], found: Sequence[str],
                 expected: Sequence[str], hint: Optional[str] = None):
        self.path = path
        self.missing = list(missing)
        self.found = list(found)
        self.expected = list(expected)
        cols = ", ".join(repr(col) if col == name else f"{col!r} (for field {name!r})"
                         for name, col in self.missing)
        noun = "column" if len(self.missing) == 1 else "columns"
        msg = (f"{path}: missing {noun} {cols} (columns found: {self.found}; expected: "
               f"{self.expected}); rename the file's columns to the expected names")
        if hint:
            msg += " or map them: " + " ".join(hint.format(field=name, column=col)
                                               for name, col in self.missing)
        super().__init__(msg)
        self.message = msg

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


@dataclass
class LoadReport:
    path: str
    total: int = 0
    loaded: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)
    too_large: list[tuple[int, int]] = field(default_factory=list)
    """``(row index, bytes)`` of the jsonl lines longer than ``max_row_bytes`` (not loaded)."""

    @property
    def skipped_indices(self) -> list[int]:
        return [i for i, _ in self.bad]


def _format_bad(bad: list[tuple[int, str]], limit: int = 20) -> str:
    parts = [f"index {i} ({why})" for i, why in bad[:limit]]
    if len(bad) > limit:
        parts.append(f"... and {len(bad) - limit} more")
    return ", ".join(parts)


def json_too_deep(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON ``text`` nests lists/objects deeper than ``limit``, found without parsing it
    (linear time in C, memory bounded by a block; text with at most ``limit`` brackets is not
    scanned). Brackets inside strings do not count."""
    if text.count("[") + text.count("{") <= limit:
        return False
    outside = np.frombuffer(_JSON_STRING.sub("", text).encode("utf-8", "replace"), np.uint8)
    depth = 0
    for start in range(0, len(outside), _DEPTH_BLOCK):
        run = np.cumsum(_NESTING_STEP[outside[start:start + _DEPTH_BLOCK]], dtype=np.int64) + depth
        if run.max() > limit:
            return True
        depth = int(run[-1])
    return False


def _lone_surrogate(value: Any) -> bool:
    """Whether a loaded value holds a lone UTF-16 surrogate (JSON ``"\\ud800"``): Python keeps it,
    but it cannot be encoded, so tokenizing, printing or saving it would fail later."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, Mapping):
        return any(_lone_surrogate(k) or _lone_surrogate(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_lone_surrogate(v) for v in value)
    return False


class RowTooLarge(ValueError):
    """A jsonl line longer than the reader's bound: ``nbytes`` long, never parsed."""

    def __init__(self, nbytes: int):
        super().__init__(f"{nbytes} bytes")
        self.nbytes = nbytes


def open_regular(path: str):
    """``path`` opened for binary reading if it is a regular file (links resolved), else
    :class:`DataFileError` naming what it is. Opened non-blocking and checked before any read:
    a named pipe would block the open, a device such as ``/dev/zero`` would never end."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise DataFileError(path, e.strerror or str(e)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
                else "a device or socket")
        raise DataFileError(path, f"it is {kind}, not a regular file")
    return os.fdopen(fd, "rb")


def read_records(path: str) -> list[Union[dict, Exception]]:
    """Raw records of a file, one per row; an unparsable jsonl line is returned as an Exception.

    Raises :class:`DataFileError` when the file cannot be read at all.
    """
    return _read(path)[0]


def _read(path: str, max_row_bytes: Optional[int] = None) -> tuple[list[Union[dict, Exception]], Optional[Any]]:
    """(records, pyarrow schema for parquet files else None)."""
    lower = path.lower()
    if not lower.endswith((".parquet", ".jsonl", ".ndjson", ".json")):
        raise DataFileError(path, "unsupported file type: use .parquet, .jsonl or .json")
    try:
        with open_regular(path) as f:
            if lower.endswith(".parquet"):
                table = pq.read_table(f)
                return table.to_pylist(), table.schema
            if lower.endswith(".json"):
                return _read_json(path, f.read().decode("utf-8")), None
            return _read_jsonl(f, max_row_bytes), None
    except DataFileError:
        raise
    except (OSError, ValueError) as e:  # ArrowInvalid, JSONDecodeError, UnicodeDecodeError
        reason = " ".join(str(e).split()) or type(e).__name__
        raise DataFileError(path, reason) from e


def _lines(f, limit: Optional[int]):
    """The lines of the binary file ``f`` (bytes), a line longer than ``limit`` bytes as a
    :class:`RowTooLarge`, read to its end in bounded blocks and never held whole."""
    while True:
        line = f.readline() if limit is None else f.readline(limit + 1)
        if not line:
            return
        if limit is None or len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        size = len(line)
        while not line.endswith(b"\n"):
            line = f.readline(_SKIP_BLOCK)
            if not line:
                break
            size += len(line)
        yield RowTooLarge(size)


def _read_jsonl(f, max_row_bytes: Optional[int] = None) -> list[Union[dict, Exception]]:
    out: list[Union[dict, Exception]] = []
    for raw in _lines(f, max_row_bytes):
        if isinstance(raw, RowTooLarge):
            out.append(raw)
            continue
        line = raw.decode("utf-8").strip()
        if not line:
            out.append(ValueError("blank line"))
            continue
        if json_too_deep(line):
            out.append(ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels"))
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            out.append(ValueError(f"invalid JSON: {e.msg}"))
            continue
        out.append(rec if isinstance(rec, dict) else ValueError("not a JSON object"))
    # a trailing newline does not make a row
    while out and isinstance(out[-1], ValueError) and str(out[-1]) == "blank line":
        out.pop()
    return out


def _read_json(path: str, text: str) -> list[Union[dict, Exception]]:
    if not text.strip():
        return []
    outer = 1 if text.lstrip().startswith("[") else 2  # rows sit in [...] or {"data": [...]}
    if json_too_deep(text, MAX_JSON_DEPTH + outer):
        raise DataFileError(path, f"JSON nested deeper than {MAX_JSON_DEPTH} levels in a row")
    data = json.loads(text)
    if isinstance(data, dict):  # {"data": [...]} or column dict
        if len(data) == 1 and isinstance(next(iter(data.values())), list):
            data = next(iter(data.values()))
        else:
            raise DataFileError(path, "expected a JSON list of objects")
    if not isinstance(data, list):
        raise DataFileError(path, "expected a JSON list of objects")
    return [r if isinstance(r, dict) else ValueError("not a JSON object") for r in data]


def _schema_columns(schema: Any) -> list[str]:
    return list(schema.names)


def _schema_has(schema: Any, column: str) -> bool:
    """Whether a parquet schema has ``column`` (a dotted column walks struct fields)."""
    if column in schema.names:
        return True
    fields = {f.name: f for f in schema}
    parts = column.split(".")
    for i, part in enumerate(parts):
        f = fields.get(part)
        if f is None:
            return False
        if i == len(parts) - 1:
            return True
        if not pa.types.is_struct(f.type):
            return False
        fields = {f.type.field(j).name: f.type.field(j) for j in range(f.type.num_fields)}
    return False


def get_field(record: Mapping[str, Any], column: str, default: Any = _MISSING) -> Any:
    """``record[column]``; a dotted column (``a.b.c``) walks nested mappings."""
    if column in record:
        return record[column]
    cur: Any = record
    for part in column.split("."):
        if isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        else:
            return default
    return cur


def _is_empty(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, str) and value.strip() == "":
        return True
    if isinstance(value, (list, tuple)) and len(value) == 0:
        return True
    return False


def load_rows(
    path: Union[str, Sequence[str]],
    *,
    fields: Mapping[str, str],
    required: Sequence[str] = (),
    on_bad_row: str = "skip",
    normalize: Optional[Callable[[dict], dict]] = None,
    limit: Optional[int] = None,
    return_report: bool = False,
    map_hint: Optional[str] = None,
    warn: bool = True,
    max_row_bytes: Optional[int] = None,
):
    """Load rows with canonical field names.

    Args:
      path: a .parquet, .jsonl or .json file (or a list of them; indices are per file).
      fields: canonical name -> column in the file (dotted paths allowed). Canonical fields not
        listed map to a column of the same name. Only mapped fields are kept, plus ``_index``
        and ``_file``.
      required: canonical names that must be present and non-empty.
      on_bad_row: ``"skip"`` (warn with indices and count) or ``"error"`` (raise BadRowError).
      normalize: per-row hook (canonical dict -> dict) that may raise ValueError for a bad row.
      limit: keep at most this many good rows (per call).
      return_report: also return a list of :class:`LoadReport` (one per file).
      map_hint: how the caller's user maps a field to another column, a ``str.format`` template
        with ``{field}`` and ``{column}`` (e.g. ``"--field {field}=<column>"``); added to the
        :class:`MissingColumnError` message. Without it the message only suggests renaming.
      warn: log skipped bad rows (``on_bad_row="skip"``); callers that report them from the
        returned :class:`LoadReport` pass False.
      max_row_bytes: a jsonl line longer than this is not parsed (nor held in memory): it goes to
        :attr:`LoadReport.too_large`, not into the rows.

    Raises:
      FileNotFoundError: a file does not exist.
      DataFileError: a file cannot be read (type, not a regular file, corrupt parquet, invalid
        .json, not UTF-8).
      MissingColumnError: a required column is in no row (for parquet: not in the schema).
      BadRowError: bad rows with ``on_bad_row="error"``.
    """
    if on_bad_row not in ("skip", "error"):
        raise ValueError(f"on_bad_row must be 'skip' or 'error', got {on_bad_row!r}")
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    mapping = {k: v for k, v in fields.items()}
    for name in required:
        mapping.setdefault(name, name)

    rows: list[dict] = []
    reports: list[LoadReport] = []
    for p in paths:
        p = os.fspath(p)
        if not os.path.exists(p):
            raise FileNotFoundError(f"data file not found: {p}")
        if os.path.isdir(p):
            raise DataFileError(p, "is a directory, not a .parquet, .jsonl or .json file")
        records, schema = _read(p, max_row_bytes)
        report = LoadReport(path=p, total=len(records))
        # A required column absent from every row is a configuration error, not bad data.
        good_records = [r for r in records if isinstance(r, dict)]
        if schema is not None:
            missing = [(n, mapping[n]) for n in required if not _schema_has(schema, mapping[n])]
            found = _schema_columns(schema)
        elif good_records:
            missing = [(n, mapping[n]) for n in required
                       if all(get_field(r, mapping[n]) is _MISSING for r in good_records)]
            found = list(dict.fromkeys(k for r in good_records[:100] for k in r))
        else:
            missing, found = [], []
        if missing:
            expected = list(dict.fromkeys(mapping[n] for n in required))
            raise MissingColumnError(p, missing, found, expected, hint=map_hint)
        for idx, rec in enumerate(records):
            if isinstance(rec, RowTooLarge):
                report.too_large.append((idx, rec.nbytes))
                continue
            if isinstance(rec, Exception):
                report.bad.append((idx, str(rec)))
                continue
            out: dict[str, Any] = {}
            why = None
            for name, col in mapping.items():
                value = get_field(rec, col)
                if value is _MISSING or _is_empty(value):
                    if name in required:
                        why = f"missing {col!r}" if value is _MISSING else f"empty {col!r}"
                        break
                    value = None
                if _lone_surrogate(value):
                    why = f"{col!r} holds a lone surrogate escape such as \\ud800 (not valid text)"
                    break
                out[name] = value
            out["_file"] = os.path.basename(p)
            if why is None and normalize is not None:
                try:
                    out = normalize(out)
                except (ValueError, TypeError) as e:
                    why = str(e) or type(e).__name__
            if why is not None:
                report.bad.append((idx, why))
                continue
            out[INDEX_COLUMN] = idx
            out.setdefault("_file", os.path.basename(p))
            rows.append(out)
            report.loaded += 1
            if limit is not None and report.loaded >= limit:
                break
        reports.append(report)
        if report.bad:
            if on_bad_row == "error":
                raise BadRowError(p, report.bad)
            if warn:
                logger.warning("skipped %d of %d rows in %s: %s", len(report.bad), report.total, p,
                               _format_bad(report.bad))

    ds = _dataset(rows, ", ".join(map(os.fspath, paths)), mapping)
    return (ds, reports) if return_report else ds


def _dataset(rows: list[dict], where: str, mapping: Mapping[str, str]) -> datasets.Dataset:
    """The rows as a Dataset, built with pyarrow directly: ``Dataset.from_dict`` retries a column
    arrow refuses with a cast that takes time exponential in the values' nesting depth."""
    columns: dict[str, list] = {}
    for r in rows:
        for k in r:
            columns.setdefault(k, [])
    for k in columns:
        columns[k] = _one_type([r.get(k) for r in rows])
    try:
        return datasets.Dataset(InMemoryTable(pa.Table.from_pydict(columns)))
    except RecursionError:  # deep parquet structs (JSON rows were checked when read)
        raise DataFileError(where, "values nested too deeply") from None
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        raise _mixed_column_error(where, columns, mapping) from None


def _one_type(values: list) -> list:
    """Mixed scalars (e.g. a ``data_source`` of "gsm8k" and 3) become strings: an arrow column
    holds one type (ints and floats already share one)."""
    kinds = {type(v) for v in values if v is not None}
    if len(kinds) > 1 and kinds <= {str, int, float, bool} and not kinds <= {int, float}:
        return [v if v is None else str(v) for v in values]
    return values


def _mixed_column_error(where: str, columns: Mapping[str, list],
                        mapping: Mapping[str, str]) -> DataFileError:
    """The error for the first column arrow cannot hold (values of incompatible types)."""
    for name, values in columns.items():
        try:
            pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
            kinds = sorted({type(v).__name__ for v in values if v is not None})
            detail = " ".join(str(e).split())[:200]
            return DataFileError(where, f"column {mapping.get(name, name)!r} mixes values of types "
                                        f"{', '.join(kinds)} across rows ({detail}); give it one type")
    return DataFileError(where, "its rows do not fit one table")


class TableRows(Sequence):
    """The rows of an arrow table as dicts, made on access: a million prompts stay one columnar
    table (memory-mapped when read from a file, so the ranks of a node share its pages) instead of
    a million dicts in each process. ``rows[i]`` and ``rows[a:b]`` equal ``table.to_pylist()``'s."""

    def __init__(self, table: pa.Table):
        self.table = table

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return self.table.slice(start, max(0, stop - start)).to_pylist()
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"row {index} of {n}")
        return self.table.slice(index % n, 1).to_pylist()[0]

    def select(self, indices: Sequence[int]) -> "TableRows":
        """The rows at ``indices``, in that order."""
        return TableRows(self.table.take(pa.array(indices, type=pa.int64())))
