"""The plain CUDA -> CPU mapping: Megatron's device requests land on the CPU.

* :class:`CudaToCpuMode`, a ``TorchFunctionMode``, rewrites every ``device=``
  argument and ``Tensor.cuda()`` / ``Tensor.to("cuda")`` to the CPU, and
  reports CPU tensors' ``type()`` under their CUDA names. Once strict mode is on,
  it hands every torch function to strict mode instead (:mod:`.strict_mode`).
* :func:`install` patches the few ``torch.cuda`` functions that do not go
  through torch functions: the current device, the RNG state (mapped to the
  CPU generator, so Megatron's RNG tracker forks the generator dropout really
  uses), synchronisation and streams (no-ops on CPU); and it runs backward
  passes under the mode (:class:`MappingEngine`).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
from megatron.core.tensor_parallel import random as mrandom
from torch.autograd.variable import Variable
from torch.overrides import TorchFunctionMode

from . import state

CPU = torch.device("cpu")


def is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # Megatron passes torch.cuda.current_device() (an int) as a device.
    return isinstance(device, int) and not isinstance(device, bool)


def map_device(device):
    return CPU if is_cuda_device(device) else device


def is_device_like(obj) -> bool:
    return isinstance(obj, (str, torch.device)) or (isinstance(obj, int) and not isinstance(obj, bool))


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests made through torch functions to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        strict_torch_function = state.strict_torch_function
        if strict_torch_function is not None:
            return strict_torch_function(func, args, kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron asserts 'torch.cuda.FloatTensor' etc.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = map_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:  # .to("cuda") and .to(device, dtype)
            args = (args[0], map_device(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


class MappingEngine:
    """Stands in for ``Variable._execution_engine`` in CPU mode: backward passes run mapped too.

    ``Tensor.backward`` and ``torch.autograd.backward`` / ``grad`` are torch functions, and
    handling one pops the mode for its whole duration, backward pass included. Megatron allocates
    in backward (``torch.empty(..., device=torch.cuda.current_device())`` in sequence-parallel
    linear layers), and custom autograd Functions' backward and gradient hooks are to be mapped
    (in strict mode: checked) like the forward, so the mode is put back for the engine's run.
    Strict mode's engine adds to the run by overriding :meth:`_run`.
    """

    def __init__(self, engine):
        self._engine = engine

    def run_backward(self, *args, **kwargs):
        if torch._C._len_torch_function_stack() == 0:
            with CudaToCpuMode():
                return self._run(args, kwargs)
        return self._run(args, kwargs)

    def _run(self, args, kwargs):
        return self._engine.run_backward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)


# -- torch.cuda and Megatron's RNG tracker ----------------------------------------------------

def _cpu_rng_state(device=None):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=None, graph_safe=False):
    torch.set_rng_state(new_state)


def _patch_torch_cuda():
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.device_count = lambda: 1
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.get_rng_state = _cpu_rng_state
    cuda.set_rng_state = _set_cpu_rng_state
    cuda.random.get_rng_state = _cpu_rng_state
    cuda.random.set_rng_state = _set_cpu_rng_state
    # torch.manual_seed itself calls cuda.manual_seed_all: seed the CPU generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0


def _patch_megatron_rng():
    # Megatron's tracker reads and writes the CUDA generator directly.
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = _set_cpu_rng_state
    # The tracker warns when the CPU state changes inside a fork; on CPU that is the point.
    logging.getLogger(mrandom.__name__).addFilter(
        lambda record: "CPU RNG state changed" not in record.getMessage()
    )


class _NullStream(torch.Stream):
    """CPU's one stream. A ``torch.Stream`` so that what takes a stream argument accepts it
    (``tensor.record_stream(torch.cuda.current_stream())`` in Megatron's MoE dispatcher)."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls, device="cpu")

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return _NullEvent()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def install() -> None:
    """Map CUDA to the CPU for the rest of this process (once: the package's install checks)."""
    # Some VMs advertise AMX without enabling it: oneDNN's bf16 matmul then dies with SIGILL.
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    _patch_torch_cuda()
    _patch_megatron_rng()
    Variable._execution_engine = MappingEngine(Variable._execution_engine)
    CudaToCpuMode().__enter__()  # stays active for the process lifetime
    state.installed = True
