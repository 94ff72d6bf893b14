"""Passages: a jsonl corpus read and normalised, and the retriever interface.

Corpus format (jsonl, one passage per line), either Search-R1's::

    {"id": "12", "contents": "\\"Eiffel Tower\\"\\nThe Eiffel Tower is a wrought-iron ..."}

(first line of ``contents`` is the title) or explicit fields::

    {"id": "12", "title": "Eiffel Tower", "text": "The Eiffel Tower is a wrought-iron ..."}

A passage is returned as ``{"id", "title", "text", "contents", "score"}``.
"""
from __future__ import annotations

import json
import logging
from typing import Protocol, Sequence

from ..data import json_too_deep

logger = logging.getLogger(__name__)

__all__ = ["Retriever", "load_corpus", "format_passages", "split_contents"]


class Retriever(Protocol):
    """What the search task needs of a retriever: the top-k passages of a query, or of each of
    a batch."""

    def search(self, query: str, k: int = 3) -> list[dict]: ...

    def batch_search(self, queries: Sequence[str], k: int = 3) -> list[list[dict]]: ...


def split_contents(contents: str) -> tuple[str, str]:
    """(title, text) of Search-R1's ``contents``: the first line is the quoted title."""
    title, _, text = contents.partition("\n")
    return title.strip().strip('"').strip(), text.strip()


def load_corpus(path: str) -> list[dict]:
    """Passages of a jsonl corpus, normalised to ``{"id", "title", "text", "contents"}``.

    Lines that are not JSON objects with ``contents`` or ``text`` (or nest deeper than
    :data:`~.data.MAX_JSON_DEPTH`) are reported (index and count) and skipped.
    """
    passages: list[dict] = []
    bad: list[int] = []
    with open(path, "r", encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            try:
                rec = None if json_too_deep(line) else json.loads(line)
            except json.JSONDecodeError:
                rec = None
            if not isinstance(rec, dict):
                bad.append(i)
                continue
            if rec.get("contents"):
                title, text = split_contents(str(rec["contents"]))
                if rec.get("title"):
                    title = str(rec["title"])
            elif rec.get("text"):
                title, text = str(rec.get("title") or ""), str(rec["text"])
            else:
                bad.append(i)
                continue
            pid = str(rec.get("id", rec.get("_id", i)))
            passages.append({"id": pid, "title": title, "text": text,
                             "contents": f'"{title}"\n{text}' if title else text})
    if bad:
        shown = ", ".join(map(str, bad[:20])) + (" ..." if len(bad) > 20 else "")
        logger.warning("skipped %d bad line(s) in corpus %s: line index %s", len(bad), path, shown)
    if not passages:
        raise ValueError(f"corpus {path} has no usable passages")
    return passages


def format_passages(passages: Sequence[dict]) -> str:
    """Search-R1's rendering: ``Doc 1(Title: ...) text`` one per line."""
    lines = []
    for i, p in enumerate(passages):
        title = p.get("title")
        text = p.get("text")
        if title is None or text is None:
            title, text = split_contents(str(p.get("contents", "")))
        lines.append(f"Doc {i + 1}(Title: {title}) {text}")
    return "\n".join(lines)
