"""The ``mcore`` marker is computed from the imports (tests/mcore_marker.py): a module is marked
when its imports reach megatron-core, through helpers, the package's modules, function-local and
lazy imports, and the programs it starts; tests/run.sh's 0.19.2 suite selects on it."""

import os
import subprocess
import sys

import pytest
from mcore_marker import megatron_chain, reaches_megatron

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


@pytest.mark.parametrize("module", ["kl/test_kl_fdiv.py", "kl/test_kl_topk.py", "kl/test_kl_sampled.py",
                                    "kl/test_kl_sequence.py", "kl/test_kl_extreme.py",
                                    "tasks/test_tasks_math.py", "test_docker.py", "test_layers.py"])
def test_modules_that_never_import_megatron_core_are_not_marked(module):
    assert not reaches_megatron(os.path.join(TESTS, module)), megatron_chain(os.path.join(TESTS, module))


@pytest.mark.parametrize("module", [
    "training/test_trainer.py",
    "test_launch.py",
    "kl/test_kl_registry.py",  # in kl/, but it imports emapg_megatron.parallel (megatron's TP ops)
    "test_examples_dry_run.py",  # imports nothing of the package: runs the example scripts
])
def test_modules_that_reach_megatron_core_are_marked(module):
    chain = megatron_chain(os.path.join(TESTS, module))
    assert chain and chain[-1].split(".")[0] == "megatron", chain


@pytest.mark.parametrize("source, marked", [
    ("import math\nfrom emapg_megatron.kl import exact_kl\n", False),
    ("def f():\n    from emapg_megatron import runtime\n", True),  # function-local; lazy in the package
    ("from emapg_megatron.runtime import initialize\n", True),  # a name the package loads lazily
    # a light submodule of that package: importing it runs runtime/__init__, not its __getattr__
    ("from emapg_megatron.runtime.environment import environment\n", False),
    ("def f():\n    from trainer_launch import torchrun\n", True),  # a helper, by bare name
    ("from .sibling import x\n", False),  # a relative import outside the repository resolves to nothing
    ("import importlib\nimportlib.import_module('megatron.core')\n", True),
    ("CMD = ['python', '-m', 'emapg_megatron.train']\n", True),  # a program the test starts
    ("SCRIPT = 'tiny_cpu.sh'\n", True),  # examples/tiny_cpu.sh: python -m emapg_megatron.launch
    ("NAME = 'megatron-core'\n", False),  # a distribution name, not a module
])
def test_the_import_graph_is_followed_statically(tmp_path, source, marked):
    path = tmp_path / "test_synthetic.py"
    path.write_text(source)
    assert reaches_megatron(str(path)) is marked


def test_collection_marks_modules_and_minus_m_mcore_selects_them():
    """conftest.py marks at collection, before ``-m`` selects (this module is marked: its strings
    name programs that import megatron-core; kl/test_kl_fdiv.py is not)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-m", "mcore", "tests/kl/test_kl_fdiv.py", "tests/test_mcore_marker.py"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    assert ids and all(i.startswith("tests/test_mcore_marker.py::") for i in ids)
    assert "deselected" in r.stdout


def test_every_test_of_this_session_is_marked_as_its_module_reaches_megatron_core(request):
    for item in request.session.items:
        assert (item.get_closest_marker("mcore") is not None) == reaches_megatron(str(item.path)), item.nodeid
