"""The EMA anchor: fp32 storage sharded like the policy, and the in-place update.

``θ_ema ← η·θ_ema + (1−η)·θ`` every ``update_period`` trainer steps, after the
optimizer step (paper Algorithm 3, lines 25-27). θ is the optimizer's fp32 main
parameter, not the bf16 model weight: with η = 0.9 an update moves the EMA by
a tenth of the lag, which for a small learning rate is far below bf16's
resolution (8 mantissa bits), so a bf16 EMA would stop moving.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from emapg_megatron.anchor.checkpoint import (
    build_sharded_state_dict,
    check_checkpoint,
    load_loaded_state,
)
from emapg_megatron.anchor.config import EmaConfig
from emapg_megatron.anchor.layout import Bucket, build_layout
from emapg_megatron.anchor.swap import swap

logger = logging.getLogger(__name__)

_FP32 = torch.float32


@dataclass
class _Store:
    """The EMA of bucket range [lo, hi): the whole bucket, or this DP rank's shard of it."""

    bucket: Bucket
    lo: int
    hi: int
    data: torch.Tensor  # fp32, on the model's device or in pinned host memory


def _overlaps(pieces, lo: int, hi: int):
    for piece in pieces:
        a, b = max(lo, piece.lo), min(hi, piece.hi)
        if a < b:
            yield piece, a, b


