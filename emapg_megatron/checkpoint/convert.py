"""HF <-> Megatron-Core ``torch_dist`` checkpoints, and atomic model checkpoint save / load.

``hf_to_mcore`` runs in one process: it builds the model at TP=1/PP=1, streams the HF tensors into
it (one full copy of the weights in memory, never two) and saves Megatron's own
``sharded_state_dict``. ``torch_dist`` ShardedTensors carry global shapes and offsets, so
Megatron reshards the result to any TP/PP on load. ``mcore_to_hf`` loads the checkpoint the same
way and streams the HF tensors into size-bounded safetensors shards.

Every output directory is written under a temporary name next to the target and renamed only
when complete: a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from tqdm import tqdm

from emapg_megatron import mcore_compat, runtime
from emapg_megatron.checkpoint.files import (
    atomic_dir,
    check_new_output,
    check_output_apart,
    commit,
    temp_dir_for,
)
from emapg_megatron.checkpoint.hf_config import (  # noqa: F401 - architecture_for: build.py's
    ARCHITECTURES,
    architecture_for,
    check_same_architecture,
    hf_config_from_model,
    hf_dtype,
    model_config_from_hf,
    read_hf_config,
)
from emapg_megatron.checkpoint.hf_io import (
    SafetensorsReader,
    StreamingSafetensorsWriter,
    copy_tokenizer_files,
)
from emapg_megatron.checkpoint.hf_mapping import HFMapping, stored_key_alias
from emapg_megatron.checkpoint.lora_base import BaseRecord, check_same_base
from emapg_megatron.checkpoint.paths import MODEL_KEY_PREFIXES, TRACKER, iteration_dir  # noqa: F401 (re-exported)
from emapg_megatron.checkpoint.safe_load import (
    DCP_METADATA,
    load_verified,
    read_dcp_metadata,
    read_json,
    verify_checkpoint_metadata,
)
from emapg_megatron.checkpoint.training import latest_iteration, saved_lora_base
from emapg_megatron.checkpoint.weights import (
    export_hf_weights,
    high_precision,
    load_hf_weights,
)
from emapg_megatron.errors import ConfigError, shown
from emapg_megatron.lora.config import is_adapter_name
from emapg_megatron.models.config import ModelConfig, PrecisionConfig
from emapg_megatron.models.gpt import build_gpt_model, unwrap
from emapg_megatron.multiprocess import free_port
from emapg_megatron.runtime.environment import environment
from emapg_megatron.training.collectives import on_rank0

METADATA = "emapg_model_config.json"
FORMAT = "emapg-mcore-v1"
MAX_SAVED_PARALLEL = 1024  # the TP / PP a checkpoint records it was saved at (sizes its padding)
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPES = tuple(TORCH_DTYPES)
# One process, nothing to communicate: small buckets only bound the export's transient copies.
EXPORT_BUCKET_BYTES = 64 * 1024**2


# --- Megatron checkpoints -----------------------------------------------------------------


def _sharded_state_dict(model_chunks) -> dict:
    if len(model_chunks) == 1:
        return {"model": unwrap(model_chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(model_chunks)}


def checkpoint_metadata(cfg: ModelConfig, arch: str, dtype: str, *, tp: int, pp: int,
                        hf_config: dict | None = None) -> dict:
    """What :data:`METADATA` records so a checkpoint loads without the HF directory."""
    return {"format": FORMAT, "architecture": arch, "model_config": cfg.to_dict(), "dtype": dtype,
            "saved_tp": tp, "saved_pp": pp, "hf_config": hf_config}


def read_checkpoint_metadata(ckpt_dir: str | Path) -> dict:
    """:data:`METADATA` of ``ckpt_dir``, its entries checked (the model config is checked by
    :func:`checked_checkpoint`); ConfigError in one line."""
    if not Path(ckpt_dir).is_dir():
        raise ConfigError(f"checkpoint directory {ckpt_dir} does not exist")
    path = Path(ckpt_dir) / METADATA
    if not path.is_file():
        raise ConfigError(f"{ckpt_dir} has no {METADATA}: not a checkpoint written by emapg-megatron")
    meta = read_json(str(path), 1 << 20, "corrupt checkpoint metadata", root=str(ckpt_dir))
    if not isinstance(meta, dict) or not isinstance(meta.get("model_config"), dict):
        raise ConfigError(f"corrupt checkpoint metadata {path}: not an object with a model_config")
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path}: unknown format {shown(meta.get('format'))} (expected {FORMAT})")
    for name, known in (("architecture", ARCHITECTURES), ("dtype", DTYPES)):
        if meta.get(name) is not None and meta[name] not in known:  # required where used
            raise ConfigError(f"{path}: {name} {shown(meta[name])} must be one of {', '.join(known)}")
    for name, kind in (("hf_config", dict), ("hf_dir", str)):
        if meta.get(name) is not None and not isinstance(meta[name], kind):
            raise ConfigError(f"{path}: {name} must be a JSON {'object' if kind is dict else 'string'} "
                              f"(got {shown(meta[name])})")
    for name in ("saved_tp", "saved_pp"):
        value = meta.get(name, 1)
        if type(value) is not int or not 1 <= value <= MAX_SAVED_PARALLEL:
            raise ConfigError(f"{path}: {name} must be an integer from 1 to {MAX_SAVED_PARALLEL} "
                              f"(got {shown(value)})")
    return meta


def checked_checkpoint(ckpt_dir: str | Path, *, lora: bool = False) -> tuple[dict, ModelConfig]:
    """(:data:`METADATA`, the :class:`ModelConfig` it stores) of ``ckpt_dir``, before anything is
    built from them: the config's entries of the right types and bounds, its heads, groups and
    width consistent, and equal to the model tensors the checkpoint holds. A LoRA run's checkpoint
    (its ``lora`` entry, ``build.model_metadata``: base and adapters) is refused in one line unless
    ``lora`` (the caller applies the adapters: :func:`mcore_to_hf` merges them)."""
    meta = read_checkpoint_metadata(ckpt_dir)
    where = str(Path(ckpt_dir) / METADATA)
    adapters = meta.get("lora")
    if adapters is not None and (not lora or not isinstance(adapters, dict)):
        rank = adapters.get("rank") if isinstance(adapters, dict) else None
        raise ConfigError(f"{ckpt_dir} is a LoRA run's checkpoint (--lora-rank {shown(rank)}): it cannot be "
                          "loaded into another model yet (docs/lora.md); emapg-train --load resumes it "
                          "and emapg-convert mcore-to-hf exports it merged")
    cfg = ModelConfig.from_dict(meta["model_config"], where)
    try:
        cfg.validate()
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    check_stored_tensors(ckpt_dir, cfg, f"the model config in {where}", adapters=adapters is not None)
    return meta, cfg


def checkpoint_model_config(ckpt_dir: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` stored with a checkpoint (for ``--load`` without ``--load-hf``),
    checked (:func:`checked_checkpoint`)."""
    return checked_checkpoint(ckpt_dir)[1]


