"""Which backends a run measures: every registered impl available here (the peer adapters
included) plus bench-only baselines, and the callable timed for each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmkernels.harness.bench.plan import FLCE
from lmkernels.harness.runner import not_runnable_here
from lmkernels.registry.core import impls


class Unsupported(Exception):
    pass


_NAIVE_OK = {"hidden", "weight", "target", "ignore_index", "reduction", "softcap", "grad_accum_dtype"}
_naive_compiled: Callable[..., Any] | None = None


def _is_default(v: Any) -> bool:
    """None, False or 0: an option left at its default (FLCE's defaults are all of these)."""
    return v is None or v is False or (isinstance(v, (int, float)) and v == 0)


def naive_flce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: float | None = None,
) -> torch.Tensor:
    """Plain PyTorch as people write it (and as transformers' loss does): the (tokens x V) logits,
    upcast to fp32, softcapped (Gemma 2's c * tanh(z / c)) if asked, then cross entropy."""
    logits = (hidden.reshape(-1, weight.shape[1]) @ weight.T).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.nn.functional.cross_entropy(
        logits, target.reshape(-1), ignore_index=ignore_index, reduction=reduction
    )


def compile_naive_fn(inputs: dict[str, Any]) -> Callable[..., Any]:
    """torch.compile of naive_flce (the torch.compile FLCE baseline: logits materialized)."""
    global _naive_compiled
    extra = [k for k, v in inputs.items() if k not in _NAIVE_OK and not _is_default(v)]
    if extra:
        raise Unsupported(f"compile_naive takes only the default loss, not {extra}")
    if _naive_compiled is None:
        _naive_compiled = torch.compile(naive_flce)
    compiled = _naive_compiled

    def run(
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int = -100,
        reduction: str = "mean",
        softcap: float | None = None,
        **_: Any,
    ) -> torch.Tensor:
        # grad_accum_dtype does not apply: dW is one matmul with fp32 accumulation.
        return compiled(hidden, weight, target, ignore_index, reduction, softcap)

    return run


PSEUDO_BACKENDS: dict[str, tuple[str, Callable[[dict[str, Any]], Callable[..., Any]]]] = {
    "compile_naive": (FLCE, compile_naive_fn),
}


def backends_for(
    op: str, requested: Sequence[str] | None, device: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """The backends to run for `op` (on `device`, when given) and, for the others asked for or
    registered, why not."""
    names, skipped = [], {}
    registered = {i.backend: i for i in impls(op)}
    candidates = (
        list(requested)
        if requested
        else [*registered, *(b for b, (o, _) in PSEUDO_BACKENDS.items() if o == op)]
    )
    for name in candidates:
        if name in PSEUDO_BACKENDS:
            if PSEUDO_BACKENDS[name][0] == op:
                names.append(name)
            continue
        impl = registered.get(name)
        if impl is None:
            continue  # not implemented for this op: nothing to report
        reason = impl.unavailable_reason() if device is None else not_runnable_here(impl, device)
        if reason:
            skipped[name] = reason
        else:
            names.append(name)
    return names, skipped


def backend_fn(op: str, backend: str, inputs: dict[str, Any]) -> Callable[..., Any]:
    """The callable to time (the Impl's fn, after its support check: the kernels' time without
    the public function's input checks, which sync with the host for FLCE), or Unsupported."""
    if backend in PSEUDO_BACKENDS:
        return PSEUDO_BACKENDS[backend][1](inputs)
    impl = next((i for i in impls(op) if i.backend == backend), None)
    if impl is None:
        raise Unsupported(f"backend {backend!r} has no {op}")
    reasons = impl.not_supported_reasons(**inputs)
    if reasons:
        raise Unsupported("; ".join(reasons))
    return impl.fn
