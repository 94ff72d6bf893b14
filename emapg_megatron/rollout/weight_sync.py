"""Weight sync from the Megatron trainer to a rollout engine: bucketing and timing glue.

The export itself (HF names through the checkpoint mapping table, TP all-gather in size-bounded
buckets, broadcast from the owning pipeline stage) is
:func:`emapg_megatron.checkpoint.weights.export_hf_weights`. This module regroups its
``(hf_name, full tensor)`` stream into loader buckets of at most ``bucket_bytes`` (so the
engine's ``load_weights`` sees a bounded amount of new memory per call), hands each bucket to a
``load`` callable, and times the whole transfer.

Every rank of the model-parallel group must call :func:`sync_weights` in step (the export is a
collective). Each rank's ``load`` receives every tensor: a colocated vLLM TP worker slices its
own shard out of the full HF tensor inside ``load_weights``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from emapg_megatron.checkpoint.weights import DEFAULT_BUCKET_BYTES, export_hf_weights

Bucket = list[tuple[str, torch.Tensor]]


@dataclass
class SyncStats:
    """One weight sync on this rank. ``bytes`` counts the full HF tensors handed to the loader."""

    seconds: float
    load_seconds: float  # time spent inside ``load`` (the rest is export: gather + broadcast)
    bytes: int
    tensors: int
    buckets: int

    @property
    def gbps(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0

    def metrics(self) -> dict:
        return {"weight_sync_s": self.seconds, "weight_sync_load_s": self.load_seconds,
                "weight_sync_gb": self.bytes / 1e9, "weight_sync_gbps": self.gbps}


def rebucket(pairs: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group consecutive ``(name, tensor)`` pairs into lists of at most ``bucket_bytes``.

    Greedy and order-preserving; a tensor larger than the bound travels alone (it cannot be split:
    ``load_weights`` takes whole HF tensors).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0 (got {bucket_bytes})")
    bucket: Bucket = []
    size = 0
    for name, tensor in pairs:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _synchronize() -> None:
    # GPU copies are asynchronous: without this the clock stops before the bytes have moved.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def sync_weights(model_chunks, model_cfg, load: Callable[[Bucket], None], *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncStats:
    """Stream the trainer's weights into ``load`` bucket by bucket; return the timing.

    ``bucket_bytes`` bounds both the export's communication buckets and the loader buckets, so at
    most about two buckets of gathered weights are alive at once on top of the model itself.
    """
    _synchronize()
    start = time.perf_counter()
    load_seconds = 0.0
    nbytes = tensors = buckets = 0
    stream = export_hf_weights(model_chunks, model_cfg, bucket_bytes=bucket_bytes)
    with torch.no_grad():
        for bucket in rebucket(stream, bucket_bytes):
            t0 = time.perf_counter()
            load(bucket)
            _synchronize()
            load_seconds += time.perf_counter() - t0
            buckets += 1
            tensors += len(bucket)
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
    _synchronize()
    return SyncStats(time.perf_counter() - start, load_seconds, nbytes, tensors, buckets)
