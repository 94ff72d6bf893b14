"""Directories and files that appear whole or not at all: what every checkpoint writer uses.

A writer fills a temporary directory next to the target, then renames it into place
(:func:`atomic_dir`, :func:`replace_dir`); a small text file (a tracker) is written aside and
renamed (:func:`atomic_write_text`); renames are fsynced (:func:`fsync_dir`) so a power loss
cannot leave a file naming a directory whose rename was lost.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from emapg_megatron.errors import ConfigError


def check_new_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} already exists (pass --overwrite to replace it)")


def check_output_apart(out: str | Path, inputs: dict[str, str | Path | None]) -> None:
    """Refuse an output directory that is, contains or lies inside one of ``inputs`` (``{flag:
    path}``, links resolved): writing it (with --overwrite: replacing it) would destroy or
    change what the conversion reads."""
    target = os.path.realpath(out)
    for flag, path in inputs.items():
        if path is None:
            continue
        source = os.path.realpath(path)
        relation = ("is" if target == source else "contains" if _inside(source, target)
                    else "is inside" if _inside(target, source) else None)
        if relation:
            raise ConfigError(f"--out {out} {relation} {flag} {path} (links resolved): writing it would "
                              "replace what the conversion reads; choose an --out apart from it")


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _with_umask(mode: int) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def temp_dir_for(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    tmp.chmod(_with_umask(0o777))  # mkdtemp's 0700 would outlive the rename
    return tmp


def replace_dir(tmp: str | Path, out: str | Path) -> Path | None:
    """Rename the finished directory ``tmp`` to ``out``. An existing ``out`` is moved aside first
    (and put back if the rename fails); returns where it went, for the caller to delete once the
    new one counts (None if there was none)."""
    tmp, out = Path(tmp), Path(out)
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        if old is not None:
            old.rename(out)
        raise
    return old


def commit(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out`` (replacing an old ``out`` only now)."""
    old = replace_dir(tmp, out)
    if old is not None:
        shutil.rmtree(old)


@contextmanager
def atomic_dir(out: str | Path, *, overwrite: bool = False):
    """Yield a temporary directory that becomes ``out`` on success and vanishes on failure."""
    out = Path(out)
    check_new_output(out, overwrite)
    tmp = temp_dir_for(out)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit(tmp, out)


def atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path: str) -> None:
    """Make the renames inside directory ``path`` durable (a power loss must not leave the
    tracker naming a step whose directory rename was lost)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
