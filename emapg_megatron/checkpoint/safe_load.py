"""Reading a checkpoint never runs code from it; a damaged one is one clear line.

A ``torch_dist`` checkpoint directory (what ``megatron.core.dist_checkpointing`` writes)::

    metadata.json      json: the backend names
    .metadata          pickle: torch.distributed.checkpoint Metadata (read with pickle.load!)
    __R_I.distcp       tensors (read by torch with weights_only=True) and byte items
                       (ShardedObjects, e.g. the RNG state and _extra_state, read by torch's
                       DefaultLoadPlanner with ``torch.load(weights_only=False)``!)
    common.pt          torch.save of the non-sharded state (step, scheduler, ...)

:func:`verify_checkpoint_metadata` reads all of them before megatron does: ``.metadata`` with an
unpickler that admits only the classes torch's checkpoint metadata is made of, every byte item
and ``common.pt`` with ``torch.load(weights_only=True)``. Anything else is refused with a
:class:`ConfigError` naming the file and the refused global; garbage is a ConfigError naming the
file. Nothing is executed while checking: a pickle can only run code through a global it names,
and every global is checked before it is looked up.

Transformer Engine's ``set_extra_state`` unpickles its fp8 state from a uint8 tensor;
:func:`verify_loaded_extra_state` scans such payloads of a loaded state dict before the model
sees them.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import warnings
from dataclasses import dataclass

import torch
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from emapg_megatron.errors import ConfigError

METADATA_JSON = "metadata.json"
COMMON = "common.pt"
DCP_METADATA = ".metadata"

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
    "builtins": {"set", "frozenset", "slice", "complex", "bytearray"},
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _refusal(path: str, what: str) -> ConfigError:
    return ConfigError(f"refusing to load {path}: it references {what}, which a checkpoint never "
                       f"contains (tampered or not a checkpoint); nothing from it was executed")


def read_dcp_metadata(path: str):
    """torch's checkpoint ``Metadata`` from ``path`` without executing anything else."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise _refusal(path, e.qualname) from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure: a corrupt file
        raise ConfigError(f"corrupt checkpoint metadata {path}: {_first_line(e)}") from None
    if not isinstance(metadata, Metadata):
        raise ConfigError(f"corrupt checkpoint metadata {path}: holds a {type(metadata).__name__}, "
                          f"not torch checkpoint metadata")
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


def safe_torch_load(data, where: str):
    """``torch.load(weights_only=True)`` of a file path or bytes; ConfigError naming ``where``."""
    try:
        source = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Detected pickle protocol 4 ..." and the like
            return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        refused = _weights_only_reason(str(e))
        if refused:
            raise _refusal(where, refused) from None
        raise ConfigError(f"corrupt checkpoint file {where}: {_first_line(e)}") from None


def read_metadata_json(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, METADATA_JSON)
    if not os.path.isfile(path):
        raise ConfigError(f"{ckpt_dir} is not a distributed checkpoint (no {METADATA_JSON})")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except Exception as e:  # noqa: BLE001 - bad bytes, bad json
        raise ConfigError(f"corrupt checkpoint metadata {path}: {_first_line(e)}") from None
    if not isinstance(config, dict) or not isinstance(config.get("sharded_backend"), str):
        raise ConfigError(f"corrupt checkpoint metadata {path}: no 'sharded_backend' entry")
    return config


def _verify_byte_items(ckpt_dir: str, metadata) -> None:
    """Every ShardedObject payload must load with weights_only=True (torch loads it without)."""
    root = os.path.realpath(ckpt_dir)
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        where = f"{os.path.join(ckpt_dir, str(getattr(info, 'relative_path', '?')))} (item {index.fqn})"
        try:
            rel, offset, length = info.relative_path, int(info.offset), int(info.length)
            path = os.path.realpath(os.path.join(root, rel))
        except Exception as e:  # noqa: BLE001 - a storage entry of the wrong shape
            raise ConfigError(f"corrupt checkpoint metadata {os.path.join(ckpt_dir, DCP_METADATA)}: "
                              f"bad storage entry for {index.fqn}: {_first_line(e)}") from None
        if os.path.dirname(path) != root:
            raise ConfigError(f"corrupt checkpoint metadata {os.path.join(ckpt_dir, DCP_METADATA)}: "
                              f"{index.fqn} points outside the checkpoint ({rel!r})")
        if getattr(info, "transform_descriptors", None):
            raise ConfigError(f"cannot verify {where}: stored with transforms "
                              f"{list(info.transform_descriptors)} this loader does not read")
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(length)
        except OSError as e:
            raise ConfigError(f"cannot read {where}: {_first_line(e)}") from None
        if len(data) != length:
            raise ConfigError(f"corrupt checkpoint file {where}: truncated")
        safe_torch_load(data, where)


