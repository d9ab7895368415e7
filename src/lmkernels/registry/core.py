"""The op registry: what an op is (OpSpec), what an implementation is (Impl), and register()."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import torch

if TYPE_CHECKING:
    from typing_extensions import Unpack


class LMKernelsError(ValueError):
    """Base class of the errors this library raises for bad input or configuration."""


class UnknownOpError(LMKernelsError):
    """An op name that is not registered (the message lists the known ones)."""


class UnknownBackendError(LMKernelsError):
    """A backend name that is not registered, for any op or for this op (the message lists them)."""


class BackendNotSupportedError(LMKernelsError):
    """An explicitly requested backend cannot take these inputs; the message lists why."""


class HigherOrderGradientError(LMKernelsError, RuntimeError):
    """A backward with create_graph=True through an impl that has no double backward: raised
    instead of returning gradients that silently miss the second-order term."""


class ForwardADError(LMKernelsError, RuntimeError):
    """Forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) through an impl that has no
    tangent formula: raised instead of returning a tangent that is silently zero or missing."""


class ConsumedInputsError(LMKernelsError, RuntimeError):
    """A second backward through an op whose first backward used buffers it owned (handed over
    with consume_inputs=True, or gradients computed in the forward) and wrote over them."""


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Pass when err(impl) <= factor * err(eager in the same dtype) + floor, and err(impl) <= bound.

    err is the relative RMS error ||out - ref|| / ||ref|| against an fp64 reference run on the
    same (low-precision) input values. `factor` absorbs a different but equally valid summation
    order; `floor` covers outputs where the eager run is exact to the last bit (err 0), so the
    impl may differ by a few ulps; `bound` is the absolute sanity ceiling for the dtype.
    """

    factor: float
    floor: float
    bound: float


DEFAULT_TOLERANCES: dict[torch.dtype, Tolerance] = {
    # fp32: eager upcasts nothing, errors are ~1e-7; a kernel with another reduction order
    # lands within a few times that.
    torch.float32: Tolerance(factor=4.0, floor=2e-6, bound=1e-4),
    # bf16 has 8 mantissa bits: one rounding of the output is ~2e-3 relative RMS. An impl that
    # rounds once more (e.g. an intermediate kept in bf16 for a tensor-core matmul) stays within 2x.
    torch.bfloat16: Tolerance(factor=2.0, floor=1e-3, bound=2e-2),
    torch.float16: Tolerance(factor=2.0, floor=2e-4, bound=5e-3),
}


@dataclasses.dataclass(frozen=True)
class ErrorInput:
    """A call every backend must refuse with an LMKernelsError whose message matches `match` (a
    regex naming the bad argument and what was expected)."""

    kwargs: dict[str, Any]
    match: str


@dataclasses.dataclass
class OpSpec:
    """Everything the harness, tests and benchmarks need to know about one op.

    reference: eager PyTorch, upcasts to fp32 inside; defines the signature and the semantics.
    make_inputs(shape, dtype, device, seed, **options) -> dict of keyword arguments for the op.
    shapes: name -> list of shape dicts (named dims), at least "quick" and "full".
    cases: option sets (extra keyword arguments) the harness runs on top of every shape.
    grad_inputs: names of the inputs that get gradients.
    check_inputs(**kwargs): raises LMKernelsError for bad input; shared by every backend. It must
      read no tensor values (only shapes, dtypes, devices, requires_grad and the options): the
      dispatcher runs it once per input signature.
    check_values(**kwargs): the checks that read values (a host sync on CUDA), run on every call.
    bytes_moved(shape, dtype) / flops(shape): minimum traffic / work of fwd+bwd for rooflines.
    error_inputs(device): the bad calls every backend must refuse (OpInfo's error_inputs).
    sample(draw): a random valid case for the property-based tests, as (shape, options) for
      make_inputs. `draw` chooses: draw.integers(lo, hi) (inclusive), draw.sampled_from(seq),
      draw.booleans() (hypothesis in the tests, a seeded random.Random elsewhere).
    sample_layouts: input name -> the memory layouts the property tests may give it (default:
      every layout its rank allows; see harness/properties.py).
    no_upstream(options): the indices of differentiable outputs the harness gives no upstream
      gradient in a case of these make_inputs options (an output a loss only logs, such as
      FLCE's entropy with entropy_grad=False); every other output the reference differentiates
      gets a random one, and an impl whose output there has no gradient fails.
    short_name: an alias of name, for the columns of `lmkernels list`, the validation tables and
      the command line and LMKERNELS_BACKEND ("flce"); "" for none.
    """

    name: str
    reference: Callable[..., Any]
    make_inputs: Callable[..., dict[str, Any]]
    shapes: dict[str, list[dict[str, int]]]
    grad_inputs: tuple[str, ...]
    check_inputs: Callable[..., None]
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    cases: list[dict[str, Any]] = dataclasses.field(default_factory=lambda: [{}])
    tolerances: dict[torch.dtype, Tolerance] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_TOLERANCES)
    )
    bytes_moved: Callable[[dict[str, int], torch.dtype], int] | None = None
    flops: Callable[[dict[str, int]], int] | None = None
    description: str = ""
    check_values: Callable[..., None] | None = None
    error_inputs: Callable[[str], list[ErrorInput]] | None = None
    sample: Callable[[Any], tuple[dict[str, int], dict[str, Any]]] | None = None
    sample_layouts: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    short_name: str = ""
    no_upstream: Callable[[dict[str, Any]], tuple[int, ...]] | None = None

    def skipped_upstream(self, options: dict[str, Any]) -> tuple[int, ...]:
        """no_upstream(options), or () without it."""
        return tuple(self.no_upstream(options)) if self.no_upstream is not None else ()

    def shape_id(self, shape: dict[str, int]) -> str:
        return "x".join(str(v) for v in shape.values())


