"""tests/run.sh: paths given replace the default `tests`, options pass through; the second
megatron-core suite runs only the tests marked mcore. Run in a copy of the scripts with fake
interpreters (shell scripts that record their arguments): no install, no pytest."""

import configparser
import os
import shutil
import stat
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("tests/run.sh", "tools/install_cpu.sh", "tools/python.sh", "setup.py", "pytest.ini")

FAKE = """#!/usr/bin/env bash
case "$*" in
  *sys.prefix*) echo "$(dirname "$(dirname "$0")")" ;;
  *sys.executable*) echo "$0" ;;
  *'version("megatron-core")'*) echo "{mcore}" ;;
  *python_version*) echo "{python}" ;;
  "-m pytest "*) echo "$EMAPG_SUITE" > "{log}.suite"
                 printf '%s\\n' "$@" > "{log}.$$"; mv "{log}.$$" "{log}"; exit {pytest_exit} ;;
esac
exit 0
"""


def _fake(path, log, mcore, python, pytest_exit=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(FAKE.format(log=log, mcore=mcore, python=python, pytest_exit=pytest_exit))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _run_sh(tmp_path, *args, suites, failing_019=False, expect=0, **env_extra):
    """tests/run.sh ARGS in a copy of the repository's scripts; the pytest argv of each suite."""
    repo = tmp_path / "repo"
    for name in SCRIPTS:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), repo / name)
    logs = {"mcore016": tmp_path / "argv016", "mcore019": tmp_path / "argv019"}
    _fake(repo / ".venv" / "bin" / "python", logs["mcore016"], "0.16.1", "3.11.7")
    _fake(repo / ".venv-mcore019" / "bin" / "python", logs["mcore019"], "0.19.2", "3.12.3", 5 if failing_019 else 0)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV", "VENV", "BASE_PYTHON",
                                                            "MCORE_VERSION", "SUITES")}
    env.update(SUITES=suites, PYTHON312=str(repo / ".venv-mcore019" / "bin" / "python"), **env_extra)
    r = subprocess.run(["bash", str(repo / "tests" / "run.sh"), *args], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == expect, r.stderr
    return {name: log.read_text().splitlines()[2:] if log.exists() else None for name, log in logs.items()}


def test_paths_given_replace_the_default_and_options_pass_through(tmp_path):
    argv = _run_sh(tmp_path, "tests/kl", "-q", "-k", "topk", suites="mcore016")
    assert argv["mcore019"] is None
    assert argv["mcore016"][-4:] == ["tests/kl", "-q", "-k", "topk"]
    assert "tests" not in argv["mcore016"]  # the default is pytest.ini's testpaths: only without paths


def test_without_paths_pytest_runs_the_default_folder(tmp_path):
    argv = _run_sh(tmp_path, "--junitxml=/tmp/x.xml", suites="mcore016")
    assert not [a for a in argv["mcore016"] if not a.startswith("-") and "=" not in a
                and not a.isdigit() and a != "no:cacheprovider"]  # no path: testpaths applies
    ini = configparser.ConfigParser()
    ini.read(os.path.join(ROOT, "pytest.ini"))
    assert ini["pytest"]["testpaths"].split() == ["tests"]


def test_the_second_release_runs_only_the_mcore_tests(tmp_path):
    argv = _run_sh(tmp_path, "tests/training", suites="mcore016 mcore019")
    assert "mcore" not in argv["mcore016"]
    assert argv["mcore019"][-3:] == ["tests/training", "-m", "mcore"]
    argv = _run_sh(tmp_path, "-m", "not slow", "tests/kl", suites="mcore019")
    assert argv["mcore019"][-3:] == ["tests/kl", "-m", "mcore and (not slow)"]


def test_both_suites_run_side_by_side_or_in_turn_and_either_failing_fails_the_run(tmp_path):
    for parallel in ("1", "0"):
        argv = _run_sh(tmp_path / parallel, "tests/kl", suites="mcore016 mcore019", failing_019=True, expect=1,
                       SUITES_PARALLEL=parallel)
        assert argv["mcore016"][-1] == "tests/kl" and argv["mcore019"][-3:] == ["tests/kl", "-m", "mcore"]


def test_each_suite_names_itself_and_a_one_suite_launch_runs_only_in_its_suite(tmp_path):
    _run_sh(tmp_path, "tests/kl", suites="mcore016 mcore019")
    for name, log in (("mcore016", "argv016"), ("mcore019", "argv019")):
        assert (tmp_path / f"{log}.suite").read_text().strip() == name
    # conftest.py drops, under EMAPG_SUITE, the tests marked one_suite(another suite)
    collected = {}
    for suite in ("mcore016", "mcore019", ""):
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                            "tests/test_stop_signals.py"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "EMAPG_SUITE": suite})
        collected[suite] = sum("::" in line for line in r.stdout.splitlines())
    assert collected["mcore016"] == 0 and collected["mcore019"] == collected[""] >= 3
