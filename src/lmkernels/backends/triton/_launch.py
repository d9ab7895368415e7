"""Kernel launches without Triton's per-call binding: a cache from what decides a launch's
compiled kernel to that kernel's launcher.

`kernel[grid](*args, **kw)` binds the arguments to the signature, specializes each one (its
type, a pointer's 16-byte alignment, an integer's divisibility by 16, ...), builds a cache key
from those and every constexpr and option value, and looks the compiled kernel up, on every
call: 8-14 us of host time per launch on the H200 machine, on top of the 5-8 us that the
compiled kernel's launcher takes (measured; docs/performance.md). So `launch`
keeps its own key, per kernel, of exactly what Triton specializes on, and calls the launcher
directly once Triton has compiled the kernel for that key.

The key of a launch: the current CUDA device; per positional argument its type, and for a tensor
its dtype and whether its data pointer is 16-byte aligned, for an int whether it is 1, whether
it is divisible by 16 and its width (i32, i64 or u64), for a constexpr its value; each keyword
(constexprs and launch options such as num_warps) by name, type and value. Those are all that
Triton's specialization reads on NVIDIA GPUs (Triton 3.6-3.9). A launch whose arguments fall
outside them (another tensor subclass, a non-constexpr passed by keyword) always takes
Triton's own path, as do kernels that are not plain jit functions (an autotuner), Triton
versions before 3.6, the interpreter, ROCm, launches while Triton's launch hooks are set (a
profiler), and every launch when LMKERNELS_FAST_LAUNCH=0.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch

from lmkernels.backends.triton import _version, interpreting
from lmkernels.registry import LMKernelsError

# LMKERNELS_FAST_LAUNCH=0: every launch through Triton's own path (to rule the cache out; A/B).
USE_FAST_LAUNCH = os.environ.get("LMKERNELS_FAST_LAUNCH", "1") != "0"

_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_NOT_CACHED = object()  # a cache entry: this key's launches take Triton's path
_UNALLOCATED = object()  # ends a key whose tensor argument has elements but no memory
_LOW_ADDRESSES = 1 << 32
_current_device = torch._C._cuda_getDevice if hasattr(torch._C, "_cuda_getDevice") else None


def launch(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> None:
    """kernel[grid](*args, **kwargs), through the compiled kernel's launcher where the cache
    has it. grid: a tuple of 1-3 ints. Non-constexpr parameters go by position, constexprs and
    options by keyword."""
    if not _enabled() or type(kernel) is not _JIT_FUNCTION or _hooks_set():
        check_allocated(kernel, args)
        kernel[grid](*args, **kwargs)
        return
    state = kernel.__dict__.get("_lmk_launches")
    if state is None:  # the kernel's cache, and the positions of its constexpr parameters
        state = kernel._lmk_launches = ({}, tuple(i for i, p in enumerate(kernel.params) if p.is_constexpr))
    cache, constexprs = state
    key = launch_key(args, kwargs, constexprs)
    if key[1] is None or (key[1] and key[1][-1] is _UNALLOCATED):
        # an argument type the key does not cover, or a tensor without memory (never cached)
        check_allocated(kernel, args)
        kernel[grid](*args, **kwargs)
        return
    try:
        entry = cache.get(key)
    except TypeError:  # an unhashable keyword value: Triton's path
        entry = _NOT_CACHED
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        cache[key] = _entry(kernel, compiled, len(args), kwargs)
        return
    if entry is _NOT_CACHED:
        kernel[grid](*args, **kwargs)
        return
    run, function, metadata, tail, stream = entry
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    # The arguments as Triton's path hands them over: every parameter in order, constexprs too
    # (the launcher skips them); no launch metadata and no hooks (_hooks_set).
    run(grid[0], g1, g2, stream(key[0]), function, metadata, None, None, None, *args, *tail)


def check_allocated(kernel: Any, args: tuple) -> None:
    """LMKernelsError for a positional tensor argument with elements but no memory (its storage
    freed or resized to 0, as FSDP2 does to an unsharded parameter between its uses): a kernel
    would read or write near address 0, an illegal memory access that ends the process's CUDA
    context. (The library passes every tensor by position.)"""
    for i, a in enumerate(args):
        if type(a) in _TENSOR_TYPES and _no_memory(a, a.data_ptr()):
            name = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
            raise LMKernelsError(
                f"{name}: tensor argument {i} (shape {tuple(a.shape)}, {a.dtype}) has no allocated "
                f"memory (its storage was freed or resized to 0, e.g. an FSDP2 parameter used "
                f"outside the forward and backward of the module that owns it)"
            )


def _no_memory(t: torch.Tensor, ptr: int) -> bool:
    """Whether tensor t (data pointer ptr) has elements but a freed storage. A freed storage's
    views point at their offset from address 0; memory lies far above 4 GiB, so only such low
    pointers pay for the storage's own check."""
    return ptr < _LOW_ADDRESSES and t.numel() > 0 and not t.untyped_storage().data_ptr()


