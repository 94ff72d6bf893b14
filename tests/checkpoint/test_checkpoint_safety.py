"""Loading a checkpoint never runs code from it; damaged checkpoints, a busy --save directory
and non-finite weights each fail in one clear line."""

import io
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
from trainer_workers import training_checkpoint_job

from emapg_megatron.anchor.checkpoint import check_checkpoint
from emapg_megatron.checkpoint import training as checkpointing
from emapg_megatron.checkpoint.safe_load import (
    read_dcp_metadata,
    verify_checkpoint_metadata,
    verify_loaded_extra_state,
)
from emapg_megatron.errors import ConfigError
from emapg_megatron.multiprocess import run_distributed
from emapg_megatron.run.run_lock import LOCK_NAME, SaveDirLock, lock_save_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ITER = "iter_0000001"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real checkpoint of this project (model with _extra_state items, optimizer, EMA, RNG)."""
    root = tmp_path_factory.mktemp("ckpt")
    (out,) = run_distributed(training_checkpoint_job, 1, args=(str(root),))
    return root, out


@pytest.fixture
def ckpt(saved, tmp_path):
    """A private copy to tamper with."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved[0], root)
    return root


# --- payloads that would create a file when unpickled ----------------------------------------
class _System:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Open:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _metadata_carrying(payload):
    """Real-looking torch checkpoint metadata with the payload deep inside."""
    from torch.distributed.checkpoint.metadata import Metadata

    return Metadata(state_dict_metadata={"model.weight": payload})


PAYLOADS = {
    "os.system": (lambda m: _System(m), "system"),
    "open": (lambda m: _Open(m), "io.open"),
    "nested in Metadata": (lambda m: _metadata_carrying(_System(m)), "system"),
}


def _resume_load(ckpt):
    """What --load does on one rank: the tracker's step, then that step's checkpoint."""
    return checkpointing.load(str(ckpt), {}, checkpointing.latest_iteration(str(ckpt)))


def _one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def test_real_checkpoint_passes_and_records_its_layout(saved):
    root, _ = saved
    checked = verify_checkpoint_metadata(str(root / ITER))
    assert type(checked.metadata).__name__ == "Metadata"
    assert checked.common["common"][checkpointing.LAYOUT_KEY] == {
        "world_size": 1, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
        "data_parallel_size": 1, "expert_model_parallel_size": 1, "optimizer": "local"}


@pytest.mark.parametrize("kind", PAYLOADS)
def test_code_in_dot_metadata_is_refused_and_never_runs(kind, ckpt, tmp_path):
    make, refused = PAYLOADS[kind]
    marker = tmp_path / "pwned"
    (ckpt / ITER / ".metadata").write_bytes(pickle.dumps(make(marker)))
    for load in (lambda: verify_checkpoint_metadata(str(ckpt / ITER)),
                 lambda: _resume_load(ckpt),  # the trainer's --load
                 lambda: check_checkpoint(None, str(ckpt / ITER))):  # resume's EMA shape check
        with pytest.raises(ConfigError) as e:
            load()
        text = _one_line(e)
        assert f"refusing to load {ckpt / ITER / '.metadata'}" in text and refused in text
    assert not marker.exists()


def test_code_in_a_sharded_object_is_refused(ckpt, tmp_path):
    """torch's DCP planner loads byte items (RNG state, _extra_state) with weights_only=False."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    marker = tmp_path / "pwned"
    md = read_dcp_metadata(str(ckpt / ITER / ".metadata"))
    index = next(i for i in md.storage_data if i.fqn.startswith("rng_state"))
    buf = io.BytesIO()
    torch.save([_System(marker)], buf)
    (ckpt / ITER / "__9_0.distcp").write_bytes(buf.getvalue())
    md.storage_data[index] = _StorageInfo("__9_0.distcp", 0, len(buf.getvalue()))
    with open(ckpt / ITER / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(ConfigError) as e:
        _resume_load(ckpt)
    assert "__9_0.distcp (item rng_state" in _one_line(e) and "system" in str(e.value)
    assert not marker.exists()


def test_code_in_common_pt_is_refused(ckpt, tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"iteration": 1, "x": _System(marker)}, ckpt / ITER / "common.pt")
    with pytest.raises(ConfigError) as e:
        verify_checkpoint_metadata(str(ckpt / ITER))
    assert f"refusing to load {ckpt / ITER / 'common.pt'}" in _one_line(e)
    assert not marker.exists()


def test_code_in_transformer_engine_extra_state_is_refused(tmp_path):
    """TE's set_extra_state unpickles a uint8 tensor: scanned before the model sees it."""
    marker = tmp_path / "pwned"

    def as_tensor(obj):
        return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)

    benign = {"scale_fwd": torch.ones(3), "extra_fp8_variables": {"num_gemms": 2}}
    verify_loaded_extra_state({"decoder.layers.mlp.linear_fc1._extra_state": as_tensor(benign),
                               "decoder.final_layernorm._extra_state": None}, "ckpt")
    with pytest.raises(ConfigError) as e:
        verify_loaded_extra_state({"decoder": {"linear_fc1._extra_state": as_tensor(
            {"recipe": _System(marker)})}}, "ckpt")
    assert "refusing to load ckpt (decoder.linear_fc1._extra_state)" in _one_line(e)
    assert not marker.exists()


# --- garbage --------------------------------------------------------------------------------
GARBAGE = {
    ".metadata": b"\x80\x04\x95 not a pickle at all",
    "metadata.json": b"{not json",
    "common.pt": b"PK\x03\x04 truncated zip",
}


