"""``emapg-train`` (emapg_megatron.launch): bad input is one line before any rank starts, a failed
rank is its own line and exit code, Ctrl-C saves and exits 130 without a traceback; a new run
never silently replaces an earlier one's checkpoints or metrics."""

import contextlib
import io
import os
import signal
import subprocess
import sys
import time

import pytest

from emapg_megatron import train
from emapg_megatron.launch import split_argv
from emapg_megatron.multiprocess import free_port

pytestmark = pytest.mark.one_suite("mcore016")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")


def launch(*argv, wait=True):
    cmd = [sys.executable, "-m", "emapg_megatron.launch", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "--preset", "tiny-cpu", *argv]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def in_process(*argv):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), \
            pytest.raises(SystemExit) as e:
        train.main(["--preset", "tiny-cpu", "--tensor-model-parallel-size", "1", *argv])
    return e.value.code, err.getvalue().strip()


def test_launcher_and_trainer_flags_are_told_apart():
    launcher, trainer = split_argv(["--nproc-per-node", "8", "--lr", "1e-6", "--nnodes=2", "--standalone",
                                    "--log-dir", "runs/x", "--master_port", "29501", "--seed", "3"])
    assert launcher == ["--nproc-per-node", "8", "--nnodes=2", "--standalone", "--master_port", "29501"]
    assert trainer == ["--lr", "1e-6", "--log-dir", "runs/x", "--seed", "3"]  # --log-dir is ours


@pytest.mark.launch
def test_bad_input_is_one_line_before_any_rank_starts(tmp_path):
    r = launch("--ema-eta", "2", "--log-dir", str(tmp_path))
    assert r.returncode == 2 and r.stderr.strip() == "error: --ema-eta must be in [0, 1] (got 2.0)", r.stderr
    assert r.stdout == "" and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("argv, line", [
    (["--train-iter", "3"], "error: unrecognized arguments: --train-iter 3 (did you mean --train-iters?)"),
    (["--lr-warmup-steps", "2"], "error: unrecognized arguments: --lr-warmup-steps 2 (did you mean "
                                 "--lr-warmup-iters?)"),
    (["--kl-tail", "bogus"], "error: argument --kl-tail: invalid choice: 'bogus' (choose from 'unbiased', "
                             "'paper', 'none', 'truncate', 'renorm')"),
])
def test_no_prefix_matching_and_a_hint_for_unknown_flags(argv, line):
    assert in_process("--dry-run", *argv) == (2, line)


@pytest.mark.slow
@pytest.mark.launch
def test_a_failed_run_is_one_line_and_the_ranks_exit_code(tmp_path):
    r = launch("--train-iters", "4", "--lr", "1e30", "--clip-grad", "0", "--log-dir", str(tmp_path))
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: stopping after step 1: the weights are exploded (max |w| = 1e+30 > 1e+06); no checkpoint "
        "written and the EMA anchor not updated from them (lower --lr, or set --clip-grad)"]


@pytest.mark.slow
@pytest.mark.launch
def test_ctrl_c_saves_and_exits_130_without_a_traceback(tmp_path):
    proc = launch("--train-iters", "400", "--log-dir", str(tmp_path / "log"), "--save", str(tmp_path / "ckpt"),
                  wait=False)
    metrics = tmp_path / "log" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: every process of the job
    out, err = proc.communicate(timeout=300)
    # one line, said at once (issue 39: it was nothing until the save ended), and no traceback
    assert proc.returncode == 130 and err.strip() == (
        f"Ctrl-C (SIGINT) received: each rank finishes the step it is in, saves a checkpoint in "
        f"{tmp_path / 'ckpt'} and stops; Ctrl-C again stops at once, without that checkpoint"), err
    step = len(metrics.read_text().splitlines())
    assert f"signal received: stopped after step {step}" in out
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(step)


def test_a_fresh_run_never_replaces_an_earlier_ones_outputs(tmp_path):
    save, log = tmp_path / "ckpt", tmp_path / "log"
    (save / "iter_0000004").mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("4")
    log.mkdir()
    (log / "metrics.jsonl").write_text('{"step": 1}\n')
    code, err = in_process("--save", str(save), "--log-dir", str(tmp_path / "other"))
    assert (code, err) == (2, f"error: --save {save} holds the checkpoints of an earlier run: pass --load {save} "
                              "to resume it, another --save, or --overwrite to delete them and start over")
    code, err = in_process("--log-dir", str(log))
    # this run saves nowhere: nothing to resume, so --load is not suggested (issue 39, item 9)
    assert (code, err) == (2, f"error: --log-dir {log} holds the metrics of an earlier run: pass another "
                              "--log-dir, or --overwrite to delete them and start over")
    assert (save / "iter_0000004").is_dir() and (log / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_overwrite_deletes_only_what_an_earlier_run_wrote(tmp_path):
    from emapg_megatron.run.config import CheckpointConfig, LogConfig
    from emapg_megatron.run.outputs import clear_earlier_run

    save, log = tmp_path / "ckpt", tmp_path / "log"
    for d in ("iter_0000002", "iter_0000004", "iter_0000006.tmp", ".iter_0000004.old-7", "mine"):
        (save / d).mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("4")
    (save / ".emapg-run.lock").write_text("")
    (log / "tensorboard" / "run-1").mkdir(parents=True)
    for name in ("metrics.jsonl", "curves.png", "notes.txt"):
        (log / name).write_text("x")
    clear_earlier_run(CheckpointConfig(save=str(save), overwrite=True), LogConfig(log_dir=str(log)))
    assert sorted(os.listdir(save)) == [".emapg-run.lock", "mine"]
    assert sorted(os.listdir(log)) == ["notes.txt"]


ADOPTION = """
import os, subprocess, sys, time
import psutil
sys.path.insert(0, sys.argv[1])
from emapg_megatron.launch import adopt_orphans, end_descendants

RANK = '''
import os, time
pid = os.fork()
if pid == 0:  # the "writer": outlives its parent, the "rank"
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    time.sleep(120)
    os._exit(0)
print(pid, flush=True)
'''

adopt_orphans()
writer = psutil.Process(int(subprocess.run([sys.executable, "-c", RANK], capture_output=True,
                                           text=True, timeout=60).stdout))
adopted = writer.ppid() == os.getpid()  # re-parented to us, not to init
end_descendants()
writer.wait(timeout=30)
print(adopted, not writer.is_running())
"""


def test_what_a_dead_rank_left_running_is_adopted_and_ended():
    """A rank killed mid-save leaves Megatron's writers and results Manager behind: the launcher
    is their subreaper and ends them with the run (issue 28)."""
    r = subprocess.run([sys.executable, "-c", ADOPTION, ROOT], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["True", "True"], r.stdout + r.stderr


def test_a_ranks_exit_code_wins_over_the_sigterm_torchrun_sent_the_others(capsys):
    """Rank 1 exits 2 (a bad checkpoint, said by rank 0), torchrun then stops rank 0 while it
    tears down: the run exits 2 with no second line about a signal."""
    from types import SimpleNamespace

    from emapg_megatron.launch import failure_code

    failures = {0: SimpleNamespace(exitcode=-15), 1: SimpleNamespace(exitcode=2)}
    assert failure_code(failures) == 2 and capsys.readouterr().err == ""
    assert failure_code({0: SimpleNamespace(exitcode=-9)}) == 1
    assert "rank 0 was stopped by SIGKILL" in capsys.readouterr().err
