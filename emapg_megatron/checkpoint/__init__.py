"""Checkpoints: the trainer's own, and HF <-> Megatron-Core conversion.

The trainer's checkpoints:

* :mod:`.training`   - save / resume of a run (``iter_N`` directories, the tracker, the layout
  guard, optimizer-state quirks); the EMA's part of the state is ``anchor/checkpoint.py``
* :mod:`.safe_load`  - reading a checkpoint never runs code from it
* :mod:`.files`      - directories and files that appear whole or not at all

Conversion, with one mapping table:

* :mod:`.hf_mapping` - the table (:data:`RULES`, :class:`HFMapping`): per Megatron param and TP
  rank, the slice of the HF tensors (import); from all TP shards, the HF tensors (export)
* :mod:`.hf_config`  - HF ``config.json`` <-> :class:`~emapg_megatron.models.config.ModelConfig`
* :mod:`.hf_io`      - lazy safetensors reading, sharded safetensors writing
* :mod:`.weights`    - :func:`load_hf_weights` (``--load-hf``), :func:`export_hf_weights` (weight sync)
* :mod:`.convert`    - ``hf-to-mcore`` / ``mcore-to-hf``, atomic ``torch_dist`` save / load
* :mod:`.verify`     - logit comparison against ``transformers``
* :mod:`.cli`        - ``emapg-convert``

See ``docs/checkpoints.md``.
"""

from .convert import (
    METADATA,
    checkpoint_metadata,
    checkpoint_model_config,
    hf_to_mcore,
    load_mcore,
    mcore_to_hf,
    read_checkpoint_metadata,
    save_mcore,
)
from .files import atomic_dir
from .hf_config import hf_config_from_model, model_config_from_hf, read_hf_config
from .hf_mapping import RULES, HFMapping
from .weights import export_hf_buckets, export_hf_weights, load_hf_weights

__all__ = [
    "METADATA", "RULES", "HFMapping", "atomic_dir", "checkpoint_metadata", "checkpoint_model_config",
    "export_hf_buckets", "export_hf_weights", "hf_config_from_model", "hf_to_mcore", "load_hf_weights",
    "load_mcore", "mcore_to_hf", "model_config_from_hf", "read_checkpoint_metadata", "read_hf_config",
    "save_mcore",
]