def launch_key(args: tuple, kwargs: dict, constexprs: tuple = ()) -> tuple:
    """(device, the positional arguments' specialization or None where one is of a type this
    cache does not key, the keywords' names, types and values, the values and types of the
    constexprs passed by position: at `constexprs`, positions in the kernel's parameters).

    An int's specialization is one small int: 1 for the value 1 (a constant to Triton), else
    2 + (divisible by 16) + 2 * width, width 0 for i32, 1 for i64, 2 for u64 (or beyond). It is
    computed inline: this loop runs for every argument of every launch, and a function call per
    int was a quarter of RoPE's key (31 arguments: 5.3 against 4.0-4.2 us on the CPU)."""
    spec: list | None = []
    append = spec.append
    for a in args:
        kind = type(a)
        if kind is int:
            if a == 1:
                append(1)
            elif -0x80000000 <= a <= 0x7FFFFFFF:
                append(2 + (not a & 15))
            else:
                append(4 + (not a & 15) + (0 if -(1 << 63) <= a < (1 << 63) else 2))
        elif kind in _TENSOR_TYPES:
            ptr = a.data_ptr()
            append(a.dtype)
            append(not ptr & 15)
            if _no_memory(a, ptr):
                append(_UNALLOCATED)
                break
        elif kind is float or kind is bool or a is None:
            append(kind)
        else:
            spec = None
            break
    values = tuple(kwargs.values())
    n = len(args)
    positional = tuple([args[i] for i in constexprs if i < n]) if constexprs else ()
    return (
        _current_device() if _current_device is not None else None,
        None if spec is None else tuple(spec),
        tuple(kwargs),
        values,
        tuple(map(type, values)),
        positional,
        tuple(map(type, positional)),
    )


def _entry(kernel: Any, compiled: Any, n_args: int, kwargs: dict) -> Any:
    """The launcher call of a key's compiled kernel, or _NOT_CACHED where the arguments do not
    map onto the parameters the way `launch` calls the launcher (positional arguments, then
    keyword constexprs or defaults)."""
    if compiled is None or not hasattr(compiled, "packed_metadata"):
        return _NOT_CACHED
    signature = inspect.signature(kernel.fn).parameters
    tail = []
    for i, param in enumerate(kernel.params):
        if i < n_args:
            continue
        if not param.is_constexpr:
            return _NOT_CACHED
        if param.name in kwargs:
            tail.append(kwargs[param.name])
        else:
            default = signature[param.name].default
            if default is inspect.Parameter.empty:
                return _NOT_CACHED
            tail.append(default)
    return compiled.run, compiled.function, compiled.packed_metadata, tuple(tail), _stream_getter()


def _stream_getter() -> Any:
    """Triton's own function for the current stream of a device (its launch path's)."""
    from triton.runtime import driver

    return driver.active.get_current_stream


_ENABLED: bool | None = None
_JIT_FUNCTION: type | None = None  # the kernels the cache takes: plain jit functions (not wrappers)


def _enabled() -> bool:
    """Whether `launch` may use its cache at all (decided once per process)."""
    global _ENABLED, _JIT_FUNCTION
    if _ENABLED is None:
        from triton.runtime.jit import JITFunction

        _JIT_FUNCTION = JITFunction
        _ENABLED = (
            USE_FAST_LAUNCH
            and not interpreting()
            and torch.version.hip is None
            and _current_device is not None
            and _triton_layout_known()
        )
    return _ENABLED


def _triton_layout_known() -> bool:
    """The Triton versions whose launch path `launch` reproduces, read in their source: compiled
    kernels with `run` (a property), `function` and `packed_metadata`, called with the grid,
    stream, function, metadata, launch metadata, both hooks and every bound argument, constexprs
    included (3.6 and 3.9; later ones until they change it)."""
    import triton
    from triton.compiler.compiler import CompiledKernel

    return _version(triton.__version__) >= (3, 6) and isinstance(CompiledKernel.__dict__.get("run"), property)


def _hooks_set() -> bool:
    """Whether a launch hook is set (Triton 3.9 keeps them as chains of hooks, empty by default;
    earlier versions as a function or None)."""
    runtime = _runtime_knobs()
    return _hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook)


def _hook_set(hook: Any) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))


@functools.cache
def _runtime_knobs() -> Any:
    from triton import knobs

    return knobs.runtime
