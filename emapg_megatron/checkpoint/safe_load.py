"""Reading a checkpoint never runs code from it; a damaged one is one clear line.

A ``torch_dist`` checkpoint directory (what ``megatron.core.dist_checkpointing`` writes)::

    metadata.json      json: the backend names
    .metadata          pickle: torch.distributed.checkpoint Metadata (read with pickle.load!)
    __R_I.distcp       tensors (read by torch with weights_only=True) and byte items
                       (ShardedObjects, e.g. the RNG state and _extra_state, read by torch's
                       DefaultLoadPlanner with ``torch.load(weights_only=False)``!)
    common.pt          torch.save of the non-sharded state (step, scheduler, ...); from
                       megatron-core 0.19 on, the byte item ``common_state`` of the .distcp
                       files instead (:mod:`emapg_megatron.mcore_compat`)

:func:`verify_checkpoint_metadata` reads all of them before megatron does: ``.metadata`` with an
unpickler that admits only the classes torch's checkpoint metadata is made of, every byte item
and ``common.pt`` with ``torch.load(weights_only=True)``. Anything else is refused with a
:class:`ConfigError` naming the file and the refused global; garbage is a ConfigError naming the
file; a checkpoint the installed megatron-core cannot read (one from a later release) is a
ConfigError naming the release that wrote it. Nothing is executed while checking: a pickle can only run code through a global it names,
and every global is checked before it is looked up.

Transformer Engine's ``set_extra_state`` unpickles its fp8 state from a uint8 tensor;
:func:`verify_loaded_extra_state` scans such payloads of a loaded state dict before the model
sees them.

Hostile files cost bounded memory and time: every file is checked to be a regular file inside
the folder named (:func:`open_checked`: a named pipe would block every rank) before it is opened,
pickles may not name a callable that allocates what an integer in them asks for
(:func:`_allocates`), and what torch loads is bounded in depth and size (:func:`_check_shape`).
The HF readers (:mod:`.hf_config`, :mod:`.hf_io`) open files through the same checks.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import re
import stat
import warnings
import zipfile
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from dataclasses import dataclass

import torch
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from emapg_megatron import mcore_compat
from emapg_megatron.errors import ConfigError, shown
from emapg_megatron.training.collectives import on_rank0

METADATA_JSON = "metadata.json"
COMMON = mcore_compat.COMMON_FILE
DCP_METADATA = ".metadata"

# The one format read: megatron's torch_dist (torch DCP files, whose pickles are checked here) with
# torch common state; megatron's other backends (zarr, ...) store pickles nothing here checks.
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}

# The most bytes read from a file of each kind: bounds on memory, far above real files (metadata
# json: ~120 bytes; .metadata grows with tensors x shards: tens of MB for a large model).
MAX_JSON_BYTES = 1 << 20
MAX_PICKLE_BYTES = 4 << 30
# What torch loads from a checkpoint's pickles (common.pt, byte items): real ones nest a few
# levels and hold thousands of objects; the code walking them recurses, and a pickle can share
# one list many times over (2**60 visits from a few hundred bytes).
MAX_DEPTH = 64
MAX_OBJECTS = 1_000_000

# Recorded from the find_class calls of real checkpoints of this project (TP/PP/DP, local and
# distributed optimizer, fp32 and bf16), plus the few builtins a pickle of such data may name.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "builtins": {"set", "frozenset", "slice", "complex"},  # not bytearray: bytearray(2**31) is 2 GB
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id may be a path
}


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def metadata_global_allowed(module: str, name: str) -> bool:
    return name in _METADATA_GLOBALS.get(module, ()) or _is_dtype(module, name)


class _Refused(Exception):
    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.qualname = f"{module}.{name}"


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if not metadata_global_allowed(module, name):
            raise _Refused(module, name)
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise _Refused("<persistent id>", repr(pid)[:40])


def first_line(e: BaseException) -> str:
    """``Type: first line of the message`` (torch's and megatron's span many lines)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _refusal(path: str, what: str) -> ConfigError:
    return ConfigError(f"refusing to load {path}: it references {what}, which a checkpoint never "
                       f"contains (tampered or not a checkpoint); nothing from it was executed")


