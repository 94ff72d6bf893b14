"""``python -m emapg_megatron.tasks.retriever``: serve a BM25 retriever over HTTP on 127.0.0.1."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from .bm25 import BM25Retriever
from .protocol import DEFAULT_MAX_QUERIES, DEFAULT_MAX_QUERY_CHARS, DEFAULT_MAX_TOPK, LOOPBACK
from .server import DEFAULT_MAX_BODY, DEFAULT_REQUEST_TIMEOUT, RetrieverServer

__all__ = ["main"]


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
    if args.host not in LOOPBACK:
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
        srv.close()
    return 0
