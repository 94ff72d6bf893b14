"""Everything that differs between the supported Megatron-Core releases, 0.16.1 to 0.19.x.

Both ends of the range run the whole test suite (``tests/run.sh``: 0.16.1 on Python 3.11,
0.19.x on 3.12, which 0.17 and later require). Other modules ask this one instead of testing a
version themselves:

* inference (:func:`gpt_inference_wrapper`, :func:`forward_whole_batch`): 0.19 dropped
  ``InferenceWrapperConfig`` (the wrapper reads the model's config) and replaced the small/large
  input forwards by one ``forward_pass_with_pipeline_parallel`` without row micro-batching;
* the output layer (:data:`HAS_OUTPUT_PROCESSOR`): 0.19's ``GPTModel.forward`` takes an
  ``output_processor`` that is given the final hidden states and the output weight, so the
  fused LM head needs no patch of the model there (``models.hidden_output``);
* checkpoints (:data:`COMMON_FILE`, :data:`COMMON_ITEM`, :data:`VERSION_KEY`, :func:`unreadable`):
  0.19 writes the non-sharded state as the byte item ``common_state`` of the ``.distcp`` files
  instead of ``common.pt`` (it still reads ``common.pt``; 0.16.1 cannot read the item), so each
  checkpoint records the release that wrote it and a later release's is refused; and
  ``import megatron.core`` rebinds ``torch.storage._load_from_bytes`` to its
  ``safe_load_from_bytes``, the name pickles written under it then carry
  (:data:`LOAD_FROM_BYTES`);
* Transformer Engine's absence (:data:`TE_GAPS_FILLED`): 0.16.1's ``moe_utils`` imports
  ``te_general_gemm`` only when TE imports and never defines the name otherwise, so the MoE
  router's ``router_gating_linear`` (which tests ``te_general_gemm is not None`` to choose the
  ``torch.mm`` path) raises ``NameError`` without TE, on the CPU above all; 0.19 defines it as
  ``None``. This module defines it as ``None`` the same way when it is missing (importing it is
  enough: ``runtime.initialize`` does).

Imported by modules that already import Megatron: it imports ``megatron.core`` itself.
"""

from __future__ import annotations

from importlib import metadata

import megatron.core  # noqa: F401  (0.19 rebinds torch.storage._load_from_bytes on import)
from megatron.core.dist_checkpointing import serialization
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
    GPTInferenceWrapper,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.moe import moe_utils
from packaging.version import InvalidVersion, Version

VERSION = metadata.version("megatron-core")  # the installed one (setup.py: >=0.16.1,<0.20)

# --- Transformer Engine's absence ---------------------------------------------------------------
def _fill_te_gaps() -> tuple:
    """Define as ``None`` the TE names a release leaves undefined without TE (what 0.19 does), so
    its ``is not None`` tests take the torch path instead of raising ``NameError``. Returns the names
    defined. The installed package's files are not changed: the module's globals are."""
    filled = []
    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # 0.16.1: read by RouterGatingLinearFunction (MoE router)
        filled.append("moe_utils.te_general_gemm")
    return tuple(filled)


#: The names :func:`_fill_te_gaps` defined at import (empty with TE, and on 0.19).
TE_GAPS_FILLED = _fill_te_gaps()

# --- inference ----------------------------------------------------------------------------------
HAS_WRAPPER_CONFIG = not hasattr(GPTInferenceWrapper, "forward_pass_with_pipeline_parallel")


def gpt_inference_wrapper(model, context, model_config, padded_vocab_size: int):
    """Megatron's ``GPTInferenceWrapper`` of ``model`` (not DDP-wrapped) over ``context``."""
    if not HAS_WRAPPER_CONFIG:
        return GPTInferenceWrapper(model, context)  # the wrapper reads the model's config itself
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
        InferenceWrapperConfig,
    )
    cfg = model_config
    wcfg = InferenceWrapperConfig(
        hidden_size=cfg.hidden_size, params_dtype=cfg.params_dtype,
        inference_batch_times_seqlen_threshold=-1,  # the caller micro-batches rows itself
        padded_vocab_size=padded_vocab_size, fp32_residual_connection=cfg.fp32_residual_connection,
        fp8=cfg.fp8)  # under FP8 Megatron pads TE GEMM inputs: rows leave, counts go odd
    return GPTInferenceWrapper(model, wcfg, context)


def forward_whole_batch(wrapper, inputs: dict):
    """One forward of every row of ``inputs`` through the wrapper (pipeline stages exchange
    hidden states); advances the context's offset by the width. Logits on the last stage."""
    if HAS_WRAPPER_CONFIG:
        return wrapper.forward_pass_with_pipeline_parallel_small_input_batch(inputs)
    return wrapper.forward_pass_with_pipeline_parallel(inputs)


# --- the output layer ----------------------------------------------------------------------------
HAS_OUTPUT_PROCESSOR = "output_processor" in GPTModel.forward.__code__.co_varnames

# --- checkpoints ---------------------------------------------------------------------------------
COMMON_FILE = "common.pt"  # where 0.16 writes the non-sharded state (0.19 still reads it)
COMMON_ITEM = "common_state"  # where 0.19 writes it: a byte item of the .distcp files
#: Whether the installed release reads the common state from :data:`COMMON_ITEM` (0.16.1 looks
#: for ``common.pt`` only and fails with "'str' object has no attribute 'iterdir'").
READS_COMMON_ITEM = hasattr(serialization, "_legacy_common_state_exists")
#: The entry of the common state where this project's checkpoints record the release that wrote
#: them (checkpoints written before it was recorded are 0.16.1's).
VERSION_KEY = "megatron_core_version"
#: The functions a pickled storage names to rebuild itself from bytes: torch's, and the one
#: ``import megatron.core`` rebinds it to from 0.19 on (both: torch.load of the bytes).
LOAD_FROM_BYTES = {("torch.storage", "_load_from_bytes"),
                   ("megatron.core.safe_globals", "safe_load_from_bytes")}


def valid_version(text) -> bool:
    try:
        Version(text)
    except (InvalidVersion, TypeError):
        return False
    return True


def unreadable(written_by: str | None, common_in_item: bool) -> str | None:
    """Why the installed release cannot read a checkpoint written under ``written_by`` (its
    :data:`VERSION_KEY`, None when not recorded) whose common state is (``common_in_item``) or is
    not in :data:`COMMON_ITEM`; None when it can. A later minor release may change the format
    (patch releases keep it)."""
    newer = written_by is not None and Version(written_by).release[:2] > Version(VERSION).release[:2]
    if not newer and (READS_COMMON_ITEM or not common_in_item):
        return None
    who = (f"megatron-core {written_by}" if written_by else
           "a megatron-core after 0.16 (its common state is inside the .distcp files)")
    return (f"it was written by {who}, newer than the installed megatron-core {VERSION}, which "
            f"cannot read it; load it where megatron-core {written_by or '0.17 or later'} is "
            f"installed (Python >= 3.12)")
