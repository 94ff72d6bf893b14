"""``emapg-evaluate``: every bad value is one ``error:`` line with exit code 2 before any work (no
traceback), its inputs are read only if they are regular files, and scoring says how far it is
(issue 40 items 4, 10 and 10d)."""

import contextlib
import io
import os
import resource
import subprocess
import sys

import pytest

from emapg_megatron import evaluate

pytest.importorskip("math_verify")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
S = os.path.join(ROOT, "data", "samples")
DATA, RESPONSES = os.path.join(S, "math.jsonl"), os.path.join(S, "math_responses.jsonl")


def argv(out, *extra, data=DATA, responses=RESPONSES):
    return ["--task", "math", "--data-path", str(data), "--responses", str(responses),
            "--num-samples-per-prompt", "4", "--out", str(out), "--workers", "1", *map(str, extra)]


def evaluate_here(args):
    """(exit code, stderr) of emapg-evaluate in this process."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = evaluate.main(args)
    return code, err.getvalue()


@pytest.mark.parametrize("extra, line", [
    (["--k", "abc"], "error: --k must be comma-separated integers (got 'abc')"),
    (["--k", "0"], "error: --k values must lie in 1..4 (--num-samples-per-prompt; got '0')"),
    (["--k", "1,64"], "error: --k values must lie in 1..4 (--num-samples-per-prompt; got '1,64')"),
    (["--k", ","], "error: --k values must lie in 1..4 (--num-samples-per-prompt; got ',')"),
    (["--timeout", "-5"], "error: --timeout must be > 0 (got -5.0)"),
    (["--workers", "0"], "error: --workers must be >= 1 (got 0)"),
])
def test_bad_values_are_one_line(extra, line, tmp_path):
    code, err = evaluate_here(argv(tmp_path / "out", *extra))
    assert (code, err.strip()) == (2, line)
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_or_cannot_be_made_is_one_line_before_scoring(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    code, err = evaluate_here(argv(taken))
    assert (code, err.strip()) == (2, f"error: --out {taken} is a file, not a folder")
    assert taken.read_text() == "mine"
    code, err = evaluate_here(argv("/proc/emapg-eval"))
    assert (code, err.strip()) == (2, "error: --out /proc/emapg-eval: cannot make the folder (No such file or directory)")


def test_responses_that_are_a_folder_is_one_line(tmp_path):
    code, err = evaluate_here(argv(tmp_path / "out", responses=tmp_path))
    assert (code, err.strip()) == (2, f"error: --responses cannot read {tmp_path}: it is a directory, not a "
                                      "regular file")


def _cap_memory():
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.parametrize("which, kind", [("responses", "fifo"), ("data", "fifo"), ("data", "dev_zero"),
                                         ("responses", "dev_zero")])
def test_a_named_pipe_or_a_device_is_refused_without_reading_it(which, kind, tmp_path):
    """In a child (capped at 4 GiB, with a timeout): a pipe blocked the read, /dev/zero never ended."""
    path = tmp_path / ("data.jsonl" if which == "data" else "responses.jsonl")
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    args = argv(tmp_path / "out", **{which: path})
    r = subprocess.run([sys.executable, "-m", "emapg_megatron.evaluate", *args], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, preexec_fn=_cap_memory)
    what = "a named pipe (FIFO)" if kind == "fifo" else "a device or socket"
    flag = "--responses " if which == "responses" else ""
    assert r.returncode == 2 and r.stderr.strip() == (f"error: {flag}cannot read {path}: it is {what}, not a "
                                                      "regular file"), r.stderr


def test_scoring_reports_its_progress(tmp_path):
    code, err = evaluate_here(argv(tmp_path / "out"))
    assert code == 0
    assert "scored 144/144 responses (100%)" in err
