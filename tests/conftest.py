import os
import sys

import pytest

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
TESTS = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(os.path.dirname(TESTS), "data", "samples", "corpus.jsonl")

# Test modules import their helpers by bare module name, also across folders
# (``from megatron_workers import ...`` in tests/anchor, ``from tiny_hf import ...``). Put tests/
# and every subfolder on sys.path before anything is collected, so that this does not depend on
# which files pytest imported first. Ranks started by ``run_distributed`` start with the parent's
# sys.path and re-import their rank function's module by the same name. Module basenames are
# therefore unique across tests/ (pytest's default "prepend" import mode requires that anyway).
for _dir in [TESTS, *sorted(os.path.join(TESTS, d) for d in os.listdir(TESTS)
                            if not d.startswith((".", "_")) and os.path.isdir(os.path.join(TESTS, d)))]:
    if _dir not in sys.path:
        sys.path.insert(0, _dir)


def _check_unique_module_names() -> None:
    seen = {}
    for folder, dirs, files in os.walk(TESTS):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
        for name in files:
            if name.endswith(".py") and name != "conftest.py":
                if name in seen:
                    raise RuntimeError(f"tests/: two modules named {name} ({seen[name]} and {folder}); "
                                       "they are imported by bare name, so names must be unique")
                seen[name] = folder


_check_unique_module_names()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: multi-process or long-running test")
    config.addinivalue_line("markers", "launch: starts the trainer or emapg-train as real processes (torchrun, "
                                       "fresh interpreters): signals, exit codes, the launcher, a smoke run")
    config.addinivalue_line("markers", "mcore: the test module reaches megatron-core through its imports "
                                       "(set by tests/mcore_marker.py, not by hand); tests/run.sh runs only "
                                       "these on the second megatron-core release")


@pytest.hookimpl(tryfirst=True)  # before -m selects on it
def pytest_collection_modifyitems(config, items):
    from mcore_marker import reaches_megatron

    verdicts = {}
    for item in items:
        path = str(item.path)
        if path not in verdicts:
            verdicts[path] = reaches_megatron(path)
        if verdicts[path]:
            item.add_marker(pytest.mark.mcore)
    _skip_gpu_tests(items)


def pytest_collection_finish(session):
    """Remember how many tests this run selected (after -m/-k), said in the summary."""
    items = session.items
    session.config._emapg_counts = (len(items), sum(1 for i in items if i.get_closest_marker("mcore")),
                                    sum(1 for i in items if i.get_closest_marker("launch")))


def pytest_terminal_summary(terminalreporter, config):
    counts = getattr(config, "_emapg_counts", None)
    if counts:
        terminalreporter.write_line(f"tests selected: {counts[0]} ({counts[1]} marked mcore, "
                                    f"{counts[2]} marked launch)")


def _skip_gpu_tests(items):
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
