#!/usr/bin/env python3
"""Convert the public DeepScaleR, GSM8K and MATH-500 files into the math task's jsonl.

Nothing is downloaded: fetch the files yourself (docs/tasks.md, "Public math data"), then

    python tools/prepare_data.py deepscaler.json --out data/deepscaler.jsonl
    python tools/prepare_data.py gsm8k/main/train-00000-of-00001.parquet --out data/gsm8k_train.jsonl
    python tools/prepare_data.py test.jsonl --out data/math500.jsonl          # MATH-500

Each output row is ``{"problem", "answer", "data_source"}`` (MATH-500 also keeps ``subject``,
``level`` and ``unique_id``): the columns ``--task math`` reads by default and
``emapg-evaluate`` groups its tables by (``data_source``). The format is recognised from the
columns (``--format`` names it):

* ``deepscaler``: agentica-org/DeepScaleR-Preview-Dataset ``deepscaler.json``, a JSON list of
  ``{"problem", "solution", "answer"}``; the answer is kept as written.
* ``gsm8k``: openai/gsm8k (``main/*.parquet`` on Hugging Face, or ``grade_school_math/data/*.jsonl``
  of the GitHub repository), ``{"question", "answer"}`` where the answer is a worked solution
  ending in ``#### N``; the answer becomes N without thousands separators (as verl's GSM8K
  preprocessing takes it).
* ``math500``: HuggingFaceH4/MATH-500 ``test.jsonl``, ``{"problem", "solution", "answer",
  "subject", "level", "unique_id"}``; the answer is kept as written.

A row without a usable problem or answer stops the conversion with one ``error:`` line naming the
rows (exit code 2); ``--skip-bad`` leaves them out and says how many. An existing output file is
refused unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FORMATS = ("deepscaler", "gsm8k", "math500")
DATA_SOURCE = {"deepscaler": "deepscaler", "gsm8k": "gsm8k", "math500": "math500"}
MATH500_EXTRA = ("subject", "level", "unique_id")
GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")  # verl's examples/data_preprocess/gsm8k.py


class BadInput(Exception):
    """A file or its rows cannot be converted (one line for the user)."""


def detect(record: dict) -> str:
    """The public format of a file, from the columns of its first row."""
    keys = set(record)
    if {"question", "answer"} <= keys and "problem" not in keys:
        return "gsm8k"
    if {"problem", "answer", "subject", "level"} <= keys:
        return "math500"
    if {"problem", "answer"} <= keys:
        return "deepscaler"
    raise BadInput(f"unrecognised columns {sorted(keys)}: expected DeepScaleR's problem/answer, "
                   "GSM8K's question/answer or MATH-500's problem/answer/subject/level (or pass --format)")


def _text(value) -> str:
    if isinstance(value, bool) or value is None:
        raise ValueError("missing")
    if isinstance(value, (int, float)):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"a {type(value).__name__}, not text")
    if not value.strip():
        raise ValueError("empty")
    return value.strip()


def convert_row(record: dict, fmt: str) -> dict:
    """The math task's row for one public record; ValueError says what is wrong with it."""
    if fmt == "gsm8k":
        problem = _field(record, "question")
        solution = _field(record, "answer")
        m = GSM8K_ANSWER.search(solution)
        if not m:
            raise ValueError("answer has no '#### <number>'")
        answer = m.group(1).replace(",", "")
    else:
        problem, answer = _field(record, "problem"), _field(record, "answer")
    row = {"problem": problem, "answer": answer, "data_source": DATA_SOURCE[fmt]}
    if fmt == "math500":
        row.update({k: record[k] for k in MATH500_EXTRA if record.get(k) is not None})
    return row


def _field(record: dict, name: str) -> str:
    try:
        return _text(record.get(name))
    except ValueError as e:
        raise ValueError(f"'{name}' {e}") from None


def convert(path: str, fmt: str = "auto", data_source: str | None = None,
            skip_bad: bool = False) -> tuple[list[dict], str, list[tuple[int, str]]]:
    """(rows, format, skipped (index, reason)) for one public file."""
    from emapg_megatron.tasks.data import DataFileError, read_records

    try:
        records = read_records(path)
    except DataFileError as e:
        raise BadInput(str(e)) from None
    if not records:
        raise BadInput(f"{path}: no rows")
    first = next((r for r in records if isinstance(r, dict)), None)
    if first is None:
        raise BadInput(f"{path}: no row is a JSON object")
    fmt = detect(first) if fmt == "auto" else fmt
    rows, bad = [], []
    for i, rec in enumerate(records):
        try:
            if isinstance(rec, Exception):
                raise rec
            row = convert_row(rec, fmt)
        except ValueError as e:
            bad.append((i, str(e)))
            continue
        if data_source:
            row["data_source"] = data_source
        rows.append(row)
    if bad and not skip_bad:
        shown = ", ".join(f"row {i} ({why})" for i, why in bad[:5]) + (", ..." if len(bad) > 5 else "")
        raise BadInput(f"{path}: {len(bad)} of {len(records)} rows cannot be converted as {fmt}: {shown}; "
                       "fix them or pass --skip-bad")
    if not rows:
        raise BadInput(f"{path}: none of its {len(records)} rows can be converted as {fmt}")
    return rows, fmt, bad


def write_jsonl(rows: list[dict], out: str) -> None:
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{out}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("inputs", nargs="+", metavar="FILE", help="public files (.json, .jsonl or .parquet)")
    p.add_argument("--out", required=True, help="the jsonl to write (all inputs, in order)")
    p.add_argument("--format", choices=("auto", *FORMATS), default="auto",
                   help="the inputs' format (default: recognised from the columns)")
    p.add_argument("--data-source", help="data_source of every row (default: deepscaler, gsm8k or math500)")
    p.add_argument("--skip-bad", action="store_true", help="leave out rows that cannot be converted")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    a = p.parse_args(argv)
    try:
        if os.path.exists(a.out) and not a.overwrite:
            raise BadInput(f"{a.out} exists: pass --overwrite to replace it")
        everything = []
        for path in a.inputs:
            if not os.path.isfile(path):
                raise BadInput(f"{path}: no such file (download it first: docs/tasks.md, 'Public math data')")
            rows, fmt, bad = convert(path, a.format, a.data_source, a.skip_bad)
            note = f", {len(bad)} skipped (first: row {bad[0][0]}, {bad[0][1]})" if bad else ""
            print(f"{path}: {fmt}, {len(rows)} rows{note}", file=sys.stderr)
            everything += rows
        write_jsonl(everything, a.out)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(everything)} rows to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
