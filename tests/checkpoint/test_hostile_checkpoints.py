"""Hostile trainer checkpoints (what --load and --pretrained-checkpoint read) fail in one line
naming the file, in bounded memory and time: named pipes, allocation gadgets in the pickles,
files outside the checkpoint, a common state of the wrong shape, backends nothing checks.

The checkpoints are built here from small files (metadata that lists no tensors, a trainer's
common.pt): every case fails before megatron reads anything. Real checkpoints still loading is
``test_checkpoint_safety.py``'s and the resume tests' part.
"""

import io
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
)

from emapg_megatron import mcore_compat
from emapg_megatron.checkpoint import training as checkpointing
from emapg_megatron.checkpoint.safe_load import (
    BACKEND,
    MAX_DEPTH,
    MAX_OBJECTS,
    read_dcp_metadata,
    verify_checkpoint_metadata,
)
from emapg_megatron.errors import ConfigError

ITER = "iter_0000001"
N = 1 << 20  # what the gadgets below ask for: small here, 2**31 in an attack

SCHEDULER = {"max_lr": 1e-6, "lr_warmup_steps": 0, "num_steps": 3, "lr_decay_style": "constant",
             "lr_decay_steps": 10, "min_lr": 1e-6, "start_wd": 0.01, "end_wd": 0.01,
             "wd_incr_style": "constant", "wd_incr_steps": 10}
LAYOUT = {"world_size": 1, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
          "data_parallel_size": 1, "optimizer": "local"}


def trainer_common(**changes) -> dict:
    """common.pt as ``run.loop.save`` writes it (None in ``changes`` drops an entry)."""
    common = {"iteration": 1, "scheduler": dict(SCHEDULER), "skipped_steps": 0,
              "args": json.dumps({"seed": 1}), checkpointing.LAYOUT_KEY: dict(LAYOUT)}
    common.update(changes)
    common = {k: v for k, v in common.items() if v is not None}
    return {"optimizer": {"state": {"common_step": torch.tensor(1.0)}}, "common": common}


def write_checkpoint(root, common=None, metadata=None, backend=None) -> str:
    """A checkpoint directory ``root/iter_0000001`` with its tracker; returns the step's path."""
    path = root / ITER
    path.mkdir(parents=True)
    (root / checkpointing.TRACKER).write_text("1")
    (path / "metadata.json").write_text(json.dumps(backend or BACKEND))
    (path / ".metadata").write_bytes(pickle.dumps(metadata or Metadata(state_dict_metadata={})))
    torch.save(trainer_common() if common is None else common, path / "common.pt")
    return str(path)


def one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text
    return text


class Calls:
    """Pickles as ``fn(*args)``: what a tampered pickle can ask an admitted callable to do."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_the_written_common_state_passes(tmp_path):
    checkpoint = verify_checkpoint_metadata(write_checkpoint(tmp_path))
    assert checkpointing.checked_common(checkpoint)["scheduler"] == SCHEDULER
    assert checkpointing.saved_layout(checkpoint) == LAYOUT


# --- named pipes: refused before they are opened ----------------------------------------------
FIFO_SCRIPT = """
import sys
from emapg_megatron.checkpoint.safe_load import verify_checkpoint_metadata
from emapg_megatron.errors import ConfigError
for path in sys.argv[1:]:
    try:
        verify_checkpoint_metadata(path)
        print("loaded")
    except ConfigError as e:
        print(e)
"""


def test_a_named_pipe_in_a_checkpoint_is_refused_without_blocking(tmp_path):
    """Opening a FIFO blocks until a writer comes: every rank would hang before any timeout.
    The check runs in a subprocess, so that a regression fails here instead of hanging."""
    cases = {}
    for name in ("common.pt", ".metadata", "metadata.json"):
        path = write_checkpoint(tmp_path / name)
        os.remove(os.path.join(path, name))
        os.mkfifo(os.path.join(path, name))
        cases[name] = path
    r = subprocess.run([sys.executable, "-c", FIFO_SCRIPT, *cases.values()], capture_output=True,
                       text=True, timeout=120, check=False)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == len(cases), r.stderr[-2000:]
    for (name, path), line in zip(cases.items(), lines):
        assert line == (f"refusing to read {os.path.join(path, name)}: it is a named pipe (FIFO), "
                        "not a regular file")


# --- allocation gadgets ----------------------------------------------------------------------
def test_a_bytearray_in_dot_metadata_is_refused(tmp_path):
    """30 bytes that ask for bytearray(2**31): 2 GB on every rank."""
    path = tmp_path / ".metadata"
    path.write_bytes(b"\x80\x02cbuiltins\nbytearray\nJ" + N.to_bytes(4, "little") + b"\x85R.")
    with pytest.raises(ConfigError) as e:
        read_dcp_metadata(str(path))
    assert one_line(e).startswith(f"refusing to load {path}: it references builtins.bytearray")


GADGETS = {"bytearray": (bytearray, "builtins.bytearray"),
           "Tensor": (torch.Tensor, "torch.Tensor"),
           "ByteTensor": (torch.ByteTensor, "torch.ByteTensor"),
           "UntypedStorage": (torch.UntypedStorage, "torch.storage.UntypedStorage")}


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])
@pytest.mark.parametrize("gadget", GADGETS)
def test_allocating_callables_in_common_pt_are_refused(gadget, legacy, tmp_path):
    """torch's weights-only loader admits these; each allocates what an integer asks for."""
    fn, qualname = GADGETS[gadget]
    path = write_checkpoint(tmp_path, common={})
    torch.save({"x": Calls(fn, N)}, os.path.join(path, "common.pt"),
               _use_new_zipfile_serialization=not legacy)
    with pytest.raises(ConfigError) as e:
        verify_checkpoint_metadata(path)
    assert one_line(e).startswith(f"refusing to load {os.path.join(path, 'common.pt')}: it "
                                  f"references {qualname}")