def check_stored_tensors(ckpt_dir: str | Path, cfg: ModelConfig, what: str, adapters: bool = False) -> None:
    """Refuse, in one line, a model ``cfg`` whose tensors differ from the model tensors the
    ``torch_dist`` checkpoint ``ckpt_dir`` stores (their global shapes, read from its checked
    ``.metadata``): Megatron would build the model and then stop in the load with a traceback,
    or ignore a stored tensor the model lacks. A folder without ``.metadata`` is no such
    checkpoint: its load refuses it. ``adapters``: LoRA's adapter matrices (``.lora.``) are
    stored too, and not compared."""
    stored = _stored_model_keys(ckpt_dir)
    if stored is None:  # no torch_dist checkpoint: refused in one line when it is loaded
        return
    if adapters:
        stored = {k: v for k, v in stored.items() if not is_adapter_name(k)}
        if not stored:  # adapters only: the base is checked by its sha256 where it is read
            return
    expected = HFMapping(cfg).stored_shapes()
    for key in list(expected):  # either spec's key (load_mcore reads both)
        alias = stored_key_alias(key) if cfg.is_moe else None
        if alias is not None and key not in stored and alias in stored:
            expected[alias] = expected.pop(key)
    problems = [f"{key} is not stored" for key in expected if key not in stored]
    problems += [f"{key} is stored but not in the model" for key in stored if key not in expected]
    problems += [f"{key}: stored {stored[key]}, expected {_shape_text(shape)}"
                 for key, shape in expected.items() if key in stored and not _fits(stored[key], shape, cfg)]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ConfigError(f"{what} does not describe the tensors {ckpt_dir} holds: "
                          f"{'; '.join(problems[:3])}{more}")


