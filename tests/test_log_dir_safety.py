"""A run's ``--log-dir`` is its own: one run at a time writes it, and a full disk leaves whole lines
(issue 40 items 2 and 3).

* Two runs with one ``--log-dir`` (and different ``--save``) both appended to one metrics.jsonl
  (steps 1, 2, 1, 3, 2, 4, ...); ``--overwrite`` deleted the metrics of a run still writing them.
  The log dir now has the one-run lock ``--save`` has.
* On a full disk the run stopped with its line, then the metrics logger's close flushed the failed
  write again (an ``OSError`` traceback on rank 0) and metrics.jsonl ended in a partial line.
"""

import fcntl
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.one_suite("mcore016")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")


def hold_lock(folder) -> int:
    """Take the one-run lock of ``folder`` as a live run does (a POSIX record lock on
    ``.emapg-run.lock`` holding its pid): the open file, closed by the caller."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".emapg-run.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"pid {os.getpid()} on testhost\n".encode())
    return fd


def train(*argv):
    """A one-process emapg-train run of the tiny preset: (exit code, stderr)."""
    r = subprocess.run([sys.executable, "-m", "emapg_megatron.train", "--preset", "tiny-cpu",
                        "--tensor-model-parallel-size", "1", "--train-iters", "2", *map(str, argv)],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    return r.returncode, r.stderr


@pytest.mark.slow
def test_overwrite_deletes_nothing_of_a_live_run(tmp_path):
    log = tmp_path / "log"
    fd = hold_lock(log)
    try:
        (log / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
        code, err = train("--log-dir", log, "--save", tmp_path / "save", "--overwrite")
        assert code == 2 and err.strip().splitlines()[-1] == (
            f"error: --log-dir {log} is in use by another run (pid {os.getpid()} on testhost): two runs "
            "must not write the same metrics"), err
        assert "Traceback" not in err and err.count("error:") == 1
        assert (log / "metrics.jsonl").read_text() == '{"step": 1, "reward_mean": 0.5}\n'
    finally:
        os.close(fd)


@pytest.mark.slow
def test_a_fresh_log_dir_a_live_run_holds_is_refused(tmp_path):
    """Two runs started together: the second finds the log dir locked (no metrics written yet)."""
    log = tmp_path / "log"
    fd = hold_lock(log)
    try:
        code, err = train("--log-dir", log)
        assert code == 2 and f"error: --log-dir {log} is in use by another run" in err, err
        assert not (log / "metrics.jsonl").exists()
    finally:
        os.close(fd)
    code, err = train("--log-dir", log, "--save", tmp_path / "save")  # free again; one folder for both
    assert code == 0, err
    assert [r["step"] for r in map(json.loads, (log / "metrics.jsonl").read_text().splitlines())] == [1, 2]
    code, err = train("--log-dir", log, "--save", log, "--overwrite")  # --save and --log-dir one folder
    assert code == 0, err


FULL_DISK = """
import json, os, resource, signal, sys
from emapg_megatron.run.metrics import MetricsLogger

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
log_dir = sys.argv[1]
logger = MetricsLogger(log_dir, 10)
logger.log(1, {"reward_mean": 0.5, "kl": 0.1})
size = os.path.getsize(os.path.join(log_dir, "metrics.jsonl"))
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 100, resource.RLIM_INFINITY))  # room for part of a line
logger.log(2, {f"metric_{i}": float(i) for i in range(40)})
logger.dump_rollouts(2, [("p" * 50, "r" * 50, 1.0)] * 4)
print(json.dumps({"failure": logger.failure, "curves": logger.close()}))
"""


def test_a_full_disk_leaves_whole_lines_and_closes_without_a_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["failure"].startswith(f"--log-dir {tmp_path}: cannot write the metrics of step 2 (File too large)")
    assert result["curves"] is None and f"warning: --log-dir {tmp_path}: cannot write curves.png" in r.stdout
    data = (tmp_path / "metrics.jsonl").read_bytes()
    assert data.endswith(b"\n") and [json.loads(line)["step"] for line in data.splitlines()] == [1]
    rollouts = tmp_path / "rollouts.jsonl"
    assert not rollouts.exists() or rollouts.read_bytes() == b""  # whole lines or none