def _no_extra_reasons(**inputs: Any) -> list[str]:
    return []


def _always_available() -> str | None:
    return None


@dataclasses.dataclass
class Impl:
    """One implementation of one op by one backend, with what it can and cannot take."""

    op: str
    backend: str
    fn: Callable[..., Any]
    priority: int = 0
    dtypes: tuple[torch.dtype, ...] | None = None  # None: every dtype of the OpSpec
    devices: tuple[str, ...] = ("cpu", "cuda")
    # Devices where `auto` may pick this impl (None: all of `devices`). Triton lists "cuda"
    # only, so the CPU interpreter runs when asked for explicitly, never by default.
    auto_devices: tuple[str, ...] | None = None
    min_capability: tuple[int, int] | None = None  # CUDA compute capability
    has_backward: bool = True
    # Whether a backward with create_graph=True gives gradients that are themselves
    # differentiable (double backward). Impls without it raise HigherOrderGradientError there.
    double_backward: bool = False
    # Whether forward-mode AD (torch.func.jvp, torch.autograd.forward_ad dual tensors) gives the
    # tangents of its outputs. Impls without it raise ForwardADError there.
    forward_ad: bool = False
    compile_safe: bool = True
    # Whether it runs under torch.func transforms inside code torch.compile traces (torch.compile
    # of a torch.func.grad, jvp or vmap). Impls without it are not supported there.
    compiled_transforms: bool = True
    # Returns why the backend cannot run at all here (package missing, no GPU), or None.
    available: Callable[[], str | None] = _always_available
    # Op-specific reasons for given inputs (unsupported option, shape limit, ...).
    supports: Callable[..., list[str]] = _no_extra_reasons
    # Why `auto` passes over this impl for inputs it can run (e.g. slower than another
    # backend on this GPU); a backend asked for by name still runs. Empty list: auto may pick it.
    auto_declines: Callable[..., list[str]] = _no_extra_reasons
    description: str = ""
    # Another project's kernels registered for comparison (liger, cce, torch_native): validated
    # and benchmarked like ours, but their failures are reported, not treated as our test failures.
    external: bool = False

    def unavailable_reason(self) -> str | None:
        # Cached by hand: functools.cached_property takes a lock that torch.compile cannot trace.
        cached = self.__dict__.get("_availability", _NOT_CACHED)
        if cached is not _NOT_CACHED:
            return cached
        if _IMPLS.get(self.op, {}).get(self.backend) is self:
            # The first call may come from code torch.compile traces, e.g. inside an activation
            # checkpoint, where dynamo refuses to store anything: done for real there.
            return _registered_availability(self.op, self.backend)
        reason = self.__dict__["_availability"] = self.available()
        return reason

    def not_supported_reasons(self, **inputs: Any) -> list[str]:
        """Empty list: this impl can run these inputs. Otherwise, every reason it cannot."""
        reason = self.unavailable_reason()
        if reason:
            return [reason]
        reasons = []
        named = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        tensors = list(named.values())
        for name, t in named.items():
            if t.device.type not in self.devices:
                reasons.append(f"{name}: device {t.device.type!r} not supported (supports {self.devices})")
                break
        if self.dtypes is not None:
            bad = [
                f"{k} ({t.dtype})"
                for k, t in named.items()
                if t.is_floating_point() and t.dtype not in self.dtypes
            ]
            if bad:
                reasons.append(f"dtype of {', '.join(bad)} not supported (supports {self.dtypes})")
        if self.min_capability is not None and any(t.is_cuda for t in tensors):
            dev = next(t.device for t in tensors if t.is_cuda)
            cap = torch.cuda.get_device_capability(dev)
            if cap < self.min_capability:
                reasons.append(f"needs compute capability >= {self.min_capability}, got {cap}")
        if not self.compiled_transforms and torch.compiler.is_compiling():
            if torch._C._are_functorch_transforms_active():
                reasons.append(
                    "no torch.func transform inside torch.compile (take it outside the compiled code)"
                )
        if torch.is_grad_enabled() and not self.has_backward:
            if any(t.requires_grad for t in tensors):
                reasons.append("no backward, but an input requires grad")
        reasons.extend(self.supports(**inputs))
        return reasons