@pytest.mark.parametrize("name", GARBAGE)
def test_corrupt_metadata_is_one_line_naming_the_file(name, ckpt):
    (ckpt / ITER / name).write_bytes(GARBAGE[name])
    with pytest.raises(ConfigError) as e:
        _resume_load(ckpt)
    assert "corrupt checkpoint" in _one_line(e) and str(ckpt / ITER / name) in str(e.value)


def test_truncated_dot_metadata_and_missing_files(ckpt):
    path = ckpt / ITER / ".metadata"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ConfigError, match="corrupt checkpoint metadata .*\\.metadata"):
        verify_checkpoint_metadata(str(ckpt / ITER))
    path.unlink()
    with pytest.raises(ConfigError, match="no \\.metadata"):
        verify_checkpoint_metadata(str(ckpt / ITER))
    (ckpt / ITER / "metadata.json").unlink()
    with pytest.raises(ConfigError, match="not a distributed checkpoint"):
        verify_checkpoint_metadata(str(ckpt / ITER))


@pytest.mark.parametrize("text", [b"\xff\xfe\x00garbage", b"abc", b"7", b""])
def test_corrupt_tracker_is_one_line(text, ckpt):
    (ckpt / checkpointing.TRACKER).write_bytes(text)  # 7: no iter_0000007 directory
    with pytest.raises(ConfigError) as e:
        _resume_load(ckpt)
    assert f"corrupt {checkpointing.TRACKER}" in _one_line(e)


# --- non-finite weights are never saved -----------------------------------------------------
def test_non_finite_weights_or_ema_refuse_the_save(saved):
    _, out = saved
    assert out["weight"] == ("refusing to save a checkpoint at step 7: decoder.final_layernorm."
                             "weight is not finite (NaN or inf); the last good checkpoint is kept")
    assert out["ema"].startswith("refusing to save a checkpoint at step 7: EMA of ")


# --- one run per --save directory -----------------------------------------------------------
def test_second_run_on_the_same_save_dir_is_refused(tmp_path):
    first = SaveDirLock(str(tmp_path / "save")).acquire()
    with pytest.raises(ConfigError) as e:
        lock_save_dir(str(tmp_path / "save"))  # a separate open file: conflicts like a process
    assert _one_line(e) == (f"--save {tmp_path / 'save'} is in use by another run (pid "
                            f"{os.getpid()} on {socket.gethostname()}): two runs must not write "
                            f"the same checkpoint directory")
    first.release()
    with lock_save_dir(str(tmp_path / "save")):  # free again
        pass


def test_lock_left_by_a_dead_run_does_not_block(tmp_path):
    path = tmp_path / LOCK_NAME
    code = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'pid 999999 on elsewhere'); os._exit(9)")
    subprocess.run([sys.executable, "-c", code, str(path)], check=False)
    assert path.read_text() == "pid 999999 on elsewhere"  # the stale file is still there
    lock = lock_save_dir(str(tmp_path))
    assert lock.held and path.read_text().startswith(f"pid {os.getpid()} ")
    lock.release()


def test_a_writer_that_outlives_its_killed_rank_does_not_hold_the_lock(tmp_path):
    """Megatron forks writer processes during a save; they must not keep the --save lock when the
    rank that took it is SIGKILLed (issue 28: every restart was refused while they lived)."""
    import signal

    code = ("import os, sys, time; sys.path.insert(0, sys.argv[2]); "
            "from emapg_megatron.run.run_lock import SaveDirLock; "
            "SaveDirLock(sys.argv[1]).acquire(); pid = os.fork(); "
            "time.sleep(60) if pid == 0 else (print(pid, flush=True), time.sleep(60))")
    rank = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), ROOT], stdout=subprocess.PIPE, text=True)
    writer = int(rank.stdout.readline())
    try:
        rank.kill()  # SIGKILL: no teardown; the forked "writer" lives on
        rank.wait(timeout=30)
        os.kill(writer, 0)  # still alive
        lock = lock_save_dir(str(tmp_path))  # the next start is not refused
        assert lock.held
        lock.release()
    finally:
        os.kill(writer, signal.SIGKILL)


NO_TEARDOWN_EXIT = """
import sys
import torch.multiprocessing as mp
sys.path.insert(0, sys.argv[1])
from emapg_megatron import train

manager = mp.get_context("spawn").Manager()  # as megatron's async writer makes one
print(manager._process.pid, flush=True)


def fail():
    raise RuntimeError("Connection closed by peer")


train.run_checked(fail)
"""


@pytest.mark.launch
def test_the_no_teardown_exit_ends_the_ranks_child_processes():
    """A collective failure exits at once (os._exit): Megatron's results Manager and writers, the
    rank's multiprocessing children, must not outlive it."""
    r = subprocess.run([sys.executable, "-c", NO_TEARDOWN_EXIT, ROOT], capture_output=True, text=True,
                       timeout=120)
    manager = int(r.stdout.split()[0])
    assert r.returncode == 1 and r.stderr.strip().startswith("error: a collective failed"), r.stderr
    for _ in range(100):
        try:
            os.kill(manager, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the Manager (pid {manager}) outlived its rank")


def test_the_optimizer_format_is_detected_and_a_switch_refused(saved):
    _, out = saved
    assert out["saved"]["optimizer"] == "local"
    assert out["distributed"]["optimizer"] == "distributed:dp_reshardable"
    assert out["switch"].endswith("the checkpoint was saved without --use-distributed-optimizer and "
                                  "this run is with it; their optimizer states are stored "
                                  "differently and cannot be converted: resume without "
                                  "--use-distributed-optimizer")
