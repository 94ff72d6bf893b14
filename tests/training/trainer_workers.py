"""Rank functions for the trainer tests (spawned)."""

import math

import torch

from emapg_megatron.arguments import parse_args
from emapg_megatron.build import model_config


def save_initial_weights(ckpt_dir: str, argv: list, poison: bool = False):
    """Write a model-only dist checkpoint for --pretrained-checkpoint (same weights at any layout)."""
    import os

    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)

    from emapg_megatron.models.gpt import build_for_this_rank

    cfg = model_config(parse_args(argv))
    gpt = build_for_this_rank(cfg)
    if poison:
        with torch.no_grad():
            gpt.decoder.final_layernorm.weight[0] = math.nan
    dist_checkpointing.save(gpt.sharded_state_dict(), ckpt_dir)
    return None