@dataclass
class VerifiedCheckpoint:
    path: str
    config: dict  # metadata.json
    metadata: object | None  # torch.distributed.checkpoint Metadata (torch_dist backend)
    common: dict | None  # common.pt


def verify_checkpoint_metadata(ckpt_dir: str) -> VerifiedCheckpoint:
    """Check every metadata file of the dist checkpoint ``ckpt_dir`` (an ``iter_N`` directory or
    a model-only checkpoint) before megatron reads it. Raises :class:`ConfigError` in one line."""
    if not os.path.isdir(ckpt_dir):
        raise ConfigError(f"checkpoint directory {ckpt_dir} does not exist")
    config = read_metadata_json(ckpt_dir)
    metadata = None
    names = sorted(os.listdir(ckpt_dir))
    if config["sharded_backend"] == "torch_dist" and DCP_METADATA not in names:
        raise ConfigError(f"corrupt checkpoint {ckpt_dir}: no {DCP_METADATA} file")
    for name in names:  # .metadata and any per-rank __R.metadata
        if name.endswith(DCP_METADATA):
            read = read_dcp_metadata(os.path.join(ckpt_dir, name))
            if name == DCP_METADATA:
                metadata = read
    if metadata is not None:
        try:
            _verify_byte_items(ckpt_dir, metadata)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - admitted classes holding the wrong things
            raise ConfigError(f"corrupt checkpoint metadata {os.path.join(ckpt_dir, DCP_METADATA)}: "
                              f"{_first_line(e)}") from None
    common = None
    if COMMON in names:
        common = safe_torch_load(os.path.join(ckpt_dir, COMMON), os.path.join(ckpt_dir, COMMON))
        if not isinstance(common, dict):
            raise ConfigError(f"corrupt checkpoint file {os.path.join(ckpt_dir, COMMON)}: "
                              f"holds a {type(common).__name__}, not a dict")
    return VerifiedCheckpoint(ckpt_dir, config, metadata, common)


# --- Transformer Engine extra state: a pickle inside a uint8 tensor -------------------------
_EXTRA_STATE_GLOBALS = {
    "torch._utils": {"_rebuild_tensor_v2", "_rebuild_tensor", "_rebuild_parameter"},
    "torch.storage": {"_load_from_bytes"},  # its bytes are checked with weights_only=True
    "torch": {"Size", "device"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex", "bytearray"},
}
_EXTRA_STATE_MODULES = ("transformer_engine.common.recipe",)  # fp8 recipes and their enums


def _extra_state_global_allowed(module: str, name: str) -> bool:
    return (name in _EXTRA_STATE_GLOBALS.get(module, ()) or _is_dtype(module, name)
            or module in _EXTRA_STATE_MODULES)


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
        if (module, name) == ("torch.storage", "_load_from_bytes"):
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
        raise ConfigError(f"corrupt extra state {where}: {_first_line(e)}") from None


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
            verify_pickled_extra_state(node.detach().cpu().numpy().tobytes(), f"{where} ({key})")

    walk(loaded, "")


def load_verified(sharded_state_dict: dict, ckpt_dir: str) -> dict:
    """``dist_checkpointing.load`` of a checkpoint checked first, so nothing in it can run."""
    verify_checkpoint_metadata(ckpt_dir)
    loaded = dist_checkpointing.load(sharded_state_dict, str(ckpt_dir))
    verify_loaded_extra_state(loaded, str(ckpt_dir))
    return loaded
