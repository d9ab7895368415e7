"""Correctness checks: values and gradients of one impl on one case, by DESIGN.md's policy.

For a case (op, impl, shape, dtype, option set) the harness
1. builds inputs with the OpSpec's make_inputs, and upstream gradients rounded to each output's
   dtype (so every run sees identical values): a random one for every output the reference
   differentiates (but those OpSpec.no_upstream names for the case); an impl output that gets
   one and has no gradient fails (a term of the gradient would be missing);
2. runs the eager reference in fp64 on the same input values: the ground truth;
3. runs the eager reference in the case's dtype: what plain PyTorch gets;
4. runs the impl with freshly allocated outputs poisoned with NaN;
5. for every output and every input gradient, computes the relative RMS error
   ||x - ref|| / ||ref|| of the impl and of eager, and passes when the impl's error is finite,
   <= factor * eager's + floor, and <= the dtype's bound (OpSpec.tolerances); a tensor of at most
   FEW_ELEMENTS elements is allowed at least one unit in the last place of its dtype.
It also checks the impl left its inputs untouched (unless the case hands them over with
consume_inputs=True: their memory may then hold gradients) and matched eager's output shapes
and dtypes.
Optionally it runs the impl through torch.compile(fullgraph=True) and checks that too.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from lmkernels.ops._common import dispatch
from lmkernels.registry.core import Impl, OpSpec, Tolerance
from lmkernels.utils import poison_outputs

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


@dataclasses.dataclass
class TensorError:
    name: str  # "out", "out[1]", "grad_x", ...
    impl: float  # relative RMS error of the impl vs fp64
    eager: float  # relative RMS error of eager in the same dtype vs fp64
    allowed: float  # min(factor * eager + floor, bound)
    max_abs: float  # max |impl - fp64|

    @property
    def ok(self) -> bool:
        return self.impl == self.impl and self.impl <= self.allowed  # nan fails the first test


@dataclasses.dataclass
class CaseResult:
    op: str
    backend: str
    shape: str
    dtype: str
    case: str
    device: str
    status: str  # "pass", "fail", "unsupported", "error"
    reason: str = ""
    errors: list[TensorError] = dataclasses.field(default_factory=list)
    compile_status: str = "not run"  # "pass", "fail: ...", "not run", "unsupported"
    seconds: float = 0.0

    @property
    def test_id(self) -> str:
        parts = [self.op, self.backend, self.shape, self.dtype]
        if self.case:
            parts.append(self.case)
        return "-".join(parts)

    @property
    def worst_ratio(self) -> float:
        """max over tensors of err(impl) / allowed: < 1 passes."""
        ratios = [e.impl / e.allowed if e.allowed > 0 else float("inf") for e in self.errors]
        return max(ratios, default=0.0)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["test_id"] = self.test_id
        d["worst_ratio"] = self.worst_ratio
        return d


def case_id(case: dict[str, Any]) -> str:
    """A short, stable id for an option set: {"reduction": "sum", "with_bias": True} -> reduction=sum,with_bias."""
    parts = []
    for k, v in case.items():
        if v is True:
            parts.append(k)
        elif v is None:
            parts.append(f"no_{k}")
        else:
            parts.append(f"{k}={v}")
    return ",".join(parts)


# --- helpers ------------------------------------------------------------------------------------


def _outputs(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _output_names(n: int) -> list[str]:
    return ["out"] if n == 1 else [f"out[{i}]" for i in range(n)]


def rel_rms_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    x64, ref64 = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x64).all():
        return float("nan")
    num = torch.linalg.vector_norm(x64 - ref64)
    den = torch.linalg.vector_norm(ref64)
    if den == 0:
        return float(num)  # exact zeros expected (e.g. all tokens ignored): any deviation counts
    return float(num / den)


def _clone_inputs(inputs: dict[str, Any], dtype: torch.dtype | None, grad_names: list[str]) -> dict[str, Any]:
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            v = v.detach().clone()
            if dtype is not None and v.is_floating_point():
                v = v.to(dtype)
            if k in grad_names:
                v.requires_grad_(True)
        out[k] = v
    return out


def _upstream_grads(
    outs: list[torch.Tensor], seed: int, skip: tuple[int, ...] = ()
) -> list[torch.Tensor | None]:
    """A random upstream gradient for every differentiable output (of the reference's run), but
    those at `skip` (OpSpec.no_upstream: outputs the case's loss only logs)."""
    g = torch.Generator().manual_seed(seed + 7919)
    grads: list[torch.Tensor | None] = []
    for i, o in enumerate(outs):
        if o.requires_grad and i not in skip:
            grads.append(torch.randn(o.shape, generator=g).to(o.dtype).to(o.device))
        else:
            grads.append(None)
    return grads


def without_gradient(outs: list[torch.Tensor], upstream: list[torch.Tensor | None]) -> list[str]:
    """Problems for the outputs given an upstream gradient (the reference differentiates them)
    that have none: a term of the gradient dropped, which the gradients' errors alone might miss
    (e.g. an upstream gradient drawn from the impl's own outputs)."""
    names = _output_names(len(outs))
    return [
        f"{names[i]}: not differentiable, the reference's is (its gradient term would be missing)"
        for i, (o, g) in enumerate(zip(outs, upstream))
        if g is not None and not o.requires_grad
    ]


def _run(
    fn: Callable[..., Any],
    inputs: dict[str, Any],
    grad_names: list[str],
    upstream: list[torch.Tensor | None] | None,
    seed: int = 0,
    skip: tuple[int, ...] = (),
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor | None], list[str]]:
    """Run fn and backprop upstream grads (drawn from `seed` when None, none for the outputs at
    `skip`); return (tensors by name, upstream, problems: outputs that got an upstream gradient
    and have no gradient)."""
    outs = _outputs(fn(**inputs))
    if upstream is None:
        # Drawn once, in the dtype of the low-precision run's outputs, so the fp64, eager and
        # impl runs all backpropagate identical values.
        upstream = _upstream_grads(outs, seed, skip)
    result = {}
    for name, o in zip(_output_names(len(outs)), outs):
        result[name] = o.detach()
    problems = without_gradient(outs, upstream) if grad_names else []
    pairs = [(o, g) for o, g in zip(outs, upstream) if g is not None and o.requires_grad]
    wrt = [inputs[n] for n in grad_names]
    if pairs and wrt:
        grads = torch.autograd.grad(
            [o for o, _ in pairs], wrt, [g.to(o.dtype).clone() for o, g in pairs], allow_unused=True
        )
        for n, gr in zip(grad_names, grads):
            result[f"grad_{n}"] = gr if gr is not None else torch.zeros_like(inputs[n])
    return result, upstream, problems


def _snapshot(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}


# At most this many elements, a tensor's error is a handful of roundings: one draw of eager's
# can land far below its typical level, and a result one unit in the last place of its dtype
# from the correctly rounded one is as good as eager's. Such a tensor is allowed at least that
# unit (the dtype's eps, relative), and properties.check_sample compares gradients' levels
# over resampled runs.
FEW_ELEMENTS = 64


def allowed_error(e_eager: float, tol: Tolerance) -> float:
    """The policy's ceiling for an impl whose eager run in the same dtype has error e_eager:
    factor x e_eager + floor, at most the dtype's bound. Where factor x e_eager itself passes
    the bound (an input ill-conditioned for the dtype, which the random cases of the property
    tests can draw: eager's own error is then within a factor of the bound) the impl is held to
    factor x e_eager, so the ceiling never drops as eager's error grows; where eager is not
    finite (an fp16 overflow), to the bound."""
    if e_eager != e_eager:
        return tol.bound
    return max(min(tol.factor * e_eager + tol.floor, tol.bound), tol.factor * e_eager)


def _compare(
    impl_out: dict[str, torch.Tensor],
    eager_out: dict[str, torch.Tensor],
    ref_out: dict[str, torch.Tensor],
    tol: Tolerance,
    eager_levels: dict[str, float] | None = None,
    impl_levels: dict[str, float] | None = None,
) -> tuple[list[TensorError], list[str]]:
    """Errors and problems of impl_out against ref_out, by the policy. eager_levels and
    impl_levels: for some names, eager's and the impl's error levels over several runs as valid
    as these (properties.check_sample's resampled backward): eager's error is then the larger of
    its level and this run's, the impl's its level, where finite."""
    problems = []
    errors = []
    for name, ref in ref_out.items():
        if name not in impl_out:
            problems.append(f"{name}: missing from the impl's results")
            continue
        got, eag = impl_out[name], eager_out[name]
        if tuple(got.shape) != tuple(eag.shape):
            problems.append(f"{name}: shape {tuple(got.shape)}, eager gives {tuple(eag.shape)}")
            continue
        if got.dtype != eag.dtype:
            problems.append(f"{name}: dtype {got.dtype}, eager gives {eag.dtype}")
        e_impl, e_eager = rel_rms_error(got, ref), rel_rms_error(eag, ref)
        impl_level = (impl_levels or {}).get(name, float("nan"))
        if e_impl == e_impl and impl_level == impl_level:
            e_impl = impl_level
        level = (eager_levels or {}).get(name, float("nan"))
        if e_eager == e_eager and level == level:
            e_eager = max(e_eager, level)
        allowed = allowed_error(e_eager, tol)
        if got.numel() <= FEW_ELEMENTS and got.is_floating_point():
            allowed = max(allowed, torch.finfo(got.dtype).eps)
        diff = (got.detach().double() - ref.detach().double()).abs()
        max_abs = float(diff.max()) if diff.numel() else 0.0
        err = TensorError(name, e_impl, e_eager, allowed, max_abs)
        errors.append(err)
        if not err.ok:
            what = (
                "non-finite values" if e_impl != e_impl else f"rel err {e_impl:.3g} > allowed {allowed:.3g}"
            )
            problems.append(f"{name}: {what} (eager {e_eager:.3g})")
    return errors, problems


_REFERENCE_CACHE: dict[str, Any] = {}


def clear_reference_cache() -> None:
    _REFERENCE_CACHE.clear()


# --- the check ----------------------------------------------------------------------------------


def check_case(
    spec: OpSpec,
    impl: Impl,
    shape: dict[str, int],
    dtype: torch.dtype,
    case: dict[str, Any] | None = None,
    device: str = "cpu",
    seed: int = 0,
    compile_backend: str | None = None,
) -> CaseResult:
    """Check `impl` against the fp64 reference on one case; see the module docstring.

    compile_backend: None skips the compile check; otherwise the torch.compile backend
    ("inductor", "aot_eager", "eager") used to compile a call through the public dispatch
    with fullgraph=True.
    """
    case = dict(case or {})
    result = CaseResult(
        op=spec.name,
        backend=impl.backend,
        shape=spec.shape_id(shape),
        dtype=DTYPE_NAMES[dtype],
        case=case_id(case),
        device=device,
        status="error",
    )
    start = time.perf_counter()
    try:
        _check(spec, impl, shape, dtype, case, device, seed, compile_backend, result)
    except Exception as e:  # a crashing impl is a result, not a harness failure
        result.status = "error"
        result.reason = f"{type(e).__name__}: {e}".strip()
        result.reason += "\n" + "".join(traceback.format_exception(e)[-3:])
    result.seconds = time.perf_counter() - start
    return result


def _check(
    spec: OpSpec,
    impl: Impl,
    shape: dict[str, int],
    dtype: torch.dtype,
    case: dict[str, Any],
    device: str,
    seed: int,
    compile_backend: str | None,
    result: CaseResult,
) -> None:
    inputs = spec.make_inputs(shape, dtype, device, seed, **case)
    grad_names = [n for n in spec.grad_inputs if isinstance(inputs.get(n), torch.Tensor)]
    if dtype not in spec.dtypes:
        result.status, result.reason = "unsupported", f"{spec.name} is not defined for {dtype}"
        return
    probe = _clone_inputs(inputs, None, grad_names)
    reasons = impl.not_supported_reasons(**probe)
    if reasons:
        result.status, result.reason = "unsupported", "; ".join(reasons)
        return
    spec.check_inputs(**probe)
    tol = spec.tolerances[dtype]

    key = (spec.name, tuple(shape.items()), dtype, case_id(case), device, seed)
    if _REFERENCE_CACHE.get("key") != key:
        # fp64 and same-dtype eager runs depend only on the case, not on the impl: computed once
        # and shared by the impls checked one after another (the runner orders cases so).
        _REFERENCE_CACHE.clear()
        eager, upstream, _ = _run(
            spec.reference,
            _clone_inputs(inputs, None, grad_names),
            grad_names,
            None,
            seed,
            spec.skipped_upstream(case),
        )
        ref, _, _ = _run(
            spec.reference, _clone_inputs(inputs, torch.float64, grad_names), grad_names, upstream
        )
        _REFERENCE_CACHE.update(key=key, eager=eager, ref=ref, upstream=upstream)
    eager, ref, upstream = _REFERENCE_CACHE["eager"], _REFERENCE_CACHE["ref"], _REFERENCE_CACHE["upstream"]

    impl_inputs = _clone_inputs(inputs, None, grad_names)
    before = _snapshot(impl_inputs)
    with poison_outputs():
        got, _, no_grad = _run(impl.fn, impl_inputs, grad_names, upstream)
    if impl.has_backward is False:
        got.update({k: v for k, v in eager.items() if k.startswith("grad_")})
        no_grad = []
    errors, problems = _compare(got, eager, ref, tol)
    problems = no_grad + problems
    # consume_inputs=True: the caller hands its tensors over, the impl may write over them.
    kept = {} if inputs.get("consume_inputs") is True else _snapshot(impl_inputs)
    for k, v in kept.items():
        if not torch.equal(v, before[k]):
            problems.append(f"input {k} was modified by the impl")
    result.errors = errors

    if compile_backend is not None:
        if not impl.compile_safe:
            result.compile_status = "unsupported (impl marked compile_safe=False)"
        else:
            result.compile_status = _compile_check(
                spec, impl, inputs, grad_names, upstream, eager, ref, tol, compile_backend
            )
            if result.compile_status != "pass":
                problems.append(f"compile: {result.compile_status}")

    result.status = "fail" if problems else "pass"
    result.reason = "; ".join(problems)


def _compile_check(
    spec: OpSpec,
    impl: Impl,
    inputs: dict[str, Any],
    grad_names: list[str],
    upstream: list[torch.Tensor | None],
    eager: dict[str, torch.Tensor],
    ref: dict[str, torch.Tensor],
    tol: Tolerance,
    compile_backend: str,
) -> str:
    torch._dynamo.reset()

    def call(**kw: Any) -> Any:
        return dispatch(spec.name, impl.backend, **kw)

    compiled = torch.compile(call, fullgraph=True, backend=compile_backend)
    try:
        got, _, no_grad = _run(compiled, _clone_inputs(inputs, None, grad_names), grad_names, upstream)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"fail: {type(e).__name__}: {first}"[:300]
    _, problems = _compare(got, eager, ref, tol)
    problems = no_grad + problems
    return "pass" if not problems else "fail: " + "; ".join(problems)
