"""What the Triton op files share: how an op call reaches its kernels (the eager fast path
around the torch.library custom ops, the autograd.Functions for torch.func transforms and
forward-mode AD), kernel launches without Triton's per-call argument binding, and the small
launcher and kernel helpers every op needs (PDL, bf16 rounding, cdiv).

An op file reads: kernels; raw launchers (plain Python functions, type-annotated);
`op = torch.library.custom_op("lmkernels::name", raw_launcher, mutates_args=...)` with
register_fake; setup_context and backward, registered on the op with register_autograd and
turned into the eager Function with `eager_function` (whose `transforms` is the
`transforms_function` made of them and the jvp); the impl, `call(op, Function, *args)`.
Inside a backward, launchers run through `op_or_raw(op, raw, name)(*args)`; every kernel is
launched with `launch(kernel, grid, *args, **constexprs)`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.autograd.forward_ad
import triton
import triton.language as tl

from lmkernels.backends.triton import _version, interpreting
from lmkernels.backends.triton.configs import targets as _targets
from lmkernels.registry.core import LMKernelsError, forward_ad_error, higher_order_error

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without PDL: `pdl` never turns it on, these never run

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

    _TRITON_PDL = False
else:
    _TRITON_PDL = True

# --- how an op call reaches its launchers --------------------------------------------------------
#
# Three routes, one set of launchers. Code being traced (torch.compile, export, fake tensors,
# subclasses) calls the torch.library custom op: an opaque op with a known output shape and
# gradient. Eager calls skip the custom op's dispatcher, whose per-call host cost exceeds the
# kernels of a mid-sized norm (docs/performance.md): a plain autograd.Function runs the same
# launchers with the same setup_context and backward. torch.func transforms and forward-mode AD
# need what neither has (a tangent formula, functorch's autograd): a third Function
# (`transforms_function`) with setup_context as its own staticmethod, the op's jvp (or a named
# refusal) and a vmap rule; functorch unwraps the inputs, so the launchers see plain tensors.

# Tensor types the raw launchers take as they are. nn.Parameter is a plain tensor for them; any
# other subclass (FakeTensor, FunctionalTensor, DTensor, ...) is left to the custom op's dispatch.
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def traced(args: tuple) -> bool:
    """True when a call with these arguments must go through the registered custom op.

    That is under torch.compile / torch.export (is_compiling), under any other tracer or fake
    tensor mode (make_fx, FakeTensorMode, the modes AOTAutograd traces under: a torch dispatch
    mode is active), and for tensor subclasses: the raw launchers hand real memory to Triton and
    would fail (or read garbage) on any of those. torch.func transforms and forward-mode AD are
    `transforming`, not traced.
    """
    if _is_compiling() or _dispatch_modes():
        return True
    for a in args:
        if type(a) not in _PLAIN_TYPES and isinstance(a, torch.Tensor):
            return True
    return False


def transforming() -> bool:
    """True under torch.func transforms (functorch's wrapped tensors: grad, vjp, jvp, vmap) and
    forward-mode AD (a torch.autograd.forward_ad.dual_level, whose dual tensors are plain
    tensors): calls go to the op's `transforms_function` there. The test of
    lmkernels.utils.transforms_active, with the lookups `call` inlines."""
    return _functorch_active() or _forward_ad._current_level >= 0


# Argument types that are neither a tensor subclass nor need an isinstance() to tell: for a
# non-tensor that test takes torch.Tensor's metaclass's slow isinstance route, which would cost
# more host time than the rest of `call` for an RMSNorm's options.
_PLAIN_TYPES = frozenset({*_PLAIN_TENSOR_TYPES, float, int, bool, str, type(None), torch.dtype})


# Looked up once: `call` runs on every op call, and each attribute hop costs host time. Dynamo
# still recognizes is_compiling (the same function object).
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled
# The dual level lives in this module's global `_current_level` (-1: no level entered).
_forward_ad = torch.autograd.forward_ad
_JVP = torch._C._functorch.TransformType.Jvp


def eager_function(
    name: str,
    forward: Callable[..., Any],
    setup_context: Callable[[Any, tuple, Any], None],
    backward: Callable[..., Any],
    transforms: type[torch.autograd.Function],
) -> type[torch.autograd.Function]:
    """An autograd.Function running `forward` (the custom op's raw launcher) with the custom op's
    own setup_context and backward, for eager calls; `transforms` (made by transforms_function)
    is what `call` runs instead under torch.func transforms and forward-mode AD.

    forward takes ctx and calls setup_context itself: a Function that defines setup_context as a
    separate staticmethod pays an inspect.signature() bind on every apply(), which is host time
    this path exists to save. (The separate form is only needed for functorch transforms, and
    those calls go to `transforms`.)
    """

    def forward_with_ctx(ctx: Any, *args: Any) -> Any:
        output = forward(*args)
        setup_context(ctx, args, output)
        return output

    return type(
        name,
        (torch.autograd.Function,),
        {
            "forward": staticmethod(forward_with_ctx),
            "backward": staticmethod(backward),
            "raw_forward": staticmethod(forward),
            "transforms": transforms,
        },
    )


VmapRule = Callable[[type[torch.autograd.Function]], Callable[..., Any]]


def transforms_function(
    name: str,
    op: Callable[..., Any],
    forward: Callable[..., Any],
    setup_context: Callable[[Any, tuple, Any], None],
    backward: Callable[..., Any],
    jvp: Callable[..., Any],
    vmap: VmapRule | None = None,
) -> type[torch.autograd.Function]:
    """The autograd.Function of a launcher for torch.func transforms and forward-mode AD.

    forward runs the raw launcher `forward` (the custom op `op` on traced arguments): functorch
    calls it on the unwrapped tensors. setup_context must save with ctx.save_for_forward what
    `jvp(ctx, *input_tangents) -> output tangents` reads; jvp computes the tangents or raises
    (ForwardADError, HigherOrderGradientError). vmap: how the rule is made from the Function
    (vmap_over_rows(...), or vmap_by_loop by default).
    """

    def run(*args: Any) -> Any:
        return op(*args) if traced(args) or _functorch_wrapped(args) else forward(*args)

    # Any: its vmap staticmethod, made of the class itself, is set once the class exists
    function: Any = type(
        name,
        (torch.autograd.Function,),
        {
            "forward": staticmethod(run),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
            "jvp": staticmethod(jvp),
        },
    )
    function.vmap = staticmethod((vmap or vmap_by_loop)(function))
    return function


def _functorch_wrapped(args: tuple) -> bool:
    """Whether an argument is functorch's wrapper of a tensor (no memory of its own). A backward
    that torch.func.vjp's function runs after its transform has ended gets such tensors from the
    forward's context; the custom op takes them (the dispatcher unwraps them), a raw launcher
    cannot."""
    return any(
        isinstance(a, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(a) for a in args
    )


def refuse_nested_jvp(op: str, backend: str = "triton") -> None:
    """For a jvp staticmethod: ForwardADError under nested forward-mode AD (jvp of jvp, jacfwd
    of jacfwd: two of functorch's jvp levels). torch runs an autograd.Function's jvp with
    forward AD off, so the outer level would get no tangent of the tangent: a silent zero."""
    stack = torch._C._functorch.get_interpreter_stack() or ()
    if sum(i.key() == _JVP for i in stack) > 1:
        raise forward_ad_error(op, backend, "nested in another forward-mode transform (jvp of jvp)")


def vmap_by_loop(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """A vmap rule calling `function` once per batch element and stacking the results (batch
    dim 0): right for any op, one launch per element."""

    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        n = info.batch_size
        results = [function.apply(*_element(args, in_dims, i)) for i in range(max(n, 1))]
        outs = tuple(torch.stack(o) for o in zip(*map(_as_tuple, results)))
        if n == 0:  # the call above ran on zeros, for the outputs' shapes
            outs = tuple(o[:0] for o in outs)
        if isinstance(results[0], tuple):
            return outs, (0,) * len(outs)
        return outs[0], 0

    return vmap


def _element(args: tuple, in_dims: tuple, i: int) -> list:
    """Batch element i of args (zeros of an element's shape in an empty batch)."""
    out = []
    for a, d in zip(args, in_dims):
        if d is not None:
            a = a.select(d, i) if a.shape[d] else a.new_zeros(a.shape[:d] + a.shape[d + 1 :])
        out.append(a)
    return out


def _as_tuple(out: Any) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def vmap_over_rows(rows: tuple[int, ...], stats: int = 0) -> VmapRule:
    """A vmap rule for an op applied row by row over any leading dims of its arguments at
    `rows` (the norms' x, the GLUs' gate and up): these get the batch as one more leading dim
    (an unbatched one expanded) and the op runs once over the merged rows. Its last `stats`
    outputs, one value per row (flat), come back as (batch, rows). Where another argument is
    batched (a weight per batch element), one call per element (vmap_by_loop)."""

    def make(function: type[torch.autograd.Function]) -> Callable[..., Any]:
        by_loop = vmap_by_loop(function)

        def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
            n = info.batch_size
            if n == 0 or any(d is not None for i, d in enumerate(in_dims) if i not in rows):
                return by_loop(info, in_dims, *args)
            merged = list(args)
            for i in rows:
                a, d = merged[i], in_dims[i]
                merged[i] = a.expand(n, *a.shape) if d is None else a.movedim(d, 0)
            out = function.apply(*merged)
            outs = _as_tuple(out)
            first_stat = len(outs) - stats
            outs = tuple(o.view(n, o.shape[0] // n) if j >= first_stat else o for j, o in enumerate(outs))
            if isinstance(out, tuple):
                return outs, (0,) * len(outs)
            return outs[0], 0

        return vmap

    return make


def call(op: Callable[..., Any], function: Any, *args: Any) -> Any:
    """Run a differentiable op: the custom op when traced, the Function's `transforms` under
    torch.func transforms and forward-mode AD, else the eager Function, or the raw launcher alone
    when no gradient will be taken (no graph to record)."""
    if _is_compiling():
        return op(*args)
    if _functorch_active() or _forward_ad._current_level >= 0:
        return function.transforms.apply(*args)
    if _dispatch_modes():
        return op(*args)
    grad = _grad_enabled()
    record = False
    for a in args:  # traced()'s subclass test and any requires_grad, in one pass
        kind = type(a)
        if kind in _PLAIN_TENSOR_TYPES:
            record = record or (grad and a.requires_grad)
        elif kind not in _PLAIN_TYPES and isinstance(a, torch.Tensor):
            return op(*args)
    if record:
        return function.apply(*args)
    return function.raw_forward(*args)


def op_or_raw(
    op: Callable[..., Any], raw: Callable[..., Any], name: str, backend: str = "triton"
) -> Callable[..., Any]:
    """For a launcher with no autograd formula of its own (a backward kernel of lmkernels op
    `name`): a function that runs the custom op when traced (AOTAutograd traces the registered
    backward, so the compiled graph calls the op), and the raw launcher otherwise.

    Under torch.func transforms and forward-mode AD, and with grad mode on (a backward with
    create_graph=True: torch.func.vjp's function asks for one by default), it runs as a Function
    whose own derivatives (backward, jvp) raise HigherOrderGradientError: the first-order
    gradients are exact, and differentiating them (grad of grad, jvp of grad) is refused by name
    instead of silently missing the second-order term.
    """

    def refuse(ctx: Any, *grads: Any) -> NoReturn:
        raise higher_order_error(name, backend)

    def no_context(ctx: Any, inputs: tuple, output: Any) -> None:
        pass

    function = transforms_function(f"{name}_backward", op, raw, no_context, refuse, refuse)

    def run(*args: Any) -> Any:
        if not _is_compiling() and transforming():
            return function.apply(*args)
        if traced(args):
            return op(*args)
        if _grad_enabled():
            return function.apply(*args)
        return raw(*args)

    return run


# --- launcher helpers ------------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code: triton.cdiv is a constexpr-function wrapper that costs a few
    microseconds per call outside a kernel, on every launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for host code: triton.next_power_of_2 is
    a constexpr-function wrapper too, far slower per call than this integer arithmetic."""
    return 1 << max(n - 1, 0).bit_length()


_NO_GUARD = contextlib.nullcontext()


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: switch to t's device, only if it is another."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_GUARD


def soft_bf16(t: torch.Tensor) -> bool:
    """Whether kernels on t's device round fp32 -> bf16 in software (to_dtype's SOFT_BF16): on
    the CPU interpreter, unless the kernels are being compiled for a GPU (targets.simulate)."""
    return not t.is_cuda and not (_targets.ACTIVE is not None and _targets.ACTIVE.compiled)


@triton.jit
def to_dtype(v, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 `v` rounded to nearest-even in `dtype`: every kernel's stores of 16-bit results.

    The GPU converts with round-to-nearest-even. The CPU interpreter truncates fp32 -> bf16, so
    there (SOFT_BF16, from soft_bf16()) the rounding is done on the bits: add half an ulp (ties
    to even), clear the low 16 bits; the conversion that follows is then exact. nan stays nan.
    Only the interpreter takes this path: on the GPU it compiles to the plain conversion.
    """
    if SOFT_BF16 and dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        v = tl.where(v != v, v, ((bits >> 16) << 16).to(tl.float32, bitcast=True))
    return v.to(dtype)


# --- the GPU's rules for every impl --------------------------------------------------------------


def gpu_reasons(**inputs: Any) -> list[str]:
    """Why the Triton kernels cannot take these inputs on their GPU: bf16 tensors on a GPU without
    bf16 arithmetic (sm_75: T4, RTX 20xx), where `auto` then picks compile or eager."""
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.is_cuda:
            gpu = no_bf16(t.get_device())
            if gpu:
                return [
                    f"{name}: bf16 on {gpu}, which has no bf16 arithmetic "
                    "(NVIDIA compute capability 8.0 or later needed): use fp16 or fp32, or compile / eager"
                ]
    return []


@torch.compiler.assume_constant_result
def no_bf16(index: int) -> str:
    """ "" where CUDA device `index` has bf16 arithmetic, else the GPU as the refusal names it. A
    constant to torch.compile, which cannot trace the device's properties or Triton's driver
    (a fullgraph compile of a Triton op would fail at this check)."""
    target = _targets.device_target(index)
    return "" if target.bf16 else f"{target.name} ({target.gpus})"


def gpu_capabilities(op: str, supports: Callable[..., list[str]]) -> dict[str, Any]:
    """register() keywords every Triton impl of `op` takes: `supports` with the GPU's dtype rule
    (gpu_reasons) ahead of the op's own reasons, and `auto_declines`: `auto` passes over Triton
    where the device runs untuned (generic) tables that are slower than compile for `op` there
    (configs.generic.PREFER_COMPILE)."""

    def supported(**inputs: Any) -> list[str]:
        return gpu_reasons(**inputs) + supports(**inputs)

    def auto_declines(**inputs: Any) -> list[str]:
        device = next((t.device for t in inputs.values() if isinstance(t, torch.Tensor) and t.is_cuda), None)
        gpu = "" if device is None else generic_slower(op, -1 if device.index is None else device.index)
        if not gpu:
            return []
        return [
            f"{gpu} runs the generic launch tables, measured slower than compile for {op} "
            "(configs.generic.PREFER_COMPILE; `lmkernels tune --install` measures this GPU's own)"
        ]

    return {"supports": supported, "auto_declines": auto_declines}


@torch.compiler.assume_constant_result
def generic_slower(op: str, index: int) -> str:
    """The name of CUDA device `index` (-1: the current one) where it runs the generic launch
    tables (no tuned ones) and those were measured slower than compile for `op`, else "". A
    constant to torch.compile, as no_bf16."""
    from lmkernels.backends.triton.configs import generic, is_tuned, tables_for

    index = torch.cuda.current_device() if index < 0 else index
    if is_tuned(tables_for(torch.device("cuda", index))):
        return ""
    target = _targets.device_target(index)
    return target.name if generic.prefers_compile(target, op) else ""


# --- programmatic dependent launch ---------------------------------------------------------------
#
# A kernel launched with PDL (Hopper and later) may be scheduled before the kernel ahead of it
# in the stream has finished: its launch, its programs' placement on the SMs and their first
# instructions overlap the previous kernel's last programs, and `gdc_wait` then holds it until
# that kernel has completed and its writes are visible. That shortens the gap between two
# dependent kernels, which counts where the kernels are short (docs/performance.md, "What we
# tried" and "Design decisions and their measurements").
#
# The rule that keeps it correct: a kernel launched with PDL calls `pdl_enter(PDL)` before it
# touches global memory at all (reads and writes: a buffer it writes may have been freed by a
# tensor the previous kernel still reads). It then lets the next kernel launch early too; that
# kernel waits in turn, for this one's completion, so the order of every kernel's effects is
# the stream's order.

# LMKERNELS_PDL=0 launches without PDL everywhere (to rule it out); tools set USE_PDL (an A/B).
USE_PDL = os.environ.get("LMKERNELS_PDL", "1") != "0"


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of every kernel: with PDL, wait for the previous kernel in the stream to
    complete, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


_PDL_ON = {"PDL": True, "launch_pdl": True}
_PDL_OFF = {"PDL": False}  # no launch_pdl keyword: a Triton without PDL rejects it


def pdl(t: torch.Tensor) -> dict[str, bool]:
    """Launch keywords for a kernel working on t: PDL where sm90_ptx holds and Triton has it
    (under targets.simulate: where the simulated target has sm_90 PTX and the kernels are
    compiled). The kernel must start with `pdl_enter(PDL)`."""
    if _targets.ACTIVE is not None:
        return _PDL_ON if USE_PDL and _TRITON_PDL and target_ptx(t) else _PDL_OFF
    if USE_PDL and _TRITON_PDL and t.is_cuda and sm90_ptx(t.get_device()):
        return _PDL_ON
    return _PDL_OFF


def target_ptx(t: torch.Tensor) -> bool:
    """Whether kernels on t run sm_90 instructions (PDL, the bulk L2 prefetch): sm90_ptx of t's
    CUDA device, or under targets.simulate, of the simulated target where the kernels are
    compiled (offline, or on a CUDA device)."""
    simulation = _targets.ACTIVE
    if simulation is not None:
        return simulation.target.sm90_ptx and (
            simulation.compiled or (t.is_cuda and sm90_ptx(t.get_device()))
        )
    return t.is_cuda and sm90_ptx(t.get_device())


@functools.cache
def sm90_ptx(index: int) -> bool:
    """Whether sm_90 instructions (PDL, the bulk L2 prefetch) run on CUDA device `index`: an
    NVIDIA GPU of sm_90 or later, kernels compiled (not the interpreter), not ROCm."""
    if interpreting() or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(index) >= (9, 0)


# --- kernel launches ---------------------------------------------------------------------------
#
# Kernel launches without Triton's per-call binding: a cache from what decides a launch's
# compiled kernel to that kernel's launcher.
#
# `kernel[grid](*args, **kw)` binds the arguments to the signature, specializes each one (its
# type, a pointer's 16-byte alignment, an integer's divisibility by 16, ...), builds a cache key
# from those and every constexpr and option value, and looks the compiled kernel up, on every
# call: more host time per launch than the compiled kernel's launcher itself takes
# (docs/performance.md, "Design decisions and their measurements"). So `launch`
# keeps its own key, per kernel, of exactly what Triton specializes on, and calls the launcher
# directly once Triton has compiled the kernel for that key.
#
# The key of a launch: the current CUDA device; per positional argument its type, and for a tensor
# its dtype and whether its data pointer is 16-byte aligned, for an int whether it is 1, whether
# it is divisible by 16 and its width (i32, i64 or u64), for a constexpr its value; each keyword
# (constexprs and launch options such as num_warps) by name, type and value. Those are all that
# Triton's specialization reads on NVIDIA GPUs (Triton 3.6-3.9). A launch whose arguments fall
# outside them (another tensor subclass, a non-constexpr passed by keyword) always takes
# Triton's own path, as do kernels that are not plain jit functions (an autotuner), Triton
# versions before 3.6, the interpreter, ROCm, launches while Triton's launch hooks are set (a
# profiler), and every launch when LMKERNELS_FAST_LAUNCH=0.

# LMKERNELS_FAST_LAUNCH=0: every launch through Triton's own path (to rule the cache out; A/B).
USE_FAST_LAUNCH = os.environ.get("LMKERNELS_FAST_LAUNCH", "1") != "0"

_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_NOT_CACHED = object()  # a cache entry: this key's launches take Triton's path
_UNALLOCATED = object()  # ends a key whose tensor argument has elements but no memory
_LOW_ADDRESSES = 1 << 32
# The launch key's device: None where no CUDA device is (a CUDA build of torch on a machine
# without one raises on the call, and its launches run on the interpreter anyway).
_current_device = (
    torch._C._cuda_getDevice if hasattr(torch._C, "_cuda_getDevice") and torch.cuda.is_available() else None
)


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
    int would be a large share of the key's host time at RoPE's 31 arguments."""
    spec: list | None
    spec = []
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
_JIT_FUNCTION: type[Any] | None = None  # the kernels the cache takes: plain jit functions (not wrappers)


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
