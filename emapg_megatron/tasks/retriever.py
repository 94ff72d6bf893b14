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

Run a server: ``python -m emapg_megatron.tasks.retriever --corpus data/samples/corpus.jsonl
--port 8000``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional, Protocol, Sequence, Union

logger = logging.getLogger(__name__)

__all__ = [
    "Retriever",
    "BM25Retriever",
    "DenseRetriever",
    "RetrieverServer",
    "RetrieverClient",
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

    Lines that are not JSON objects with ``contents`` or ``text`` are reported (index and count)
    and skipped.
    """
    passages: list[dict] = []
    bad: list[int] = []
    with open(path, "r", encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad.append(i)
                continue
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
        import torch
        from transformers import AutoModel, AutoTokenizer

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
        import numpy as np

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


class _Handler(BaseHTTPRequestHandler):
    server_version = "emapg-retriever/1"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet
        logger.debug("retriever %s - " + fmt, self.address_string(), *args)

    def _send(self, code: int, payload: Any) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        if self.path.rstrip("/") == "/health":
            self._send(200, {"ok": True, "passages": len(getattr(self.server.retriever, "passages", []))})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/retrieve":
            self._send(404, {"error": "not found"})
            return
        try:
            n = int(self.headers.get("Content-Length", "0"))
            if n > self.server.max_body:
                self._send(413, {"error": "request too large"})
                return
            req = json.loads(self.rfile.read(n) or b"{}")
            queries = req.get("queries")
            if isinstance(queries, str):
                queries = [queries]
            if not isinstance(queries, list):
                raise ValueError("'queries' must be a list of strings")
            k = int(req.get("topk", req.get("k", 3)))
            return_scores = bool(req.get("return_scores", True))
        except (ValueError, TypeError) as e:
            self._send(400, {"error": str(e)})
            return
        try:
            results = self.server.retriever.batch_search([str(q) for q in queries], k)
        except Exception as e:  # keep serving
            logger.exception("retrieval failed")
            self._send(500, {"error": f"{type(e).__name__}: {e}"})
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


class RetrieverServer:
    """Serve a retriever over HTTP on the loopback interface, in a background thread.

    ``port=0`` picks a free port; read it back from ``.port`` / ``.url``.
    """

    def __init__(self, retriever: Retriever, host: str = "127.0.0.1", port: int = 0,
                 max_body: int = 1 << 22) -> None:
        if host not in _LOOPBACK:
            raise ValueError(f"the retriever service binds to loopback only (127.0.0.1), not {host!r}")
        if host == "localhost":
            host = "127.0.0.1"
        server_cls = ThreadingHTTPServer
        if ":" in host:
            import socket

            class _V6(ThreadingHTTPServer):
                address_family = socket.AF_INET6

            server_cls = _V6
        self._httpd = server_cls((host, port), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.retriever = retriever  # type: ignore[attr-defined]
        self._httpd.max_body = max_body  # type: ignore[attr-defined]
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
    """Client for :class:`RetrieverServer` (or a Search-R1 retrieval server)."""

    def __init__(self, url: str, timeout: float = 30.0, retries: int = 2) -> None:
        url = url.rstrip("/")
        self.endpoint = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout = timeout
        self.retries = retries
        host = urllib.parse.urlsplit(self.endpoint).hostname or ""
        # never route a loopback service through an HTTP proxy from the environment
        self._opener = (urllib.request.build_opener(urllib.request.ProxyHandler({}))
                        if host in _LOOPBACK else urllib.request.build_opener())

    def batch_search(self, queries: Sequence[str], k: int = 3) -> list[list[dict]]:
        if not queries:
            return []
        body = json.dumps({"queries": list(queries), "topk": int(k), "return_scores": True}).encode()
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
                    raise RuntimeError(f"retriever {self.endpoint} rejected the request: {e.code} {e.read()[:200]!r}")
                last = e
            except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
                last = e
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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    if args.host not in _LOOPBACK:
        ap.error(f"--host must be a loopback address (127.0.0.1), not {args.host!r}")
    try:
        retr = BM25Retriever(args.corpus)
        srv = RetrieverServer(retr, host=args.host, port=args.port)
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
