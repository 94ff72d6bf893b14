"""What a training step does for a mixture-of-experts policy, beside the dense step.

* the old-policy pass records the experts each token was routed to (``models.routing_replay``);
  under ``--moe-routing-replay r2`` the training passes replay them, otherwise they are dropped
  once the step's expert load is counted;
* the metrics: expert load per MoE layer (the most-loaded expert over the mean, over the tokens
  whose log-prob trains, summed over data-parallel ranks) and the router losses
  (``training.router_losses``).

Routes are recorded where they lie per padded sequence on one stage: at PP = 1, without sequence
parallelism or packing (those layouts train without the load metrics; replay refuses them).
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state as ps

from emapg_megatron.models.routing_replay import ROUTES, expert_load, route_dtype
from emapg_megatron.training.router_losses import router_loss_metrics


class MoERouting:
    def __init__(self, num_experts: int, num_layers: int, *, replay: bool, record: bool):
        # num_layers: the MoE layers (a model may mix in dense ones)
        self.num_experts, self.num_layers, self.replay = num_experts, num_layers, replay
        self.record_dtype = route_dtype(num_experts) if record or replay else None
        """The dtype the old pass records routes in; None: no recording."""

    @classmethod
    def for_policy(cls, model_cfg, moe, *, pipeline: int, sequence_parallel: bool,
                   packing: bool) -> "MoERouting | None":
        """None for a dense policy."""
        if not model_cfg.is_moe:
            return None
        record = pipeline == 1 and not sequence_parallel and not packing
        return cls(model_cfg.num_experts, len(model_cfg.moe_layers), replay=moe.routing_replay == "r2",
                   record=record)

    def after_passes(self, batch: dict) -> tuple[dict, dict]:
        """The batch the update trains on (the routes kept only to be replayed) and the step's
        expert-load metrics (collective over data-parallel ranks)."""
        routes = batch.get(ROUTES)
        if routes is None:
            return batch, {}
        counts = expert_load(routes, batch["mask"], self.num_experts)
        dist.all_reduce(counts, group=ps.get_data_parallel_group())
        ratio = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)  # per layer
        metrics = {"moe_load_max_over_mean": float(ratio.mean()),
                   "moe_load_max_over_mean_worst": float(ratio.max()),
                   **{f"moe_load_max_over_mean/layer{i}": float(r) for i, r in enumerate(ratio.tolist())}}
        if not self.replay:
            batch = {k: v for k, v in batch.items() if k != ROUTES}
        return batch, metrics

    def router_losses(self, forwards: int) -> dict:
        return router_loss_metrics(forwards, self.num_layers)