class ImplCapabilities(TypedDict, total=False):
    """register()'s keyword arguments: the fields of Impl after op, backend and fn."""

    priority: int
    dtypes: tuple[torch.dtype, ...] | None
    devices: tuple[str, ...]
    auto_devices: tuple[str, ...] | None
    min_capability: tuple[int, int] | None
    has_backward: bool
    double_backward: bool
    forward_ad: bool
    compile_safe: bool
    compiled_transforms: bool
    available: Callable[[], str | None]
    supports: Callable[..., list[str]]
    auto_declines: Callable[..., list[str]]
    description: str
    external: bool


_OPS: dict[str, OpSpec] = {}
_IMPLS: dict[str, dict[str, Impl]] = {}
_SHORT_NAMES: dict[str, str] = {}  # OpSpec.short_name -> name
_NOT_CACHED = object()


def _registered_availability(op: str, backend: str) -> str | None:
    """The registered impl's unavailable_reason, computed once and cached on it."""
    impl = _IMPLS[op][backend]
    if "_availability" not in impl.__dict__:
        impl.__dict__["_availability"] = impl.available()
    return impl.__dict__["_availability"]


# Run for real when torch.compile traces a call (as _ensure_loaded below, and for the same reason).
_registered_availability._dynamo_marked_constant = True  # type: ignore[attr-defined]


def register_op(spec: OpSpec) -> OpSpec:
    """Register a new op (its OpSpec); returns `spec`. Backends then register impls of it."""
    _OPS[spec.name] = spec
    if spec.short_name:
        _SHORT_NAMES[spec.short_name] = spec.name
    _IMPLS.setdefault(spec.name, {})
    return spec


def register(op: str, backend: str, fn: Callable[..., Any], **capabilities: Unpack[ImplCapabilities]) -> Impl:
    """Register `fn` as the `backend` implementation of `op`; returns the Impl.

    This is all a new backend needs: the dispatcher, the harness, `lmkernels validate`, the
    test suite and the benchmarks enumerate the registry and pick it up. `fn` takes the op's
    inputs as keyword arguments (those of the op's public function, without `backend`).
    `capabilities` are the fields of Impl (ImplCapabilities: priority, dtypes, devices,
    auto_devices, min_capability, has_backward, double_backward, forward_ad, compile_safe,
    compiled_transforms, available, supports, auto_declines, description, external). Registering a backend
    again replaces it.
    """
    if op not in _OPS:
        raise UnknownOpError(f"register: unknown op {op!r}; known ops: {sorted(_OPS)}")
    impl = Impl(op=op, backend=backend, fn=fn, **capabilities)
    _IMPLS[op][backend] = impl
    _changed()
    return impl


