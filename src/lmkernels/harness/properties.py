"""Properties every backend must hold on any valid input, not only on the grid of checks.py.

A case is an op's random valid sample (OpSpec.sample: shape and options for make_inputs), a
dtype, a memory layout per tensor input and a seed. `check_sample` runs it through the public
dispatch with one backend and holds it to:

- values and gradients within the correctness policy (checks.py) against the reference in fp64
  on the same input values, the reference in the same dtype standing for plain PyTorch, under
  random upstream gradients for every differentiable output (but those OpSpec.no_upstream
  names for the case); an output the reference differentiates and the impl does not fails;
  where a gradient has few elements, its eager error is eager's largest over its backward rerun
  under upstream gradients scaled by non-powers of two (one rounding draw of a few elements can
  be far below the level an equally valid computation reaches);
- no NaN or Inf unless the reference has it there, no unwritten output (outputs are poisoned);
- no input modified: every tensor the caller owns (the leaves here) keeps its bits, whatever
  the options (with consume_inputs=True only a non-leaf "fresh" tensor may be written);
- no error but BackendNotSupportedError (the backend declines: the case is skipped).

`check_bad_input` takes a valid case and breaks one tensor input (a list for a tensor, an
integer tensor for a float one or the reverse, another device) and wants an LMKernelsError
whose message names that input.

`check_double_backward` runs a backward with create_graph=True: an impl that declares
double_backward must match the reference's second-order gradients (gradgradcheck in fp64 for
the eager reference itself), any other must raise HigherOrderGradientError naming the op and
itself.

The torch.func checks run every option set (OpSpec.cases) of the op's "tiny" shape, judged by
the same policy against the reference run through the same transform in fp64:
`check_forward_ad` (torch.func.jvp and torch.autograd.forward_ad, fp32 and bf16: an impl that
declares forward_ad must match, any other must raise ForwardADError naming the op and itself;
a jvp of a jvp may be refused so by any), `check_func_grad` (torch.func.grad and torch.func.vjp, its
function called after the transform, against the reference's plain gradient, wherever the impl
has a backward; a grad of a grad must match or,
without double_backward, raise HigherOrderGradientError naming the op and the impl) and
`check_vmap` (torch.vmap of the op and of its torch.func.vjp, with every
tensor input batched and with the first one alone, against a loop; or an LMKernelsError naming
the op and the backend). A missing or zero tangent or gradient is an error of 1 and fails.

Layouts (the tensor the op gets, from a contiguous leaf `base` holding the values):
contiguous (base itself), fresh (base.clone(): a non-leaf, as an MLP's projection output),
transposed (last two dims, from column-major memory), sliced (every other element of a row
twice as long whose gaps hold nan, so that a kernel reading the gaps fails), expanded (stride 0
over dim -2, or over the only dim) and swapped (a 4-D tensor as the transpose of dims 1 and 2
of contiguous memory: (B, H, T, D) from (B, T, H, D), as transformers passes q and k).
"""

from __future__ import annotations

import dataclasses
import re
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeGuard

import torch
import torch.autograd.forward_ad as forward_ad

from lmkernels.harness.checks import DTYPE_NAMES, FEW_ELEMENTS, _compare, case_id, rel_rms_error
from lmkernels.ops._common import dispatch
from lmkernels.registry.core import (
    BackendNotSupportedError,
    ForwardADError,
    HigherOrderGradientError,
    Impl,
    LMKernelsError,
    OpSpec,
)
from lmkernels.utils import poison_outputs

LAYOUTS = ("contiguous", "fresh", "transposed", "sliced", "expanded", "swapped")


