"""Passage retrieval for the search-agent task, one concern per module.

* :mod:`.corpus` - the jsonl corpus, Search-R1's passage rendering, the :class:`Retriever` interface.
* :mod:`.bm25` - :class:`BM25Retriever` (``bm25s``, CPU, in process).
* :mod:`.dense` - :class:`DenseRetriever` (e5 + faiss; optional).
* :mod:`.protocol` - the ``/retrieve`` wire format and its request validation.
* :mod:`.server` - :class:`RetrieverServer`, the loopback HTTP service.
* :mod:`.client` - :class:`RetrieverClient`.
* :mod:`.cli` - ``python -m emapg_megatron.tasks.retriever``.

:mod:`emapg_megatron.tasks.retriever` gathers the public names.
"""