def byte_item_checkpoint(root, payload: bytes, relative_path="__0_0.distcp", offset=0, length=None,
                         fqn="rng_state/shard_0_1"):
    """A checkpoint whose metadata names one byte item (as the RNG state is stored)."""
    storage = {MetadataIndex(fqn): _StorageInfo(relative_path, offset,
                                                len(payload) if length is None else length)}
    md = Metadata(state_dict_metadata={fqn: BytesStorageMetadata()}, storage_data=storage)
    path = write_checkpoint(root, metadata=md)
    with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
        f.write(payload)
    return path


def common_item_checkpoint(root, common) -> str:
    """megatron-core 0.19's layout: the common state is the byte item ``common_state``, no common.pt."""
    buf = io.BytesIO()
    torch.save(common, buf)
    path = byte_item_checkpoint(root, buf.getvalue(), fqn=f"{mcore_compat.COMMON_ITEM}/shard_0_1")
    os.remove(os.path.join(path, mcore_compat.COMMON_FILE))
    return path


def test_the_common_state_item_is_read_where_megatron_core_reads_it(tmp_path):
    path = common_item_checkpoint(tmp_path, [trainer_common()])
    where = f"{path}/__0_0.distcp (item {mcore_compat.COMMON_ITEM}/shard_0_1)"
    if not mcore_compat.READS_COMMON_ITEM:  # 0.16.1: one line instead of megatron's AttributeError
        with pytest.raises(ConfigError, match="after 0.16 .its common state is inside the .distcp"):
            verify_checkpoint_metadata(path)
        return
    checkpoint = verify_checkpoint_metadata(path)
    assert checkpoint.common_where == where
    assert checkpointing.checked_common(checkpoint)["scheduler"] == SCHEDULER
    assert checkpointing.saved_layout(checkpoint) == LAYOUT


@pytest.mark.parametrize("common", [{"common": {}}, [], [1, 2], [[1]]], ids=repr)
def test_a_common_state_item_of_another_shape_is_corrupt(common, tmp_path):
    path = common_item_checkpoint(tmp_path, common)
    with pytest.raises(ConfigError) as e:
        verify_checkpoint_metadata(path)
    assert one_line(e).startswith(f"corrupt checkpoint file {path}/__0_0.distcp (item "
                                  f"{mcore_compat.COMMON_ITEM}/shard_0_1): holds ")


def test_a_byte_item_asking_for_a_bytearray_is_refused(tmp_path):
    buf = io.BytesIO()
    torch.save({"torch": Calls(bytearray, N)}, buf)
    path = byte_item_checkpoint(tmp_path, buf.getvalue())
    with pytest.raises(ConfigError) as e:
        verify_checkpoint_metadata(path)
    assert one_line(e).startswith(f"refusing to load {os.path.join(path, '__0_0.distcp')} (item "
                                  "rng_state/shard_0_1): it references builtins.bytearray")


@pytest.mark.parametrize("relative_path,length,message", [
    ("../outside.distcp", None, "outside"),
    ("/etc/passwd", None, "outside"),
    ("__0_0.distcp", 1 << 40, "truncated"),
])
def test_byte_items_outside_or_beyond_the_checkpoint_are_refused(relative_path, length, message,
                                                                 tmp_path):
    buf = io.BytesIO()
    torch.save({"torch": torch.zeros(4, dtype=torch.uint8)}, buf)
    path = byte_item_checkpoint(tmp_path, buf.getvalue(), relative_path, length=length)
    with pytest.raises(ConfigError) as e:
        verify_checkpoint_metadata(path)
    assert message in one_line(e)


