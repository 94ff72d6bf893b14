"""tools/install_cpu.sh and tools/python.sh: which interpreter, which torch index, which
megatron-core, visible steps.

A fake interpreter (a shell script that records its arguments) stands in for python: no network,
no install."""

import os
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE = """#!/usr/bin/env bash
echo "$*" >> "{log}"
case "$*" in
  *sys.prefix*) echo "{prefix}" ;;
  *sys.executable*) echo "{prefix}/bin/python" ;;
  *urlopen*) exit {reachable} ;;
  *"import torch, sys"*) exit 1 ;;
  *"import emapg_megatron"*) exit 1 ;;
esac
exit 0
"""


def _fake_python(tmp_path, reachable: bool) -> tuple[str, str]:
    log, prefix = tmp_path / "calls.log", tmp_path / "prefix"
    prefix.mkdir()
    py = tmp_path / "python"
    py.write_text(FAKE.format(log=log, prefix=prefix, reachable=0 if reachable else 1))
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    return str(py), str(log)


# The scripts' settings, which tests/run.sh's second suite sets around pytest: each test sets its own.
SETTINGS = ("VIRTUAL_ENV", "PYTHON", "VENV", "BASE_PYTHON", "MCORE_VERSION", "TORCH_VERSION", "EXTRAS",
            "CPU_INDEX")


def _clean_env(env: dict) -> dict:
    return {**{k: v for k, v in os.environ.items() if k not in SETTINGS}, **env}


def _install(env: dict) -> subprocess.CompletedProcess:
    env = _clean_env(env)
    return subprocess.run(["bash", "tools/install_cpu.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("reachable", [True, False])
def test_torch_comes_from_the_cpu_index_when_it_is_reachable(tmp_path, reachable):
    py, log = _fake_python(tmp_path, reachable)
    r = _install({"PYTHON": py, "CPU_INDEX": "https://cpu.example/whl"})
    assert r.returncode == 0, r.stderr
    torch_install = [c for c in open(log).read().splitlines() if c.startswith("-m pip install -q torch==")]
    assert len(torch_install) == 1
    assert ("--index-url https://cpu.example/whl" in torch_install[0]) == reachable
    assert "install_cpu: torch" in r.stderr and "install_cpu: done in" in r.stderr  # visible steps
    # idempotent: the stamp in the interpreter's prefix says what is installed
    assert (tmp_path / "prefix" / ".emapg-install-stamp").read_text().strip().endswith("torch==2.13.0")


def test_megatron_core_is_pinned_when_asked(tmp_path):
    """tests/run.sh's second suite: MCORE_VERSION pins megatron-core in the package's install."""
    py, log = _fake_python(tmp_path, reachable=False)
    r = _install({"PYTHON": py, "MCORE_VERSION": "0.19.2"})
    assert r.returncode == 0, r.stderr
    package = [c for c in open(log).read().splitlines() if c.startswith("-m pip install -q -e")]
    assert package == ["-m pip install -q -e .[test,math,search,wandb] megatron-core==0.19.2"]
    stamp = (tmp_path / "prefix" / ".emapg-install-stamp").read_text().strip()
    assert stamp.endswith("torch==2.13.0 megatron-core==0.19.2")  # another pin reinstalls


def test_the_interpreter_is_python_or_the_active_venv_or_dot_venv(tmp_path):
    def which(**env):
        env = _clean_env(env)
        return subprocess.run(["bash", "tools/python.sh", *env.pop("_args", [])], cwd=ROOT, env=env,
                              capture_output=True, text=True).stdout.strip()

    assert which(PYTHON="/opt/py/bin/python3", VIRTUAL_ENV="/v") == "/opt/py/bin/python3"
    assert which(VIRTUAL_ENV="/v") == "/v/bin/python"
    assert which(_args=["--for-install"]) == os.path.join(ROOT, ".venv", "bin", "python")
    assert which(VENV=".venv-mcore019", _args=["--for-install"]) == os.path.join(
        ROOT, ".venv-mcore019", "bin", "python")  # tests/run.sh's second environment
    assert which(VENV="/v2", _args=["--for-install"]) == "/v2/bin/python"
    expected = os.path.join(ROOT, ".venv", "bin", "python") if os.path.exists(
        os.path.join(ROOT, ".venv", "bin", "python")) else "python3"
    assert which() == expected


INSTALLED = """#!/usr/bin/env bash
echo "$*" >> "{log}"
case "$*" in
  *sys.prefix*) echo "{prefix}" ;;
  *sys.executable*) echo "{prefix}/bin/python" ;;
esac
exit 0
"""


@pytest.mark.parametrize("settings", [{}, {"MCORE_VERSION": "0.19.2"}], ids=["mcore016", "mcore019"])
def test_a_second_run_installs_nothing(tmp_path, settings):
    """tests/run.sh installs before each suite: in an environment the first run completed (its
    stamp matches, the package imports), a re-run installs nothing, in either suite's environment
    (./.venv, or VENV=.venv-mcore019 with its megatron-core pin)."""
    prefix, log = tmp_path / "venv", tmp_path / "calls.log"
    (prefix / "bin").mkdir(parents=True)
    py = prefix / "bin" / "python"
    py.write_text(INSTALLED.format(log=log, prefix=prefix))
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    first = _install({"VENV": str(prefix), **settings})
    assert first.returncode == 0, first.stderr
    assert any(c.startswith("-m pip install") for c in open(log).read().splitlines())
    log.write_text("")
    again = _install({"VENV": str(prefix), **settings})
    assert again.returncode == 0 and again.stderr == "", again.stderr
    assert not [c for c in open(log).read().splitlines() if "pip" in c]