def layouts_for(t: torch.Tensor, allowed: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The layouts a tensor of t's rank can take (among `allowed`: OpSpec.sample_layouts)."""
    out = ["contiguous", "sliced", "expanded"]
    if t.is_floating_point():
        out.append("fresh")
    if t.dim() >= 2:
        out.append("transposed")
    if t.dim() == 4:
        out.append("swapped")
    return tuple(o for o in out if allowed is None or o in allowed)


@dataclasses.dataclass
class Case:
    """One property-test case, plain data: kept as is in the regression list when it fails."""

    op: str
    backend: str
    shape: dict[str, int]
    options: dict[str, Any]
    dtype: str  # "fp32", "bf16", "fp16"
    layouts: dict[str, str]
    seed: int = 0


@dataclasses.dataclass
class Result:
    status: str  # "pass", "fail", "unsupported"
    reason: str = ""


def _base_and_view(
    t: torch.Tensor, layout: str
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """(a contiguous base holding the values, base -> the tensor the op gets)."""
    if layout == "fresh":
        return t.clone(), lambda b: b.clone()
    if layout == "transposed":
        return t.transpose(-1, -2).contiguous(), lambda b: b.transpose(-1, -2)
    if layout == "swapped":
        return t.transpose(1, 2).contiguous(), lambda b: b.transpose(1, 2)
    if layout == "sliced":
        wide = torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
        wide.fill_(float("nan") if t.is_floating_point() else -7)
        wide[..., ::2] = t
        return wide, lambda b: b[..., ::2]
    if layout == "expanded":
        dim = -2 if t.dim() >= 2 else -1
        shape = t.shape
        return t.narrow(dim, 0, min(1, t.shape[dim])).clone(), lambda b: b.expand(shape)
    return t.clone(), lambda b: b


_Plan = dict[str, tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]
_Upstream = list[torch.Tensor | None]


def _build(
    inputs: dict[str, Any], plan: _Plan, grad_names: list[str], dtype: torch.dtype | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the op's keyword arguments, the inputs gradients are taken for, every base: the leaves
    the caller owns), from fresh copies of the bases (cast to `dtype` for the fp64 run)."""
    kwargs: dict[str, Any] = {}
    leaves: dict[str, torch.Tensor] = {}
    bases: dict[str, torch.Tensor] = {}
    for name, value in inputs.items():
        if name not in plan:
            kwargs[name] = value
            continue
        base, view = plan[name]
        base = base.detach().clone()
        if dtype is not None and base.is_floating_point():
            base = base.to(dtype)
        if name in grad_names:
            base.requires_grad_(True)
        bases[name] = base
        kwargs[name] = view(base)
        if name in grad_names:
            # Gradients are taken for what the op got (the view): a reduction over an expanded
            # dim is autograd's, in the input dtype, not the op's.
            leaves[name] = kwargs[name]
    return kwargs, leaves, bases


def _outputs(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _run(
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    leaves: dict[str, torch.Tensor],
    upstream: _Upstream | Callable[[list[torch.Tensor]], _Upstream],
) -> tuple[dict[str, torch.Tensor], _Upstream, list[bool]]:
    """(outputs and the leaves' gradients by name, the upstream gradients used, whether each
    output is differentiable). upstream: a list, or a function making one from the outputs (the
    first run's)."""
    outs = _outputs(fn(**kwargs))
    if callable(upstream):
        upstream = upstream(outs)
    differentiable = [o.requires_grad for o in outs]
    result = {f"out[{i}]": o.detach() for i, o in enumerate(outs)}
    pairs = [(o, g) for o, g in zip(outs, upstream) if g is not None and o.requires_grad]
    if pairs and leaves:
        grads = torch.autograd.grad(
            [o for o, _ in pairs], list(leaves.values()), [g.to(o.dtype) for o, g in pairs], allow_unused=True
        )
        for name, g in zip(leaves, grads):
            result[f"grad_{name}"] = g if g is not None else torch.zeros_like(leaves[name])
    return result, upstream, differentiable


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _plan(spec: OpSpec, case: Case, device: str) -> tuple[torch.dtype, dict[str, Any], _Plan, list[str]]:
    dtype = {v: k for k, v in DTYPE_NAMES.items()}[case.dtype]
    inputs = spec.make_inputs(case.shape, dtype, device, case.seed, **case.options)
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    plan = {k: _base_and_view(v, case.layouts.get(k, "contiguous")) for k, v in tensors.items()}
    grad_names = [n for n in spec.grad_inputs if n in tensors and tensors[n].is_floating_point()]
    return dtype, inputs, plan, grad_names


def _random_like(seed: int, skip: tuple[int, ...] = ()) -> Callable[[list[torch.Tensor]], _Upstream]:
    """Random upstream gradients for the differentiable outputs but those at `skip`
    (OpSpec.no_upstream); check_sample fails an impl whose output is not differentiable where
    the reference's is, so drawing from the impl's outputs drops no term unnoticed."""

    def make(outs: list[torch.Tensor]) -> _Upstream:
        gen = torch.Generator().manual_seed(seed + 7919)
        return [
            torch.randn(o.shape, generator=gen).to(o.dtype).to(o.device)
            if o.requires_grad and i not in skip
            else None
            for i, o in enumerate(outs)
        ]

    return make


# Upstream gradients scaled by these factors (no powers of two) give the backward further runs:
# the same math, every rounding moved. Only where a gradient has at most FEW_ELEMENTS elements
# (checks.py): over more, one run's relative RMS error already sits at its typical level.
RESAMPLE_SCALES = (0.75, 0.875, 1.125)


def _resampled_gradient_errors(
    fn: Callable[..., Any],
    spec: OpSpec,
    inputs: dict[str, Any],
    plan: _Plan,
    grad_names: list[str],
    upstream: _Upstream,
) -> dict[str, list[float]]:
    """Per gradient, the finite errors of `fn`'s backward (against fp64 under the same upstream
    gradients) with the upstream gradients scaled by each of RESAMPLE_SCALES.

    A gradient's rounding error in one run is one draw of noise. Over many elements its relative
    RMS settles near its typical size, but a gradient of a few elements, each a long sum (the
    hidden gradient of one token through V = 65k classes) or a sum that nearly cancels, draws
    errors that differ between runs by several times: one draw of eager's can land far below
    its typical level and one of an equally accurate impl far above. check_sample compares
    levels there: eager's largest draw against the impl's median one."""
    errors: dict[str, list[float]] = {}
    for scale in RESAMPLE_SCALES:
        scaled = [None if u is None else (u.double() * scale).to(u.dtype) for u in upstream]
        got, _, _ = _run(fn, *_build(inputs, plan, grad_names)[:2], scaled)
        ref, _, _ = _run(spec.reference, *_build(inputs, plan, grad_names, torch.float64)[:2], scaled)
        for name, r in ref.items():
            if not name.startswith("grad_") or not torch.isfinite(r).all():
                continue
            e = rel_rms_error(got[name], r)
            if e == e:
                errors.setdefault(name, []).append(e)
    return errors


def check_sample(spec: OpSpec, impl: Impl, case: Case, device: str = "cpu") -> Result:
    """Run `case` through `impl` by the public dispatch and judge it (module docstring)."""
    dtype, inputs, plan, grad_names = _plan(spec, case, device)
    kwargs, leaves, bases = _build(inputs, plan, grad_names)
    before = {name: _bits(base) for name, base in bases.items()}
    skip = spec.skipped_upstream(case.options)
    try:
        with poison_outputs():
            got, upstream, impl_diff = _run(
                _impl_fn(spec, impl),
                kwargs,
                leaves,
                _random_like(case.seed, skip),
            )
    except BackendNotSupportedError as e:
        return Result("unsupported", str(e))
    except Exception as e:
        return Result("fail", f"raised {type(e).__name__}: {e}\n{_tail(e)}")
    eager, _, eager_diff = _run(spec.reference, *_build(inputs, plan, grad_names)[:2], upstream)
    ref, _, _ = _run(spec.reference, *_build(inputs, plan, grad_names, torch.float64)[:2], upstream)
    problems = [f"input {n} was modified" for n, b in bases.items() if not torch.equal(_bits(b), before[n])]
    if leaves and impl.has_backward:
        problems += [
            f"out[{i}]: not differentiable, the reference's is (its gradient term would be missing)"
            for i, (mine, theirs) in enumerate(zip(impl_diff, eager_diff))
            if theirs and not mine and i not in skip
        ]
    # Where the fp64 reference itself is not finite (an overflow the op defines), the impl must
    # have nan where it has nan; the policy's errors are taken over the finite results.
    finite_ref = {}
    for name, r in ref.items():
        if r.numel() and not torch.isfinite(r).all():
            g = got.get(name)
            if g is None or not torch.equal(torch.isnan(g), torch.isnan(r)):
                problems.append(f"{name}: nan where the fp64 reference has none, or the reverse")
        else:
            finite_ref[name] = r
    tol = spec.tolerances[dtype]
    errors, more = _compare(got, eager, finite_ref, tol)
    if more and any(t.numel() <= FEW_ELEMENTS for t in leaves.values()):
        # One draw each may mislead over a few elements: judged again by levels over resampled
        # backward runs, the impl's median against eager's largest (_resampled_gradient_errors).
        eager_levels = {
            name: max(errs)
            for name, errs in _resampled_gradient_errors(
                spec.reference, spec, inputs, plan, grad_names, upstream
            ).items()
        }
        impl_levels = {}
        for name, errs in _resampled_gradient_errors(
            _impl_fn(spec, impl), spec, inputs, plan, grad_names, upstream
        ).items():
            first = rel_rms_error(got[name], ref[name]) if name in got else float("nan")
            if first == first and len(errs) == len(RESAMPLE_SCALES):
                impl_levels[name] = sorted([*errs, first])[len(errs) // 2 + 1]  # the upper median of four
        errors, more = _compare(got, eager, finite_ref, tol, eager_levels, impl_levels)
    problems.extend(more)
    if problems:
        worst = max((e.impl / e.allowed if e.allowed else 0.0 for e in errors), default=0.0)
        return Result("fail", "; ".join(problems) + f" (worst error / allowed: {worst:.3g})")
    return Result("pass")


CORRUPTIONS = ("not_a_tensor", "wrong_kind", "other_device")


def check_bad_input(
    spec: OpSpec, impl: Impl, case: Case, name: str, corruption: str, device: str = "cpu"
) -> Result:
    """Break input `name` of a valid case (module docstring); the call must raise an
    LMKernelsError naming it. "other_device" moves it to the meta device."""
    _, inputs, plan, _ = _plan(spec, case, device)
    kwargs = _build(inputs, plan, [])[0]
    t = kwargs[name]
    if corruption == "not_a_tensor":
        kwargs[name] = t.tolist()
    elif corruption == "wrong_kind":
        kwargs[name] = t.long() if t.is_floating_point() else t.float()
    else:
        kwargs[name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
    try:
        dispatch(spec.name, impl.backend, **kwargs)
    except LMKernelsError as e:
        if not re.search(rf"\b{re.escape(name)}\b", str(e)):
            return Result("fail", f"the message does not name {name!r}: {e}")
        return Result("pass")
    except Exception as e:
        return Result(
            "fail", f"{corruption} of {name!r} raised {type(e).__name__}, not an LMKernelsError: {e}"
        )
    return Result("fail", f"{corruption} of {name!r} was accepted")


def _second_order(
    fn: Callable[..., Any], inputs: dict[str, Any], grad_names: list[str], dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """Every second-order gradient of fn at inputs (cast to dtype): d/d(inputs, v) of
    <d<out, v>/d inputs, w> for random v, w."""
    kw = {
        k: v.detach().to(dtype).requires_grad_(k in grad_names)
        if isinstance(v, torch.Tensor) and v.is_floating_point()
        else v
        for k, v in inputs.items()
    }
    leaves = [kw[n] for n in grad_names]
    outs = [o for o in _outputs(fn(**kw)) if o.requires_grad]
    gen = torch.Generator().manual_seed(seed + 2)
    vs = [torch.randn(o.shape, generator=gen).to(o).requires_grad_(True) for o in outs]
    grads = torch.autograd.grad(outs, leaves, vs, create_graph=True, allow_unused=True)
    ws = [torch.randn(x.shape, generator=gen).to(x) for x in leaves]
    terms = [(g * w).sum() for g, w in zip(grads, ws) if g is not None and g.requires_grad]
    if not terms:
        return {}
    seconds = torch.autograd.grad(sum(terms[1:], terms[0]), leaves + vs, allow_unused=True)
    names = [*grad_names, *(f"upstream[{i}]" for i in range(len(vs)))]
    return {
        f"gg_{n}": torch.zeros_like(x) if s is None else s for n, s, x in zip(names, seconds, leaves + vs)
    }


def check_double_backward(spec: OpSpec, impl: Impl, device: str = "cpu", seed: int = 0) -> Result:
    """A backward with create_graph=True on the op's "tiny" shape (module docstring)."""
    inputs = spec.make_inputs(spec.shapes["tiny"][0], torch.float32, device, seed)
    grad_names = [n for n in spec.grad_inputs if isinstance(inputs.get(n), torch.Tensor)]

    def run(**kw: Any) -> Any:
        return dispatch(spec.name, impl.backend, **kw)

    if not impl.double_backward:
        try:
            _second_order(run, inputs, grad_names, torch.float32, seed)
        except HigherOrderGradientError as e:
            if spec.name in str(e) and repr(impl.backend) in str(e):
                return Result("pass")
            return Result("fail", f"the error does not name the op and the backend: {e}")
        except Exception as e:
            return Result(
                "fail", f"create_graph=True raised {type(e).__name__}, not HigherOrderGradientError: {e}"
            )
        return Result("fail", "declares no double backward, yet create_graph=True raised nothing")
    if impl.backend == "eager":
        fp64 = {
            k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in inputs.items()
        }

        def positional(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            outs = _outputs(spec.reference(**{**fp64, **dict(zip(grad_names, tensors))}))
            return tuple(o for o in outs if o.requires_grad)

        leaves = tuple(fp64[n].detach().requires_grad_(True) for n in grad_names)
        if torch.autograd.gradgradcheck(positional, leaves, raise_exception=False):
            return Result("pass")
        return Result("fail", "gradgradcheck failed in fp64")
    try:
        got = _second_order(run, inputs, grad_names, torch.float32, seed)
    except Exception as e:
        return Result("fail", f"declares double_backward, yet raised {type(e).__name__}: {e}")
    eager = _second_order(spec.reference, inputs, grad_names, torch.float32, seed)
    ref = _second_order(spec.reference, inputs, grad_names, torch.float64, seed)
    _, problems = _compare(got, eager, ref, spec.tolerances[torch.float32])
    return Result("fail", "; ".join(problems)) if problems else Result("pass")


# --- torch.func transforms and forward-mode AD -------------------------------------------------


_Tensors = tuple[torch.Tensor, ...]


def _tiny_cases(
    spec: OpSpec, dtypes: tuple[torch.dtype, ...], device: str, seed: int
) -> Iterator[tuple[str, torch.dtype, dict[str, Any], list[str]]]:
    """(label, dtype, inputs, names of the float inputs that get gradients) per option set and
    dtype, on the op's "tiny" shape."""
    for options in spec.cases:
        for dtype in dtypes:
            inputs = spec.make_inputs(spec.shapes["tiny"][0], dtype, device, seed, **options)
            names = [n for n in spec.grad_inputs if _is_float(inputs.get(n))]
            yield f"{case_id(options) or 'defaults'}, {DTYPE_NAMES[dtype]}", dtype, inputs, names


def _is_float(v: object) -> TypeGuard[torch.Tensor]:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _fp64(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.double() if _is_float(v) else v for k, v in inputs.items()}


def _of_grad_inputs(
    fn: Callable[..., Any], inputs: dict[str, Any], names: Sequence[str]
) -> Callable[..., _Tensors]:
    """fn as a function of the tensors at `names` (positional), returning its float outputs."""

    def f(*tensors: torch.Tensor) -> _Tensors:
        outs = _outputs(fn(**{**inputs, **dict(zip(names, tensors))}))
        return tuple(o for o in outs if o.is_floating_point())

    return f


def _impl_fn(spec: OpSpec, impl: Impl) -> Callable[..., Any]:
    return lambda **kw: dispatch(spec.name, impl.backend, **kw)


def _randn_like(tensors: Iterable[torch.Tensor], seed: int) -> _Tensors:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t.shape, generator=gen).to(t) for t in tensors)


def _tangents_out(
    f: Callable[..., _Tensors],
    primals: _Tensors,
    tangents: _Tensors,
    mode: str,
    second: _Tensors | None = None,
) -> dict[str, torch.Tensor]:
    """The tangents of f's outputs by torch.func.jvp (mode "jvp") or dual tensors ("forward_ad"),
    or ("jvp_of_jvp") the tangents along `second` of those along `tangents`, or ("grad_of_jvp")
    the gradient of the tangents' squared norm; an output without a tangent gets zeros."""
    if mode == "jvp_of_jvp":
        # (torch types jvp's result as a pair or, with has_aux, a triple)
        outs, touts = torch.func.jvp(lambda *ps: torch.func.jvp(f, ps, tangents)[1], primals, second)  # type: ignore[misc]
    elif mode == "grad_of_jvp":

        def squares(*ps: torch.Tensor) -> torch.Tensor:
            return sum(t.double().square().sum() for t in torch.func.jvp(f, ps, tangents)[1])

        grads = torch.func.grad(squares, tuple(range(len(primals))))(*primals)
        return {f"grad[{i}]": g for i, g in enumerate(grads)}
    elif mode == "jvp":
        outs, touts = torch.func.jvp(f, primals, tangents)  # type: ignore[misc]
    else:
        with forward_ad.dual_level():
            duals = f(*(forward_ad.make_dual(p, t) for p, t in zip(primals, tangents)))
            outs = [forward_ad.unpack_dual(d).primal.detach() for d in duals]
            touts = [forward_ad.unpack_dual(d).tangent for d in duals]
            touts = [None if t is None else t.detach().clone() for t in touts]
    return {
        f"tangent[{i}]": torch.zeros_like(o) if t is None else t for i, (o, t) in enumerate(zip(outs, touts))
    }


def _names_op_and_backend(e: Exception, spec: OpSpec, impl: Impl) -> bool:
    return spec.name in str(e) and repr(impl.backend) in str(e)


def check_forward_ad(spec: OpSpec, impl: Impl, device: str = "cpu", seed: int = 0) -> Result:
    """torch.func.jvp and torch.autograd.forward_ad through impl (module docstring); on the
    first case also a jvp of a jvp and a grad of a jvp, which any impl may refuse by name."""
    for n, (label, dtype, inputs, names) in enumerate(
        _tiny_cases(spec, (torch.float32, torch.bfloat16), device, seed)
    ):
        if not names:
            continue
        primals = tuple(inputs[name] for name in names)
        tangents, second = _randn_like(primals, seed + 3), _randn_like(primals, seed + 4)
        run = _of_grad_inputs(_impl_fn(spec, impl), inputs, names)
        for mode in ("jvp", "forward_ad", "jvp_of_jvp", "grad_of_jvp")[: 4 if n == 0 else 2]:
            nested = mode.endswith("_of_jvp")
            try:
                got = _tangents_out(run, primals, tangents, mode, second)
            except BackendNotSupportedError:
                break
            except (ForwardADError, HigherOrderGradientError) as e:
                if not (nested or (not impl.forward_ad and isinstance(e, ForwardADError))):
                    return Result("fail", f"{mode}, {label}: raised {type(e).__name__}: {e}")
                if not _names_op_and_backend(e, spec, impl):
                    return Result("fail", f"{mode}: the error does not name the op and the backend: {e}")
                continue
            except Exception as e:
                return Result("fail", f"{mode}, {label}: raised {type(e).__name__}: {e}\n{_tail(e)}")
            if not impl.forward_ad:
                return Result("fail", f"{mode}, {label}: declares no forward_ad, yet raised nothing")
            ref_mode = "jvp" if mode == "forward_ad" else mode
            eager = _tangents_out(
                _of_grad_inputs(spec.reference, inputs, names), primals, tangents, ref_mode, second
            )
            primals64, tangents64 = (tuple(t.double() for t in ts) for ts in (primals, tangents))
            ref = _tangents_out(
                _of_grad_inputs(spec.reference, _fp64(inputs), names),
                primals64,
                tangents64,
                ref_mode,
                tuple(t.double() for t in second),
            )
            _, problems = _compare(got, eager, ref, spec.tolerances[dtype])
            if problems:
                return Result("fail", f"{mode}, {label}: " + "; ".join(problems))
    return Result("pass")


def _weighted_sum(f: Callable[..., _Tensors], cotangents: _Tensors) -> Callable[..., Any]:
    """sum_i <f(...)_i, v_i>: the scalar whose gradient is f's vjp with cotangents v."""
    return lambda *ts: sum((o.double() * v.double()).sum() for o, v in zip(f(*ts), cotangents))


def _plain_grads(
    f: Callable[..., _Tensors], primals: _Tensors, cotangents: _Tensors
) -> dict[str, torch.Tensor]:
    leaves = [p.detach().requires_grad_(True) for p in primals]
    total = _weighted_sum(f, cotangents)(*leaves)
    grads = (
        torch.autograd.grad(total, leaves, allow_unused=True) if total.requires_grad else [None] * len(leaves)
    )
    return {
        f"grad[{i}]": torch.zeros_like(x) if g is None else g for i, (g, x) in enumerate(zip(grads, leaves))
    }


def _func_grads(
    f: Callable[..., _Tensors], primals: _Tensors, cotangents: _Tensors, second: _Tensors | None = None
) -> dict[str, torch.Tensor]:
    """torch.func.grad of <f, cotangents>; with `second`, the grad of <that grad, second> (a
    Hessian-vector product)."""
    argnums = tuple(range(len(primals)))
    grads = torch.func.grad(_weighted_sum(f, cotangents), argnums=argnums)
    if second is not None:
        grads = torch.func.grad(_weighted_sum(grads, second), argnums=argnums)
    return {f"grad[{i}]": g for i, g in enumerate(grads(*primals))}


def _func_vjp(f: Callable[..., _Tensors], primals: _Tensors, cotangents: _Tensors) -> dict[str, torch.Tensor]:
    """torch.func.vjp of f with `cotangents`, its function called after the transform (grad mode
    on: it then builds the backward's graph, as a backward with create_graph=True)."""
    _, vjp_fn = torch.func.vjp(f, *primals)  # type: ignore[misc]  # (a triple only with has_aux)
    grads = vjp_fn(tuple(cotangents))
    return {
        f"grad[{i}]": torch.zeros_like(x) if g is None else g for i, (g, x) in enumerate(zip(grads, primals))
    }


def check_func_grad(spec: OpSpec, impl: Impl, device: str = "cpu", seed: int = 0) -> Result:
    """torch.func.grad and torch.func.vjp through impl against the plain gradient (module
    docstring); on the first case also a grad of a grad, which an impl without double_backward
    may refuse (HigherOrderGradientError)."""
    if not impl.has_backward:
        return Result("pass", "no backward")
    for n, (label, dtype, inputs, names) in enumerate(_tiny_cases(spec, (torch.float32,), device, seed)):
        if not names:
            continue
        primals = tuple(inputs[name] for name in names)
        run = _of_grad_inputs(_impl_fn(spec, impl), inputs, names)
        eager_fn = _of_grad_inputs(spec.reference, inputs, names)
        ref_fn = _of_grad_inputs(spec.reference, _fp64(inputs), names)
        primals64 = tuple(p.double() for p in primals)
        cotangents = _randn_like(eager_fn(*primals), seed + 5)  # the impl's output shapes and dtypes
        second = _randn_like(primals, seed + 6)
        for order in (1, 2)[: 2 if n == 0 else 1]:
            extra = () if order == 1 else (second,)
            try:
                got = _func_grads(run, primals, cotangents, *extra)
            except BackendNotSupportedError:
                break
            except HigherOrderGradientError as e:
                if order == 1 or impl.double_backward or not _names_op_and_backend(e, spec, impl):
                    return Result("fail", f"{label}, order {order}: raised {e}")
                continue
            except Exception as e:
                return Result("fail", f"{label}, order {order}: raised {type(e).__name__}: {e}\n{_tail(e)}")
            if order == 1:
                eager = _plain_grads(eager_fn, primals, cotangents)
                ref = _plain_grads(ref_fn, primals64, cotangents)
                try:
                    by_vjp = _func_vjp(run, primals, cotangents)
                except Exception as e:
                    return Result("fail", f"{label}, vjp: raised {type(e).__name__}: {e}\n{_tail(e)}")
                _, problems = _compare(by_vjp, eager, ref, spec.tolerances[dtype])
                if problems:
                    return Result("fail", f"{label}, vjp: " + "; ".join(problems))
            else:
                eager = _func_grads(eager_fn, primals, cotangents, second)
                ref = _func_grads(ref_fn, primals64, cotangents, tuple(t.double() for t in second))
            _, problems = _compare(got, eager, ref, spec.tolerances[dtype])
            if problems:
                return Result("fail", f"{label}, order {order}: " + "; ".join(problems))
    return Result("pass")


def _fixed_like(o: torch.Tensor) -> torch.Tensor:
    """A cotangent of o's shape made from its shape alone (it is created inside vmap)."""
    v = torch.sin(torch.arange(o.numel(), dtype=torch.float32, device=o.device) * 0.7 + 1.0)
    return v.reshape(o.shape).to(o.dtype)


def _outputs_and_vjp(
    fn: Callable[..., Any], inputs: dict[str, Any], names: Sequence[str], backward: bool
) -> _Tensors:
    """fn's float outputs and, with a backward, their vjp with cotangents _fixed_like them."""
    f = _of_grad_inputs(fn, inputs, names)
    primals = [inputs[n] for n in names]
    if not (backward and names):
        return f(*primals)
    outs, vjp_fn = torch.func.vjp(f, *primals)  # type: ignore[misc]  # (a triple only with has_aux)
    return (*outs, *vjp_fn(tuple(_fixed_like(o) for o in outs)))


def check_vmap(spec: OpSpec, impl: Impl, device: str = "cpu", seed: int = 0) -> Result:
    """torch.vmap of impl and of its vjp against a loop (module docstring)."""
    for options in spec.cases:
        shape = spec.shapes["tiny"][0]
        elements = [spec.make_inputs(shape, torch.float32, device, seed + i, **options) for i in (0, 1)]
        tensors = [k for k, v in elements[0].items() if isinstance(v, torch.Tensor)]
        for batched in (tensors, tensors[:1]):
            try:
                problems = _vmap_problems(spec, impl, elements, batched)
            except BackendNotSupportedError:
                break
            except LMKernelsError as e:
                if _names_op_and_backend(e, spec, impl):
                    continue
                problems = [f"the error does not name the op and the backend: {e}"]
            except Exception as e:
                problems = [f"raised {type(e).__name__}: {e}\n{_tail(e)}"]
            if problems:
                return Result(
                    "fail", f"{case_id(options) or 'defaults'}, {batched} batched: " + "; ".join(problems)
                )
    return Result("pass")


def _vmap_problems(spec: OpSpec, impl: Impl, elements: list[dict[str, Any]], batched: list[str]) -> list[str]:
    """vmap over the inputs `batched` (the others are elements[0]'s) against a loop."""
    names = [n for n in spec.grad_inputs if _is_float(elements[0].get(n))]
    backward = impl.has_backward

    def vmapped(*values: torch.Tensor) -> _Tensors:
        inputs = {**elements[0], **dict(zip(batched, values))}
        return _outputs_and_vjp(_impl_fn(spec, impl), inputs, names, backward)

    outs_vmapped = torch.vmap(vmapped)(*(torch.stack([e[k] for e in elements]) for k in batched))
    loops = []
    for cast in (lambda kw: kw, _fp64):
        outs = [
            _outputs_and_vjp(
                spec.reference, cast({**elements[0], **{k: e[k] for k in batched}}), names, backward
            )
            for e in elements
        ]
        loops.append({f"vmap[{j}]": torch.stack(o) for j, o in enumerate(zip(*outs))})
    got = {f"vmap[{j}]": o for j, o in enumerate(outs_vmapped)}
    return _compare(got, loops[0], loops[1], spec.tolerances[torch.float32])[1]


def _tail(e: BaseException) -> str:
    return "".join(traceback.format_exception(e)[-3:])
