"""Atomic training checkpoints through megatron.core.dist_checkpointing.

Layout (Megatron-LM style)::

    SAVE/latest_checkpointed_iteration.txt     # written last, via rename
    SAVE/iter_0000020/                         # torch_dist checkpoint, resharding-capable
        model.*  optimizer.*  ema.*  rng_state  + common.pt (step, scheduler, data position)

All ranks write into ``iter_N.tmp``; rank 0 renames it once every rank is done, then
updates the tracker file. A crash mid-save leaves only a ``.tmp`` directory, never a
checkpoint that looks complete.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from emapg_megatron.runtime import ConfigError

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_sharded_object():
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = dist.get_rank(), dist.get_world_size()
    state = {"torch": torch.get_rng_state(), "world_size": world}
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def save(root: str, iteration: int, sharded_state_dict: dict, common: dict) -> str:
    """Save ``sharded_state_dict`` (model/optimizer/ema ...) and ``common`` atomically."""
    from megatron.core import dist_checkpointing

    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    state = dict(sharded_state_dict, rng_state=_rng_sharded_object(), common=common)
    dist_checkpointing.save(state, tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _atomic_write_text(os.path.join(root, TRACKER), str(iteration))
    dist.barrier()
    return final


def latest_iteration(root: str) -> int:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        raise ConfigError(f"--load {root}: no {TRACKER} (not a checkpoint directory)")
    text = open(path, encoding="utf-8").read().strip()
    if not text.isdigit() or not os.path.isdir(iteration_dir(root, int(text))):
        raise ConfigError(f"--load {root}: corrupt {TRACKER} ({text!r})")
    return int(text)


# megatron-core 0.16.1 rejects the DistributedOptimizer's default (flattened) sharding on save.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def optimizer_sharded_state_dict(optimizer, model_sharded_state_dict: dict, *, is_loading: bool = False):
    return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading,
                                        metadata=OPTIMIZER_METADATA)


def materialize_optimizer_state(model_chunks, optimizer) -> None:
    """megatron-core 0.16.1 with torch Adam (no TE/Apex) cannot describe optimizer state before
    the first step; a zero-gradient step creates it. Everything it touches is then overwritten
    by the checkpoint load."""
    from emapg_megatron.training.model_and_optimizer import zero_grads

    zero_grads(model_chunks, optimizer)
    optimizer.step()


def restore_adam_steps(optimizer, loaded_optimizer_state: dict) -> None:
    """megatron-core 0.16.1's load keeps the live per-parameter Adam ``step`` (and shares one
    tensor between parameters); put back the checkpoint's step, one tensor per parameter."""
    groups = _find_param_groups(loaded_optimizer_state)
    if not groups or "step" not in groups[0]:
        return
    step = float(groups[0]["step"])
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step)


def _find_param_groups(state):
    if isinstance(state, dict):
        if "param_groups" in state:
            return state["param_groups"]
        for value in state.values():
            found = _find_param_groups(value)
            if found:
                return found
    return None


def load(root: str, sharded_state_dict: dict) -> tuple[int, dict]:
    """Load into the given sharded state dict; returns (iteration, loaded state)."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root)
    path = iteration_dir(root, iteration)
    state = dict(sharded_state_dict, rng_state=_rng_sharded_object())
    try:
        loaded = dist_checkpointing.load(state, path)
    except BaseException as e:  # noqa: BLE001 - CheckpointException derives from BaseException
        raise ConfigError(f"--load {path}: cannot load checkpoint: {str(e).splitlines()[0]}") from e
    rng = loaded.pop("rng_state")
    if rng["world_size"] == dist.get_world_size():
        torch.set_rng_state(rng["torch"])
    return iteration, loaded
