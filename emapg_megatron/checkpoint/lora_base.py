"""The frozen base a LoRA run's adapters belong to (docs/lora.md, "Checkpoints").

A LoRA run whose base weights come from files (``--load-hf``, ``--pretrained-checkpoint``) saves
its adapters, their optimizer state and their EMA only: the base is named in the checkpoint by
the flag, the folder and the sha256 of each weight file (:class:`BaseRecord`). A resume and the
converter's merged export read the base from a folder again and check it file by file against
that record; a LoRA run without such files (a random base) saves its base with the adapters.

Hashing reads every weight file once (measured in BENCHMARKS.md: about a second per GB on one
core); the trainer does it on global rank 0, after the checks that need no hash.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from emapg_megatron.checkpoint.hf_io import shard_files
from emapg_megatron.checkpoint.safe_load import open_checked, shown
from emapg_megatron.errors import ConfigError

#: The flags a base can come from, and how each names its weight files.
SOURCES = ("--load-hf", "--pretrained-checkpoint")
_HEX = frozenset("0123456789abcdef")
_CHUNK = 1 << 22  # bytes hashed per read: bounded memory on any file


def weight_files(flag: str, path: str) -> list[str]:
    """The files whose bytes are the base's weights: an HF folder's safetensors shards (its
    index's, else the single file); a ``torch_dist`` folder's regular files (not its subfolders)."""
    if flag == "--load-hf":
        return shard_files(Path(path))
    try:
        names = os.listdir(path)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: {e.strerror}") from None
    return sorted(n for n in names if os.path.isfile(os.path.join(path, n)))


def file_sha256(path: str, root: str) -> str:
    """The sha256 of ``path``, a regular file inside the folder ``root`` (links resolved); a read
    error is one ConfigError line."""
    digest = hashlib.sha256()
    with open_checked(path, None, root) as f:
        try:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    return digest.hexdigest()


@dataclass(frozen=True)
class BaseRecord:
    """Where a LoRA run's base weights came from, and the digest of each of their files."""

    flag: str
    """``--load-hf`` or ``--pretrained-checkpoint``."""
    path: str
    """The folder, as an absolute path when recorded."""
    files: dict
    """Each weight file's name -> its sha256 (hex)."""

    @classmethod
    def of(cls, flag: str, path: str) -> BaseRecord:
        """The record of the base in ``path`` now: every weight file read and hashed."""
        return cls(flag, os.path.abspath(path),
                   {name: file_sha256(os.path.join(path, name), path) for name in weight_files(flag, path)})

    @property
    def sha256(self) -> str:
        """One digest of the whole base: of the files' names and digests, in name order."""
        lines = "".join(f"{name}\0{digest}\n" for name, digest in sorted(self.files.items()))
        return hashlib.sha256(lines.encode()).hexdigest()

    def describe(self) -> str:
        return f"{self.flag} {self.path} (sha256 {self.sha256[:12]})"

    def to_dict(self) -> dict:
        return {"flag": self.flag, "path": self.path, "files": dict(self.files), "sha256": self.sha256}

    @classmethod
    def from_dict(cls, entry, where: str) -> BaseRecord:
        """The record a checkpoint stores, checked (``where`` names the file in errors)."""
        def bad(what):
            return ConfigError(f"corrupt checkpoint file {where}: its LoRA base record {what}")
        if not isinstance(entry, dict):
            raise bad(f"is {shown(entry)}, not a dict")
        flag, path, files = entry.get("flag"), entry.get("path"), entry.get("files")
        if flag not in SOURCES or not isinstance(path, str) or not path:
            raise bad(f"names {shown(flag)} {shown(path)}, not one of {', '.join(SOURCES)} and a folder")
        if not isinstance(files, dict) or not files or not all(
                isinstance(n, str) and isinstance(d, str) and len(d) == 64 and set(d) <= _HEX
                for n, d in files.items()):
            raise bad("has no valid sha256 per weight file")
        return cls(flag, path, dict(files))


def check_same_base(saved: BaseRecord, given: BaseRecord, what: str, hint: str) -> None:
    """Refuse in one line a base (``given``) other than the one the adapters were trained on
    (``saved``): another source flag, another file set or any file with another digest. ``what``
    names the checkpoint, ``hint`` says how to give the right base."""
    if saved.flag != given.flag:  # --pretrained-checkpoint wins over --load-hf (build.base_source)
        fix = ("drop --pretrained-checkpoint" if given.flag == "--pretrained-checkpoint" else
               f"pass --pretrained-checkpoint {saved.path}")
        raise ConfigError(f"{what}: its adapters were trained on the base of {saved.describe()}, "
                          f"this run's base comes from {given.flag} {given.path}: {fix}")
    differ = sorted(n for n in set(saved.files) | set(given.files) if saved.files.get(n) != given.files.get(n))
    if differ:
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        raise ConfigError(f"{what}: its adapters were trained on the base of {saved.describe()}; "
                          f"{given.describe()} differs from it ({', '.join(differ[:3])}{more}): {hint}")