def _fits(stored: tuple, expected: tuple, cfg: ModelConfig) -> bool:
    """Whether a stored shape is the expected one; a vocabulary dimension (None) holds the
    vocabulary, padded."""
    return len(stored) == len(expected) and all(
        s == e or (e is None and s >= cfg.vocab_size) for s, e in zip(stored, expected))


def _shape_text(shape: tuple) -> str:
    return "(" + ", ".join("padded vocabulary" if d is None else str(d) for d in shape) + ")"


def save_mcore(model_chunks, out_dir: str | Path, metadata: dict, *, overwrite: bool = False) -> None:
    """Collective: save the model chunks as a ``torch_dist`` checkpoint plus :data:`METADATA`.

    Rank 0 owns the temporary directory and renames it once every rank has written its shards.
    """
    for chunk in model_chunks:
        for name, p in unwrap(chunk).named_parameters():
            high_precision(name, p.detach())
    out = Path(out_dir)
    rank = dist.get_rank()

    def make_temp_dir() -> str:
        check_new_output(out, overwrite)
        return str(temp_dir_for(out))

    tmp = Path(on_rank0(make_temp_dir))
    try:
        state = {**_sharded_state_dict(model_chunks), mcore_compat.VERSION_KEY: mcore_compat.VERSION}
        dist_checkpointing.save(state, str(tmp))  # the version: a later release may refuse it
        if rank == 0:
            (tmp / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")
        dist.barrier()
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0:
        commit(tmp, out)
    dist.barrier()


def load_mcore(model_chunks, ckpt_dir: str | Path, adapters: bool | None = None) -> None:
    """Collective: load a ``torch_dist`` checkpoint into this rank's chunks, at any TP/PP.

    The vocabulary padding may differ from the saved one (Megatron marks the embedding and
    output layer ``allow_shape_mismatch``). ``adapters``: only LoRA's adapter matrices (True) or
    only the base weights (False), the others left as they are; None: every weight.
    """
    if not (Path(ckpt_dir) / "metadata.json").is_file():
        raise ConfigError(f"{ckpt_dir} is not a Megatron dist checkpoint (no metadata.json)")
    sharded = _sharded_state_dict(model_chunks)
    if adapters is not None:
        sharded = {chunk: {k: v for k, v in sd.items() if is_adapter_name(k) == adapters}
                   for chunk, sd in sharded.items()}
    _use_stored_keys(sharded, ckpt_dir)
    loaded = load_verified(sharded, str(ckpt_dir))  # nothing in the checkpoint may run
    for key, chunk in zip(sharded, model_chunks):
        unwrap(chunk).load_state_dict(loaded[key], strict=adapters is None)


def _stored_model_keys(ckpt_dir: str | Path) -> dict[str, tuple[int, ...]] | None:
    """The model tensors' keys and global shapes a ``torch_dist`` checkpoint stores (read from its
    checked ``.metadata``); None without one."""
    index = os.path.join(ckpt_dir, DCP_METADATA)
    if not os.path.lexists(index):
        return None
    metadata = read_dcp_metadata(index)
    return {key: tuple(m.size) for key, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata) and key.startswith(MODEL_KEY_PREFIXES)}


