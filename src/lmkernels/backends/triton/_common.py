"""What the Triton op files share: the eager fast path around their torch.library ops, and the
small launcher helpers every op needs.

Each op is registered with torch.library.custom_op (+ register_fake, register_autograd) so that
torch.compile sees an opaque op with a known output shape and gradient. Calling a custom op
eagerly costs host time, though: on the H200 machine (torch 2.11) about 0.1-0.3 ms per call in
the dispatcher and its per-call checks, more than the kernels of a 16384x4096 RMSNorm take.
So eager calls go through a plain torch.autograd.Function that runs the same Python launchers
and the same setup_context/backward, and only code being traced calls the custom op.

An op file therefore reads: kernels; raw launchers (plain Python functions, type-annotated);
`op = torch.library.custom_op("lmkernels::name", raw_launcher, mutates_args=...)` with
register_fake; setup_context and backward, registered on the op with register_autograd and
turned into the eager Function with `eager_function`; the impl, `call(op, Function, *args)`.
Inside a backward, launchers run through `op_or_raw(op, raw, name)(*args)`. Launchers launch their
kernels with `_launch.launch(kernel, grid, *args, **constexprs)`, which skips Triton's per-call
argument binding once a launch's specialization has been compiled.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from lmkernels.backends.triton import interpreting
from lmkernels.registry.core import higher_order_error

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

# Tensor types the raw launchers take as they are. nn.Parameter is a plain tensor for them; any
# other subclass (FakeTensor, FunctionalTensor, DTensor, ...) is left to the custom op's dispatch.
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def traced(args: tuple) -> bool:
    """True when a call with these arguments must go through the registered custom op.

    That is under torch.compile / torch.export (is_compiling), under any other tracer or fake
    tensor mode (make_fx, FakeTensorMode, the modes AOTAutograd traces under: a torch dispatch
    mode is active), under functorch transforms, and for tensor subclasses: the raw launchers
    hand real memory to Triton and would fail (or read garbage) on any of those.
    """
    if _is_compiling() or _dispatch_modes() or _functorch_active():
        return True
    for a in args:
        if type(a) not in _PLAIN_TYPES and isinstance(a, torch.Tensor):
            return True
    return False


# Argument types that are neither a tensor subclass nor need an isinstance() to tell: that
# costs ~0.3 us for a non-tensor (torch.Tensor's metaclass takes the slow isinstance route),
# more than the rest of `call` for the 3 options of an RMSNorm.
_PLAIN_TYPES = frozenset({*_PLAIN_TENSOR_TYPES, float, int, bool, str, type(None), torch.dtype})


# Looked up once: `call` runs on every op call, and each attribute hop costs host time. Dynamo
# still recognizes is_compiling (the same function object).
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled


def eager_function(
    name: str,
    forward: Callable[..., Any],
    setup_context: Callable[[Any, tuple, Any], None],
    backward: Callable[..., Any],
) -> type[torch.autograd.Function]:
    """An autograd.Function running `forward` (the custom op's raw launcher) with the custom op's
    own setup_context and backward, for eager calls.

    forward takes ctx and calls setup_context itself: a Function that defines setup_context as a
    separate staticmethod pays an inspect.signature() bind on every apply(), which is host time
    this path exists to save. (The separate form is only needed for functorch transforms, and
    those calls go to the custom op: see `traced`.)
    """

    def forward_with_ctx(ctx, *args):
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
        },
    )


def call(op: Callable[..., Any], function: Any, *args: Any) -> Any:
    """Run a differentiable op: the custom op when traced, else the eager Function, or the raw
    launcher alone when no gradient will be taken (no graph to record)."""
    if _is_compiling() or _dispatch_modes() or _functorch_active():
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


def op_or_raw(op: Callable[..., Any], raw: Callable[..., Any], name: str) -> Callable[..., Any]:
    """For a launcher with no autograd formula of its own (a backward kernel of lmkernels op
    `name`): a function that runs the custom op when traced (AOTAutograd traces the registered
    backward, so the compiled graph calls the op), and the raw launcher otherwise.

    With grad mode on (a backward with create_graph=True) it raises HigherOrderGradientError:
    the raw launcher's gradients would be silently cut from the graph.
    """

    def run(*args: Any) -> Any:
        if traced(args):
            return op(*args)
        if _grad_enabled():
            raise higher_order_error(name, "triton")
        return raw(*args)

    return run


# --- launcher helpers ------------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code: triton.cdiv is a constexpr-function wrapper that costs a few
    microseconds per call outside a kernel, on every launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for host code: triton.next_power_of_2 is
    a constexpr-function wrapper too, 1.5 us per call against 0.02."""
    return 1 << max(n - 1, 0).bit_length()


_NO_GUARD = contextlib.nullcontext()


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: switch to t's device, only if it is another."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_GUARD


def soft_bf16(t: torch.Tensor) -> bool:
    """Whether kernels on t's device round fp32 -> bf16 in software (to_dtype's SOFT_BF16)."""
    return not t.is_cuda


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


# --- programmatic dependent launch ---------------------------------------------------------------
#
# A kernel launched with PDL (Hopper and later) may be scheduled before the kernel ahead of it
# in the stream has finished: its launch, its programs' placement on the SMs and their first
# instructions overlap the previous kernel's last programs, and `gdc_wait` then holds it until
# that kernel has completed and its writes are visible. That shortens the gap between two
# dependent kernels: 1-3 us per norm forward + backward (three kernels) on an H200, a few
# percent at common sizes (docs/performance.md, "What we tried").
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
    """Launch keywords for a kernel working on t: PDL where sm90_ptx holds and Triton has it.
    The kernel must start with `pdl_enter(PDL)`."""
    if USE_PDL and _TRITON_PDL and t.is_cuda and sm90_ptx(t.get_device()):
        return _PDL_ON
    return _PDL_OFF


@functools.cache
def sm90_ptx(index: int) -> bool:
    """Whether sm_90 instructions (PDL, the bulk L2 prefetch) run on CUDA device `index`: an
    NVIDIA GPU of sm_90 or later, kernels compiled (not the interpreter), not ROCm."""
    if interpreting() or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(index) >= (9, 0)
