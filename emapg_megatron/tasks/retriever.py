"""Passage retrieval for the search-agent task.

* :class:`BM25Retriever` - ``bm25s`` over a local passage corpus (jsonl) on CPU, in process.
* :class:`RetrieverServer` / :class:`RetrieverClient` - the same retriever behind a tiny HTTP
  service (stdlib ``http.server``, bound to 127.0.0.1 only) so that many trainer / rollout
  processes share one index. The wire format is Search-R1's ``/retrieve`` endpoint, so the
  client also talks to a Search-R1 retrieval server (e5 + faiss) unchanged.
* :class:`DenseRetriever` - e5 embeddings + a faiss index, only when ``faiss`` and
  ``transformers`` are installed.

Corpus format (jsonl, one passage per line), either Search-R1's::

    {"id": "12", "contents": "\\"Eiffel Tower\\"\\nThe Eiffel Tower is a wrought-iron ..."}

(first line of ``contents`` is the title) or explicit fields::

    {"id": "12", "title": "Eiffel Tower", "text": "The Eiffel Tower is a wrought-iron ..."}

A passage is returned as ``{"id", "title", "text", "contents", "score"}``.

The server validates every request and answers a bad one with ``{"error": message}`` and a 4xx
status, and keeps serving: 411 without a ``Content-Length``, 400 for a malformed one, 413 for a
body over ``max_body`` (1 MiB by default), 408 for a request (line, headers and body together)
not received within ``request_timeout`` of the connection being ready for it (an idle connection
is closed without a reply), 400
for ``topk`` that is not an integer in ``1..max_topk`` (100 by default; bools, floats, ``inf``,
strings are refused) or ``queries`` that are not a non-empty list of non-blank strings of at most
``max_query_chars`` characters each.

Run a server: ``python -m emapg_megatron.tasks.retriever --corpus data/samples/corpus.jsonl
--port 8000``.
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import logging
import math
import numbers
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional, Protocol, Sequence, Union

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from .data import json_too_deep

logger = logging.getLogger(__name__)

__all__ = [
    "Retriever",
    "BM25Retriever",
    "DenseRetriever",
    "RetrieverServer",
    "RetrieverClient",
    "RequestError",
    "check_topk",
    "parse_retrieve_request",
    "load_corpus",
    "make_retriever",
    "format_passages",
    "require_bm25s",
]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def require_bm25s() -> None:
    if importlib.util.find_spec("bm25s") is None:
        raise ImportError(
            "BM25 retrieval needs bm25s: pip install 'emapg-megatron[search]' (or pip install bm25s)"
        )


class Retriever(Protocol):
    def search(self, query: str, k: int = 3) -> list[dict]: ...

    def batch_search(self, queries: Sequence[str], k: int = 3) -> list[list[dict]]: ...


def _split_contents(contents: str) -> tuple[str, str]:
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
                title, text = _split_contents(str(rec["contents"]))
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
            title, text = _split_contents(str(p.get("contents", "")))
        lines.append(f"Doc {i + 1}(Title: {title}) {text}")
    return "\n".join(lines)


class BM25Retriever:
    """BM25 (``bm25s``) over a passage list, on CPU. Thread-safe.

    Title and text are indexed together. Hits with a zero score (no query term in the
    passage) are dropped, so a query of stop words only returns no passages.
    """

    def __init__(
        self,
        corpus: Union[str, Sequence[dict]],
        *,
        k1: float = 1.5,
        b: float = 0.75,
        stopwords: Optional[str] = "en",
    ) -> None:
        require_bm25s()
        import bm25s

        self._bm25s = bm25s
        self.passages = load_corpus(corpus) if isinstance(corpus, (str, os.PathLike)) else list(corpus)
        self.stopwords = stopwords
        texts = [f"{p.get('title', '')} {p.get('text', '')}" for p in self.passages]
        tokens = bm25s.tokenize(texts, stopwords=stopwords, show_progress=False)
        self._index = bm25s.BM25(k1=k1, b=b)
        self._index.index(tokens, show_progress=False)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.passages)

    def batch_search(self, queries: Sequence[str], k: int = 3) -> list[list[dict]]:
        queries = [str(q) for q in queries]
        if not queries:
            return []
        k = max(1, min(int(k), len(self.passages)))
        q_tokens = self._bm25s.tokenize(queries, stopwords=self.stopwords, show_progress=False,
                                        return_ids=False)
        with self._lock:
            docs, scores = self._index.retrieve(q_tokens, k=k, show_progress=False, n_threads=0)
        out = []
        for row_docs, row_scores in zip(docs, scores):
            hits = []
            for d, s in zip(row_docs, row_scores):
                if float(s) <= 0.0:
                    continue
                hits.append(dict(self.passages[int(d)], score=float(s)))
            out.append(hits)
        return out

    def search(self, query: str, k: int = 3) -> list[dict]:
        return self.batch_search([query], k)[0]


class DenseRetriever:
    """e5 embeddings + faiss inner-product index (optional; needs faiss and transformers).

    ``index_path`` is a faiss index over the corpus passages in file order, built with the same
    encoder ("passage: " prefix, mean pooling, L2-normalised), as in Search-R1.
    """

    def __init__(self, corpus: str, index_path: str, model_name: str = "intfloat/e5-base-v2",
                 device: str = "cpu", batch_size: int = 32) -> None:
        if importlib.util.find_spec("faiss") is None or importlib.util.find_spec("transformers") is None:
            raise ImportError(
                "dense retrieval needs faiss and transformers: pip install faiss-cpu transformers "
                "(or use the BM25 retriever from the [search] extra)"
            )
        import faiss
        self._torch = torch
        self.passages = load_corpus(corpus)
        self.index = faiss.read_index(index_path)
        if self.index.ntotal != len(self.passages):
            raise ValueError(f"index has {self.index.ntotal} vectors, corpus {len(self.passages)} passages")
        self.tokenizer = AutoTokenizer.from_pretrained(model_name)
        self.model = AutoModel.from_pretrained(model_name).to(device).eval()
        self.device = device
        self.batch_size = batch_size
        self._lock = threading.Lock()

    def _encode(self, queries: Sequence[str]):
        torch = self._torch
        out = []
        for i in range(0, len(queries), self.batch_size):
            batch = [f"query: {q}" for q in queries[i : i + self.batch_size]]
            enc = self.tokenizer(batch, padding=True, truncation=True, max_length=256, return_tensors="pt")
            enc = {k: v.to(self.device) for k, v in enc.items()}
            with torch.no_grad():
                hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
            out.append(torch.nn.functional.normalize(emb, dim=-1).cpu().numpy().astype("float32"))
        return np.concatenate(out, axis=0)

    def batch_search(self, queries: Sequence[str], k: int = 3) -> list[list[dict]]:
        if not queries:
            return []
        with self._lock:
            scores, ids = self.index.search(self._encode(list(queries)), int(k))
        return [[dict(self.passages[int(d)], score=float(s)) for d, s in zip(ri, rs) if d >= 0]
                for ri, rs in zip(ids, scores)]

    def search(self, query: str, k: int = 3) -> list[dict]:
        return self.batch_search([query], k)[0]


# ----------------------------------------------------------------------------------------------
# HTTP service

#: Largest request body the server reads (bytes); a larger ``Content-Length`` gets a 413.
DEFAULT_MAX_BODY = 1 << 20
#: Largest ``topk`` a request may ask for.
DEFAULT_MAX_TOPK = 100
#: Most queries in one request.
DEFAULT_MAX_QUERIES = 1024
#: Longest query (characters).
DEFAULT_MAX_QUERY_CHARS = 8192
#: Seconds from a connection being ready for a request (accepted, or its previous reply sent) to
#: the whole request (line, headers, body) being read: a deadline, not a per-read timeout, so a
#: client trickling bytes cannot hold a thread. A late request gets a 408, an idle connection is
#: closed.
DEFAULT_REQUEST_TIMEOUT = 30.0
#: Listen backlog: connections waiting to be accepted. The stdlib default (5) made the kernel
#: reset connections from a few dozen concurrent clients.
LISTEN_BACKLOG = 1024
# After an error that leaves part of a request body unread, the server stops writing and reads
# (and drops) what the client still sends, at most this long / this much, before it closes the
# socket; closing with unread input would send a TCP reset that can destroy the error reply.
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 1 << 23
_DIGITS = frozenset("0123456789")


class RequestError(ValueError):
    """A request the retriever service refuses: ``status`` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message


