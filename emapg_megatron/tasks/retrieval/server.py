"""The retriever behind a tiny HTTP service (stdlib ``http.server``, bound to loopback only),
so that many trainer / rollout processes share one index.

The server validates every request and answers a bad one with ``{"error": message}`` and a 4xx
status, and keeps serving: 411 without a ``Content-Length``, 400 for a malformed one, 413 for a
body over ``max_body`` (1 MiB by default), 408 for a request (line, headers and body together)
not received within ``request_timeout`` of the connection being ready for it (an idle connection
is closed without a reply), 400 for ``topk`` or ``queries`` that
:func:`~.protocol.parse_retrieve_request` refuses.
"""
from __future__ import annotations

import io
import json
import logging
import math
import numbers
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from .corpus import Retriever
from .protocol import (
    DEFAULT_MAX_QUERIES,
    DEFAULT_MAX_QUERY_CHARS,
    DEFAULT_MAX_TOPK,
    LOOPBACK,
    RequestError,
    brief,
    parse_retrieve_request,
)

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_BODY", "DEFAULT_REQUEST_TIMEOUT", "LISTEN_BACKLOG", "RetrieverServer"]

#: Largest request body the server reads (bytes); a larger ``Content-Length`` gets a 413.
DEFAULT_MAX_BODY = 1 << 20
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
            raise RequestError(400, f"invalid Content-Length {brief(text)}: must be a non-negative integer")
        max_body = self.server.max_body
        text = text.lstrip("0") or "0"
        if len(text) > len(str(max_body)) or int(text) > max_body:
            raise RequestError(413, f"request body too large: Content-Length {brief(text)} > {max_body} bytes")
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
        if host not in LOOPBACK:
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