# --- files: regular, inside the folder named, bounded -----------------------------------------
def _inside(path: str, root: str) -> str:
    """``path`` with links resolved; ConfigError if that is outside the folder ``root`` (for a
    Hugging Face hub cache snapshot, ``.../snapshots/REV``, its own ``blobs/`` counts as inside:
    its files are links there)."""
    real = os.path.realpath(path)
    tops = [os.path.realpath(root)]
    parent = os.path.dirname(os.path.abspath(root))
    if os.path.basename(parent) == "snapshots":
        tops.append(os.path.realpath(os.path.join(parent, os.pardir, "blobs")))
    if not any(os.path.commonpath([real, top]) == top for top in tops):
        raise ConfigError(f"refusing to read {path}: it resolves to {real}, outside {root}")
    return real


def _check_regular(info: os.stat_result, path: str, limit: int | None) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(info.st_mode) else
                "a directory" if stat.S_ISDIR(info.st_mode) else "a device or socket")
        raise ConfigError(f"refusing to read {path}: it is {kind}, not a regular file")
    if limit is not None and info.st_size > limit:
        raise ConfigError(f"refusing to read {path}: {info.st_size} bytes, more than the {limit} "
                          f"such a file may have")


def checked_file(path: str, root: str) -> int:
    """The size of ``path``, for a reader that opens it itself: a regular file inside the folder
    ``root`` (links resolved), else ConfigError naming it. A named pipe would block the open."""
    real = _inside(path, root)
    try:
        info = os.stat(real)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    _check_regular(info, path, None)
    return info.st_size


def open_checked(path: str, limit: int | None, root: str | None = None):
    """``path`` opened for binary reading if it is a regular file (of at most ``limit`` bytes)
    inside the folder ``root`` (default: the one it is named in); else ConfigError naming it.
    Opened non-blocking and checked before any read: a named pipe would block every rank forever."""
    real = _inside(path, os.path.dirname(path) if root is None else root)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    try:
        _check_regular(os.fstat(fd), path, limit)
    except ConfigError:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_json(path: str, limit: int, what: str, root: str | None = None):
    """The JSON in ``path`` (:func:`open_checked`); ConfigError ``"{what} {path}: ..."`` if it
    is not JSON (also nested beyond the parser's depth)."""
    with open_checked(path, limit, root) as f:
        data = f.read(limit)  # also if it grew since the check
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # bad bytes, bad JSON, nesting too deep
        raise ConfigError(f"{what} {path}: {first_line(e)}") from None


# --- pickles --------------------------------------------------------------------------------
def read_dcp_metadata(path: str):
    """torch's checkpoint ``Metadata`` from ``path`` without executing anything else."""
    try:
        with open_checked(path, MAX_PICKLE_BYTES) as f:
            metadata = _MetadataUnpickler(f).load()
    except ConfigError:
        raise
    except _Refused as e:
        raise _refusal(path, e.qualname) from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure: a corrupt file
        raise ConfigError(f"corrupt checkpoint metadata {path}: {first_line(e)}") from None
    if not isinstance(metadata, Metadata):
        raise ConfigError(f"corrupt checkpoint metadata {path}: holds a {type(metadata).__name__}, "
                          f"not torch checkpoint metadata")
    if not all(isinstance(t, dict) for t in (metadata.state_dict_metadata, metadata.storage_data or {})):
        raise ConfigError(f"corrupt checkpoint metadata {path}: its tables are not dicts")
    return metadata


_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _weights_only_reason(message: str) -> str | None:
    """What torch's weights-only unpickler refused, from its (multi-line) message."""
    if "Weights only load failed" not in message:
        return None
    found = _REFUSED_GLOBAL.search(message)
    if found:
        return found.group(1)
    lines = [line.strip() for line in message.split("WeightsUnpickler error:", 1)[-1].splitlines()]
    reason = next((line for line in lines if line), "an unsupported construct")
    return f"a construct torch's weights-only loader rejects ({reason})"


def _allocates(qualname: str) -> bool:
    """Whether torch's weights-only loader admits ``qualname`` as a callable that allocates what
    an integer in the pickle asks for: bytearray(2**31) is 2 GB from an 800-byte file, and so are
    torch.Tensor(n), the legacy torch.FloatTensor(n) ... and the storages. torch.save never names
    them (it rebuilds tensors with torch._utils._rebuild_tensor_v2 from the archive's records)."""
    module, _, name = qualname.rpartition(".")
    return (qualname == "builtins.bytearray" or name in ("UntypedStorage", "TypedStorage")
            or (module.split(".")[0] == "torch" and name.endswith("Tensor")))