class EmaAnchor:
    """fp32 EMA of the policy, kept in the layout of Megatron DDP's buckets (an
    :class:`~emapg_megatron.anchor.protocol.Anchor`).

    ``model_chunks`` are the DDP-wrapped GPTModels of this rank and ``optimizer``
    the Megatron optimizer built on them. Construct it after the policy weights
    are loaded (Algorithm 3, line 1: θ_ema ← θ), or call :meth:`reset`.
    """

    def __init__(self, model_chunks: list, optimizer, cfg: EmaConfig):
        self.cfg = cfg
        self.model_chunks = list(model_chunks)
        self.layout = build_layout(self.model_chunks, optimizer)
        cfg.validate(self.layout.distributed_optimizer)
        self.num_updates = 0
        self.last_update_iteration = -1
        self._swapped = False
        self._saved_host: list[torch.Tensor] | None = None  # offload: reused host copies of aliased mains
        device = self.layout.device
        pin = cfg.cpu_offload and torch.cuda.is_available() and device.type == "cuda"
        self.stores: list[_Store] = []
        for bucket in self.layout.buckets:
            lo, hi = (bucket.shard_lo, bucket.shard_hi) if cfg.shard_over_dp else (0, bucket.numel)
            if cfg.cpu_offload:
                data = torch.zeros(hi - lo, dtype=_FP32, device="cpu", pin_memory=pin)
            else:
                data = torch.zeros(hi - lo, dtype=_FP32, device=device)
            self.stores.append(_Store(bucket, lo, hi, data))
        # One transfer bucket on the device: fp32 EMA chunks are staged through it (cpu_offload).
        longest = max(s.hi - s.lo for s in self.stores)
        self._chunk = max(min(cfg.transfer_numel, longest), 1)
        self._staging = torch.empty(self._chunk, dtype=_FP32, device=device) if cfg.cpu_offload else None
        self.reset()

    # ------------------------------------------------------------------ streaming helpers
    def _chunks(self, lo: int, hi: int, bounded: bool = False):
        """Bucket range [lo, hi) in transfer-bucket steps when streaming (or ``bounded``), else whole."""
        step = self._chunk if self._staging is not None or bounded else max(hi - lo, 1)
        for a in range(lo, hi, step):
            yield a, min(a + step, hi)

    def _load(self, store: _Store, a: int, b: int) -> torch.Tensor:
        """The EMA of bucket range [a, b) on the model's device (a view, or the staging buffer)."""
        view = store.data[a - store.lo:b - store.lo]
        if self._staging is None:
            return view
        buf = self._staging[:b - a]
        buf.copy_(view, non_blocking=True)
        return buf

    def _store_back(self, store: _Store, a: int, b: int, buf: torch.Tensor) -> None:
        if self._staging is not None:
            store.data[a - store.lo:b - store.lo].copy_(buf, non_blocking=True)

    def _sync(self) -> None:
        # Host-side EMA copies were queued non-blocking: finish before anyone reads them.
        if self._staging is not None and self._staging.is_cuda:
            torch.cuda.current_stream().synchronize()

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def reset(self) -> None:
        """θ_ema ← θ (the optimizer's fp32 main params)."""
        self._lerp(1.0)

    @torch.no_grad()
    def _lerp(self, weight: float) -> None:
        for store in self.stores:
            bucket = store.bucket
            for a, b in self._chunks(bucket.shard_lo, bucket.shard_hi):
                buf = self._load(store, a, b)
                emas, mains = [], []
                for piece, x, y in _overlaps(bucket.pieces, a, b):
                    emas.append(buf[x - a:y - a])
                    mains.append(piece.main[x - piece.lo:y - piece.lo])
                if emas:
                    torch._foreach_lerp_(emas, mains, weight)  # weight 1 copies exactly
                self._store_back(store, a, b, buf)
            if not self.cfg.shard_over_dp and bucket.dp_size > 1:
                self._gather_shards(store)
        self._sync()

    def _gather_shards(self, store: _Store) -> None:
        """Replicated EMA with the distributed optimizer: each DP rank updated its shard; share them."""
        bucket = store.bucket
        if self._staging is None:
            dist.all_gather_into_tensor(store.data, store.data[bucket.shard_lo:bucket.shard_hi],
                                        group=bucket.dp_group)
            return
        # Streamed: gather chunk j of every rank's shard through one transfer bucket.
        n_ranks, shard = bucket.dp_size, bucket.shard_hi - bucket.shard_lo
        step = max(self._chunk // (n_ranks + 1), 1)
        for j in range(0, shard, step):
            n = min(step, shard - j)
            send = self._staging[:n]
            recv = self._staging[n:n + n_ranks * n] if (n_ranks + 1) * n <= self._chunk else \
                torch.empty(n_ranks * n, dtype=_FP32, device=send.device)  # transfer bucket < DP + 1
            send.copy_(store.data[bucket.shard_lo + j:bucket.shard_lo + j + n], non_blocking=True)
            dist.all_gather_into_tensor(recv, send, group=bucket.dp_group)
            for r in range(n_ranks):
                store.data[r * shard + j:r * shard + j + n].copy_(recv[r * n:(r + 1) * n], non_blocking=True)

    def step(self, iteration: int) -> bool:
        """Call after ``optimizer.step()`` of trainer step ``iteration`` (1-based, Algorithm 3's t).

        Updates when ``iteration % update_period == 0``; returns whether it did.
        η = 1 never updates (the fixed anchor of standard GRPO).
        """
        if self._swapped:
            raise RuntimeError("EmaAnchor.step() inside swapped_in(): the model holds the EMA weights")
        if self.cfg.eta >= 1.0 or iteration % self.cfg.update_period != 0:
            return False
        if iteration == self.last_update_iteration:
            return False  # a repeated call for the same step (e.g. after a resume) must not re-apply
        self._lerp(1.0 - self.cfg.eta)
        self.num_updates += 1
        self.last_update_iteration = iteration
        return True

    # ------------------------------------------------------------------ reference pass
    @contextmanager
    def swapped_in(self):
        """Run the anchor forward passes on the live model: EMA weights in, policy restored bit for bit."""
        if self._swapped:
            raise RuntimeError("EmaAnchor.swapped_in() is not re-entrant")
        with swap(self):
            yield self

    @contextmanager
    def model(self):
        """The anchor's model for its forward passes: the policy's chunks with the EMA swapped in
        (the anchor interface it shares with ``anchor.teacher.Teacher``)."""
        with self.swapped_in():
            yield self.model_chunks

    def metrics(self) -> dict:
        return {"ema_lag": self.lag()}

    def named_tensors(self):
        """This rank's EMA of each parameter piece it stores, as ``("EMA of NAME", tensor)``."""
        for store in self.stores:
            for slot in store.bucket.slots:
                a, b = max(slot.lo, store.lo), min(slot.hi, store.hi)
                if a < b:
                    yield f"EMA of {slot.name}", store.data[a - store.lo:b - store.lo]

    # ------------------------------------------------------------------ diagnostics
    @torch.no_grad()
    def lag(self) -> float:
        """‖θ − θ_ema‖ / ‖θ‖ over the whole model (all TP/PP/DP shards, duplicates counted once)."""
        groups = self.layout.norm_groups
        sq_diff, sq_norm = [[] for _ in groups], [[] for _ in groups]
        for store in self.stores:
            bucket = store.bucket
            kind = next(i for i, g in enumerate(groups) if g is bucket.norm_group)
            # Bounded chunks keep the fp32 difference temporaries small for huge embedding matrices.
            for a, b in self._chunks(bucket.shard_lo, bucket.shard_hi, bounded=True):
                buf = self._load(store, a, b)
                mains, emas = [], []
                for piece, x, y in _overlaps(bucket.pieces, a, b):
                    if piece.counted:
                        mains.append(piece.main[x - piece.lo:y - piece.lo])
                        emas.append(buf[x - a:y - a])
                if mains:
                    sq_diff[kind].append(torch.stack(torch._foreach_norm(torch._foreach_sub(mains, emas))).double())
                    sq_norm[kind].append(torch.stack(torch._foreach_norm(mains)).double())
        total = torch.zeros(2, dtype=torch.float64, device=self.layout.device)
        for group, diffs, norms in zip(groups, sq_diff, sq_norm):  # each kind over its own group
            acc = torch.zeros(2, dtype=torch.float64, device=self.layout.device)
            if diffs:
                acc[0] = torch.cat(diffs).square().sum()
                acc[1] = torch.cat(norms).square().sum()
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(acc, group=group)
            total += acc
        diff, norm = total.sqrt().tolist()
        return diff / norm if norm > 0 else diff

    @torch.no_grad()
    def gathered(self) -> dict[str, torch.Tensor]:
        """The full local (TP/PP-shard) EMA per parameter, fp32 on CPU, keyed by global name.

        Diagnostic (tests, tools): allocates a full bucket at a time on the device.
        """
        out = {}
        for store in self.stores:
            bucket = store.bucket
            if store.lo == 0 and store.hi == bucket.numel:
                full = store.data.to("cpu")
            else:
                full = torch.empty(bucket.numel, dtype=_FP32, device=self.layout.device)
                dist.all_gather_into_tensor(full, store.data.to(self.layout.device), group=bucket.dp_group)
                full = full.cpu()
            for slot in bucket.slots:
                out[slot.name] = full[slot.lo:slot.hi].view(slot.param.shape).clone()
        return out

    def memory_report(self) -> dict:
        """Bytes the anchor adds, counted from its tensors and the swap plan (not sampled)."""
        numel = self.layout.numel
        elt = torch.tensor([], dtype=self.layout.model_dtype).element_size()
        ema_bytes = sum(s.data.numel() * 4 for s in self.stores)
        aliased = sum(p.hi - p.lo for b in self.layout.buckets for p in b.pieces if p.aliased)
        staging = self._staging.numel() * 4 if self._staging is not None else 0
        report = {
            "local_params": numel,
            "model_dtype": str(self.layout.model_dtype).replace("torch.", ""),
            "ema_device_bytes": 0 if self.cfg.cpu_offload else ema_bytes,
            "ema_host_bytes": ema_bytes if self.cfg.cpu_offload else 0,
            "staging_device_bytes": staging,
            # During a swap: copies of main params that are the model weights themselves (fp32 params).
            "swap_device_bytes": 0 if self.cfg.cpu_offload else aliased * elt,
            "swap_host_bytes": aliased * elt if self.cfg.cpu_offload else 0,
        }
        for key in ("ema_device_bytes", "ema_host_bytes", "swap_device_bytes", "swap_host_bytes"):
            report[key.replace("_bytes", "_bytes_per_param")] = report[key] / max(numel, 1)
        return report

    # ------------------------------------------------------------------ checkpointing
    def state_dict_meta(self) -> dict:
        return {"num_updates": self.num_updates, "last_update_iteration": self.last_update_iteration,
                "eta": float(self.cfg.eta), "update_period": int(self.cfg.update_period)}

    def sharded_state_dict(self, model_sharded_state_dict: dict | None = None) -> dict:
        """For ``dist_checkpointing.save/load`` next to the model and optimizer state.

        Pass the model's ``sharded_state_dict()`` (the one saved with it) or None to build it
        from the model chunks. EMA tensors carry the model's keys with an ``ema.`` prefix.
        """
        return build_sharded_state_dict(self, model_sharded_state_dict)

    def load_state_dict(self, loaded: dict) -> None:
        """Take the result of ``dist_checkpointing.load(anchor.sharded_state_dict(...), dir)``."""
        load_loaded_state(self, loaded)

    def check_checkpoint(self, ckpt_dir: str) -> None:
        """Raise ConfigError naming the first EMA tensor whose shape in ``ckpt_dir`` mismatches."""
        check_checkpoint(self, ckpt_dir)
