"""Ctrl-C (issue 39, item 4), under `emapg-train` and plain torchrun, with real launches: a first
Ctrl-C is said at once, in one line for the run, and the run still saves (the checkpoint writers
Megatron starts are not killed with the ranks' stop signal); a second one stops the run at once,
names the last complete checkpoint and leaves no half-written step for a later --load."""

import os
import signal
import subprocess
import sys
import time

import pytest

from emapg_megatron.multiprocess import free_port

pytestmark = [pytest.mark.slow, pytest.mark.one_suite("mcore019")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
TRAIN = ["--preset", "tiny-cpu", "--train-iters", "400", "--save-interval", "2"]


def _start(cmd: list, tmp_path):
    err = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=err, text=True, start_new_session=True)
    return proc, err


def _wait_for_step(proc, step: int, timeout: float = 240.0) -> None:
    """Read the progress lines until step ``step`` has been logged (its checkpoint written before)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(f"step {step:5d}/"):
            return
        assert line or proc.poll() is None, "the run ended before the step"
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _finish(proc, err) -> tuple[int, str, str]:
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err.seek(0)
    return proc.returncode, out, err.read()


def _emapg_train(tmp_path):
    return _start([sys.executable, "-m", "emapg_megatron.launch", "--nproc-per-node", "2", "--master-port",
                   str(free_port()), *TRAIN, "--save", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "log")],
                  tmp_path)


def _said_within(err, text: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        err.seek(0)
        if text in err.read():
            return True
        time.sleep(0.1)
    return False


def test_ctrl_c_is_said_at_once_and_the_run_saves_with_its_writers_alive(tmp_path):
    proc, err = _emapg_train(tmp_path)
    _wait_for_step(proc, 5)  # checkpoints at 2 and 4: Megatron's writer processes exist
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    assert _said_within(err, "Ctrl-C (SIGINT) received: each rank finishes the step it is in, saves a "
                             f"checkpoint in {tmp_path / 'ckpt'} and stops; Ctrl-C again stops at once", 5.0)
    code, out, stderr = _finish(proc, err)
    assert code == 130, stderr
    assert stderr.count("received") == 1 and "Traceback" not in stderr and "error" not in stderr, stderr
    step = int(open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read())
    assert step >= 5 and f"signal received: stopped after step {step}" in out
    assert not [n for n in os.listdir(tmp_path / "ckpt") if n.endswith(".tmp")]


def test_a_second_ctrl_c_stops_at_once_and_names_the_last_checkpoint(tmp_path):
    proc, err = _emapg_train(tmp_path)
    _wait_for_step(proc, 3)
    os.killpg(proc.pid, signal.SIGINT)
    assert _said_within(err, "Ctrl-C (SIGINT) received", 5.0)
    os.killpg(proc.pid, signal.SIGINT)
    code, _, stderr = _finish(proc, err)
    assert code == 130 and "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    ckpt = tmp_path / "ckpt"
    step = int(open(ckpt / "latest_checkpointed_iteration.txt").read())
    assert lines == [f"error: stopped at once by a second Ctrl-C (SIGINT), without a checkpoint of this "
                     f"step; the last complete checkpoint: {ckpt}/iter_{step:07d}"], stderr
    assert not [n for n in os.listdir(ckpt) if n.endswith(".tmp")]  # nothing a later --load trips on
    time.sleep(2)
    alive = subprocess.run(["pgrep", "-f", str(ckpt)], capture_output=True, text=True).stdout.split()
    assert alive == [], "processes of the run are left"


def test_under_plain_torchrun_rank_0_says_it_once(tmp_path):
    proc, err = _start([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "emapg_megatron.train", "--preset", "tiny-cpu", "--train-iters",
                        "400", "--save", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "log")], tmp_path)
    _wait_for_step(proc, 3)
    for rank in _ranks(proc.pid):  # the rank processes alone, as `kill -TERM <pid>` of them would
        os.kill(rank, signal.SIGTERM)
    assert _said_within(err, "SIGTERM received: finishing step", 5.0)
    code, out, stderr = _finish(proc, err)
    assert stderr.count("SIGTERM received: finishing step") == 1, stderr
    assert f"then saving a checkpoint in {tmp_path / 'ckpt'} and stopping" in stderr
    assert "signal received: stopped after step" in out


def _ranks(agent: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(agent).children() if "emapg_megatron.train" in " ".join(p.cmdline())]
