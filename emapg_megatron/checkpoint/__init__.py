"""Checkpoints: the trainer's own, and HF <-> Megatron-Core conversion.

The trainer's checkpoints:

* :mod:`.training`   - save / resume of a run (``iter_N`` directories, the tracker, the layout
  guard, optimizer-state quirks); the EMA's part of the state is ``anchor/checkpoint.py``
* :mod:`.safe_load`  - reading a checkpoint never runs code from it
* :mod:`.files`      - directories and files that appear whole or not at all
* :mod:`.paths`      - where a run's checkpoints lie (``iter_N`` directories, the tracker)

Conversion, with one mapping table:

* :mod:`.hf_mapping` - the table (:data:`RULES`, :class:`HFMapping`): per Megatron param and TP
  rank, the slice of the HF tensors (import); from all TP shards, the HF tensors (export)
* :mod:`.hf_config`  - HF ``config.json`` <-> :class:`~emapg_megatron.models.config.ModelConfig`
* :mod:`.hf_io`      - lazy safetensors reading, sharded safetensors writing
* :mod:`.weights`    - :func:`load_hf_weights` (``--load-hf``), :func:`export_hf_weights` (weight sync)
* :mod:`.convert`    - ``hf-to-mcore`` / ``mcore-to-hf`` / ``lora-to-peft``, atomic ``torch_dist``
  save / load
* :mod:`.peft_format` - LoRA adapters in peft's format (export, import, ``--lora-peft-init``)
* :mod:`.verify`     - logit comparison against ``transformers``
* :mod:`.cli`        - ``emapg-convert``

See ``docs/checkpoints.md``.
"""

import importlib

# Loaded on first use: the light modules (paths, files) must not pull in Megatron.
_LAZY = {"METADATA": "convert", "checkpoint_metadata": "convert", "checkpoint_model_config": "convert",
         "hf_to_mcore": "convert", "load_mcore": "convert", "mcore_to_hf": "convert",
         "read_checkpoint_metadata": "convert", "save_mcore": "convert", "atomic_dir": "files",
         "hf_config_from_model": "hf_config", "model_config_from_hf": "hf_config",
         "read_hf_config": "hf_config", "RULES": "hf_mapping", "HFMapping": "hf_mapping",
         "export_hf_buckets": "weights", "export_hf_weights": "weights", "load_hf_weights": "weights"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
