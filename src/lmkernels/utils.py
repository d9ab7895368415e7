"""Small helpers shared by ops and backends: output allocation, input checks, torch.func."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import NoReturn

import torch
import torch.autograd.forward_ad

from lmkernels.registry.core import LMKernelsError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# --- output allocation -------------------------------------------------------------------------
# Backends allocate outputs with empty()/empty_like() below. While the harness runs, freshly
# allocated outputs are filled with NaN, so an element a kernel forgets to write fails the check
# instead of passing on leftover memory.

_POISON = False


@contextlib.contextmanager
def poison_outputs(enabled: bool = True) -> Iterator[None]:
    global _POISON
    previous, _POISON = _POISON, enabled
    try:
        yield
    finally:
        _POISON = previous


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return _poisoned(torch.empty(shape, dtype=dtype, device=device))


def empty_strided(
    shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    return _poisoned(torch.empty_strided(shape, stride, dtype=dtype, device=device))


def _poisoned(out: torch.Tensor) -> torch.Tensor:
    if _POISON and out.is_floating_point():
        out.fill_(float("nan"))
    return out


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return empty(t.shape, dtype or t.dtype, t.device)


# --- input checks --------------------------------------------------------------------------------


def fail(message: str) -> NoReturn:
    """Raise LMKernelsError(message): the error of every check of the inputs."""
    raise LMKernelsError(message)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | Sequence[int] | None = None,
    floating: bool = True,
    dtypes: Sequence[torch.dtype] | None = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            fail(f"{name}: expected {' or '.join(map(str, allowed))} dims, got shape {tuple(t.shape)}")
    if floating and dtypes is None and t.dtype not in FLOAT_DTYPES:
        fail(f"{name}: expected a float32, bfloat16 or float16 tensor, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        fail(f"{name}: expected dtype in {tuple(dtypes)}, got {t.dtype}")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> None:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {k: v.device for k, v in present.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            fail(f"{name}: expected device {first} (same as {first_name}), got {dev}")


def check_same_dtype(**tensors: torch.Tensor | None) -> None:
    present = {k: v for k, v in tensors.items() if v is not None}
    first_name, first = next(iter(present.items()))
    for name, t in present.items():
        if t.dtype != first.dtype:
            fail(f"{name}: expected dtype {first.dtype} (same as {first_name}), got {t.dtype}")


def check_number(
    name: str, value: object, *, low: float | None = None, high: float | None = None, what: str = "a number"
) -> None:
    """value is a real number (int, float or bool is not; nan never is) within [low, high]."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
        if (low is None or value >= low) and (high is None or value <= high):
            return
    fail(f"{name}: expected {what}, got {value!r}")


def check_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        fail(f"{name}: expected an int, got {value!r}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        fail(f"{name}: expected a bool, got {value!r}")


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    if value not in choices:
        fail(f"{name}: expected one of {tuple(choices)}, got {value!r}")


def data_checks_enabled() -> bool:
    """Checks that read tensor values (e.g. targets in range) cost a host sync on CUDA.

    They are on by default; LMKERNELS_CHECK_VALUES=0 turns them off for production runs.
    They never run while torch.compile traces (the values are not known then).
    """
    if torch.compiler.is_compiling():
        return False
    return os.environ.get("LMKERNELS_CHECK_VALUES", "1") not in ("0", "false", "False")


def checked_values(t: torch.Tensor) -> torch.Tensor:
    """The tensor a value check reads for input t: t itself, or under torch.func transforms the
    plain tensor inside functorch's wrappers. Under vmap that holds the values of every batch
    element, which are all checked at once: a Python branch on a batched tensor's values is an
    error there."""
    if torch._C._are_functorch_transforms_active():
        while torch._C._functorch.is_functorch_wrapped_tensor(t):
            t = torch._C._functorch.get_unwrapped(t)
    return t


# torch.autograd.forward_ad keeps the level of the dual tensors being made in a module global.
_forward_ad = torch.autograd.forward_ad


def transforms_active() -> bool:
    """Whether torch.func transforms (grad, vjp, jvp, vmap, ...) or forward-mode AD (a
    torch.autograd.forward_ad.dual_level) are active: where the backends' eager autograd
    Functions, which have no tangent formula and no vmap rule, must not run."""
    return torch._C._are_functorch_transforms_active() or _forward_ad._current_level >= 0


def env_sizes(name: str, count: int) -> tuple[int, ...] | None:
    """The environment variable `name` as `count` positive integers separated by commas, or None
    where it is unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    parts = text.split(",")
    if len(parts) != count or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        what = "a positive integer" if count == 1 else f"{count} positive integers separated by commas"
        fail(f"{name}: expected {what}, got {text!r}")
    return tuple(int(p) for p in parts)


def cuda_capability() -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()
