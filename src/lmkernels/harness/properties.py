"""Properties every backend must hold on any valid input, not only on the grid of checks.py.

A case is an op's random valid sample (OpSpec.sample: shape and options for make_inputs), a
dtype, a memory layout per tensor input and a seed. `check_sample` runs it through the public
dispatch with one backend and holds it to:

- values and gradients within the correctness policy (checks.py) against the reference in fp64
  on the same input values, the reference in the same dtype standing for plain PyTorch;
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
from collections.abc import Callable
from typing import Any

import torch

from lmkernels.harness.checks import DTYPE_NAMES, _compare
from lmkernels.ops._common import dispatch
from lmkernels.registry.core import (
    BackendNotSupportedError,
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
) -> tuple[dict[str, torch.Tensor], _Upstream]:
    """(outputs and the leaves' gradients by name, the upstream gradients used). upstream: a
    list, or a function making one from the outputs (the first run's)."""
    outs = _outputs(fn(**kwargs))
    if callable(upstream):
        upstream = upstream(outs)
    result = {f"out[{i}]": o.detach() for i, o in enumerate(outs)}
    pairs = [(o, g) for o, g in zip(outs, upstream) if g is not None and o.requires_grad]
    if pairs and leaves:
        grads = torch.autograd.grad(
            [o for o, _ in pairs], list(leaves.values()), [g.to(o.dtype) for o, g in pairs], allow_unused=True
        )
        for name, g in zip(leaves, grads):
            result[f"grad_{name}"] = g if g is not None else torch.zeros_like(leaves[name])
    return result, upstream


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _plan(spec: OpSpec, case: Case, device: str) -> tuple[torch.dtype, dict[str, Any], _Plan, list[str]]:
    dtype = {v: k for k, v in DTYPE_NAMES.items()}[case.dtype]
    inputs = spec.make_inputs(case.shape, dtype, device, case.seed, **case.options)
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    plan = {k: _base_and_view(v, case.layouts.get(k, "contiguous")) for k, v in tensors.items()}
    grad_names = [n for n in spec.grad_inputs if n in tensors and tensors[n].is_floating_point()]
    return dtype, inputs, plan, grad_names


def _random_like(seed: int) -> Callable[[list[torch.Tensor]], _Upstream]:
    def make(outs: list[torch.Tensor]) -> _Upstream:
        gen = torch.Generator().manual_seed(seed + 7919)
        return [
            torch.randn(o.shape, generator=gen).to(o.dtype).to(o.device) if o.requires_grad else None
            for o in outs
        ]

    return make


def check_sample(spec: OpSpec, impl: Impl, case: Case, device: str = "cpu") -> Result:
    """Run `case` through `impl` by the public dispatch and judge it (module docstring)."""
    dtype, inputs, plan, grad_names = _plan(spec, case, device)
    kwargs, leaves, bases = _build(inputs, plan, grad_names)
    before = {name: _bits(base) for name, base in bases.items()}
    try:
        with poison_outputs():
            got, upstream = _run(
                lambda **kw: dispatch(spec.name, impl.backend, **kw), kwargs, leaves, _random_like(case.seed)
            )
    except BackendNotSupportedError as e:
        return Result("unsupported", str(e))
    except Exception as e:
        return Result("fail", f"raised {type(e).__name__}: {e}\n{_tail(e)}")
    eager, _ = _run(spec.reference, *_build(inputs, plan, grad_names)[:2], upstream)
    ref, _ = _run(spec.reference, *_build(inputs, plan, grad_names, torch.float64)[:2], upstream)

    problems = [f"input {n} was modified" for n, b in bases.items() if not torch.equal(_bits(b), before[n])]
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
    errors, more = _compare(got, eager, finite_ref, spec.tolerances[dtype])
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


def _tail(e: BaseException) -> str:
    return "".join(traceback.format_exception(e)[-3:])
