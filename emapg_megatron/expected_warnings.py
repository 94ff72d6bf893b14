"""Megatron-Core warnings that are expected without Apex/TE, on CPU or from its own use of
deprecated torch APIs, silenced at package import.

They are raised while ``megatron.core`` is imported, so the filter must be in place before any of
our modules import it; the package's ``__init__`` installs it. The patterns are narrow: every
other warning still shows.
"""

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
)


def quiet() -> None:
    for pattern in EXPECTED:
        warnings.filterwarnings("ignore", message=pattern)