def _refused_global(pickle_file) -> str | None:
    """The first callable named by the pickle at ``pickle_file``'s position (read up to its STOP)
    that :func:`_allocates`, its name mapped as torch's loader maps it (GLOBAL is the only opcode
    by which torch's weights-only unpickler finds a callable)."""
    for opcode, arg, _ in pickletools.genops(pickle_file):
        if opcode.name == "GLOBAL":
            module, name = arg.split(" ", 1)
            module, name = NAME_MAPPING.get((module, name), (IMPORT_MAPPING.get(module, module), name))
            if _allocates(f"{module}.{name}"):
                return f"{module}.{name}"
    return None


def _torch_pickles(stream, where: str) -> list:
    """The pickles ``torch.load`` reads from ``stream``, each as a file positioned at its start:
    a zip archive's ``*.pkl`` records (which must be stored, no larger than the file), else the
    five leading pickles of the legacy format (how torch pickles a storage)."""
    size = stream.seek(0, os.SEEK_END)
    stream.seek(0)
    is_zip = stream.read(4) == b"PK\x03\x04"  # torch.load's own test
    stream.seek(0)
    if not is_zip:
        return [stream] * 5  # one stream: each scan reads one pickle
    with zipfile.ZipFile(stream) as archive:
        records = archive.infolist()
        if any(r.compress_type != zipfile.ZIP_STORED or r.file_size > size for r in records):
            raise ConfigError(f"corrupt checkpoint file {where}: a record is compressed or larger "
                              f"than the file")
        return [io.BytesIO(archive.read(r)) for r in records if r.filename.endswith(".pkl")]


def _check_torch_archive(stream, where: str) -> None:
    """Refuse, before torch reads it, a torch.save file whose pickles name an allocating callable."""
    for pickle_file in _torch_pickles(stream, where):
        refused = _refused_global(pickle_file)
        if refused:
            raise _refusal(where, refused)
    stream.seek(0)


_CONTAINERS = (dict, list, tuple, set, frozenset)


def _check_shape(loaded, where: str) -> None:
    """Refuse a loaded object nested deeper than :data:`MAX_DEPTH` or holding more than
    :data:`MAX_OBJECTS` (counted as a recursive walk meets them: a shared list once per path)."""
    stack, seen = [(loaded, 0)] if isinstance(loaded, _CONTAINERS) else [], 0
    while stack:
        node, depth = stack.pop()
        children = [c for pair in node.items() for c in pair] if isinstance(node, dict) else node
        seen += len(children)
        if (depth >= MAX_DEPTH and children) or seen > MAX_OBJECTS:
            raise ConfigError(f"corrupt checkpoint file {where}: nested more than {MAX_DEPTH} levels "
                              f"deep or more than {MAX_OBJECTS} objects")
        stack.extend((c, depth + 1) for c in children if isinstance(c, _CONTAINERS))


def safe_torch_load(source, where: str):
    """``torch.load(weights_only=True)`` of bytes or a binary file, after
    :func:`_check_torch_archive`; the result passes :func:`_check_shape`. ConfigError naming
    ``where``."""
    stream = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    try:
        _check_torch_archive(stream, where)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Detected pickle protocol 4 ..." and the like
            loaded = torch.load(stream, map_location="cpu", weights_only=True)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        refused = _weights_only_reason(str(e))
        if refused:
            raise _refusal(where, refused) from None
        raise ConfigError(f"corrupt checkpoint file {where}: {first_line(e)}") from None
    _check_shape(loaded, where)
    return loaded


# --- the checkpoint directory -----------------------------------------------------------------
def read_metadata_json(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, METADATA_JSON)
    if not os.path.lexists(path):
        raise ConfigError(f"{ckpt_dir} is not a distributed checkpoint (no {METADATA_JSON})")
    config = read_json(path, MAX_JSON_BYTES, "corrupt checkpoint metadata")
    if not isinstance(config, dict) or not isinstance(config.get("sharded_backend"), str):
        raise ConfigError(f"corrupt checkpoint metadata {path}: no 'sharded_backend' entry")
    for key, value in config.items():
        if key not in BACKEND or type(value) is not type(BACKEND[key]) or value != BACKEND[key]:
            raise ConfigError(
                f"unsupported checkpoint {path}: {shown(key)} is {shown(value)}; only "
                f"{BACKEND['sharded_backend']} checkpoints with {BACKEND['common_backend']} common "
                f"state, version 1, are read (the format whose files are checked before loading)")
    return config


