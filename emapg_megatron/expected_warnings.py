"""Megatron-Core warnings that are expected without Apex/TE or on CPU, silenced at package import.

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
)


def quiet() -> None:
    for pattern in EXPECTED:
        warnings.filterwarnings("ignore", message=pattern)
