"""Megatron-Core on a machine without CUDA: every CPU workaround of the project, in one place.

Megatron-Core assumes a GPU in many small ways (``torch.cuda.current_device()``, ``device="cuda"``,
``.cuda()``, CUDA streams/events, the CUDA RNG tracker, ``tensor.type() == 'torch.cuda.FloatTensor'``).
On a CPU-only machine those calls would raise, so :func:`install_cpu_shims` makes them act on the CPU:

* ``torch.cuda`` functions that would raise without a GPU get CPU meanings: ``current_device()`` is 0,
  ``synchronize``/streams/events do nothing, the CUDA RNG state is the CPU RNG state.
* MoE token dispatch gets its all-to-all split sizes as host arrays, as it does from a GPU.
* A ``TorchFunctionMode`` maps the devices ``"cuda"``, ``"cuda:N"`` and integer ids to the CPU in every
  torch call (factories, ``.to()``, ``.cuda()``), and answers ``tensor.type()`` with the CUDA twin
  ("torch.cuda.FloatTensor") when Megatron asks, since Megatron compares those strings.

It is a no-op when CUDA is available, and idempotent. Nothing here changes numerics: with no GPU,
every tensor already lives on the CPU.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):  # page-locked memory needs a CUDA driver (e.g. the CP rotary slice's index)
            kwargs = {**kwargs, "pin_memory": False}
        name = getattr(func, "__name__", "")
        if name == "cuda":  # Tensor.cuda(...) / Module.cuda goes through here per tensor
            return args[0]
        if name == "to" and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if name == "type" and len(args) == 1 and not kwargs:
            result = func(*args)
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("megatron.") and result.startswith("torch.") and ".cuda." not in result:
                return "torch.cuda." + result[len("torch.") :]
            return result
        return func(*args, **kwargs)


class _NoopStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event or _NoopEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoopEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _patch_torch_cuda() -> None:
    cuda: Any = torch.cuda  # its functions and classes replaced by CPU stand-ins (of other types than torch's)
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda device=None: None
    cuda.current_stream = lambda device=None: _NoopStream()
    cuda.default_stream = lambda device=None: _NoopStream()
    cuda.Stream = _NoopStream
    cuda.Event = _NoopEvent
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.set_stream = lambda stream: None
    cuda.set_device = lambda device: None
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.reset_peak_memory_stats = lambda device=None: None
    # The CUDA RNG is the CPU RNG here (Megatron's tracker forks it for tensor-parallel dropout).
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed)) and None
    cuda.manual_seed_all = lambda seed: None


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


def _patch_megatron_moe_dispatch() -> None:
    # MoE all-to-all dispatch: Megatron-Core turns the split sizes into host numpy arrays only when they are
    # on a GPU (moe_utils.maybe_move_tensor_to_cpu); on the CPU they stay tensors, which all_to_all_single
    # rejects. Give it the same host arrays it gets on a GPU.
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def install_cpu_shims() -> bool:
    """Install the shims if CUDA is unavailable. Returns True if they are active."""
    global _INSTALLED
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    _patch_torch_cuda()
    _patch_megatron_rng()
    _patch_megatron_moe_dispatch()
    _CudaToCpuMode().__enter__()  # process-wide: stays active for the life of the process
    _INSTALLED = True
    return True
