"""Routing replay for a mixture-of-experts policy (``--moe-routing-replay r2``), on Megatron-Core's
``RouterReplay``.

Without replay, each forward of a MoE policy routes every token afresh, so a pass whose weights
differ slightly from the sampler's (or from the old-policy pass's, after an update) may send a
token to other experts: a discontinuous change of its log-prob that the importance ratio then
reads as a policy change. R2 records, in the old-policy pass, the experts each router chose for
each token, and the training passes of the step replay them: the routes are those of the policy
that produced the old log-probs, while the routing weights (and every other weight) still train.

Megatron's router takes its top-k from a ``RouterReplay`` when ``moe_enable_routing_replay`` is
set: recorded (``RECORD``) or given (``REPLAY_FORWARD``), per layer, as ``[s * b, k]`` expert
indices in the router's token order (sequence-major, the layer's ``[s, b]`` input flattened).
Here the routes travel with the batch per sequence, ``[b, s, layers, k]``, so that a training
micro-batch, which regroups sequences, carries its own. Under sequence parallelism a TP rank's
routers see its contiguous part of the sequence: it records that part (gathered into the whole
over the TP group) and replays it. The anchor pass (the EMA swapped in, or a
teacher) routes itself: the anchor is another model, whose routing is part of the distribution the
KL term compares with; replaying the policy's routes would make the anchor a function of the policy.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

ROUTES = "moe_routes"
"""The batch key of the recorded routes: ``[sequences, positions, MoE layers, k]`` expert indices."""

ROLLOUT_ROUTES = "moe_rollout_routes"
"""The batch key of the routes the sampler took (``rollout.route_recording``), laid out like
``ROUTES``: replayed under R3, compared with the old pass's otherwise."""


def router_replays(model) -> list:
    """This stage's routers' ``RouterReplay``, in layer order (empty: replay is off)."""
    return [m.router_replay for m in model.modules()
            if isinstance(m, TopKRouter) and getattr(m, "router_replay", None) is not None]


def route_dtype(num_experts: int) -> torch.dtype:
    """The narrowest dtype holding an expert index (the routes of a long batch are many)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def layers_to_routes(per_layer: list[torch.Tensor], b: int, s: int, dtype: torch.dtype) -> torch.Tensor:
    """``[s * b, k]`` per layer (the router's token order) -> ``[b, s, layers, k]``."""
    return torch.stack([t.view(s, b, -1).transpose(0, 1) for t in per_layer], dim=2).to(dtype)


def routes_to_layers(routes: torch.Tensor) -> list[torch.Tensor]:
    """``[b, s, layers, k]`` -> ``[s * b, k]`` int64 per layer (what the router gathers with)."""
    b, s, layers, k = routes.shape
    return [routes[:, :, i].transpose(0, 1).reshape(s * b, k).long() for i in range(layers)]


def sequence_split(model) -> tuple | None:
    """Under sequence parallelism (TP > 1), ``(TP group, TP size, TP rank)``: each rank's routers see
    its contiguous ``1 / TP`` of the sequence (the ``[s, b]`` input split on ``s``); else None."""
    router = next((m for m in model.modules() if isinstance(m, TopKRouter)), None)
    if router is None or not router.config.sequence_parallel:
        return None
    tp = ps.get_tensor_model_parallel_world_size()
    return None if tp == 1 else (ps.get_tensor_model_parallel_group(), tp, ps.get_tensor_model_parallel_rank())


def _gather_sequence(local: torch.Tensor, split: tuple) -> torch.Tensor:
    """Each TP rank's ``[b, s / TP, layers, k]`` routes -> the whole ``[b, s, layers, k]``
    (sent as int32: NCCL has no int16)."""
    group, tp, _ = split
    sent = local.to(torch.int32).contiguous()
    parts = [torch.empty_like(sent) for _ in range(tp)]
    dist.all_gather(parts, sent, group=group)
    return torch.cat(parts, dim=1).to(local.dtype)


def _local_sequence(routes: torch.Tensor, split: tuple | None) -> torch.Tensor:
    """This TP rank's part of ``[b, s, layers, k]`` routes under sequence parallelism."""
    if split is None:
        return routes
    _, tp, rank = split
    part = routes.shape[1] // tp
    return routes[:, rank * part:(rank + 1) * part]


@contextlib.contextmanager
def recording(model, b: int, s: int, dtype: torch.dtype):
    """Record the routes of the forward of ``[b, s]`` tokens run in the block: yields a function
    returning them, ``[b, s, layers, k]`` (None when replay is off); under sequence parallelism
    each TP rank records its part of the sequence, and the function gathers the whole (a
    collective over the TP group)."""
    replays, split = router_replays(model), sequence_split(model)

    def read():
        if not replays:
            return None
        local = layers_to_routes([r.get_recorded_indices() for r in replays], b,
                                 s // split[1] if split else s, dtype)
        return local if split is None else _gather_sequence(local, split)

    with recording_routers(replays):
        yield read


@contextlib.contextmanager
def recording_routers(replays: list):
    """``replays`` record each forward's top-k in the block (each forward overwrites the last:
    read them after every forward); cleared after."""
    for r in replays:
        r.clear_indices()
        r.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield
    finally:
        for r in replays:
            r.clear_router_replay_action()
            r.clear_indices()


@contextlib.contextmanager
def replaying(model, routes: torch.Tensor | None):
    """The forward run in the block takes its experts from ``routes`` (``[b, s, layers, k]``);
    nothing changes when ``routes`` is None or replay is off."""
    replays = router_replays(model) if routes is not None else []
    targets = routes_to_layers(_local_sequence(routes, sequence_split(model))) if replays else []
    if replays and len(targets) != len(replays):
        raise ValueError(f"routes for {len(targets)} MoE layers, the model has {len(replays)}")
    for r, target in zip(replays, targets):
        r.clear_indices()
        r.set_target_indices(target)
        r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for r in replays:
            r.clear_router_replay_action()
            r.clear_indices()


def route_agreement(routes: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    """(tokens whose expert set equals ``reference``'s in every MoE layer, tokens) over the
    positions where ``mask`` ([b, s]) is set; the order of a token's k experts does not count
    (a replay may list them in another order than the top-k did)."""
    sel = mask.bool()
    a, b = (r[sel].long().sort(dim=-1).values for r in (routes, reference))  # [tokens, layers, k]
    return int((a == b).flatten(1).all(dim=1).sum()), int(sel.sum())


def expert_load(routes: torch.Tensor, mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert of each layer, ``[layers, experts]`` (float64), over the
    positions where ``mask`` ([b, s]) is set."""
    picked = routes[mask.bool()].long()  # [tokens, layers, k]
    counts = torch.zeros(picked.shape[1], num_experts, dtype=torch.float64, device=routes.device)
    if picked.numel():
        ones = torch.ones(picked.shape[0] * picked.shape[2], dtype=torch.float64, device=routes.device)
        for layer in range(picked.shape[1]):
            counts[layer].index_add_(0, picked[:, layer].reshape(-1), ones)
    return counts
