import os

import pytest

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
CORPUS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "data", "samples", "corpus.jsonl")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: multi-process or long-running test")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def retriever():
    """The BM25 retriever over the bundled sample corpus (one per test module)."""
    pytest.importorskip("bm25s")
    from emapg_megatron.tasks.retriever import BM25Retriever

    return BM25Retriever(CORPUS)