def _brief(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_topk(k: Any, max_topk: Optional[int] = None) -> int:
    """``k`` as an int if it is an integer (not a bool) in ``1..max_topk``, else :class:`RequestError`
    (a ``ValueError``) with status 400. Floats (``3.0``, ``inf``, ``nan``) and strings are refused."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise RequestError(400, f"'topk' must be an integer, got {type(k).__name__} {_brief(k)}")
    k = int(k)
    if k < 1 or (max_topk is not None and k > max_topk):
        upper = "" if max_topk is None else f" and {max_topk}"
        raise RequestError(400, f"'topk' must be between 1{upper}, got {_brief(k)}")
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
        raise RequestError(400, f"'return_scores' must be true or false, got {_brief(return_scores)}")
    return list(queries), k, return_scores


class _RequestTimeout(Exception):
    """The request's deadline passed while reading it (not a ``TimeoutError``, which
    ``http.server`` swallows without a reply). ``begun``: some of the request had arrived."""

    def __init__(self, begun: bool) -> None:
        super().__init__("request deadline passed")
        self.begun = begun


class _DeadlineReader(io.RawIOBase):
    """A socket's input where every read of one request shares one deadline (:meth:`arm`);
    a socket timeout alone restarts on every byte received."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        super().__init__()
        self._sock, self._seconds = sock, seconds
        self._deadline: Optional[float] = None
        self._received = 0

    def readable(self) -> bool:
        return True

    def arm(self) -> None:
        self._deadline, self._received = time.monotonic() + self._seconds, 0

    def disarm(self) -> None:
        """Back to a plain timeout (replies are written with it)."""
        self._deadline = None
        self._sock.settimeout(self._seconds)

    def readinto(self, buf) -> int:
        if self._deadline is None:
            return self._sock.recv_into(buf)
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise _RequestTimeout(self._received > 0)
        self._sock.settimeout(left)
        try:
            n = self._sock.recv_into(buf)
        except TimeoutError:
            raise _RequestTimeout(self._received > 0) from None
        self._received += n
        return n


