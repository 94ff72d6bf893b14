"""Nothing of a run outlives the process that started it, and Ctrl-C while the trainer's modules
import is one line (issue 40 items 10b, 11, 12).

torchrun starts each rank in a session of its own: SIGKILL of emapg-train (the launcher), of plain
torchrun or of their process group left both ranks training unsupervised (40/40 steps, writing
checkpoints, holding the --save lock), and ranks still importing alive 430 s later. SIGKILL of one
rank under plain torchrun (the OOM killer) left its save helpers (the results Manager, a spawned
child, the resource tracker) running under init. Each case here is a real 2-rank launch of the tiny
preset; every process of the run carries a tag in its environment, so the test finds them all
(and kills whatever is left, whatever the outcome)."""

import fcntl
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from emapg_megatron.multiprocess import free_port

pytestmark = pytest.mark.one_suite("mcore016")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WITHIN_S = 30  # after the kill, no process of the run may be alive longer


class Run:
    """A 2-rank training run started by ``emapg-train`` or plain ``torchrun``, in a session of its
    own, its temp folder its own."""

    def __init__(self, tmp_path, launcher: str, *flags):
        self.tag = uuid.uuid4().hex
        self.save, self.tmp = tmp_path / "save", tmp_path / "tmp"
        self.tmp.mkdir()
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1", EMAPG_TEST_RUN=self.tag,
                   TMPDIR=str(self.tmp))
        start = ([sys.executable, "-m", "emapg_megatron.launch"] if launcher == "emapg-train" else
                 [sys.executable, "-m", "torch.distributed.run"])
        train = [] if launcher == "emapg-train" else ["-m", "emapg_megatron.train"]
        cmd = [*start, "--nproc-per-node", "2", "--master-port", str(free_port()), *train, "--preset", "tiny-cpu",
               "--train-iters", "400", "--log-dir", str(tmp_path / "log"), *map(str, flags)]
        self.log = open(tmp_path / "output", "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def processes(self) -> list[int]:
        """Every process alive that carries this run's tag (zombies are dead)."""
        mark = f"EMAPG_TEST_RUN={self.tag}".encode()
        found = []
        for name in os.listdir("/proc"):
            try:
                if name.isdigit() and mark in open(f"/proc/{name}/environ", "rb").read():
                    state = open(f"/proc/{name}/stat", "rb").read().rsplit(b")", 1)[1].split()[0]
                    if state not in (b"Z", b"X"):
                        found.append(int(name))
            except OSError:
                pass
        return found

    def ranks(self) -> list[int]:
        """The ranks: the children of the launcher or torchrun (torchrun's agent runs in it)."""
        import psutil

        try:
            return [child.pid for child in psutil.Process(self.proc.pid).children()]
        except psutil.Error:
            return []

    def wait_for(self, ready, what: str, timeout: float = 400):
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                pytest.fail(f"no {what} after {timeout}s (exit {self.proc.poll()}): {self.output()[-2000:]}")
            time.sleep(0.2)

    def wait_for_a_save(self):
        self.wait_for(lambda: (self.save / "latest_checkpointed_iteration.txt").exists(), "checkpoint")
        time.sleep(1.0)  # mid-run: training on after the save

    def left_after_kill(self) -> list[int]:
        """The run's processes still alive :data:`WITHIN_S` seconds after a kill (none, as soon
        as they are gone)."""
        deadline = time.monotonic() + WITHIN_S
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return [f"{pid} {_cmdline(pid)[:120]!r}" for pid in left]

    def output(self) -> str:
        self.log.flush()
        return open(self.log.name).read()

    def end(self):
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.kill()
        self.proc.wait(timeout=60)
        self.log.close()


def _cmdline(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
    except OSError:
        return b""


@pytest.fixture
def runs(tmp_path):
    started = []

    def start(launcher, *flags):
        started.append(Run(tmp_path, launcher, *flags))
        return started[-1]

    yield start
    for run in started:  # whatever happened: nothing of the run stays
        run.end()


def save_lock_is_free(save) -> bool:
    fd = os.open(save / ".emapg-run.lock", os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@pytest.mark.slow
@pytest.mark.parametrize("launcher, target", [("emapg-train", "launcher"), ("torchrun", "launcher"),
                                              ("emapg-train", "process group")])
def test_killing_the_launcher_ends_every_process_of_the_run(launcher, target, runs, tmp_path):
    run = runs(launcher, "--save", tmp_path / "save", "--save-interval", "2")
    run.wait_for_a_save()
    helpers = len(run.processes()) - len(run.ranks()) - 1
    assert len(run.ranks()) == 2 and helpers >= 2, run.processes()  # each rank's save helpers
    if target == "launcher":
        run.proc.kill()
    else:
        os.killpg(run.proc.pid, signal.SIGKILL)
    assert run.left_after_kill() == []
    assert save_lock_is_free(run.save)  # a restart is not refused
    assert not [n for n in os.listdir(run.tmp) if n.startswith("emapg-prompts-")]  # the prompt cache folder


@pytest.mark.slow
def test_ranks_still_importing_end_with_a_killed_torchrun(runs):
    run = runs("torchrun")
    run.wait_for(lambda: len(run.ranks()) == 2, "ranks")
    time.sleep(1.0)  # importing torch and Megatron (seconds)
    run.proc.kill()
    assert run.left_after_kill() == []


@pytest.mark.slow
def test_a_killed_ranks_save_helpers_end_with_it_under_plain_torchrun(runs, tmp_path):
    import psutil

    run = runs("torchrun", "--save", tmp_path / "save", "--save-interval", "2")
    run.wait_for_a_save()
    rank = psutil.Process(max(run.ranks()))
    helpers = rank.children(recursive=True)
    assert len(helpers) >= 2, helpers  # the results Manager (spawned) and the resource tracker
    rank.kill()  # as the OOM killer does
    assert run.left_after_kill() == []  # its helpers, and the rest of the run, which then fails


@pytest.mark.slow
def test_ctrl_c_while_the_modules_import_is_one_line(tmp_path):
    cmd = [sys.executable, "-m", "emapg_megatron.launch", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--preset", "tiny-cpu", "--log-dir", str(tmp_path / "log")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_until_torch_loads(proc.pid)  # then torch and Megatron import (seconds more)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert (proc.returncode, err.strip()) == (130, "error: interrupted before training started"), err


def _wait_until_torch_loads(pid: int, timeout: float = 120.0) -> None:
    """Until process ``pid`` has mapped libtorch: it is past its start, in the heavy imports."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/maps") as f:
                if "libtorch" in f.read():
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not load torch in {timeout} s")


def test_ctrl_c_that_an_import_swallows_still_stops_before_any_rank(monkeypatch, capsys):
    """megatron-core wraps optional imports in a bare ``except:``, which swallows the
    KeyboardInterrupt of a Ctrl-C landing there: the launcher remembers the signal and stops
    before starting any rank (the run used to train on, ignoring the Ctrl-C)."""
    from emapg_megatron import launch

    def swallowing_validate(trainer, world):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the next bytecode
            time.sleep(0.2)
        except:  # noqa: E722 - what those imports do
            pass

    def no_ranks(*_):
        raise AssertionError("the ranks started after Ctrl-C")

    monkeypatch.setattr(launch, "validate", swallowing_validate)
    monkeypatch.setattr(launch, "run_ranks", no_ranks)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as e:
        launch.main(["--nproc-per-node", "2", "--preset", "tiny-cpu"])
    assert e.value.code == 130
    assert capsys.readouterr().err.strip() == "error: interrupted before training started"
    assert signal.getsignal(signal.SIGINT) is before  # the launcher's handler was for its run only