def _storage_entry(ckpt_dir: str, index, info) -> tuple[str, int, int]:
    """``(relative path, offset, length)`` of a storage entry of the metadata."""
    try:
        rel, offset, length = info.relative_path, int(info.offset), int(info.length)
        if not isinstance(rel, str) or offset < 0 or length < 0:
            raise ValueError(f"{shown(rel)} at {offset}, {length} bytes")
    except Exception as e:  # noqa: BLE001 - a storage entry of the wrong shape
        raise ConfigError(f"corrupt checkpoint metadata {os.path.join(ckpt_dir, DCP_METADATA)}: "
                          f"bad storage entry for {shown(getattr(index, 'fqn', index))}: "
                          f"{first_line(e)}") from None
    return rel, offset, length


def _verify_storage(ckpt_dir: str, metadata) -> tuple[object, str] | None:
    """Every file the metadata points into is a regular file in the checkpoint holding the bytes
    it is said to; every byte item loads with :func:`safe_torch_load` (torch loads it with
    ``weights_only=False``). Returns the common-state item as loaded, with where it is, if the
    checkpoint has one (megatron-core >= 0.19)."""
    sizes, common = {}, None
    for index, info in (metadata.storage_data or {}).items():
        rel, offset, length = _storage_entry(ckpt_dir, index, info)
        path = os.path.join(ckpt_dir, rel)
        where = f"{path} (item {index.fqn})"
        if rel not in sizes:
            sizes[rel] = checked_file(path, ckpt_dir)
        if offset + length > sizes[rel]:
            raise ConfigError(f"corrupt checkpoint file {where}: truncated")
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        if getattr(info, "transform_descriptors", None):
            raise ConfigError(f"cannot verify {where}: stored with transforms "
                              f"{list(info.transform_descriptors)} this loader does not read")
        if length > MAX_PICKLE_BYTES:
            raise ConfigError(f"refusing to read {where}: {length} bytes, more than the "
                              f"{MAX_PICKLE_BYTES} such an item may have")
        with open_checked(path, None, ckpt_dir) as f:
            f.seek(offset)
            loaded = safe_torch_load(f.read(length), where)
        if index.fqn.split("/", 1)[0] == mcore_compat.COMMON_ITEM:
            common = loaded, where
    return common


@dataclass
class VerifiedCheckpoint:
    path: str
    config: dict  # metadata.json
    metadata: object | None  # torch.distributed.checkpoint Metadata (torch_dist backend)
    common: dict | None  # the non-sharded state: common.pt, or the common-state item
    common_where: str = ""  # where it is, for messages


def _common_file(ckpt_dir: str) -> tuple[dict, str]:
    path = os.path.join(ckpt_dir, COMMON)
    with open_checked(path, MAX_PICKLE_BYTES) as f:
        return safe_torch_load(f, path), path


def _common_item(item) -> dict:
    """The common state in its item: a list of the one dict (megatron saves it as a ShardedObject)."""
    loaded, where = item
    if not (isinstance(loaded, list) and len(loaded) == 1):
        raise ConfigError(f"corrupt checkpoint file {where}: holds {shown(loaded)}, not the common state")
    return loaded[0]


def _check_readable(checkpoint: VerifiedCheckpoint, common_in_item: bool) -> None:
    """Refuse in one line a checkpoint the installed megatron-core cannot read."""
    written_by = (checkpoint.common or {}).get(mcore_compat.VERSION_KEY)
    if written_by is not None and not mcore_compat.valid_version(written_by):
        raise ConfigError(f"corrupt checkpoint file {checkpoint.common_where}: "
                          f"'{mcore_compat.VERSION_KEY}' is {shown(written_by)}, not a version")
    reason = mcore_compat.unreadable(written_by, common_in_item)
    if reason:
        raise ConfigError(f"cannot load checkpoint {checkpoint.path}: {reason}")


