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
    config.addinivalue_line("markers", "one_suite(name): real launches that test our own process handling "
                                       "(signals, the launcher, locks, exit codes) or scripts (the examples' "
                                       "dry runs, the GPU rehearsal), which do not depend on megatron-core's "
                                       "version: tests/run.sh runs them in suite `name` only "
                                       "(the launches are a third of each suite's time); plain pytest runs it")


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
    _keep_this_suites_launches(config, items)
    _skip_gpu_tests(items)


def _keep_this_suites_launches(config, items):
    """Under tests/run.sh (EMAPG_SUITE names the suite), drop the tests marked for the other suite."""
    suite = os.environ.get("EMAPG_SUITE")
    if not suite:
        return
    other = [i for i in items if (m := i.get_closest_marker("one_suite")) and m.args[0] != suite]
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = [i for i in items if i not in other]


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


# --- shared by several modules: built or run once per session ----------------------------------
@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory):
    """``tiny_hf.build_tiny_hf``'s folder (a tiny Qwen2 model and its byte-level BPE tokenizer),
    built once for every module that reads it; a test that changes files works on a copy."""
    from tiny_hf import build_tiny_hf

    return build_tiny_hf(str(tmp_path_factory.mktemp("tiny_hf")))


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """The equivalence matrix's architectures (``test_equivalence_matrix.ARCHS``, seeded weights)
    as tiny HF folders, built once for it, the fused-LM-head and the distillation tests."""
    from test_equivalence_matrix import ARCHS, build_hf_model

    return {a: build_hf_model(tmp_path_factory.mktemp(a), a) for a in ARCHS}


@pytest.fixture(scope="session")
def trainer_steps():
    """``train_run_workers.train_steps`` on forked ranks, each distinct run once per session (the
    equivalence matrix and the fused-LM-head test take some of the same runs): ``run(nproc, argv,
    steps, tp=1, pp=1, ep=1, export_hf=False)`` -> each rank's result. Callers only read the results."""
    from train_run_workers import train_steps

    from emapg_megatron.multiprocess import run_distributed

    done = {}

    def run(nproc, argv, steps, tp=1, pp=1, ep=1, timeout=600, export_hf=False):
        key = (nproc, tp, pp, ep, tuple(argv), steps, export_hf)
        if key not in done:
            done[key] = run_distributed(train_steps, nproc, tp=tp, pp=pp, ep=ep,
                                        args=(list(argv), steps, export_hf), timeout=timeout)
        return done[key]

    return run


@pytest.fixture(scope="module")
def retriever():
    """The BM25 retriever over the bundled sample corpus (one per test module)."""
    pytest.importorskip("bm25s")
    from emapg_megatron.tasks.retriever import BM25Retriever

    return BM25Retriever(CORPUS)
