"""The client of the retriever service (:mod:`.server`, or a Search-R1 e5/faiss retrieval server)."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Optional, Sequence

from .corpus import split_contents
from .protocol import LOOPBACK, check_topk

__all__ = ["RetrieverClient"]


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
                        if host in LOOPBACK else urllib.request.build_opener())

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
                    title, text = split_contents(str(doc.get("contents", "")))
                row.append({"id": doc.get("id"), "title": title, "text": text,
                            "contents": doc.get("contents") or f'"{title}"\n{text}',
                            "score": h.get("score") if isinstance(h, dict) else None})
            out.append(row)
        return out

    def search(self, query: str, k: int = 3) -> list[dict]:
        return self.batch_search([query], k)[0]
