"""Dense retrieval: e5 embeddings and a faiss index (optional: needs faiss and transformers)."""
from __future__ import annotations

import importlib.util
import threading
from typing import Sequence

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from .corpus import load_corpus

__all__ = ["DenseRetriever"]


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
