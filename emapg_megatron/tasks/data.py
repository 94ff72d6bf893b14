"""Loading task data from local parquet / jsonl / json files into a ``datasets.Dataset``.

Nothing is downloaded: files are read with pyarrow (parquet) or line by line (jsonl), validated
row by row in Python, and the good rows are turned into a ``datasets.Dataset`` in memory (no
cache files are written).

Field names are configurable: ``fields`` maps a canonical name (what the task reads, e.g.
``question``) to a column in the file (e.g. ``problem``). A dotted column reaches into nested
structs, e.g. ``reward_model.ground_truth`` for verl-style parquet files.

Bad rows (a required field missing, null or empty; a jsonl line that is not a JSON object; a
value the task cannot normalise) are never dropped silently: with ``on_bad_row="skip"`` they are
skipped and a warning names their indices and the count; with ``on_bad_row="error"`` loading
fails with :class:`BadRowError` listing them. The index is the 0-based row number in the file
(for jsonl: the 0-based line number, blank lines included). Every loaded row keeps it in the
``_index`` column.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

logger = logging.getLogger(__name__)

__all__ = ["BadRowError", "LoadReport", "load_rows", "read_records", "get_field", "INDEX_COLUMN"]

INDEX_COLUMN = "_index"
_MISSING = object()


class BadRowError(ValueError):
    """Raised with ``on_bad_row='error'`` when rows lack required fields."""

    def __init__(self, path: str, bad: list[tuple[int, str]]):
        self.path = path
        self.bad = bad
        super().__init__(f"{len(bad)} bad row(s) in {path}: {_format_bad(bad)}")


@dataclass
class LoadReport:
    path: str
    total: int = 0
    loaded: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)

    @property
    def skipped_indices(self) -> list[int]:
        return [i for i, _ in self.bad]


def _format_bad(bad: list[tuple[int, str]], limit: int = 20) -> str:
    parts = [f"index {i} ({why})" for i, why in bad[:limit]]
    if len(bad) > limit:
        parts.append(f"... and {len(bad) - limit} more")
    return ", ".join(parts)


def read_records(path: str) -> list[Union[dict, Exception]]:
    """Raw records of a file, one per row; an unparsable jsonl line is returned as an Exception."""
    lower = path.lower()
    if lower.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if lower.endswith(".jsonl") or lower.endswith(".ndjson"):
        out: list[Union[dict, Exception]] = []
        with open(path, "r", encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    out.append(ValueError("blank line"))
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
    if lower.endswith(".json"):
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict):  # {"data": [...]} or column dict
            if len(data) == 1 and isinstance(next(iter(data.values())), list):
                data = next(iter(data.values()))
            else:
                raise ValueError(f"{path}: expected a JSON list of objects")
        return [r if isinstance(r, dict) else ValueError("not a JSON object") for r in data]
    raise ValueError(f"unsupported data file {path!r}: use .parquet, .jsonl or .json")


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
    """
    import datasets

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
        records = read_records(p)
        report = LoadReport(path=p, total=len(records))
        # A required column absent from every row is a configuration error, not bad data.
        good_records = [r for r in records if isinstance(r, dict)]
        if good_records:
            for name in required:
                col = mapping[name]
                if all(get_field(r, col) is _MISSING for r in good_records):
                    avail = sorted({k for r in good_records[:100] for k in r})
                    raise KeyError(
                        f"{p}: no row has column {col!r} for field {name!r}; available columns: "
                        f"{avail}. Map it with fields={{'{name}': '<column>'}} (--field {name}=<column>)."
                    )
        for idx, rec in enumerate(records):
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
            logger.warning(
                "skipped %d of %d rows in %s: %s", len(report.bad), report.total, p, _format_bad(report.bad)
            )

    columns: dict[str, list] = {}
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in columns:
                columns[k] = []
                keys.append(k)
    for k in keys:
        columns[k] = [r.get(k) for r in rows]
    ds = datasets.Dataset.from_dict(columns)
    return (ds, reports) if return_report else ds
