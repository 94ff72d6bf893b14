"""``run_distributed``: ranks forked from a preloaded forkserver on CPU behave as spawned ones.
``launch_ranks``: a program on ranks forked the same way, as torchrun would start it.

The forkserver's own environment, ``sys.path`` and working directory are those of its start; a
rank must see the caller's at the call (tests set variables, change directory and put helper
folders on the path after the server is up: multiprocessing passes the path and directory, we
pass the environment). Failures come back as errors naming the rank, with its traceback.
"""

import os
import sys

import pytest
import torch.distributed as dist

from emapg_megatron.multiprocess import RankError, launch_ranks, run_distributed

LATE_MODULE = '''
import os
import torch.distributed as dist

def where():
    return os.environ.get("EMAPG_TEST_MARK"), os.getcwd(), dist.get_rank()
'''


def _rank():
    return dist.get_rank()


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    return 0


def _die():
    os._exit(3)


def _hang():
    import time

    time.sleep(60)


def _fail_then_peer_dies():
    """Rank 1 reports a broken collective at once; rank 0, whose death broke it, exits a moment
    later (its exit code reaches the parent after rank 1's report)."""
    import time

    if dist.get_rank() == 1:
        raise RuntimeError("Connection closed by peer")
    time.sleep(0.5)
    os._exit(3)


