"""Continuous batching of a rollout's sequences over the slots of a
:class:`~emapg_megatron.rollout.static_decode.StaticDecoder`.

Sequences wait in a queue; ``--inference-max-requests`` slots decode together, and the moment a
slot's sequence finishes the next waiting one is fed into it (its prefill), before the next
decode step, so the batch never waits for its longest sequence. ``waves`` refills only once
every slot is empty: the lockstep schedule of Megatron's static context, kept to compare with
(``tools/bench_rollout.py --compare-scheduling``).

The per-sequence protocol is :func:`~emapg_megatron.rollout.kv_cache_decoding.decode_lockstep`'s
(``Stream``, an ``advance`` callback that records a step's tokens and says of each row whether it
continues, is done or must restart), so the sampler's single- and multi-turn callers drive either
path. A sequence's tokens depend only on its own history and uniforms (keyed by its global
index), never on its slot or its neighbours: both schedules sample the same.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from emapg_megatron.rollout.kv_cache_decoding import (
    CONTINUE,
    DONE,
    RESTART,
    Stream,
    _needs_restart,
)

SCHEDULES = ("continuous", "waves")


@dataclass
class ScheduleStats:
    """Decode forwards (fixed-shape steps), prefill forwards (each feeds every history waiting),
    histories prefilled, and live slots summed over the decode steps, over one or more runs."""

    decode_forwards: int = 0
    prefill_forwards: int = 0
    prefilled: int = 0
    live_slot_steps: int = 0

    @property
    def mean_live_slots(self) -> float:
        return self.live_slot_steps / self.decode_forwards if self.decode_forwards else 0.0


def next_uniform(stream: Stream) -> float:
    """The uniform of the stream's next token in its current turn."""
    return stream.uniforms[len(stream.turn.token_ids)]


def to_feed(fed: int, before: list[int], after: list[int], status: str) -> int | None:
    """Where a row's history must be fed from after ``advance``: None when the token it just
    sampled is all that is new (the next decode step feeds it), ``fed`` when history was appended
    (an observation), 0 when the history rewrote cached tokens (the slot starts over)."""
    if status == RESTART or _needs_restart(before, after, fed):
        return 0
    return fed if len(after) > fed + 1 else None


class SlotScheduler:
    """Runs streams through a decoder's slots (see the module doc)."""

    def __init__(self, decoder, advance, schedule: str = "continuous", stats: ScheduleStats | None = None):
        assert schedule in SCHEDULES, schedule
        self.decoder, self.advance, self.schedule = decoder, advance, schedule
        self.stats = stats if stats is not None else ScheduleStats()
        self.slots: list[Stream | None] = [None] * decoder.slots

    def run(self, streams: list[Stream], halted=None) -> None:
        """Run until no stream is left, or until ``halted(busy)`` says stop; it is asked before
        every step, ``busy`` saying whether this rank has streams left (partial rollouts: the
        sequences left, live or waiting, keep what they sampled; across data-parallel ranks it
        agrees, and a rank with nothing left keeps asking until every rank stops)."""
        queue = deque(streams)
        while not self._stop(bool(queue or self._live()), halted):
            if self.schedule == "continuous" or not self._live():
                self._admit(queue)
            live = self._live()
            if live:
                ids, lps = self.decoder.step(live, [next_uniform(self.slots[i]) for i in live])
                self.stats.decode_forwards += 1
                self.stats.live_slot_steps += len(live)
                self._feed(self._settle(live, ids, lps))

    @staticmethod
    def _stop(busy: bool, halted) -> bool:
        return not busy if halted is None else halted(busy)

    def _live(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s is not None]

    def _admit(self, queue: deque) -> None:
        """Every free slot takes the next waiting sequence's prefill (which may finish it at
        once: then the slot takes the next)."""
        while queue and None in self.slots:
            pending = []
            for i, s in enumerate(self.slots):
                if s is None and queue:
                    self.slots[i] = queue.popleft()
                    pending.append((i, 0))
            self._feed(pending)

    def _feed(self, pending: list[tuple[int, int]]) -> None:
        """Feed each ``(slot, start)``'s history from ``start`` and record the token sampled
        after it; feeding again where that brings new history (until none does)."""
        while pending:
            rows = [i for i, _ in pending]
            ids, lps = self.decoder.extend(rows, [self.slots[i].known[start:] for i, start in pending],
                                           [start for _, start in pending],
                                           [next_uniform(self.slots[i]) for i in rows])
            self.stats.prefill_forwards += 1
            self.stats.prefilled += len(rows)
            pending = self._settle(rows, ids, lps)

    def _settle(self, rows: list[int], ids: list[int], lps: list[float]) -> list[tuple[int, int]]:
        """Record one sampled token per row, all in one ``advance`` call (one environment
        agreement per step); free the finished slots; returns the rows with history to feed."""
        due = [self.slots[i] for i in rows]
        before = [s.known for s in due]  # advance appends to them, or replaces them at a turn's end
        pending = []
        for i, s, known, status in zip(rows, due, before, self.advance(due, ids, lps)):
            if status == DONE:
                routes = self.decoder.routes_of(i)  # what the slot fed it, before another takes it
                if routes is not None:
                    s.trace.write(0, routes)
                self.slots[i] = None
                self.decoder.free(i)
                continue
            assert status in (CONTINUE, RESTART), status
            start = to_feed(self.decoder.fed[i], known, s.known, status)
            if start is not None:
                pending.append((i, start))
        return pending
