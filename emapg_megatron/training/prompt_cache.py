"""Checked prompts, loaded and tokenised once per node.

Loading a data file and tokenising every prompt to check its length costs a minute per million
rows. Done by every rank, a node pays it (and its memory) once per GPU. Instead, the first process
of a node to get here does it and writes the result as one arrow file; the node's other processes
memory-map that file (its pages are shared) and tokenise nothing.

Where the file goes:

* under ``emapg-train``, the launcher validates the run first, so it is the one that loads: it
  names a private directory in :data:`CACHE_DIR_ENV` for the ranks, which empty and remove it once
  their process group exists (:func:`release`: every rank has read its files by then), so that it
  does not outlive a launcher killed later; the launcher removes what is left when the run ends;
* under plain ``torchrun`` (``TORCHELASTIC_RUN_ID`` set), a directory of this user's in the temp
  folder, the run id part of the key; the ranks delete the files they read or wrote once the
  process group exists (:func:`release`);
* otherwise (one process) nothing is cached.

The key hashes the run's flags, the data file's identity (path, size, mtime) and the tokenizer
folder's, so another run, a changed file or another tokenizer never reads a stale table. An
unreadable or foreign file is ignored and rebuilt. Only rows loaded from a file are cached
(built-in rows cost nothing to make: their callers do not come here, and leave nothing in the temp
folder). A lock that cannot be taken (no free inodes, a link planted at its path, a folder that
is gone) means no sharing: the process loads for itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from typing import Callable, Optional

import pyarrow as pa

from emapg_megatron.tasks.data import TableRows
from emapg_megatron.training.prompt_data import TrainingPrompts

#: the directory emapg-train gives its ranks
CACHE_DIR_ENV = "EMAPG_PROMPT_CACHE_DIR"
_LENGTHS = "__emapg_prompt_tokens"  # the prompt-length column added to the rows
_META = b"emapg_prompts"

_used: list[str] = []  # the cache files this process read or wrote, for release()


def cache_dir() -> Optional[str]:
    """Where this process shares checked prompts with the others of its node, or None."""
    given = os.environ.get(CACHE_DIR_ENV)
    if given:
        return given
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    path = os.path.join(tempfile.gettempdir(), f"emapg-prompts-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)  # a directory another user planted (the temp folder is shared) is not ours
    ours = os.path.isdir(path) and not os.path.islink(path) and st.st_uid == os.getuid()
    return path if ours and st.st_mode & 0o077 == 0 else None


def key(flags: dict, data_path: Optional[str], tokenizer_dir: Optional[str]) -> str:
    """A hash of everything the checked prompts depend on."""
    parts = {"flags": {k: repr(v) for k, v in sorted(flags.items())},
             "data": _identity(data_path), "tokenizer": _folder_identity(tokenizer_dir),
             # emapg-train's directory is the run's own; torchrun's temp folder is shared by runs
             "run": None if os.environ.get(CACHE_DIR_ENV) else os.environ.get("TORCHELASTIC_RUN_ID")}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def once_per_node(cache_key: str, load: Callable[[], TrainingPrompts]) -> TrainingPrompts:
    """``load()``'s prompts, computed by the node's first process and read by the others."""
    directory = cache_dir()
    if directory is None:
        return load()
    path = os.path.join(directory, f"{cache_key}.arrow")
    try:
        lock = _locked(path + ".lock")
    except OSError:  # no free inodes, a planted link, the folder gone: no sharing, no traceback
        return load()
    with lock:  # the others wait here while the first one loads
        _used.append(path)
        found = _read(path, cache_key)
        if found is not None:
            return found
        prompts = load()  # a ConfigError leaves no file: every process reports it alike
        if isinstance(prompts.rows, TableRows):
            _write(prompts, path, cache_key)
        return prompts


def release() -> None:
    """Delete the cache files this process read or wrote (and their locks), then emapg-train's
    directory if that leaves it empty: call it once the process group exists, when every rank of
    the node has read them (a memory-mapped file stays readable once deleted)."""
    while _used:
        path = _used.pop()
        for name in (path, path + ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
    given = os.environ.get(CACHE_DIR_ENV)
    if given:
        with contextlib.suppress(OSError):  # not empty (not only this run's), or gone already
            os.rmdir(given)


def _identity(path: Optional[str]) -> Optional[list]:
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return [os.path.abspath(path)]
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino]


def _folder_identity(path: Optional[str]) -> Optional[list]:
    if not path or not os.path.isdir(path):
        return _identity(path)
    with os.scandir(path) as entries:
        return sorted([e.name, *(_identity(e.path) or [])] for e in entries if e.is_file())


def _locked(path: str):
    """The node's lock at ``path`` (a link there is not followed), as a context manager; OSError
    when it cannot be opened."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return _holding(fd)


@contextlib.contextmanager
def _holding(fd: int):
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)  # released by the kernel if the holder dies
        yield
    finally:
        os.close(fd)


def _write(prompts: TrainingPrompts, path: str, cache_key: str) -> None:
    meta = {"key": cache_key, "max_prompt_tokens": prompts.max_prompt_tokens, "total": prompts.total,
            "dropped": prompts.dropped, "skipped_bad": prompts.skipped_bad}
    table = prompts.rows.table.append_column(_LENGTHS, pa.array(prompts.prompt_lengths, pa.int64()))
    table = table.replace_schema_metadata({_META: json.dumps(meta).encode()})
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        os.replace(tmp, path)
    except OSError:  # a full temp folder: every process loads for itself, as without a cache
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _read(path: str, cache_key: str) -> Optional[TrainingPrompts]:
    """The prompts of ``path`` if it is this key's finished file, else None."""
    try:
        table = pa.ipc.open_file(pa.memory_map(path)).read_all()
        meta = json.loads(table.schema.metadata[_META])
        if meta["key"] != cache_key:
            return None
        lengths = table.column(_LENGTHS).to_pylist()
        rows = TableRows(table.drop_columns([_LENGTHS]).replace_schema_metadata(None))
        return TrainingPrompts(rows, lengths, meta["max_prompt_tokens"], meta["total"],
                               dropped=meta["dropped"], skipped_bad=meta["skipped_bad"])
    except (OSError, pa.ArrowException, KeyError, TypeError, ValueError):
        return None  # none yet, or not one of ours