def test_ranks_take_the_callers_environment_path_and_directory_at_the_call(tmp_path, monkeypatch):
    assert run_distributed(_rank, 2) == [0, 1]  # the forkserver is up before anything changes
    (tmp_path / "modules").mkdir()
    (tmp_path / "work").mkdir()  # not the module's folder: '' on sys.path must not find it
    (tmp_path / "modules" / "late_rank_module.py").write_text(LATE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "modules"))
    monkeypatch.setenv("EMAPG_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path / "work")
    import late_rank_module

    got = run_distributed(late_rank_module.where, 2)
    assert got == [("set after the server started", str(tmp_path / "work"), r) for r in (0, 1)]
    sys.modules.pop("late_rank_module", None)


def test_a_rendezvous_port_taken_meanwhile_starts_the_launch_again_on_another(monkeypatch):
    """free_port's port is free when found, not when rank 0 binds it: a suite beside this one may
    take it. The launch starts again on another port; once PORT_TRIES ports were taken, it fails."""
    import socket

    from emapg_megatron import multiprocess

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()  # what a TCPStore of another run holds
    taken, found = held.getsockname()[1], []
    real = multiprocess.free_port

    def first_taken():
        found.append(taken if not found else real())
        return found[-1]

    try:
        monkeypatch.setattr(multiprocess, "free_port", first_taken)
        assert run_distributed(dist.get_rank, 2, timeout=60) == [0, 1]
        assert found[0] == taken and len(found) == 2
        monkeypatch.setattr(multiprocess, "free_port", lambda: taken)
        monkeypatch.setattr(multiprocess, "PORT_TRIES", 1)  # each failed launch waits out its peers
        with pytest.raises(RankError, match="EADDRINUSE"):
            run_distributed(dist.get_rank, 2, timeout=60)
    finally:
        held.close()


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(RankError, match=r"rank 1 failed:(.|\n)*ValueError: rank 1 refuses"):
        run_distributed(_fail_on_rank_1, 2)


def test_a_function_the_ranks_cannot_import_is_reported_not_hung(tmp_path, monkeypatch):
    """The call is unpickled inside the rank's error handling: an import failure is a RankError."""
    (tmp_path / "parent_only_module.py").write_text(
        "import os\nif 'RANK' in os.environ:\n    raise ImportError('not in a rank')\n"
        "def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    import parent_only_module

    with pytest.raises(RankError, match="ImportError: not in a rank"):
        run_distributed(parent_only_module.f, 1, timeout=60)
    sys.modules.pop("parent_only_module", None)


def test_a_rank_that_dies_or_hangs_fails_the_run():
    with pytest.raises(RankError, match="exit code 3"):
        run_distributed(_die, 2, timeout=60)
    with pytest.raises(TimeoutError, match="timed out"):
        run_distributed(_hang, 1, timeout=3)


def test_a_peer_that_died_is_named_before_the_rank_its_death_broke():
    with pytest.raises(RankError, match=r"rank 0 died with exit code 3 before reporting \(rank 1 failed "
                                        r"too:(.|\n)*Connection closed by peer"):
        run_distributed(_fail_then_peer_dies, 2, timeout=60)


# --- launch_ranks: a program on ranks, as torchrun starts it -------------------------------------
def _program(code_on_rank_1=0):
    """Says where it runs; rank 1 exits with ``code_on_rank_1``."""
    rank = int(os.environ["RANK"])
    print(f"rank {rank}/{os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} "
          f"run {os.environ['TORCHELASTIC_RUN_ID'] != ''} mark {os.environ.get('EMAPG_TEST_MARK')} "
          f"in {os.getcwd()} group {dist.is_initialized()}")
    print(f"warning from rank {rank}", file=sys.stderr)
    return code_on_rank_1 if rank == 1 else 0


def _strict_after_initialize():
    from emapg_megatron import cpu_device, runtime
    from emapg_megatron.runtime.config import ParallelConfig

    runtime.initialize(ParallelConfig(device="cpu"))
    try:
        print(cpu_device.strict(), dist.get_world_size())
    finally:
        runtime.destroy()


def _raise():
    raise ValueError("uncaught in the program")


def _exit_on_rank_1_while_rank_0_waits():
    import time

    if os.environ["RANK"] == "1":
        sys.exit(2)
    time.sleep(120)  # as a peer waiting in a collective for ever


def _leave_a_child_and_hang(pid_file):
    import subprocess
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    time.sleep(300)


def test_launched_ranks_have_torchruns_environment_and_their_own_output(tmp_path, monkeypatch):
    monkeypatch.setenv("EMAPG_TEST_MARK", "caller")
    r = launch_ranks(_program, 2, cwd=str(tmp_path), timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"rank {k}/2 local {k} run True mark caller in {tmp_path} group False"
                                     for k in (0, 1)]  # no process group: the program makes its own
    assert r.stderr.splitlines() == ["warning from rank 0", "warning from rank 1"]


def test_a_launched_ranks_exit_code_is_the_runs(tmp_path):
    assert launch_ranks(_program, 2, args=(3,), timeout=60).returncode == 3
    r = launch_ranks(_raise, 1, timeout=60)
    assert r.returncode == 1 and r.stderr.rstrip().endswith("ValueError: uncaught in the program"), r.stderr


def test_a_failed_rank_stops_its_peers_and_a_timeout_leaves_nothing_running(tmp_path):
    import subprocess
    import time

    import psutil

    start = time.monotonic()
    r = launch_ranks(_exit_on_rank_1_while_rank_0_waits, 2, timeout=100, stop_grace=1)
    assert r.returncode == 2 and time.monotonic() - start < 60  # rank 0 was stopped, as torchrun does
    pid_file = tmp_path / "child"
    with pytest.raises(subprocess.TimeoutExpired):
        launch_ranks(_leave_a_child_and_hang, 1, args=(str(pid_file),), timeout=8)
    child = int(pid_file.read_text())
    for _ in range(100):
        if not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
            return
        time.sleep(0.1)
    pytest.fail(f"the rank's child {child} outlived the run")


def test_strict_device_mode_reaches_launched_ranks(monkeypatch):
    monkeypatch.setenv("EMAPG_STRICT_DEVICE", "1")
    r = launch_ranks(_strict_after_initialize, 2, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "2", "True", "2"]
    monkeypatch.delenv("EMAPG_STRICT_DEVICE")
    assert launch_ranks(_strict_after_initialize, 1, timeout=120).stdout.split() == ["False", "1"]
