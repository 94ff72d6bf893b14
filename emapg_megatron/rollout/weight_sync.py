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

LoRA (docs/lora.md, "Rollouts through vLLM"): :func:`sync_weights` with ``adapters="exclude"``
streams the frozen base alone, and :func:`sync_adapters` writes the whole adapter matrices of
every pipeline stage as a peft folder, which vLLM reads through its LoRA requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from emapg_megatron.checkpoint.weights import DEFAULT_BUCKET_BYTES, export_hf_weights

Bucket = list[tuple[str, torch.Tensor]]


@dataclass
class SyncStats:
    """One weight sync on this rank. ``bytes`` counts the full HF tensors handed to the loader
    and, with LoRA through vLLM, the adapter tensors written for it (``adapter_bytes`` of them;
    None when the engine takes no adapters)."""

    seconds: float
    load_seconds: float  # time spent inside ``load`` (the rest is export: gather + broadcast)
    bytes: int
    tensors: int
    buckets: int
    adapter_bytes: int | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0

    @property
    def base_bytes(self) -> int:
        return self.bytes - (self.adapter_bytes or 0)

    def metrics(self) -> dict:
        out = {"weight_sync_s": self.seconds, "weight_sync_load_s": self.load_seconds,
               "weight_sync_gb": self.bytes / 1e9, "weight_sync_gbps": self.gbps}
        if self.adapter_bytes is not None:
            out["weight_sync_adapter_mb"] = self.adapter_bytes / 1e6
        return out

    def __add__(self, other: SyncStats) -> SyncStats:
        """Two transfers of one sync (the base, then the adapters) as one."""
        adapters = (None if self.adapter_bytes is None and other.adapter_bytes is None
                    else (self.adapter_bytes or 0) + (other.adapter_bytes or 0))
        return SyncStats(self.seconds + other.seconds, self.load_seconds + other.load_seconds,
                         self.bytes + other.bytes, self.tensors + other.tensors,
                         self.buckets + other.buckets, adapters)


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
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, adapters: str = "auto") -> SyncStats:
    """Stream the trainer's weights into ``load`` bucket by bucket; return the timing.

    ``bucket_bytes`` bounds both the export's communication buckets and the loader buckets, so at
    most about two buckets of gathered weights are alive at once on top of the model itself.
    ``adapters="exclude"``: a LoRA model's frozen base alone (see :func:`export_hf_weights`).
    """
    _synchronize()
    start = time.perf_counter()
    load_seconds = 0.0
    nbytes = tensors = buckets = 0
    stream = export_hf_weights(model_chunks, model_cfg, bucket_bytes=bucket_bytes, adapters=adapters)
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


def all_adapters(model_chunks) -> dict[str, torch.Tensor]:
    """The whole LoRA adapter matrices of the model, by global name, on every rank: each chunk's
    gathered over tensor parallelism (:func:`~emapg_megatron.checkpoint.peft_format.gathered_adapters`),
    then every pipeline stage's over the pipeline group (``all_gather_object``: a few MB). A
    collective over the model-parallel group."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.checkpoint.peft_format import gathered_adapters

    out: dict[str, torch.Tensor] = {}
    for chunk in model_chunks:
        out.update(gathered_adapters(chunk))
    if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        stages: list = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, out, group=ps.get_pipeline_model_parallel_group())
        out = {name: t for stage in stages for name, t in stage.items()}
    return out


def sync_adapters(model_chunks, model_cfg, lora_cfg, out_dir: str) -> SyncStats:
    """Write the model's whole adapter matrices (:func:`all_adapters`) as a peft folder at
    ``out_dir`` (new; ``adapter_config.json`` + ``adapter_model.safetensors``, fp32); return the
    timing, ``load_seconds`` being the write. A collective over the model-parallel group."""
    from emapg_megatron.checkpoint.peft_format import save_peft

    _synchronize()
    start = time.perf_counter()
    adapters = all_adapters(model_chunks)
    if not adapters:
        raise RuntimeError("the LoRA weight sync found no adapter in the model chunks")
    t0 = time.perf_counter()
    nbytes = save_peft(out_dir, lora_cfg, adapters, model_cfg)
    done = time.perf_counter()
    return SyncStats(done - start, done - t0, nbytes, len(adapters), 1, adapter_bytes=nbytes)
