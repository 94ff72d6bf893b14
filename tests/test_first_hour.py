"""A new user's first hour (issue 39): `emapg-train --help` names the launch flags and answers
without loading torch; a misspelt flag too; `--dry-run` starts no rank and prints a short summary;
a launch without ranks for its layout says how to start them; every example script and tool runs
the project's interpreter (tools/python.sh), not whatever `python3` is first on PATH."""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "megatron", "transformers", "datasets")

# Reports, after a launcher call in a fresh interpreter, which heavy packages it imported.
PROBE = """
import contextlib, io, sys
from emapg_megatron import launch
out, err = io.StringIO(), io.StringIO()
code = 0
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        launch.main(sys.argv[1:])
    except SystemExit as e:
        code = e.code or 0
loaded = sorted({m.split(".")[0] for m in sys.modules} & set(%r))
print(repr((code, out.getvalue(), err.getvalue(), loaded)))
""" % (HEAVY,)


def _probe(*argv):
    r = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return eval(r.stdout.strip().splitlines()[-1])  # noqa: S307  (our own repr)


def test_help_names_the_launch_flags_and_loads_no_torch():
    code, out, _, loaded = _probe("--help")
    assert code == 0 and loaded == []
    for flag in ("--nproc-per-node", "--nnodes", "--node-rank", "--standalone", "--master-addr",
                 "--master-port", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"):
        assert re.search(rf"^\s+{flag}\b", out, re.M), f"{flag} missing from --help"
    assert out.startswith("usage: emapg-train [--nproc-per-node N")
    # (argparse wraps text at hyphens too: compare without any whitespace)
    assert "emapg-train--standalone--nproc-per-node2--presettiny-cpu" in "".join(out.split())


def test_a_misspelt_flag_is_one_line_without_torch():
    code, out, err, loaded = _probe("--standalone", "--nproc-per-node", "2", "--train-iter", "3")
    assert (code, out, loaded) == (2, "", [])
    assert err == "error: unrecognized arguments: --train-iter 3 (did you mean --train-iters?)\n"


def test_a_dry_run_starts_no_rank_and_says_what_would_run(monkeypatch, capsys):
    from emapg_megatron import launch

    def no_ranks(*_):
        raise AssertionError("a dry run started ranks")

    monkeypatch.setattr(launch, "run_ranks", no_ranks)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as e:
        launch.main(["--standalone", "--nproc-per-node", "2", "--preset", "tiny-cpu", "--dry-run"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "WORLD_SIZE" not in os.environ  # the launch's world size was this dry run's only
    lines = out.strip().splitlines()
    assert lines[0] == "dry run: every check passed; nothing was started" and len(lines) <= 12
    assert "world 2 = TP 2 x PP 1 x DP 1" in out and lines[-1] == "(every resolved setting: --dry-run=json)"


def test_a_layout_without_its_ranks_says_how_to_start_them():
    r = subprocess.run([sys.executable, "-m", "emapg_megatron.launch", "--preset", "tiny-cpu"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")})
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: world size 1 is not TP x PP x DP") and "emapg-train --nproc-per-node 2" in line


SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "examples", "*.sh")) + glob.glob(os.path.join(ROOT, "examples", "lib", "*.sh"))
                 + glob.glob(os.path.join(ROOT, "tools", "*.sh")) + glob.glob(os.path.join(ROOT, "docker", "*.sh")))


@pytest.mark.parametrize("script", [os.path.relpath(s, ROOT) for s in SCRIPTS])
def test_scripts_run_the_projects_interpreter(script):
    """No script starts `python3`/`python` from PATH: each asks tools/python.sh (install_cpu.sh makes
    the environment, with the base interpreter it is given)."""
    if script in ("tools/python.sh", "tools/install_cpu.sh"):
        return
    text = open(os.path.join(ROOT, script)).read()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    command = r"(^\s*|\bexec\s+|[;&|]\s*|\$\(\s*)python3?(\s|$)"  # python3 in a command's place
    assert not re.search(command, code, re.M), script
    assert not re.search(r"\$\{PYTHON:-python3?\}", code), script


def test_an_example_runs_the_projects_interpreter_whatever_python3_is(tmp_path):
    """eval_math.sh's dry run with a broken `python3` first on PATH: the project's interpreter
    (here $PYTHON, as tests/run.sh sets it; else ./.venv) still runs it."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("python3", "python"):
        (fake / name).write_text("#!/bin/sh\necho 'the wrong python' >&2\nexit 97\n")
        (fake / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "PYTHON": os.environ.get("PYTHON", sys.executable),
           "DRY_RUN": "1", "CKPT": str(tmp_path / "ckpt"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["bash", "examples/eval_math.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "the wrong python" not in r.stderr
    assert r.stdout.startswith("dry run: python -m emapg_megatron.evaluate --task math --data-path "
                               f"{os.path.join(ROOT, 'data', 'samples', 'math.jsonl')}")


@pytest.mark.parametrize("module", ["emapg_megatron.evaluate", "emapg_megatron.checkpoint.cli"])
def test_the_other_commands_help_loads_no_heavy_package(module):
    probe = (f"import sys, contextlib, io\nfrom {module} import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
             f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY + ('matplotlib',)!r})))")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "[]", r.stdout + r.stderr
