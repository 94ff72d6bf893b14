"""What a training step does for a mixture-of-experts policy, beside the dense step.

* the routes: the old-policy pass records the experts each token was routed to
  (``models.routing_replay``); under ``--moe-routing-replay r2`` the training passes replay them.
  Under ``r3`` the old-policy and training passes replay the routes the sampler took
  (``ROLLOUT_ROUTES``, recorded by ``rollout.route_recording``) instead. Otherwise the routes are
  dropped once the step's metrics are counted;
* the metrics: expert load per MoE layer (the most-loaded expert over the mean, over the tokens
  whose log-prob trains, summed over data-parallel ranks), the router losses
  (``training.router_losses``) and, when the sampler recorded its routes, the share of trained
  tokens the old pass routed as the sampler did (``moe_route_agreement``).

Routes are recorded where they lie per padded sequence on one stage: at PP = 1, without sequence
parallelism or packing (those layouts train without the route metrics; replay refuses them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from emapg_megatron.errors import ConfigError
from emapg_megatron.models.routing_replay import (
    ROLLOUT_ROUTES,
    ROUTES,
    expert_load,
    route_agreement,
    route_dtype,
)
from emapg_megatron.training.router_losses import router_loss_metrics

REPLAYS = ("r2", "r3")


class MoERouting:
    def __init__(self, num_experts: int, num_layers: int, *, replay: str, record: bool):
        # num_layers: the MoE layers (a model may mix in dense ones); replay: none, r2 or r3
        self.num_experts, self.num_layers, self.replay = num_experts, num_layers, replay
        self.record_dtype = route_dtype(num_experts) if record or self.replay in REPLAYS else None
        """The dtype routes are recorded in (the old pass's, the sampler's); None: no recording."""

    @classmethod
    def for_policy(cls, model_cfg, moe, *, pipeline: int, sequence_parallel: bool,
                   packing: bool) -> "MoERouting | None":
        """None for a dense policy."""
        if not model_cfg.is_moe:
            return None
        record = pipeline == 1 and not packing  # routes laid per padded sequence, on one stage
        return cls(model_cfg.num_experts, len(model_cfg.moe_layers), replay=moe.routing_replay,
                   record=record)

    def before_passes(self, batch: dict) -> dict:
        """Under R3 the sampler's routes are the ones the passes replay."""
        if self.replay != "r3":
            return batch
        if ROLLOUT_ROUTES not in batch:
            raise ConfigError("--moe-routing-replay r3: this step's rollout carries no routes (the "
                              "built-in sampler and vLLM return them only at PP = 1 without packing): "
                              "use r2")
        return {**batch, ROUTES: batch[ROLLOUT_ROUTES]}

    def old_pass(self) -> dict:
        """How the old-policy pass routes (``training.schedule.forward_only``'s keywords)."""
        if self.replay == "r3":
            return {"replay_routes": True}
        return {"record_routes": self.record_dtype}

    def after_passes(self, batch: dict) -> tuple[dict, dict]:
        """The batch the update trains on (the routes kept only to be replayed) and the step's
        route metrics (collective over data-parallel ranks)."""
        routes, sampled = batch.get(ROUTES), batch.get(ROLLOUT_ROUTES)
        batch = {k: v for k, v in batch.items()
                 if k != ROLLOUT_ROUTES and (k != ROUTES or self.replay in REPLAYS)}
        if routes is None:
            return batch, {}
        counts = expert_load(routes, batch["mask"], self.num_experts)
        dist.all_reduce(counts, group=ps.get_data_parallel_group())
        ratio = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)  # per layer
        metrics = {"moe_load_max_over_mean": float(ratio.mean()),
                   "moe_load_max_over_mean_worst": float(ratio.max()),
                   **{f"moe_load_max_over_mean/layer{i}": float(r) for i, r in enumerate(ratio.tolist())}}
        if sampled is not None:
            # the old pass's routes are the training passes' first forward's: same weights, and
            # under r2/r3 the very routes they replay
            agreed = torch.tensor(route_agreement(routes, sampled, batch["mask"]), dtype=torch.float64,
                                  device=routes.device)
            dist.all_reduce(agreed, group=ps.get_data_parallel_group())
            metrics["moe_route_agreement"] = float(agreed[0] / agreed[1]) if agreed[1] else 1.0
        return batch, metrics

    def router_losses(self, forwards: int) -> dict:
        return router_loss_metrics(forwards, self.num_layers)