class _Handler(BaseHTTPRequestHandler):
    server_version = "emapg-retriever/1"
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.timeout = self.server.request_timeout  # socket timeout for every write
        super().setup()
        self.rfile.close()  # read through the deadline instead
        self._input = _DeadlineReader(self.connection, self.timeout)
        self.rfile = io.BufferedReader(self._input)

    def handle_one_request(self) -> None:
        # what _send needs if the deadline passes before the request line is parsed
        self.command, self.requestline, self.request_version = None, "", self.protocol_version
        self._input.arm()
        try:
            super().handle_one_request()
        except _RequestTimeout as e:
            self.close_connection = True
            if e.begun:  # an idle connection is just closed
                self._send_timeout("the request")

    def _send_timeout(self, what: str) -> None:
        try:
            self._refuse(RequestError(408, f"timed out reading {what}: not received within "
                                           f"{self.server.request_timeout:g} s"), unread_body=True)
        except OSError:
            self.close_connection = True

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet
        logger.debug("retriever %s - " + fmt, self.address_string(), *args)

    def _send(self, code: int, payload: Any, close: bool = False) -> None:
        self._input.disarm()
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")  # also sets self.close_connection
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """Errors found by ``http.server`` itself (bad request line, unknown method): JSON too."""
        short, long = self.responses.get(code, ("error", ""))
        self.log_error("code %d, message %s", code, message)
        self._send(code, {"error": message or long or short}, close=True)

    def _refuse(self, err: RequestError, unread_body: bool) -> None:
        """Answer ``err``; with ``unread_body`` the rest of the body cannot be told from the next
        request, so the connection closes (after draining what the client still sends)."""
        self._send(err.status, {"error": err.message}, close=unread_body)
        if unread_body:
            self._linger()

    def _linger(self) -> None:
        self.close_connection = True
        sock = self.connection
        try:
            self.wfile.flush()
            sock.shutdown(socket.SHUT_WR)  # the reply is out; the client sees EOF after it
            deadline = time.monotonic() + _LINGER_SECONDS
            drained = 0
            while drained < _LINGER_BYTES:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:  # includes the timeout
            pass

    def _body_length(self) -> int:
        """The request's Content-Length, validated (RequestError otherwise)."""
        if self.headers.get("Transfer-Encoding") is not None:
            raise RequestError(411, "Transfer-Encoding is not supported; send the body with a Content-Length")
        values = self.headers.get_all("Content-Length") or []
        if not values:
            raise RequestError(411, "missing Content-Length header")
        raw = {v.strip() for v in values}
        if len(raw) != 1:
            raise RequestError(400, "conflicting Content-Length headers")
        text = raw.pop()
        if not text or not set(text) <= _DIGITS:
            raise RequestError(400, f"invalid Content-Length {_brief(text)}: must be a non-negative integer")
        max_body = self.server.max_body
        text = text.lstrip("0") or "0"
        if len(text) > len(str(max_body)) or int(text) > max_body:
            raise RequestError(413, f"request body too large: Content-Length {_brief(text)} > {max_body} bytes")
        return int(text)

    def handle_expect_100(self) -> bool:
        # refuse a bad or oversized body before the client sends it
        if self.command == "POST":
            try:
                self._body_length()
            except RequestError as e:
                self._refuse(e, unread_body=True)
                return False
        return super().handle_expect_100()

    def do_GET(self) -> None:  # noqa: N802
        if self.path.rstrip("/") == "/health":
            srv = self.server
            self._send(200, {"ok": True, "passages": len(getattr(srv.retriever, "passages", [])),
                             "max_topk": srv.max_topk, "max_queries": srv.max_queries,
                             "max_query_chars": srv.max_query_chars, "max_body": srv.max_body})
        else:
            self._send(404, {"error": f"not found: {self.path[:200]}"})

    def do_POST(self) -> None:  # noqa: N802
        try:
            self._post()
        except Exception as e:  # a bug must not drop the connection without an answer
            logger.exception("retriever request failed")
            try:
                self._send(500, {"error": f"internal error: {type(e).__name__}"}, close=True)
            except OSError:
                self.close_connection = True

    def _post(self) -> None:
        if self.path.rstrip("/") != "/retrieve":
            self._refuse(RequestError(404, f"not found: {self.path[:200]} (POST /retrieve)"), unread_body=True)
            return
        try:
            n = self._body_length()
        except RequestError as e:
            self._refuse(e, unread_body=True)
            return
        try:
            data = self.rfile.read(n) if n else b""
        except _RequestTimeout:
            self._send_timeout(f"the {n}-byte request body")
            return
        if len(data) < n:
            self._send(400, {"error": f"request body ended after {len(data)} of {n} bytes"}, close=True)
            return
        srv = self.server
        try:
            if not data.strip():
                raise RequestError(400, "empty request body; expected a JSON object")
            try:
                req = json.loads(data)
            except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, ...
                raise RequestError(400, f"invalid JSON body: {str(e)[:200]}")
            queries, k, return_scores = parse_retrieve_request(
                req, max_topk=srv.max_topk, max_queries=srv.max_queries,
                max_query_chars=srv.max_query_chars)
        except RequestError as e:
            self._refuse(e, unread_body=False)  # the body was read: the connection stays usable
            return
        try:
            results = srv.retriever.batch_search(queries, k)
        except Exception as e:  # keep serving
            logger.exception("retrieval failed")
            self._send(500, {"error": f"retrieval failed: {type(e).__name__}: {str(e)[:200]}"})
            return
        out = []
        for hits in results:
            docs = []
            for h in hits:
                doc = {"id": h.get("id"), "contents": h.get("contents"), "title": h.get("title"),
                       "text": h.get("text")}
                docs.append({"document": doc, "score": h.get("score")} if return_scores else doc)
            out.append(docs)
        self._send(200, {"result": out})


