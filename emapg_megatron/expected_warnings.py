"""Megatron-Core warnings and log lines that are expected without Apex/TE, on CPU or from its own
use of deprecated torch APIs, silenced at package import.

They are raised while ``megatron.core`` is imported, so the filter must be in place before any of
our modules import it; the package's ``__init__`` installs it. The patterns are narrow: every
other warning and log line still shows.
"""

import logging
import re
import warnings

EXPECTED = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
    r".*all_gather_into_tensor.* is deprecated",
    r"When using async grad allreduce it is recommended",
    # every checkpoint load, inside megatron-core 0.16's torch_dist strategy (not ours to change)
    r"`load_state_dict` is deprecated and will be removed",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
    # megatron-core 0.19, when its models package is imported (we build no MIMO model) ...
    r"MimoModelConfig is experimental",
    # ... and at every checkpoint load: it reads the common state and the tensors' metadata
    # through torch DCP in one process (no_dist=True), with the arguments in the old order
    r"torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load",
    r"The argument order of load has been changed",
)

#: Log records (``logging``, not ``warnings``), by the logger that writes them.
EXPECTED_LOGS = {
    # PyPI's torch for Python 3.12 is the CUDA build: on a CPU machine, once in every process
    # (megatron-core imports torch.utils.cpp_extension)
    "torch.utils.cpp_extension": r"No CUDA runtime is found",
    # megatron-core 0.19: at every model build (the HybridModel plan: docs/gpu.md) ...
    "megatron.core.models.gpt.gpt_model": r"GPTModel IS DEPRECATED",
    # ... and at every save, synchronous ones included, and every load of a 0.16 checkpoint
    "megatron.core.dist_checkpointing.strategies.torch": r"MCore's async save is deprecated",
    "megatron.core.dist_checkpointing.strategies.common": r"(save|load)_common is deprecated",
}


class _DropMatching(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def quiet() -> None:
    for pattern in EXPECTED:
        warnings.filterwarnings("ignore", message=pattern)
    for name, pattern in EXPECTED_LOGS.items():
        logger = logging.getLogger(name)  # the logger the module will get, made before it
        if not any(isinstance(f, _DropMatching) for f in logger.filters):  # once per process
            logger.addFilter(_DropMatching(pattern))
