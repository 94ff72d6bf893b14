"""BM25 retrieval (``bm25s``) over a passage corpus, on CPU, in process."""
from __future__ import annotations

import importlib.util
import os
import threading
from typing import Optional, Sequence, Union

from .corpus import load_corpus

__all__ = ["BM25Retriever", "require_bm25s"]


def require_bm25s() -> None:
    if importlib.util.find_spec("bm25s") is None:
        raise ImportError(
            "BM25 retrieval needs bm25s: pip install 'emapg-megatron[search]' (or pip install bm25s)"
        )


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