def _positive(name: str, value: Any, kind: type = int) -> Any:
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral if kind is int else numbers.Real)) \
            or not value > 0 or (kind is float and not math.isfinite(value)):
        raise ValueError(f"{name} must be a positive {'integer' if kind is int else 'number'}, got {value!r}")
    return kind(value)


class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True


class RetrieverServer:
    """Serve a retriever over HTTP on the loopback interface, in a background thread.

    ``port=0`` picks a free port; read it back from ``.port`` / ``.url``. Requests are
    validated: a body over ``max_body`` bytes gets 413, a missing / bad ``Content-Length``
    411 / 400, a ``topk`` outside ``1..max_topk`` or a bad ``queries`` field 400, a request not
    read within ``request_timeout`` seconds (a total deadline) 408; every error is
    ``{"error": message}`` and the server keeps serving. The listen backlog is
    :data:`LISTEN_BACKLOG`.
    """

    def __init__(self, retriever: Retriever, host: str = "127.0.0.1", port: int = 0,
                 max_body: int = DEFAULT_MAX_BODY, *, max_topk: int = DEFAULT_MAX_TOPK,
                 max_queries: int = DEFAULT_MAX_QUERIES, max_query_chars: int = DEFAULT_MAX_QUERY_CHARS,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT) -> None:
        if host not in _LOOPBACK:
            raise ValueError(f"the retriever service binds to loopback only (127.0.0.1), not {host!r}")
        limits = {"max_body": _positive("max_body", max_body), "max_topk": _positive("max_topk", max_topk),
                  "max_queries": _positive("max_queries", max_queries),
                  "max_query_chars": _positive("max_query_chars", max_query_chars),
                  "request_timeout": _positive("request_timeout", request_timeout, float)}
        if host == "localhost":
            host = "127.0.0.1"
        server_cls = _HTTPServer
        if ":" in host:
            class _V6(_HTTPServer):
                address_family = socket.AF_INET6

            server_cls = _V6
        self._httpd = server_cls((host, port), _Handler)
        self._httpd.retriever = retriever  # type: ignore[attr-defined]
        for name, value in limits.items():
            setattr(self._httpd, name, value)
            setattr(self, name, value)
        self.host = host
        self.port = self._httpd.server_address[1]
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> "RetrieverServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="retriever-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:  # shutdown() blocks unless serve_forever is running
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> "RetrieverServer":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.close()


