"""Atomic training checkpoints through megatron.core.dist_checkpointing.

Layout (Megatron-LM style)::

    SAVE/latest_checkpointed_iteration.txt     # written last, via rename
    SAVE/iter_0000020/                         # torch_dist checkpoint, resharding-capable
        model.*  optimizer.*  ema.*  rng_state  + common.pt (step, scheduler, data position)

All ranks write into ``iter_N.tmp``; rank 0 renames it once every rank is done, then
updates the tracker file. A crash mid-save leaves only a ``.tmp`` directory, never a
checkpoint that looks complete.

Loading never executes code from the checkpoint (:mod:`.safe_load` checks every pickle
first) and a damaged checkpoint is one ConfigError line. ``common`` records the saving layout
(world, TP, PP, DP, optimizer format): a resume at another layout reshards the model, optimizer
and EMA, reseeds the per-rank RNG with a warning, and refuses in one line what megatron cannot
reshard (switching --use-distributed-optimizer; the distributed optimizer across TP/PP).
"""

from __future__ import annotations

import json
import math
import os
import shutil

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject

from emapg_megatron import mcore_compat
from emapg_megatron.checkpoint.files import atomic_write_text, fsync_dir, replace_dir
from emapg_megatron.checkpoint.lora_base import BaseRecord, check_same_base
from emapg_megatron.checkpoint.paths import (  # noqa: F401  (re-exported)
    MODEL_KEY_PREFIXES,
    TRACKER,
    iteration_dir,
    partial_saves,
)
from emapg_megatron.checkpoint.safe_load import (
    COMMON,
    shown,
    verify_loaded_extra_state,
    verify_on_every_rank,
)
from emapg_megatron.errors import CheckpointWriteError, ConfigError, WeightsError, agreed
from emapg_megatron.lora.config import is_adapter_name
from emapg_megatron.models.gpt import global_param_name, unwrap
from emapg_megatron.training.collectives import on_rank0
from emapg_megatron.training.model_and_optimizer import zero_grads

LAYOUT_KEY = "checkpoint_layout"  # in ``common``: how the checkpoint was saved
LORA_BASE_KEY = "lora_base"  # in ``common``: the base of an adapters-only checkpoint (lora_base.py)


def _rng_sharded_object():
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {"torch": torch.get_rng_state(), "world_size": world}
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def save(root: str, iteration: int, sharded_state_dict: dict, common: dict,
         files: dict[str, str] | None = None) -> str:
    """Save ``sharded_state_dict`` (model/optimizer/ema ...), ``common`` and the text ``files``
    (name -> content, e.g. the converter's model config) atomically."""
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    failed = f"--save {root}: could not write step {iteration} (the previous checkpoint is kept)"

    def make_tmp():
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            raise CheckpointWriteError(f"{failed}: {e}") from e

    on_rank0(make_tmp)  # every rank raises on a failure, none waits at a barrier
    common = dict(common, **{LAYOUT_KEY: current_layout(sharded_state_dict)})
    state = dict(sharded_state_dict, rng_state=_rng_sharded_object(), common=common,
                 **{mcore_compat.VERSION_KEY: mcore_compat.VERSION})  # a later release may refuse it
    try:
        dist_checkpointing.save(state, tmp)
    except BaseException as e:  # noqa: BLE001 - CheckpointException derives from BaseException
        _reraise_in_one_line(e, failed, CheckpointWriteError)
    dist.barrier()

    def install():
        try:
            for name, text in (files or {}).items():
                with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                    f.write(text)
            _install(root, tmp, final, iteration)
        except OSError as e:
            raise CheckpointWriteError(f"could not move checkpoint {tmp} into place: {e}") from e

    on_rank0(install)  # every rank raises on a failure, none waits at a barrier
    return final


def _reraise_in_one_line(e: BaseException, what: str, kind=ConfigError) -> None:
    """Megatron's and torch's checkpoint errors (a BaseException, many lines) as one line of
    ``kind`` (ConfigError: a checkpoint to read; CheckpointWriteError: one being written); an
    interrupt or exit passes through."""
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
        raise e
    lines = str(e).strip().splitlines() or [type(e).__name__]
    raise kind(f"{what}: {lines[0]}") from e