def higher_order_error(op: str, backend: str) -> HigherOrderGradientError:
    """The error an impl without double backward raises when its backward runs with
    create_graph=True: it names the op, the backend and the backends that can."""
    able = [i.backend for i in impls(op) if i.double_backward and not i.unavailable_reason()]
    return HigherOrderGradientError(
        f"{op}: backend {backend!r} has no double backward (a backward with create_graph=True "
        f"would miss the second-order term); backends that have one: {able or 'none'}"
    )


def forward_ad_error(op: str, backend: str, where: str = "") -> ForwardADError:
    """The error an impl without forward-mode AD raises when a tangent reaches it (`where` says
    in which case, for an impl that has it in others): it names the op, the backend and the
    other backends that have it."""
    able = [
        i.backend for i in impls(op) if i.forward_ad and i.backend != backend and not i.unavailable_reason()
    ]
    return ForwardADError(
        f"{op}: backend {backend!r} has no forward-mode AD{' ' + where if where else ''} "
        f"(torch.func.jvp, torch.autograd.forward_ad: the tangent would be missing); backends that "
        f"have it: {able or 'none'}"
    )


def unregister(op: str, backend: str) -> None:
    """Remove the `backend` impl of `op` (nothing if there is none)."""
    _IMPLS.get(op, {}).pop(backend, None)
    _changed()


# Called after every register/unregister: the dispatcher drops the resolutions it remembered.
_ON_CHANGE: list[Callable[[], None]] = []


def on_change(callback: Callable[[], None]) -> None:
    """Call `callback` after every register() / unregister()."""
    _ON_CHANGE.append(callback)


def _changed() -> None:
    for callback in _ON_CHANGE:
        callback()


def get_op(name: str) -> OpSpec:
    """The OpSpec of op `name` (UnknownOpError if none is registered)."""
    spec = _OPS.get(name)
    if spec is not None:  # the built-in ops register on import; a plugin's only once loaded
        return spec
    _ensure_loaded()
    try:
        return _OPS[name]
    except KeyError:
        raise UnknownOpError(f"unknown op {name!r}; known ops: {sorted(_OPS)}") from None


def ops() -> list[OpSpec]:
    """Every registered op's OpSpec, in registration order."""
    _ensure_loaded()
    return list(_OPS.values())


def impls(op: str | None = None) -> list[Impl]:
    """Registered impls, for one op or all, ordered by op then descending priority."""
    _ensure_loaded()
    names: Sequence[str] = [op] if op is not None else list(_OPS)
    out = []
    for name in names:
        get_op(name)
        out.extend(sorted(_IMPLS[name].values(), key=lambda i: -i.priority))
    return out


def get_impl(op: str, backend: str) -> Impl:
    """The `backend` impl of `op` (UnknownOpError / UnknownBackendError if not registered)."""
    _ensure_loaded()
    get_op(op)
    try:
        return _IMPLS[op][backend]
    except KeyError:
        raise UnknownBackendError(
            f"backend {backend!r} is not registered for op {op!r}; registered: {sorted(_IMPLS[op])}"
        ) from None


def backend_names() -> list[str]:
    """Every registered backend name, for any op, in registration order."""
    _ensure_loaded()
    seen: dict[str, None] = {}
    for per_op in _IMPLS.values():
        for name in per_op:
            seen[name] = None
    return list(seen)


# The registry imports nothing above it: whoever owns the built-in backends (the top-level
# package) hands in a loader, run once when impls are first asked for (first resolve, list,
# validate), so `import lmkernels` stays cheap and no module imports the registry's importers.
_PENDING_LOADERS: list[Callable[[], None]] = []


def add_loader(loader: Callable[[], None]) -> None:
    """Run `loader` (which calls register()) before impls are first looked up."""
    _PENDING_LOADERS.append(loader)


def _ensure_loaded() -> bool:
    while _PENDING_LOADERS:
        # Taken off the list before it runs: lookups made while loading do not rerun it.
        _PENDING_LOADERS.pop(0)()
    return True


# When the very first lookup happens inside a torch.compile trace, dynamo cannot trace the
# loaders (imports, entry points): marked as a constant-result function, dynamo runs it for real
# at trace time instead, and guards on nothing it reads. This is what
# torch._dynamo.assume_constant_result does (it only sets this attribute); set directly so that
# importing the registry does not import dynamo.
_ensure_loaded._dynamo_marked_constant = True  # type: ignore[attr-defined]