def _use_stored_keys(sharded: dict, ckpt_dir: str | Path) -> None:
    """Point the model's sharded tensors at the key the other layer spec stored them under
    (:data:`~emapg_megatron.checkpoint.hf_mapping.STORED_KEY_ALIASES`: a MoE checkpoint saved with
    Transformer Engine's spec loads into the local spec's model and back)."""
    stored = _stored_model_keys(ckpt_dir)
    if stored is None:
        return
    for chunk in sharded.values():
        for sh in chunk.values() if isinstance(chunk, dict) else ():
            key = getattr(sh, "key", None)
            alias = stored_key_alias(key) if isinstance(key, str) else None
            if alias is not None and key not in stored and alias in stored:
                sh.key = alias


def training_step_dir(load: str | Path) -> str:
    """A trainer ``--save`` directory's latest ``iter_N`` (read from its tracker), else ``load``."""
    if not (Path(load) / TRACKER).is_file():
        return str(load)
    return iteration_dir(str(load), latest_iteration(str(load)))


def _recorded_hf_dir(meta: dict) -> str | None:
    """The --load-hf directory of the training run that wrote the checkpoint, if it still exists."""
    hf_dir = meta.get("hf_dir")
    return hf_dir if hf_dir and (Path(hf_dir) / "config.json").is_file() else None


# --- single-process conversion ------------------------------------------------------------


@contextmanager
def single_process_runtime():
    """A world of one CPU rank (TP=PP=1) for the converter; reuses an existing one-rank world."""
    if ps.model_parallel_is_initialized():
        if dist.get_world_size() != 1:
            raise ConfigError("checkpoint conversion runs in a single process, not inside a "
                              f"{dist.get_world_size()}-rank job")
        yield
        return
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ConfigError("run the converter as a single process (not under torchrun)")
    with environment(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port())):
        runtime.initialize(runtime.ParallelConfig(device="cpu"))
        try:
            yield
        finally:
            runtime.destroy()


