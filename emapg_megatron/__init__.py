"""emapg-megatron: EMA Policy Gradient on Megatron-Core."""

from emapg_megatron import expected_warnings
from emapg_megatron.runtime.lifetime import end_with_parent

__version__ = "0.1.0"

end_with_parent()  # a rank (or a process it spawned) ends with its parent: first, before heavy imports
expected_warnings.quiet()  # before any submodule imports megatron.core
