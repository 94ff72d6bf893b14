"""The experts the built-in sampler routed each token to, per sampled sequence (R3 and the
rollout/training route agreement; docs/moe.md).

A MoE policy's routers record their top-k in every sampler forward (Megatron's ``RouterReplay`` in
``RECORD``, as the old-policy pass records them for R2): the prefill of a history, every decode
step, on each decode path. Each forward's routes, ``[rows, width, layers, k]``, are written into
the fed streams' :class:`RouteTrace` at the positions those tokens sit at, so restarts and
chunked prefills need no special case (the last routing of a position wins). The rollout batch
then carries them as ``[sequences, positions, layers, k]``, aligned with its tokens: a token's
routes are those of the forward that took it as input, which is how the trainer's passes route it.

Positions the sampler never fed (the last sampled token, whose output nobody reads, and the
batch's padding) hold :func:`fill_routes`: experts ``0..k-1``, distinct so that a replay of them
is a valid top-k; no trained log-prob depends on them (the loss mask is 0 there and attention is
causal), and the agreement metric counts only trained tokens.
"""

from __future__ import annotations

import torch

from emapg_megatron.models.routing_replay import layers_to_routes


def fill_routes(length: int, layers: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """``[length, layers, k]`` of experts ``0..k-1``: what an unrouted position holds."""
    return torch.arange(k, dtype=dtype).expand(length, layers, k).clone()


class RouteTrace:
    """One sequence's routes by position, as the sampler fed it (host memory, grown by doubling:
    a decode step writes one position)."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.length = 0

    def write(self, start: int, routes: torch.Tensor) -> None:
        """Positions ``start .. start + len(routes) - 1`` take ``routes`` (``[w, layers, k]``);
        the trace then ends there (a restart from 0 forgets what followed)."""
        end = start + routes.shape[0]
        if self.buffer is None or self.buffer.shape[0] < end:
            grown = fill_routes(max(end, 2 * (0 if self.buffer is None else self.buffer.shape[0])),
                                *routes.shape[1:], routes.dtype)
            if self.buffer is not None:
                grown[:self.length] = self.buffer[:self.length]
            self.buffer = grown
        self.buffer[start:end] = routes.to(self.buffer.device)
        self.length = end

    def routes(self) -> torch.Tensor | None:
        """``[positions routed, layers, k]``, None when nothing was recorded."""
        return None if self.buffer is None else self.buffer[:self.length]


def write_rows(traces: list[RouteTrace], starts: list[int], lengths: list[int],
               routes: torch.Tensor) -> None:
    """A forward's ``[rows, width, layers, k]`` routes into each row's trace: row ``i`` fed
    ``lengths[i]`` tokens at ``starts[i]..`` (the rest of its width is padding)."""
    routes = routes.cpu()  # one device-to-host copy per forward
    for i, (trace, start, length) in enumerate(zip(traces, starts, lengths)):
        trace.write(start, routes[i, :length])


def batch_routes(traces: list[RouteTrace], width: int) -> torch.Tensor | None:
    """The sequences' routes as the rollout batch lays them, ``[S, width, layers, k]`` (unrouted
    positions: :func:`fill_routes`); None when no sequence was recorded."""
    return lay_routes([t.routes() for t in traces], width)


def lay_routes(recorded: list[torch.Tensor | None], width: int) -> torch.Tensor | None:
    """Each sequence's ``[positions, layers, k]`` routes (None: none recorded) as rows of a batch
    ``[S, width, layers, k]`` from position 0, the rest :func:`fill_routes`; None when no
    sequence has any."""
    shape = next((r for r in recorded if r is not None), None)
    if shape is None:
        return None
    out = fill_routes(width, *shape.shape[1:], shape.dtype).expand(len(recorded), -1, -1, -1).clone()
    for row, r in zip(out, recorded):
        if r is not None:
            row[:min(width, r.shape[0])] = r[:width]
    return out


def pad_routes(routes: torch.Tensor, pad: int) -> torch.Tensor:
    """``[S, L, layers, k]`` routes widened by ``pad`` unrouted positions (:func:`fill_routes`)."""
    if not pad:
        return routes
    fill = fill_routes(pad, *routes.shape[2:], routes.dtype).expand(routes.shape[0], -1, -1, -1)
    return torch.cat([routes, fill.to(routes.device)], dim=1)


def recorded_routes(replays: list, b: int, s: int, dtype: torch.dtype) -> torch.Tensor:
    """What ``replays`` (the stage's ``RouterReplay`` s, in ``RECORD``) recorded in a forward of
    ``[b, s]`` tokens, ``[b, s, layers, k]``."""
    return layers_to_routes([r.get_recorded_indices() for r in replays], b, s, dtype)