def _recorded_lora(lora: dict, step_dir: str):
    """The ``LoRAConfig`` a LoRA run's checkpoint records (``build.model_metadata``)."""
    from emapg_megatron.lora.config import LoRAConfig

    try:
        return LoRAConfig(rank=int(lora["rank"]), alpha=float(lora["alpha"]),
                          target_modules=tuple(str(t) for t in lora["target_modules"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{step_dir}/{METADATA}: corrupt lora entry ({type(e).__name__}: {e})") from None


def _with_adapters(model, meta: dict, model_cfg: ModelConfig, step_dir: str, *, base: bool = True,
                   base_dir: str | None = None):
    """Load a LoRA run's checkpoint into ``model``, its adapters applied; returns its LoRAConfig.
    The base weights come from the checkpoint when it holds them, else (``base``) from the folder
    it records (``base_dir`` instead, when given), whose files must have the recorded sha256."""
    from emapg_megatron.lora.apply import apply_lora

    cfg = _recorded_lora(meta["lora"], step_dir)
    apply_lora(model, cfg)
    record = saved_lora_base(verify_checkpoint_metadata(step_dir))
    if record is None:
        load_mcore([model], step_dir)
        return cfg
    if base:
        _load_recorded_base(model, record, base_dir, model_cfg, step_dir)
    load_mcore([model], step_dir, adapters=True)
    return cfg


def _load_recorded_base(model, record: BaseRecord, base_dir: str | None, model_cfg: ModelConfig,
                        step_dir: str) -> None:
    """The base an adapters-only checkpoint records, read from ``base_dir`` or its recorded
    folder after every weight file's sha256 is checked against the record."""
    folder = base_dir or record.path
    hint = "pass --lora-base with the folder of the base it records"
    if not os.path.isdir(folder):
        raise ConfigError(f"{step_dir} holds LoRA adapters only; their base {record.describe()} is "
                          f"not there any more: {hint}")
    check_same_base(record, BaseRecord.of(record.flag, folder), step_dir, hint)
    if record.flag == "--load-hf":
        load_hf_weights([model], model_cfg, folder)
    else:
        load_mcore([model], folder, adapters=False)


def _merged_adapters(model, meta: dict, model_cfg: ModelConfig, step_dir: str, base_dir: str | None = None) -> None:
    """Load a LoRA run's checkpoint (base and adapters) into ``model`` and fold the adapters into
    its weights (``lora.apply.merge_lora``: W += (alpha / rank) B A, in fp32, rounded once to the
    model's dtype), so the export is the adapted model as plain HF weights."""
    from emapg_megatron.lora.apply import merge_lora

    _with_adapters(model, meta, model_cfg, step_dir, base_dir=base_dir)
    merge_lora(model)


def lora_to_peft(load: str | Path, out: str | Path, *, overwrite: bool = False) -> dict:
    """A LoRA run's adapters (the checkpoint of ``load``: a ``--save`` directory's latest step or
    one of its ``iter_N``) as a peft adapter folder for the base model the run started from.
    Returns a summary dict."""
    from emapg_megatron.checkpoint.peft_format import gathered_adapters, save_peft

    step_dir = training_step_dir(load)
    meta, cfg = checked_checkpoint(step_dir, lora=True)
    if meta.get("lora") is None:
        raise ConfigError(f"{step_dir} is not a LoRA run's checkpoint (no adapters to export): "
                          "emapg-convert mcore-to-hf exports its model")
    check_output_apart(out, {"--load": load})
    with atomic_dir(out, overwrite=overwrite) as tmp, single_process_runtime():
        model = _build_tp1(cfg, meta.get("saved_tp", 1), meta.get("dtype") or "fp32")
        lora = _with_adapters(model, meta, cfg, step_dir, base=False)  # the adapters alone are exported
        adapters = gathered_adapters(model)
        save_peft(tmp, lora, adapters, cfg, base=meta.get("hf_dir"))
    return {"out": str(out), "adapter_matrices": len(adapters), "rank": lora.rank, "alpha": lora.alpha}


def _build_tp1(cfg: ModelConfig, tp: int, dtype: str):
    # Padded as a TP=tp model is, so the stored embedding has exactly that model's shape.
    padded = replace(cfg, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by * tp)
    # Every weight is overwritten from the HF files (missing ones are an error), so skip the init.
    model = build_gpt_model(padded, prec=PrecisionConfig(bf16=dtype == "bf16"),
                            perform_initialization=False)
    # As Megatron's Float16Module does: the local spec's norms are created in fp32.
    return model.bfloat16() if dtype == "bf16" else model


def resolve_dtype(dtype: str | None, hf_cfg: dict) -> str:
    """``--dtype``; by default the HF checkpoint's own dtype (fp16 becomes bf16)."""
    if dtype is None:
        return "fp32" if hf_dtype(hf_cfg) == "fp32" else "bf16"
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    return dtype


def hf_to_mcore(hf_dir: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1,
                dtype: str | None = None, make_vocab_size_divisible_by: int = 128,
                overwrite: bool = False, progress: bool = True) -> dict:
    """Convert an HF Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral directory into a Megatron
    ``torch_dist`` checkpoint.

    ``tp`` / ``pp`` / ``ep`` are the layout it will be trained at: they are checked against the
    heads, groups, layers and experts and set the vocabulary padding; the checkpoint loads at any
    TP/PP/EP (each expert is stored at its global index). Everything is validated before anything
    is written. Returns a summary dict.
    """
    check_output_apart(out, {"--hf-dir": hf_dir})
    hf_cfg = read_hf_config(hf_dir)
    cfg, arch = model_config_from_hf(hf_cfg, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    cfg.validate(tp, pp, ep)
    dtype = resolve_dtype(dtype, hf_cfg)
    reader = SafetensorsReader(hf_dir)
    HFMapping(cfg).source(reader.read, reader.shapes())
    out = Path(out)
    check_new_output(out, overwrite)
    with single_process_runtime():
        model = _build_tp1(cfg, tp, dtype)
        nbytes = load_hf_weights([model], cfg, reader, progress=progress)
        meta = checkpoint_metadata(cfg, arch, dtype, tp=tp, pp=pp, hf_config=hf_cfg)
        save_mcore([model], out, meta, overwrite=overwrite)
    return {"out": str(out), "architecture": arch, "dtype": dtype, "bytes": nbytes,
            "padded_vocab_size": cfg.padded_vocab_size(tp)}


def mcore_to_hf(load: str | Path, out: str | Path, *, hf_template: str | Path | None = None,
                max_shard_bytes: int = 5 * 1024**3, overwrite: bool = False,
                progress: bool = True, lora_base: str | None = None) -> dict:
    """Convert a checkpoint back to HF: ``config.json``, sharded safetensors with
    ``model.safetensors.index.json``, and the tokenizer and generation files of ``hf_template``
    (else of the --load-hf directory a training run recorded, when it is still there).

    ``load``: a checkpoint of :func:`hf_to_mcore` / :func:`save_mcore`, a trainer's ``--save``
    directory (its latest step) or one of its ``iter_N`` directories. A LoRA run's checkpoint is
    exported merged; when it holds the adapters alone, their base is read from the folder it
    records (``lora_base`` instead: the same files moved). Returns a summary dict."""
    step_dir = training_step_dir(load)
    meta, cfg = checked_checkpoint(step_dir, lora=True)
    arch, dtype = meta.get("architecture"), meta.get("dtype")
    if arch is None or dtype is None:
        raise ConfigError(f"{step_dir}/{METADATA} records no architecture or dtype: it cannot be exported")
    tokenizer_dir = hf_template or _recorded_hf_dir(meta)
    record = saved_lora_base(verify_checkpoint_metadata(step_dir)) if meta.get("lora") is not None else None
    check_output_apart(out, {"--load": load, "the tokenizer folder": tokenizer_dir, "--lora-base": lora_base,
                             "the checkpoint's LoRA base": record.path if record is not None else None})
    base = meta.get("hf_config")
    if hf_template is not None:
        base = read_hf_config(hf_template)
        check_same_architecture(base, cfg)
    hf_cfg = hf_config_from_model(cfg, arch, base=base, dtype=dtype)
    plan = [(n, shape) for e in HFMapping(cfg).entries if e.export for n, shape in zip(e.hf, e.hf_shapes)]
    torch_dtype = TORCH_DTYPES[dtype]
    with atomic_dir(out, overwrite=overwrite) as tmp, single_process_runtime():
        model = _build_tp1(cfg, meta.get("saved_tp", 1), dtype)
        if meta.get("lora") is not None:  # a LoRA run: its adapters merged into the exported weights
            _merged_adapters(model, meta, cfg, step_dir, lora_base)
        else:
            load_mcore([model], step_dir)
        stream = export_hf_weights([model], cfg, bucket_bytes=EXPORT_BUCKET_BYTES, dtype=torch_dtype)
        with StreamingSafetensorsWriter(tmp, plan, torch_dtype, max_shard_bytes) as writer:
            for name, tensor in tqdm(stream, total=len(plan), desc="export HF weights",
                                     disable=not progress):
                writer.add(name, tensor)
            files = writer.close()
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
        copied = copy_tokenizer_files(tokenizer_dir, tmp) if tokenizer_dir is not None else []
    return {"out": str(out), "architecture": arch, "dtype": dtype, "bytes": writer.total_bytes,
            "shards": files, "tokenizer_files": copied}
