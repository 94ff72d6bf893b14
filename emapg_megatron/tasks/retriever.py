"""Passage retrieval for the search-agent task: the public names of :mod:`.retrieval`.

* :class:`BM25Retriever` - ``bm25s`` over a local passage corpus (jsonl) on CPU, in process.
* :class:`RetrieverServer` / :class:`RetrieverClient` - the same retriever behind a tiny HTTP
  service (stdlib ``http.server``, bound to 127.0.0.1 only) so that many trainer / rollout
  processes share one index. The wire format is Search-R1's ``/retrieve`` endpoint, so the
  client also talks to a Search-R1 retrieval server (e5 + faiss) unchanged.
* :class:`DenseRetriever` - e5 embeddings + a faiss index, only when ``faiss`` and
  ``transformers`` are installed.
* :func:`make_retriever` - one of them from the trainer's ``--retriever``.

Corpus format: :mod:`.retrieval.corpus`; request validation: :mod:`.retrieval.protocol` and
:mod:`.retrieval.server`.

Run a server: ``python -m emapg_megatron.tasks.retriever --corpus data/samples/corpus.jsonl
--port 8000``.
"""
from __future__ import annotations

from typing import Union

from .retrieval.bm25 import BM25Retriever, require_bm25s
from .retrieval.cli import main
from .retrieval.client import RetrieverClient
from .retrieval.corpus import Retriever, format_passages, load_corpus
from .retrieval.dense import DenseRetriever
from .retrieval.protocol import (
    DEFAULT_MAX_QUERIES,
    DEFAULT_MAX_QUERY_CHARS,
    DEFAULT_MAX_TOPK,
    RequestError,
    check_topk,
    parse_retrieve_request,
)
from .retrieval.server import (
    DEFAULT_MAX_BODY,
    DEFAULT_REQUEST_TIMEOUT,
    LISTEN_BACKLOG,
    RetrieverServer,
)

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
    "main",
    "DEFAULT_MAX_BODY",
    "DEFAULT_MAX_QUERIES",
    "DEFAULT_MAX_QUERY_CHARS",
    "DEFAULT_MAX_TOPK",
    "DEFAULT_REQUEST_TIMEOUT",
    "LISTEN_BACKLOG",
]


def make_retriever(spec: Union[str, Retriever]) -> Retriever:
    """A retriever from a spec: an object (returned as is), an ``http://`` URL (client), or a
    corpus path (in-process BM25)."""
    if not isinstance(spec, str):
        return spec
    if spec.startswith(("http://", "https://")):
        return RetrieverClient(spec)
    return BM25Retriever(spec)


if __name__ == "__main__":
    raise SystemExit(main())