def _install(root: str, tmp: str, final: str, iteration: int) -> None:
    """Rename the written ``tmp`` to ``final`` and point the tracker at it. A checkpoint already
    at ``final`` (the same step saved again) is deleted only once the tracker names the new one
    (:func:`replace_dir`), so the tracker's step stays whole."""
    old = replace_dir(tmp, final)
    fsync_dir(root)  # the step's directory is in place before the tracker names it
    atomic_write_text(os.path.join(root, TRACKER), str(iteration))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def latest_iteration(root: str) -> int:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        partial = partial_saves(root) if os.path.isdir(root) else []
        why = (f"no complete checkpoint, only {', '.join(partial)} (a save that was interrupted); start "
               "without --load, with --overwrite to clear the folder" if partial else "not a checkpoint directory")
        raise ConfigError(f"--load {root}: no {TRACKER} ({why})")
    with open(path, "rb") as f:
        raw = f.read(64)
    text = raw.decode("utf-8", errors="replace").strip()
    if not text.isdigit() or not text.isascii():
        shown = text if len(text) <= 20 else text[:20] + "..."
        raise ConfigError(f"--load {root}: corrupt {TRACKER} ({shown!r})")
    if not os.path.isdir(iteration_dir(root, int(text))):
        raise ConfigError(f"--load {root}: corrupt {TRACKER}: it names step {int(text)}, which has "
                          f"no {os.path.basename(iteration_dir(root, int(text)))} directory")
    return int(text)


def agreed_latest_iteration(root: str) -> int:
    """The tracker's step as rank 0 reads it, on every rank: one read, where ranks reading it on
    their own could see different steps of a directory another run is writing. Its errors raise
    on every rank."""
    return on_rank0(lambda: latest_iteration(root))


def check_train_iters(train_iters: int, load_root: str) -> int:
    """Refuse a --train-iters below the step of the checkpoint in ``load_root``; returns that step."""
    step = latest_iteration(load_root)
    if train_iters < step:
        raise ConfigError(f"--train-iters {train_iters} is below the checkpoint's step {step} "
                          f"in {load_root}")
    return step


# megatron-core 0.16.1 rejects the DistributedOptimizer's default (flattened) sharding on save.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def optimizer_sharded_state_dict(optimizer, model_sharded_state_dict: dict, *, is_loading: bool = False):
    return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading,
                                        metadata=OPTIMIZER_METADATA)


def materialize_optimizer_state(model_chunks, optimizer) -> None:
    """megatron-core 0.16.1 with torch Adam (no TE/Apex) cannot describe optimizer state before
    the first step; a zero-gradient step creates it. Everything it touches is then overwritten
    by the checkpoint load."""
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


# --- layouts ------------------------------------------------------------------------------------
def _find_key(state, key):
    if isinstance(state, dict):
        if key in state and not isinstance(state[key], dict):
            return state[key]
        for value in state.values():
            found = _find_key(value, key)
            if found is not None:
                return found
    return None


def optimizer_format(optimizer_state) -> str | None:
    """'distributed:<sharding type>' for megatron's DistributedOptimizer, 'local' for the
    others (state keyed by model tensors), None without optimizer state."""
    if optimizer_state is None:
        return None
    sharding = _find_key(optimizer_state, "param_state_sharding_type")
    return f"distributed:{sharding}" if sharding is not None else "local"


def current_layout(sharded_state_dict: dict | None = None) -> dict:
    """This run's layout (needs the process group and megatron's parallel_state)."""
    return {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "optimizer": optimizer_format((sharded_state_dict or {}).get("optimizer")),
    }


def saved_layout(checkpoint) -> dict:
    """The layout a verified checkpoint was saved at (checked: :data:`_LAYOUT`); inferred for
    checkpoints older than :data:`LAYOUT_KEY` (then the TP/PP/DP sizes are unknown: None)."""
    common = checkpoint.common or {}
    trainer = common["common"] if isinstance(common.get("common"), dict) else {}
    if trainer.get(LAYOUT_KEY) is not None:
        where = checkpoint.common_where
        _check_entries(trainer, {LAYOUT_KEY: _DICT}, where)
        _check_entries(trainer[LAYOUT_KEY], _LAYOUT, where, f"{LAYOUT_KEY}.")
        if "expert_model_parallel_size" in trainer[LAYOUT_KEY]:  # recorded since MoE (issue 41)
            _check_entries(trainer[LAYOUT_KEY], {"expert_model_parallel_size": _SIZE}, where, f"{LAYOUT_KEY}.")
        return trainer[LAYOUT_KEY]
    shards = [fqn for fqn in (checkpoint.metadata.state_dict_metadata if checkpoint.metadata else ())
              if isinstance(fqn, str) and fqn.startswith("rng_state/shard_")]
    return {"world_size": _saved_world(shards[0]) if shards else None,
            "tensor_model_parallel_size": None, "pipeline_model_parallel_size": None,
            "data_parallel_size": None, "optimizer": optimizer_format(common.get("optimizer"))}


