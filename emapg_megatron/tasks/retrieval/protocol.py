"""The ``/retrieve`` wire format (Search-R1's) and its limits: what a request may ask for.

``POST /retrieve {"queries": [...], "topk": 3, "return_scores": true}`` answers
``{"result": [[{"document": {"id", "contents", "title", "text"}, "score"}, ...], ...]}``; a
refused request gets ``{"error": message}`` and a 4xx status (:class:`RequestError`).
"""
from __future__ import annotations

import numbers
from typing import Any, Optional

__all__ = ["DEFAULT_MAX_TOPK", "DEFAULT_MAX_QUERIES", "DEFAULT_MAX_QUERY_CHARS", "LOOPBACK",
           "RequestError", "check_topk", "parse_retrieve_request"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")
"""The hosts the service binds to, and the client reaches without a proxy."""

#: Largest ``topk`` a request may ask for.
DEFAULT_MAX_TOPK = 100
#: Most queries in one request.
DEFAULT_MAX_QUERIES = 1024
#: Longest query (characters).
DEFAULT_MAX_QUERY_CHARS = 8192


class RequestError(ValueError):
    """A request the retriever service refuses: ``status`` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message


def brief(value: Any, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters (a refused value quoted in a message)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_topk(k: Any, max_topk: Optional[int] = None) -> int:
    """``k`` as an int if it is an integer (not a bool) in ``1..max_topk``, else :class:`RequestError`
    (a ``ValueError``) with status 400. Floats (``3.0``, ``inf``, ``nan``) and strings are refused."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise RequestError(400, f"'topk' must be an integer, got {type(k).__name__} {brief(k)}")
    k = int(k)
    if k < 1 or (max_topk is not None and k > max_topk):
        upper = "" if max_topk is None else f" and {max_topk}"
        raise RequestError(400, f"'topk' must be between 1{upper}, got {brief(k)}")
    return k


def parse_retrieve_request(
    req: Any,
    *,
    max_topk: int = DEFAULT_MAX_TOPK,
    max_queries: int = DEFAULT_MAX_QUERIES,
    max_query_chars: int = DEFAULT_MAX_QUERY_CHARS,
) -> tuple[list[str], int, bool]:
    """Validate a decoded ``/retrieve`` body; returns ``(queries, topk, return_scores)``.

    ``queries`` is a non-empty list of non-blank strings (a single string is one query), each at
    most ``max_query_chars`` long, at most ``max_queries`` of them; ``topk`` (or ``k``, default 3)
    an integer in ``1..max_topk``; ``return_scores`` (default true) a bool. Other keys are
    ignored. Raises :class:`RequestError` (status 400) with a message naming the field.
    """
    if not isinstance(req, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(req).__name__}")
    if "queries" not in req:
        raise RequestError(400, "missing 'queries' (a list of query strings)")
    queries = req["queries"]
    if isinstance(queries, str):
        queries = [queries]
    if not isinstance(queries, list):
        raise RequestError(400, f"'queries' must be a list of strings, got {type(queries).__name__}")
    if not queries:
        raise RequestError(400, "'queries' is empty")
    if len(queries) > max_queries:
        raise RequestError(400, f"too many queries: {len(queries)} > {max_queries} per request")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise RequestError(400, f"queries[{i}] must be a string, got {type(q).__name__}")
        if not q.strip():
            raise RequestError(400, f"queries[{i}] is empty")
        if len(q) > max_query_chars:
            raise RequestError(400, f"queries[{i}] is too long: {len(q)} > {max_query_chars} characters")
    k = check_topk(req["topk"] if "topk" in req else req.get("k", 3), max_topk)
    return_scores = req.get("return_scores", True)
    if not isinstance(return_scores, bool):
        raise RequestError(400, f"'return_scores' must be true or false, got {brief(return_scores)}")
    return list(queries), k, return_scores
