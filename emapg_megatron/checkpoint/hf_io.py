"""Reading and writing Hugging Face safetensors directories tensor by tensor.

:class:`SafetensorsReader` opens every shard lazily (``safe_open`` memory-maps the file) and reads
only the requested slice, so a TP rank never materialises tensors it does not own. It reads only
regular files inside the HF folder (the index may name any path) and refuses a malformed index or
a safetensors header that disagrees with its file in one line naming the file.
:class:`StreamingSafetensorsWriter` writes ``model-0000i-of-0000n.safetensors`` shards of bounded
size plus ``model.safetensors.index.json`` straight from the stream, holding no tensor.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from emapg_megatron.checkpoint.safe_load import checked_file, first_line, read_json
from emapg_megatron.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_INDEX_BYTES = 64 << 20  # a 1T-parameter model's index is a few MB

# Files copied from an HF template next to the exported weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "special_tokens_map.json", "added_tokens.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json")

#: The files that hold a tokenizer's vocabulary (one suffices). Without any, transformers builds a
#: tokenizer of one token from config.json that encodes every text to nothing.
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def has_tokenizer(hf_dir: str | Path) -> bool:
    """Whether the HF folder ``hf_dir`` holds a tokenizer's vocabulary."""
    return any((Path(hf_dir) / name).is_file() for name in TOKENIZER_VOCAB_FILES)


class SafetensorsReader:
    """Lazy access to the tensors of an HF model directory (single file or sharded with index).

    Each read opens its shard with ``safe_open`` and closes it again: the memory map (whose
    touched pages count as resident) then never covers more than the tensor being read.
    """

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        files = shard_files(self.dir)
        for f in files:  # before safe_open opens them: a named pipe would block it
            checked_file(str(self.dir / f), str(self.dir))
        # Shapes from the shard headers (the index may list names only).
        self._file_of, self._shapes = {}, {}
        for f in files:
            with self._open(f) as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    self._file_of[name] = f
                    self._shapes[name] = tuple(handle.get_slice(name).get_shape())

    def _open(self, file: str):
        """``safe_open`` of a shard; its header is checked against the file (offsets in bounds,
        not overlapping, byte counts matching dtype x shape): a lie is one line naming it."""
        try:
            return safe_open(str(self.dir / file), framework="pt")
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"corrupt safetensors file {self.dir / file}: {first_line(e)}") from None

    def names(self) -> list[str]:
        return list(self._file_of)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        with self._open(self._file_of[name]) as handle:
            return handle.get_tensor(name) if index is None else handle.get_slice(name)[index]


def shard_files(hf_dir: Path) -> list[str]:
    """The safetensors files of an HF folder: the index's shards, else the single file."""
    index = hf_dir / INDEX
    if os.path.lexists(index):
        entries = read_json(str(index), MAX_INDEX_BYTES, "invalid JSON in")
        weight_map = entries.get("weight_map") if isinstance(entries, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ConfigError(f"corrupt {index}: its weight_map must map tensor names to file names")
        return sorted(set(weight_map.values()))
    if os.path.lexists(hf_dir / SINGLE):
        return [SINGLE]
    found = sorted(p.name for p in hf_dir.glob("*.bin")) if hf_dir.is_dir() else []
    hint = f" (found {', '.join(found)}: convert .bin weights to safetensors first)" if found else ""
    raise ConfigError(f"{hf_dir} has no {SINGLE} or {INDEX}{hint}")


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class StreamingSafetensorsWriter:
    """Writes ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``
    while tensors stream in, holding none of them: the names, shapes and dtype are planned up
    front, so each shard's header is written first and every tensor's bytes go straight to disk.

    ``plan`` lists ``(name, shape)`` in the order :meth:`add` will receive them.
    """

    def __init__(self, out_dir: str | Path, plan: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                 max_shard_bytes: int = 5 * 1024**3):
        self.dir, self.dtype = Path(out_dir), dtype
        sizes = [(name, tuple(shape), math.prod(shape) * dtype.itemsize) for name, shape in plan]
        shards: list[list] = []
        for entry in sizes:  # consecutive tensors; one bigger than the bound gets its own shard
            if not shards or sum(e[2] for e in shards[-1]) + entry[2] > max_shard_bytes:
                shards.append([])
            shards[-1].append(entry)
        n = len(shards)
        self._shards = [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", shard)
                        for i, shard in enumerate(shards)]
        self._queue = [(fname, name, shape) for fname, shard in self._shards for name, shape, _ in shard]
        self._next, self._file, self._open_name = 0, None, None
        self.total_bytes = sum(e[2] for e in sizes)

    def _header(self, shard) -> bytes:
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, nbytes in shard:
            header[name] = {"dtype": _ST_DTYPES[self.dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format allows space padding; keeps data 8-aligned
        return struct.pack("<Q", len(raw)) + raw

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._queue):
            raise ValueError(f"unplanned tensor {name!r}: all planned tensors were written")
        fname, want, shape = self._queue[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != (want, shape, self.dtype):
            raise ValueError(f"expected {want} {shape} {self.dtype}, got {name} "
                             f"{tuple(tensor.shape)} {tensor.dtype}")
        if self._open_name != fname:
            self._close_file()
            self._file = open(self.dir / fname, "wb")  # noqa: SIM115 - spans add() calls
            self._open_name = fname
            self._file.write(self._header(next(s for f, s in self._shards if f == fname)))
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(data.numpy().data)
        self._next += 1

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._close_file()
        return False

    def close(self) -> list[str]:
        """Check every planned tensor arrived, write the index; returns the shard file names."""
        self._close_file()
        if self._next != len(self._queue):
            missing = [name for _, name, _ in self._queue[self._next:]]
            raise ValueError(f"{len(missing)} planned tensors never arrived: {', '.join(missing[:5])}")
        weight_map = {name: fname for fname, name, _ in self._queue}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return [fname for fname, _ in self._shards]


def copy_tokenizer_files(template_dir: str | Path, out_dir: str | Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(template_dir) / name
        if src.is_file():
            shutil.copy2(src, Path(out_dir) / name)
            copied.append(name)
    return copied
