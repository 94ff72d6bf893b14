"""Reference passes without a second model: swap the EMA into the live GPTModel and back.

In: the fp32 EMA is cast to the model dtype bucket by bucket and written into
the model weights (a DP-sharded EMA is written into this rank's shard of DDP's
param buffer and all-gathered in place, as the distributed optimizer does after
a step).

Out: the policy is rebuilt from the optimizer's fp32 main params, by the same
cast the optimizer uses after every step (``model.copy_(main)``), and the
distributed optimizer's in-place all-gather. That is bit-exact because the
model weights *are* ``cast(main)`` between optimizer steps. Where the main param
is the model weight itself (fp32 params) it is saved first: 4 bytes per
parameter (per DP shard with the distributed optimizer), on the host with
``cpu_offload``.

The RNG states (CPU, CUDA, Megatron's TP tracker) are saved and restored, so a
reference pass leaves the training run's randomness untouched.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from megatron.core import tensor_parallel


class _RngState:
    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        self.tracker = tensor_parallel.get_cuda_rng_tracker()
        self.tracker_states = self.tracker.get_states()

    def restore(self):
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        self.tracker.set_states(self.tracker_states)


def _aliased(anchor):
    return [p for b in anchor.layout.buckets for p in b.pieces if p.aliased]


def _save_aliased(anchor) -> list[torch.Tensor]:
    pieces = _aliased(anchor)
    if not anchor.cfg.cpu_offload:
        return [p.main.clone() for p in pieces]
    if anchor._saved_host is None:  # pinned host buffers are slow to allocate: keep them
        pin = torch.cuda.is_available() and anchor.layout.device.type == "cuda"
        anchor._saved_host = [torch.empty(p.main.numel(), dtype=p.main.dtype, pin_memory=pin)
                              for p in pieces]
    for host, piece in zip(anchor._saved_host, pieces):
        host.copy_(piece.main, non_blocking=True)
    return anchor._saved_host


@torch.no_grad()
def _write_ema(anchor) -> None:
    for store in anchor.stores:
        bucket = store.bucket
        for a, b in anchor._chunks(store.lo, store.hi):
            bucket.write_model(a, b, anchor._load(store, a, b))
        if anchor.cfg.shard_over_dp:
            bucket.gather_flat_param()


@torch.no_grad()
def _restore_policy(anchor, saved: list[torch.Tensor]) -> None:
    saved_iter = iter(saved)
    for bucket in anchor.layout.buckets:
        for piece in bucket.pieces:
            src = next(saved_iter) if piece.aliased else piece.main
            bucket.write_model(piece.lo, piece.hi, src)
        if bucket.flat_param is not None:
            bucket.gather_flat_param()  # the other DP ranks' shards, from their main params


@contextmanager
def swap(anchor):
    rng = _RngState()
    saved = _save_aliased(anchor)
    anchor._swapped = True
    try:
        _write_ema(anchor)
        anchor._sync()
        with torch.no_grad():
            yield
    finally:
        _restore_policy(anchor, saved)
        anchor._sync()
        anchor._swapped = False
        rng.restore()
