"""emapg-megatron: EMA Policy Gradient on Megatron-Core."""

from emapg_megatron import expected_warnings

__version__ = "0.1.0"

expected_warnings.quiet()  # before any submodule imports megatron.core
