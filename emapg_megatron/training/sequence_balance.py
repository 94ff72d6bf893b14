"""Sequences moved between data-parallel ranks so that every rank's share of each PPO mini-batch
carries about the same number of tokens.

The sampler leaves each DP rank with the sequences it generated: equal counts, unequal tokens
when lengths are long-tailed. Packed micro-batches (:mod:`training.packing`) balance the tokens
within a rank, and every rank runs as many micro-batches as the busiest one, so the ranks wait
for the rank that drew the long sequences. :func:`assign` moves as few sequences as it takes to
even the loads, :func:`exchange` sends them (one ``all_to_all`` per field, each sequence's real
tokens only, no padding on the wire) and lays the received batch out at its own longest
sequence. Sequences never leave their PPO mini-batch, so each optimizer step sees the same
global sequences at any layout, and every loss normaliser, a sum over the global mini-batch, is
unchanged.
"""

from __future__ import annotations

import bisect

import torch
import torch.distributed as dist

from emapg_megatron import runtime
from emapg_megatron.training.packing import token_index


# --- the assignment (pure) ---------------------------------------------------------------------
def assign(lengths_by_rank: list[list[int]], groups: list[list[int]]) -> list[list[int]]:
    """``dest[r][i]``: the rank that computes rank ``r``'s sequence ``i``.

    ``groups`` lists the local indices of each mini-batch (the same on every rank); sequences
    move only within their group. In each group, while the most and the least loaded rank
    differ by ``gap``, the change that brings their difference nearest zero moves: one
    sequence of length ``x`` from the former to the latter (``0 < x < gap``), or, when none
    fits, a swap of ``a`` for a shorter ``b`` (``0 < a - b < gap``). Each change lowers the
    sum of squared loads, so it ends; with no imbalance nothing moves. Ties go to the lower
    (rank, index), so every rank computes the same answer from the gathered lengths.
    """
    dest = [[r] * len(ls) for r, ls in enumerate(lengths_by_rank)]
    for group in groups:
        held = [[(lengths_by_rank[r][i], r, i) for i in group] for r in range(len(dest))]
        while True:
            loads = [sum(s[0] for s in h) for h in held]
            hi = max(range(len(held)), key=lambda r: (loads[r], -r))
            lo = min(range(len(held)), key=lambda r: (loads[r], r))
            change = _best_change(held[hi], held[lo], loads[hi] - loads[lo])
            if change is None:
                break
            a, b = change
            held[hi].remove(a)
            held[lo].append(a)
            if b is not None:
                held[lo].remove(b)
                held[hi].append(b)
        for d, h in enumerate(held):
            for _, r, i in h:
                dest[r][i] = d
    return dest


def _best_change(hi: list[tuple], lo: list[tuple], gap: int):
    """(sequence to move, None) or (sequence, shorter one to swap back) whose length change is
    nearest ``gap / 2`` within ``(0, gap)``; None when no change narrows the gap."""
    moves = [(abs(2 * a[0] - gap), a) for a in hi if 0 < a[0] < gap]
    if moves:
        return min(moves)[1], None
    shorter = sorted(lo)
    best = None
    for a in hi:  # for each a, the b nearest a - gap / 2 among those with a - gap < b < a
        k = bisect.bisect_left(shorter, (a[0] - gap / 2,))
        for b in shorter[max(k - 1, 0):k + 1]:
            if 0 < a[0] - b[0] < gap:
                cand = (abs(2 * (a[0] - b[0]) - gap), a, b)
                best = cand if best is None or cand < best else best
    return None if best is None else best[1:]


def received(dest: list[list[int]], rank: int) -> list[tuple[int, int]]:
    """(source rank, index) of what ``rank`` holds after the exchange, in that order."""
    return [(r, i) for r, ds in enumerate(dest) for i, d in enumerate(ds) if d == rank]


# --- the exchange ------------------------------------------------------------------------------
def exchange(batch: dict, lengths_by_rank: list[list[int]], dest: list[list[int]],
             *, rank: int, group, width_multiple: int = 1) -> dict:
    """Move ``batch``'s sequences to their ``dest`` ranks (collective over ``group``).

    ``batch`` holds this rank's ``[S, L, ...]`` per-token and ``[S, ...]`` per-sequence tensors;
    only a sequence's first ``length`` tokens travel (later ones change no loss term). Returns
    the received batch in :func:`received` order, its per-token tensors ``[S', L']`` zero past
    each sequence's length, ``L'`` its longest sequence rounded up to ``width_multiple``.
    """
    S, L = batch["tokens"].shape
    device = runtime.device()
    mine = lengths_by_rank[rank]
    sent = [i for d in range(len(dest)) for i in range(S) if dest[rank][i] == d]  # by destination
    got = received(dest, rank)  # by source
    got_len = [lengths_by_rank[r][i] for r, i in got]
    width = -(-max(got_len, default=1) // width_multiple) * width_multiple
    send_idx = token_index(sent, [mine[i] for i in sent], L, device)
    recv_idx = token_index(list(range(len(got))), got_len, width, device)
    seq_splits = ([sum(d == k for d in dest[rank]) for k in range(len(dest))],
                  [sum(r == k for r, _ in got) for k in range(len(dest))])
    tok_splits = ([sum(mine[i] for i in range(S) if dest[rank][i] == k) for k in range(len(dest))],
                  [sum(n for (r, _), n in zip(got, got_len) if r == k) for k in range(len(dest))])
    out = {}
    for key, v in batch.items():
        v = v.to(device)
        if tuple(v.shape[:2]) == (S, L):  # per token: the real tokens only
            send = v.reshape(S * L, *v.shape[2:])[send_idx]
            buf = _all_to_all(send, len(recv_idx), *tok_splits, group)
            full = buf.new_zeros(len(got) * width, *v.shape[2:])
            full[recv_idx] = buf
            out[key] = full.view(len(got), width, *v.shape[2:])
        else:  # per sequence
            send = v[torch.tensor(sent, dtype=torch.long, device=device)]
            out[key] = _all_to_all(send, len(got), *seq_splits, group)
    return out


def _all_to_all(send: torch.Tensor, n_recv: int, send_split: list[int], recv_split: list[int],
                group) -> torch.Tensor:
    buf = send.new_empty(n_recv, *send.shape[1:])
    dist.all_to_all_single(buf, send.contiguous(), recv_split, send_split, group=group)
    return buf


def imbalance(lengths_by_rank: list[list[int]], dest: list[list[int]], groups: list[list[int]]) -> float:
    """Over the mini-batches (``groups``), the largest of: the most loaded rank's tokens over
    the mean (1.0: even; 1.0 for an empty group). The ranks wait for each other once per
    mini-batch, at the gradient reduction."""
    worst = 1.0
    for group in groups:
        loads = [0] * len(dest)
        for r, ls in enumerate(lengths_by_rank):
            for i in group:
                loads[dest[r][i]] += ls[i]
        mean = sum(loads) / len(loads)
        worst = max(worst, max(loads) / mean if mean else 1.0)
    return worst