class RetrieverClient:
    """Client for :class:`RetrieverServer` (or a Search-R1 retrieval server).

    ``k`` must be an integer >= 1 (``ValueError`` otherwise, before any request); a request the
    server refuses (4xx) raises ``RuntimeError`` with the server's message and is not retried.
    """

    def __init__(self, url: str, timeout: float = 30.0, retries: int = 2) -> None:
        url = url.rstrip("/")
        self.endpoint = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout = timeout
        self.retries = retries
        host = urllib.parse.urlsplit(self.endpoint).hostname or ""
        # never route a loopback service through an HTTP proxy from the environment
        self._opener = (urllib.request.build_opener(urllib.request.ProxyHandler({}))
                        if host in _LOOPBACK else urllib.request.build_opener())

    @staticmethod
    def _error_message(e: urllib.error.HTTPError) -> str:
        try:
            raw = e.read(4096)
        except (OSError, ValueError):
            raw = b""
        try:
            payload = json.loads(raw)
            if isinstance(payload, dict) and isinstance(payload.get("error"), str):
                return payload["error"]
        except ValueError:
            pass
        return repr(raw[:200])

    def batch_search(self, queries: Sequence[str], k: int = 3) -> list[list[dict]]:
        k = check_topk(k)
        if not queries:
            return []
        body = json.dumps({"queries": [str(q) for q in queries], "topk": k, "return_scores": True}).encode()
        last: Optional[Exception] = None
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.endpoint, data=body,
                                         headers={"Content-Type": "application/json"}, method="POST")
            try:
                with self._opener.open(req, timeout=self.timeout) as resp:
                    payload = json.loads(resp.read())
                break
            except urllib.error.HTTPError as e:
                if 400 <= e.code < 500:
                    raise RuntimeError(f"retriever {self.endpoint} rejected the request: "
                                       f"{e.code} {self._error_message(e)}")
                last = e
            except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
                last = e
            if attempt < self.retries:
                time.sleep(0.2 * (attempt + 1))
        else:
            raise ConnectionError(f"retriever {self.endpoint} unreachable: {last}")
        out = []
        for hits in payload.get("result", []):
            row = []
            for h in hits:
                doc = h.get("document", h) if isinstance(h, dict) else {}
                title, text = doc.get("title"), doc.get("text")
                if title is None or text is None:
                    title, text = _split_contents(str(doc.get("contents", "")))
                row.append({"id": doc.get("id"), "title": title, "text": text,
                            "contents": doc.get("contents") or f'"{title}"\n{text}',
                            "score": h.get("score") if isinstance(h, dict) else None})
            out.append(row)
        return out

    def search(self, query: str, k: int = 3) -> list[dict]:
        return self.batch_search([query], k)[0]