def _saved_world(rng_fqn: str) -> int | None:
    """The world size in the name of an RNG shard, ``rng_state/shard_<rank>_<world>``."""
    try:
        return int(rng_fqn.rsplit("_", 1)[1])
    except ValueError:
        return None


def _describe(layout: dict) -> str:
    tp, pp = layout.get("tensor_model_parallel_size"), layout.get("pipeline_model_parallel_size")
    return f"world {layout.get('world_size')} (TP={tp}, PP={pp}, DP={layout.get('data_parallel_size')})"


def check_layout(saved: dict, now: dict, path: str) -> None:
    """Refuse in one line a resume whose layout change megatron cannot reshard."""
    before, after = saved.get("optimizer"), now.get("optimizer")
    if before is None or after is None or before == after:
        pass
    elif before.startswith("distributed") != after.startswith("distributed"):
        was = "with" if before.startswith("distributed") else "without"
        is_ = "with" if after.startswith("distributed") else "without"
        raise ConfigError(
            f"--load {path}: the checkpoint was saved {was} --use-distributed-optimizer and this "
            f"run is {is_} it; their optimizer states are stored differently and cannot be "
            f"converted: resume {was} --use-distributed-optimizer")
    else:
        raise ConfigError(f"--load {path}: the checkpoint's optimizer state is in the "
                          f"'{before.split(':', 1)[1]}' format, this run's in "
                          f"'{after.split(':', 1)[1]}'; they cannot be converted")
    if (before or "").startswith("distributed") and after is not None:
        for key, flag in (("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                          ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
                          ("expert_model_parallel_size", "--expert-model-parallel-size")):
            if saved.get(key) is not None and now.get(key) is not None and saved[key] != now[key]:
                raise ConfigError(
                    f"--load {path}: the distributed optimizer's state was saved at "
                    f"{flag.lstrip('-').replace('-', ' ')} {saved[key]} and can only be resharded "
                    f"over data-parallel ranks: resume with {flag} {saved[key]} (any DP size)")


def _same_rank_layout(saved: dict, now: dict) -> bool:
    """Every rank has the same role as when saving: its RNG state can be restored as is."""
    keys = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size")
    return all(saved.get(k) is None or saved.get(k) == now[k] for k in keys) and \
        saved.get("world_size") is not None


def _reseed(iteration: int, saved: dict, now: dict) -> None:
    """A per-rank RNG state cannot be mapped onto other ranks: reseed deterministically."""
    torch.manual_seed((iteration * 1_000_003 + dist.get_rank()) % (2**63))
    if dist.get_rank() == 0:
        print(f"warning: resuming a checkpoint saved at {_describe(saved)} at {_describe(now)}: "
              f"model, optimizer, EMA and data position are resharded; the per-rank RNG state "
              f"is not restored but reseeded from the step", flush=True)


# --- loading --------------------------------------------------------------------------------------
def _json_object(text) -> bool:
    try:
        return isinstance(text, str) and isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


# What a resume reads from the trainer's ``common`` entry (Trainer.load_state_dict,
# run.loop.resume) and the layout saved there: (what it must be, its check).
_DICT = ("a dict", lambda v: isinstance(v, dict))
_COUNT = ("a non-negative integer", lambda v: type(v) is int and 0 <= v < 2**63)
_NUMBER = ("a finite number", lambda v: type(v) in (int, float) and math.isfinite(v))
_TEXT = ("a string", lambda v: isinstance(v, str))
_SIZE = ("a positive integer or null", lambda v: v is None or (type(v) is int and 0 < v < 2**31))
_TEXT_OR_NULL = ("a string or null", lambda v: v is None or isinstance(v, str))
_FLAGS = ("a JSON object of the run's flags", _json_object)
# megatron's OptimizerParamScheduler.state_dict(): its load_state_dict reads every entry
_SCHEDULER = {"max_lr": _NUMBER, "min_lr": _NUMBER, "lr_warmup_steps": _COUNT,
              "lr_decay_steps": _COUNT, "lr_decay_style": _TEXT, "num_steps": _COUNT,
              "start_wd": _NUMBER, "end_wd": _NUMBER, "wd_incr_steps": _COUNT, "wd_incr_style": _TEXT}
_LAYOUT = {"world_size": _SIZE, "tensor_model_parallel_size": _SIZE,
           "pipeline_model_parallel_size": _SIZE, "data_parallel_size": _SIZE,
           "optimizer": _TEXT_OR_NULL}


def _check_entries(entries: dict, spec: dict, where: str, prefix: str = "") -> None:
    """Every key of ``spec`` is in ``entries`` and passes its check; else ConfigError naming
    ``where``."""
    for key, (what, ok) in spec.items():
        if key not in entries:
            raise ConfigError(f"corrupt checkpoint file {where}: no '{prefix}{key}' entry")
        if not ok(entries[key]):
            raise ConfigError(f"corrupt checkpoint file {where}: '{prefix}{key}' is "
                              f"{shown(entries[key])}, not {what}")


def checked_common(checkpoint) -> dict:
    """The trainer's ``common`` entry of a verified checkpoint, checked to hold what a resume reads
    from it: the LR schedule's state, the skipped-step count and (optional) the run's flags."""
    where = checkpoint.common_where
    if checkpoint.common is None:
        raise ConfigError(f"corrupt checkpoint {checkpoint.path}: no {COMMON} (nor the "
                          f"{mcore_compat.COMMON_ITEM} item megatron-core 0.19 writes instead)")
    _check_entries(checkpoint.common, {"common": _DICT}, where)
    common = checkpoint.common["common"]
    _check_entries(common, {"scheduler": _DICT, "skipped_steps": _COUNT}, where)
    _check_entries(common["scheduler"], _SCHEDULER, where, "scheduler.")
    if "args" in common:
        _check_entries(common, {"args": _FLAGS}, where)
    return common


def _restore_rng(rng, path: str) -> bool:
    """Set this rank's RNG to the checkpoint's; False if it was saved at another world size."""
    if not isinstance(rng, dict) or "torch" not in rng:
        raise ConfigError(f"corrupt checkpoint {path}: its rng_state is {shown(rng)}, not an RNG state")
    if rng.get("world_size") != dist.get_world_size():
        return False
    try:
        torch.set_rng_state(rng["torch"])
    except (TypeError, RuntimeError):
        raise ConfigError(f"corrupt checkpoint {path}: its rng_state holds {shown(rng['torch'])}, "
                          f"not a torch RNG state") from None
    return True


def saved_lora_base(checkpoint) -> BaseRecord | None:
    """The base an adapters-only checkpoint records (:data:`LORA_BASE_KEY`), checked; None for a
    checkpoint that holds every weight. ``checkpoint``: a verified one (``verify_on_every_rank``)."""
    entry = checked_common(checkpoint).get(LORA_BASE_KEY)
    return None if entry is None else BaseRecord.from_dict(entry, checkpoint.common_where)


def _verified_keys(path: str):
    """The checkpoint ``path`` verified on every rank and the keys of its tensors (metadata
    only): megatron unpickles .metadata, so nothing in it may run before it is checked."""
    checkpoint = verify_on_every_rank(path)
    return checkpoint, list(dist_checkpointing.load_tensors_metadata(path))


def _holds_base(keys) -> bool:
    return any(key.startswith(MODEL_KEY_PREFIXES) and not is_adapter_name(key) for key in keys)


def holds_base_weights(path: str) -> bool:
    """Whether the checkpoint ``path`` holds model weights other than LoRA's adapters (metadata
    only): every checkpoint but an adapters-only one of a LoRA run."""
    return _holds_base(_verified_keys(path)[1])


def check_same_model(path: str, lora: bool) -> None:
    """Before anything is loaded (metadata only), one line on every rank for a LoRA run's
    checkpoint (adapters ``<linear>.lora.A`` / ``.lora.B``, docs/lora.md) in a run without LoRA or
    the other way round: their optimizer and EMA states cover other parameters."""
    before = any(is_adapter_name(key) for key in _verified_keys(path)[1])
    if before != lora:
        was, is_ = ("with", "without") if before else ("without", "with")
        raise agreed(ConfigError(f"--load {path}: the checkpoint was saved {was} LoRA adapters and this "
                                 f"run is {is_} them: resume with the --lora-* flags of the run that saved it"))


def check_lora_base(path: str, base: BaseRecord | None) -> None:
    """A LoRA run's checkpoint against this run's base (``base``: its files' record; None when the
    checkpoint holds the base weights, which are then read from it, or the run has no base from
    files): an adapters-only checkpoint needs the base it records, one line on every rank
    otherwise (metadata only, read once)."""
    checkpoint, keys = _verified_keys(path)
    saved = saved_lora_base(checkpoint)
    if _holds_base(keys):
        return  # the checkpoint's own base weights are loaded with its adapters
    if saved is None:
        raise agreed(ConfigError(f"corrupt checkpoint {path}: it holds LoRA adapters but neither base "
                                 "weights nor a record of its base"))
    if base is None:
        raise agreed(ConfigError(f"--load {path}: the checkpoint holds the adapters only; their base is "
                                 f"{saved.describe()}: resume with {saved.flag} {saved.path}"))
    try:
        check_same_base(saved, base, f"--load {path}", f"resume with {saved.flag} of the base it records")
    except ConfigError as e:
        raise agreed(e) from None


def load(root: str, sharded_state_dict: dict, iteration: int) -> dict:
    """Load step ``iteration`` (:func:`agreed_latest_iteration`) into the given sharded state
    dict; returns the loaded state, its ``common`` entry checked (:func:`checked_common`).

    The checkpoint's files are verified first (nothing in them is executed), then its saving
    layout is compared with this run's (:func:`check_layout`).
    """
    path = iteration_dir(root, iteration)
    checkpoint = verify_on_every_rank(path)
    common = checked_common(checkpoint)
    saved, now = saved_layout(checkpoint), current_layout(sharded_state_dict)
    check_layout(saved, now, path)
    restore_rng = _same_rank_layout(saved, now)
    state = dict(sharded_state_dict)
    if restore_rng:
        state["rng_state"] = _rng_sharded_object()
    try:
        loaded = dist_checkpointing.load(state, path)
    except BaseException as e:  # noqa: BLE001 - CheckpointException derives from BaseException
        _reraise_in_one_line(e, f"--load {path}: cannot load checkpoint")
    verify_loaded_extra_state(loaded.get("model"), path)
    loaded["common"] = common  # the checked copy (megatron read the file once more)
    loaded.pop(mcore_compat.VERSION_KEY, None)
    rng = loaded.pop("rng_state", None)
    if not (restore_rng and _restore_rng(rng, path)):
        _reseed(iteration, saved, now)
    return loaded


# --- before saving ---------------------------------------------------------------------------------
def _first_non_finite(named_tensors) -> str | None:
    named = [(n, t) for n, t in named_tensors if t is not None and t.is_floating_point() and t.numel()]
    if not named:
        return None
    # One device sync for all tensors; names are looked up only when something is wrong.
    device = named[0][1].device
    bad = torch.stack([torch.isfinite(t).logical_not().any().to(device) for _, t in named]).cpu()
    hits = bad.nonzero()
    return named[int(hits[0])][0] if len(hits) else None


@torch.no_grad()
def check_finite_before_save(model_chunks, anchor=None, iteration: int | None = None) -> None:
    """Raise ConfigError (on every rank) if any model weight, or any tensor the anchor owns (its
    ``named_tensors()``: the EMA), is NaN or inf.

    Collective when the process group is up (call it on all ranks): all ranks agree, so none
    is left waiting inside the save.
    """
    named = []
    for i, chunk in enumerate(model_chunks):
        gpt = unwrap(chunk)
        prefix = f"chunk{i}." if len(model_chunks) > 1 else ""
        named += [(prefix + global_param_name(gpt, name), p) for name, p in gpt.named_parameters()]
    bad = _first_non_finite(named)
    if bad is None and anchor is not None:
        bad = _first_non_finite(anchor.named_tensors())
    found = [bad]
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, bad)
    for rank, name in enumerate(found):
        if name is not None:
            at = f" at step {iteration}" if iteration is not None else ""
            where = f" on rank {rank}" if len(found) > 1 else ""
            raise WeightsError(f"refusing to save a checkpoint{at}: {name}{where} is not finite "
                              f"(NaN or inf); the last good checkpoint is kept")