def verify_checkpoint_metadata(ckpt_dir: str) -> VerifiedCheckpoint:
    """Check every metadata file of the dist checkpoint ``ckpt_dir`` (an ``iter_N`` directory or
    a model-only checkpoint) before megatron reads it. Raises :class:`ConfigError` in one line."""
    if not os.path.isdir(ckpt_dir):
        raise ConfigError(f"checkpoint directory {ckpt_dir} does not exist")
    config = read_metadata_json(ckpt_dir)
    metadata = None
    names = sorted(os.listdir(ckpt_dir))
    if DCP_METADATA not in names:
        raise ConfigError(f"corrupt checkpoint {ckpt_dir}: no {DCP_METADATA} file")
    for name in names:  # .metadata and any per-rank __R.metadata
        if name.endswith(DCP_METADATA):
            read = read_dcp_metadata(os.path.join(ckpt_dir, name))
            if name == DCP_METADATA:
                metadata = read
    try:
        item = _verify_storage(ckpt_dir, metadata)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - admitted classes holding the wrong things
        raise ConfigError(f"corrupt checkpoint metadata {os.path.join(ckpt_dir, DCP_METADATA)}: "
                          f"{first_line(e)}") from None
    common, where = None, os.path.join(ckpt_dir, COMMON)
    if COMMON in names:  # megatron reads the file first when both are there
        common, where = _common_file(ckpt_dir)
    elif item is not None:
        common, where = _common_item(item), item[1]
    if common is not None and not isinstance(common, dict):
        raise ConfigError(f"corrupt checkpoint file {where}: holds a {type(common).__name__}, "
                          f"not a dict")
    checkpoint = VerifiedCheckpoint(ckpt_dir, config, metadata, common, where)
    _check_readable(checkpoint, common_in_item=COMMON not in names and item is not None)
    return checkpoint


# --- Transformer Engine extra state: a pickle inside a uint8 tensor -------------------------
_EXTRA_STATE_GLOBALS = {
    "torch._utils": {"_rebuild_tensor_v2", "_rebuild_tensor", "_rebuild_parameter"},
    "torch": {"Size", "device"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}
_EXTRA_STATE_MODULES = ("transformer_engine.common.recipe",)  # fp8 recipes and their enums


def _extra_state_global_allowed(module: str, name: str) -> bool:
    return (name in _EXTRA_STATE_GLOBALS.get(module, ()) or _is_dtype(module, name)
            or module in _EXTRA_STATE_MODULES or (module, name) in mcore_compat.LOAD_FROM_BYTES)


class _Placeholder:
    """Stands in for a class of a module that is not installed (nothing of it would run)."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


class _ExtraStateUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module, name):
        if not _extra_state_global_allowed(module, name):
            raise _Refused(module, name)
        if (module, name) in mcore_compat.LOAD_FROM_BYTES:
            return self._load_from_bytes  # torch's runs torch.load(weights_only=False)
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            if module in _EXTRA_STATE_MODULES:
                return _Placeholder
            raise

    def _load_from_bytes(self, data):
        return safe_torch_load(data, self.where)

    def persistent_load(self, pid):
        raise _Refused("<persistent id>", repr(pid)[:40])


def verify_pickled_extra_state(data: bytes, where: str) -> None:
    """Unpickle ``data`` admitting only what Transformer Engine's fp8 state is made of."""
    try:
        _ExtraStateUnpickler(data, where).load()
    except _Refused as e:
        raise _refusal(where, e.qualname) from None
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"corrupt extra state {where}: {first_line(e)}") from None


def verify_loaded_extra_state(loaded, where: str) -> None:
    """Scan non-empty uint8 ``_extra_state`` tensors (TE unpickles them) of a loaded state dict."""
    def walk(node, key):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{key}.{i}")
        elif (key.endswith("_extra_state") and isinstance(node, torch.Tensor)
              and node.dtype == torch.uint8 and node.numel() > 0):
            if node.numel() > node.untyped_storage().nbytes():  # a view repeating its bytes
                raise ConfigError(f"corrupt extra state {where} ({key}): {node.numel()} bytes "
                                  f"from {node.untyped_storage().nbytes()} stored")
            verify_pickled_extra_state(node.detach().cpu().numpy().tobytes(), f"{where} ({key})")

    walk(loaded, "")


def verify_on_every_rank(ckpt_dir: str) -> VerifiedCheckpoint:
    """:func:`verify_checkpoint_metadata` on every rank (each checks the files it reads), rank 0
    first: a checkpoint refused there is refused on every rank, in one line said once."""
    first = []
    on_rank0(lambda: first.append(verify_checkpoint_metadata(ckpt_dir)))
    return first[0] if first else verify_checkpoint_metadata(ckpt_dir)


def load_verified(sharded_state_dict: dict, ckpt_dir: str) -> dict:
    """``dist_checkpointing.load`` of a checkpoint checked first, so nothing in it can run."""
    verify_on_every_rank(ckpt_dir)
    loaded = dist_checkpointing.load(sharded_state_dict, str(ckpt_dir))
    verify_loaded_extra_state(loaded, str(ckpt_dir))
    return loaded
