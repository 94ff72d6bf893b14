"""A mixture-of-experts step's router losses, read from Megatron-Core's tracker.

Megatron's router adds its load-balancing and z losses to the backward itself
(``MoEAuxLossAutoScaler``, scaled by the pipeline schedule to a mean over micro-batches), so the
trainer's loss never sees them; each training forward also records them per layer in Megatron's
logging tracker, which this module reads once per step for the metrics.
"""

from __future__ import annotations

from megatron.core.transformer.moe import moe_utils

METRIC_NAMES = {"load_balancing_loss": "moe_aux_loss", "seq_load_balancing_loss": "moe_seq_aux_loss",
                "global_load_balancing_loss": "moe_global_aux_loss", "z_loss": "moe_z_loss"}


def router_loss_metrics(forwards: int, moe_layers: int) -> dict:
    """Each router loss the step's ``forwards`` training micro-batches recorded, as its mean per
    MoE layer and micro-batch: summed over pipeline stages, averaged over data-parallel ranks
    (Megatron's reduction), then the tracker is cleared for the next step. Collective: every
    rank calls it (none is recorded without an aux or z loss coefficient: then ``{}``)."""
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if not tracker:
        return {}
    moe_utils.reduce_aux_losses_tracker_across_ranks()
    out = {METRIC_NAMES.get(name, f"moe_{name}"): float(entry["values"].sum()) / max(forwards * moe_layers, 1)
           for name, entry in sorted(tracker.items())}
    moe_utils.clear_aux_losses_tracker()
    return out