def make_retriever(spec: Union[str, Retriever]) -> Retriever:
    """A retriever from a spec: an object (returned as is), an ``http://`` URL (client), or a
    corpus path (in-process BM25)."""
    if not isinstance(spec, str):
        return spec
    if spec.startswith(("http://", "https://")):
        return RetrieverClient(spec)
    return BM25Retriever(spec)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m emapg_megatron.tasks.retriever",
                                 description="Serve a BM25 retriever over HTTP on 127.0.0.1.")
    ap.add_argument("--corpus", required=True, help="passage corpus (jsonl)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1", help="loopback only")
    ap.add_argument("--max-body", type=int, default=DEFAULT_MAX_BODY,
                    help="largest request body in bytes (larger: 413)")
    ap.add_argument("--max-topk", type=int, default=DEFAULT_MAX_TOPK, help="largest topk a request may ask for")
    ap.add_argument("--max-queries", type=int, default=DEFAULT_MAX_QUERIES, help="most queries per request")
    ap.add_argument("--max-query-chars", type=int, default=DEFAULT_MAX_QUERY_CHARS,
                    help="longest query in characters")
    ap.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                    help="seconds a connection has, once ready for a request, to send all of it "
                         "(line, headers, body; a deadline, not a per-read timeout): a late "
                         "request gets a 408, an idle connection is closed")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    if args.host not in _LOOPBACK:
        ap.error(f"--host must be a loopback address (127.0.0.1), not {args.host!r}")
    try:
        retr = BM25Retriever(args.corpus)
        srv = RetrieverServer(retr, host=args.host, port=args.port, max_body=args.max_body,
                              max_topk=args.max_topk, max_queries=args.max_queries,
                              max_query_chars=args.max_query_chars, request_timeout=args.request_timeout)
    except (ImportError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"serving {len(retr)} passages at {srv.url}/retrieve", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv._httpd.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