def test_a_deeply_nested_common_pt_is_refused(tmp_path):
    """The code walking a loaded common state recurses; torch builds any depth."""
    nested = []
    for _ in range(MAX_DEPTH + 10):
        nested = [nested]
    path = write_checkpoint(tmp_path, common=trainer_common(iteration=nested))
    with pytest.raises(ConfigError) as e:
        verify_checkpoint_metadata(path)
    assert f"common.pt: nested more than {MAX_DEPTH} levels" in one_line(e)


def test_a_list_shared_exponentially_often_is_refused(tmp_path):
    """A few hundred bytes of pickle: 2**60 visits for a recursive walk."""
    shared = []
    for _ in range(60):
        shared = [shared, shared]
    path = write_checkpoint(tmp_path, common=trainer_common(iteration=shared))
    with pytest.raises(ConfigError, match=f"more than {MAX_OBJECTS} objects"):
        verify_checkpoint_metadata(path)


# --- the trainer's common state --------------------------------------------------------------
@pytest.mark.parametrize("common,message", [
    (trainer_common(scheduler=None), "no 'scheduler' entry"),
    (trainer_common(scheduler=dict(SCHEDULER, num_steps="3")),
     "'scheduler.num_steps' is '3', not a non-negative integer"),
    (trainer_common(scheduler={"num_steps": 3}), "no 'scheduler.max_lr' entry"),
    (trainer_common(skipped_steps="2"), "'skipped_steps' is '2', not a non-negative integer"),
    (trainer_common(skipped_steps=-1), "'skipped_steps' is -1, not a non-negative integer"),
    (trainer_common(args={"seed": 1}), "'args' is {'seed': 1}, not a JSON object of the run's flags"),
    (trainer_common(args="not json"), "'args' is 'not json', not a JSON object of the run's flags"),
    (trainer_common(args="[1, 2]"), "'args' is '[1, 2]', not a JSON object of the run's flags"),
    (trainer_common(checkpoint_layout=dict(LAYOUT, optimizer=5)),
     "'checkpoint_layout.optimizer' is 5, not a string or null"),
    (trainer_common(checkpoint_layout=[1]), "'checkpoint_layout' is [1], not a dict"),
    ({"common": "x"}, "'common' is 'x', not a dict"),
    ({}, "no 'common' entry"),
])
def test_a_common_state_of_the_wrong_shape_is_one_line(common, message, tmp_path):
    """What Trainer.load_state_dict and loop.resume read, refused by --load before any work."""
    write_checkpoint(tmp_path, common=common)
    with pytest.raises(ConfigError) as e:
        checkpointing.load(str(tmp_path), {}, 1)
    assert one_line(e) == f"corrupt checkpoint file {tmp_path / ITER / 'common.pt'}: {message}"


def test_a_checkpoint_without_common_pt_is_one_line(tmp_path):
    path = write_checkpoint(tmp_path)
    os.remove(os.path.join(path, "common.pt"))
    with pytest.raises(ConfigError) as e:
        checkpointing.load(str(tmp_path), {}, 1)
    assert one_line(e) == (f"corrupt checkpoint {path}: no common.pt (nor the common_state item "
                           f"megatron-core 0.19 writes instead)")


@pytest.mark.parametrize("change", [
    {"sharded_backend": "zarr"}, {"sharded_backend": "pickle"}, {"common_backend": "pickle"},
    {"sharded_backend_version": 2}, {"sharded_backend_version": "1"}, {"extra": 1},
], ids=["zarr", "pickle", "common-pickle", "version-2", "version-str", "unknown-key"])
def test_other_backends_are_refused(change, tmp_path):
    """megatron's other backends hold pickles nothing checks; unknown keys crash its config."""
    path = write_checkpoint(tmp_path, backend={**BACKEND, **change})
    (key, value), = change.items()
    with pytest.raises(ConfigError) as e:
        checkpointing.load(str(tmp_path), {}, 1)
    assert one_line(e).startswith(f"unsupported checkpoint {os.path.join(path, 'metadata.json')}: "
                                  f"{key!r} is {value!r}; only torch_dist checkpoints")


def test_common_pt_linked_outside_the_checkpoint_is_refused(tmp_path):
    path = write_checkpoint(tmp_path / "ckpt")
    torch.save(trainer_common(), tmp_path / "elsewhere.pt")
    os.remove(os.path.join(path, "common.pt"))
    os.symlink(tmp_path / "elsewhere.pt", os.path.join(path, "common.pt"))
    with pytest.raises(ConfigError) as e:
        verify_checkpoint_metadata(path)
    assert one_line(e).startswith(f"refusing to read {os.path.join(path, 'common.pt')}: it "
                                  f"resolves to {tmp_path / 'elsewhere.pt'}, outside {path}")
