"""Choosing the backend that runs an op.

Precedence, highest first:
1. the explicit ``backend=`` argument of the op's function;
2. ``use_backend(...)`` / ``set_backend(...)`` (per op or global; per thread and asyncio task);
3. the environment variable ``LMKERNELS_BACKEND`` (``triton`` or ``triton,flce=compile,rope=eager``);
4. ``auto``: the highest-priority impl whose ``not_supported_reasons`` is empty.

A backend chosen by 1-3 that cannot take the inputs raises BackendNotSupportedError listing its
reasons: it never silently falls back. Op names accept the aliases of op_aliases().

Where the choice lives. Eager calls read a ContextVar, so a choice made in one thread or
asyncio task never reaches another. torch.compile cannot trace ContextVar.get, so code being
compiled reads a per-thread mirror instead (threading.local, which dynamo traces and guards on:
a compiled graph recompiles when the calling thread's choice changes). use_backend/set_backend
write both. The mirror is per thread, not per task: compiled code in asyncio tasks that share a
thread sees the choice last made in that thread. Work that autograd runs in its own threads
(the recomputed forward of activation checkpointing on CUDA) sees that thread's choice, not the
caller's: pass backend= explicitly (the nn modules and the integration do) where that matters.

What the ops' public functions run on every call (the checks, this resolution, remembered per
input signature) is in registry/fastpath.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from lmkernels.registry.core import (
    _SHORT_NAMES,
    BackendNotSupportedError,
    Impl,
    LMKernelsError,
    UnknownBackendError,
    UnknownOpError,
    backend_names,
    get_impl,
    get_op,
    impls,
    on_change,
    ops,
)

ENV_VAR = "LMKERNELS_BACKEND"
logger = logging.getLogger("lmkernels")
AUTO = "auto"
# Aliases besides each op's OpSpec.short_name (e.g. "flce").
OP_ALIASES = {"rmsnorm": "rms_norm", "layernorm": "layer_norm"}

# Overrides set through use_backend()/set_backend(), as sorted (key, backend) pairs with key "*"
# (global) or an op name: immutable and hashable, so the fast path keys its cache on them.
_CONTEXT: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "lmkernels_backend", default=()
)
# The same table as a dict, per thread, for code being compiled (see the module docstring).
_THREAD = threading.local()
_NO_OVERRIDES: dict[str, str] = {}


def _overrides() -> dict[str, str]:
    if torch.compiler.is_compiling():
        return getattr(_THREAD, "table", _NO_OVERRIDES)
    return dict(_CONTEXT.get())


def op_aliases() -> dict[str, str]:
    """alias -> op name: the ops' short names and OP_ALIASES."""
    ops()  # a plugin's ops register with the backends
    return {**_SHORT_NAMES, **OP_ALIASES}


def canonical_op(name: str) -> str:
    """The registered name of an op or its alias ("flce" -> "fused_linear_cross_entropy");
    UnknownOpError for anything else."""
    name = OP_ALIASES.get(name) or _SHORT_NAMES.get(name, name)
    get_op(name)  # raises UnknownOpError with the known names
    return name


def _check_backend_name(name: str, where: str) -> None:
    if name != AUTO and name not in backend_names():
        raise UnknownBackendError(
            f"{where}: unknown backend {name!r}; known backends: {[AUTO, *backend_names()]}"
        )


def parse_backend_spec(spec: str, where: str = ENV_VAR) -> dict[str, str]:
    """Parse ``"triton,flce=compile,rope=eager"`` into ``{"*": "triton", "fused_linear...": ...}``."""
    table: dict[str, str] = {}
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        if "=" in item:
            op, _, backend = (s.strip() for s in item.partition("="))
            try:
                op = canonical_op(op)
            except UnknownOpError as e:
                raise UnknownOpError(f"{where}: {e}") from None
            _check_backend_name(backend, where)
            if op in table:
                raise LMKernelsError(
                    f"{where}: op {op!r} is given more than one backend in {spec!r} "
                    f"({table[op]!r} and {backend!r})"
                )
            table[op] = backend
        else:
            if "*" in table:
                raise LMKernelsError(
                    f"{where}: more than one global backend in {spec!r} (use op=backend for per-op choices)"
                )
            _check_backend_name(item, where)
            table["*"] = item
    return table


_env_cache: tuple[str, dict[str, str]] | None = None


def _env_table() -> dict[str, str]:
    global _env_cache
    raw = os.environ.get(ENV_VAR, "")
    if _env_cache is not None and _env_cache[0] == raw:
        return _env_cache[1]
    table = parse_backend_spec(raw) if raw else {}
    # Not stored while torch.compile traces: inside an activation checkpoint dynamo refuses
    # any store to a global.
    if not torch.compiler.is_compiling():
        _env_cache = (raw, table)
    return table


def _invalidate() -> None:
    global _env_cache
    _env_cache = None


@contextlib.contextmanager
def use_backend(backend: str | None = None, **per_op: str) -> Iterator[None]:
    """Choose backends inside a ``with`` block: ``use_backend("triton", flce="compile")``.

    Args:
        backend: A backend for every op ("triton"), or a spec with per-op choices
            ("triton,flce=compile", as LMKERNELS_BACKEND takes); None changes no global choice.
        **per_op: op name or alias -> backend ("auto" for the automatic choice).

    Overrides the environment variable, not an explicit ``backend=`` argument; nests (the
    inner block's choices win, per op). Only for this thread (or asyncio task); other threads
    keep their own choice. Unknown ops or backends raise at once."""
    table = _merged_overrides(backend, per_op)
    token = _CONTEXT.set(table)
    previous_mirror = getattr(_THREAD, "table", _NO_OVERRIDES)
    _THREAD.table = dict(table)
    try:
        yield
    finally:
        _CONTEXT.reset(token)
        _THREAD.table = previous_mirror


def set_backend(backend: str | None = None, **per_op: str) -> None:
    """Like use_backend (same arguments), until changed again or reset_backend(); for this
    thread (or task)."""
    _replace_overrides(_merged_overrides(backend, per_op))


def reset_backend() -> None:
    """Forget what set_backend() chose (for this thread or task)."""
    _replace_overrides(())


def _replace_overrides(table: tuple[tuple[str, str], ...]) -> None:
    _CONTEXT.set(table)
    _THREAD.table = dict(table)


def _merged_overrides(backend: str | None, per_op: dict[str, str]) -> tuple[tuple[str, str], ...]:
    table = dict(_CONTEXT.get())
    if backend is not None:
        table.update(parse_backend_spec(backend, where="use_backend"))
    for op, name in per_op.items():
        _check_backend_name(name, "use_backend")
        table[canonical_op(op)] = name
    return tuple(sorted(table.items()))


@dataclasses.dataclass
class Choice:
    """The backend the precedence rules ask for, for one op, and who asked."""

    op: str
    backend: str
    source: str  # "argument", "use_backend", "env LMKERNELS_BACKEND", "auto" (nothing asked)


def requested_backend(op: str, backend: str | None = None) -> Choice:
    """Which backend the precedence rules ask for, and who asked. The first level that names
    a backend for the op (per op before global) decides, ``auto`` included: ``auto`` at a
    level means the automatic choice, not "ask the next level"."""
    if backend is not None:
        _check_backend_name(backend, "backend")
        return Choice(op, backend, "argument")
    overrides = _overrides()
    for key in (op, "*"):
        if key in overrides:
            return Choice(op, overrides[key], "use_backend")
    env = _env_table()
    for key in (op, "*"):
        if key in env:
            return Choice(op, env[key], f"env {ENV_VAR}")
    return Choice(op, AUTO, "auto")


def resolve(op: str, inputs: dict[str, Any], backend: str | None = None) -> Impl:
    """The impl that runs `op` (a name or alias) on `inputs` (the op's keyword arguments), by
    the precedence rules above; `backend` as the ops' argument. Raises BackendNotSupportedError
    when the requested backend, or every backend for auto, cannot take the inputs."""
    op = canonical_op(op)
    choice = requested_backend(op, backend)
    if choice.backend != AUTO:
        impl = get_impl(op, choice.backend)
        reasons = impl.not_supported_reasons(**inputs)
        if reasons:
            raise BackendNotSupportedError(
                f"{op}: backend {choice.backend!r} (requested by {choice.source}) cannot run "
                f"these inputs: " + "; ".join(reasons)
            )
        return impl
    rejected = []
    for impl in impls(op):
        reasons = impl.not_supported_reasons(**inputs) or _not_auto(impl, inputs)
        if not reasons:
            _log_auto_choice(op, impl.backend, inputs)
            return impl
        rejected.append(f"{impl.backend}: {'; '.join(reasons)}")
    raise BackendNotSupportedError(f"{op}: no backend can run these inputs: " + " | ".join(rejected))


_AUTO_LOGGED: set[tuple[str, str, str]] = set()


def _log_auto_choice(op: str, backend: str, inputs: dict[str, Any]) -> None:
    """Say once per op, backend and device what `auto` became (at INFO, logger "lmkernels")."""
    if torch.compiler.is_compiling():
        return
    devices = ",".join(sorted({v.device.type for v in inputs.values() if isinstance(v, torch.Tensor)}))
    key = (op, backend, devices)
    if key not in _AUTO_LOGGED:
        _AUTO_LOGGED.add(key)
        logger.info(
            "%s: auto chose backend %r on %s (set one with backend=, use_backend or %s)",
            op,
            backend,
            devices or "no tensor",
            ENV_VAR,
        )


def _not_auto(impl: Impl, inputs: dict[str, Any]) -> list[str]:
    """Why `auto` passes over an impl that could run these inputs (its auto_devices, its
    auto_declines), or []."""
    devices = {v.device.type for v in inputs.values() if isinstance(v, torch.Tensor)}
    if impl.auto_devices is None or devices <= set(impl.auto_devices):
        return impl.auto_declines(**inputs)
    return [f"not chosen automatically on {', '.join(sorted(devices))} (request it explicitly)"]


on_change(_invalidate)


@dataclasses.dataclass
class Explanation:
    """What explain() found: the backend requested and by whom, the impl that runs (or the
    error), and per registered impl its priority and why it cannot run (empty: it can).
    str() gives the table `lmkernels explain` prints."""

    op: str
    requested: Choice
    chosen: str | None
    error: str | None
    rows: list[tuple[str, int, list[str]]]  # backend, priority, reasons (empty = can run)
    note: str = ""  # what else decides the choice (torch.compile and the environment variable)

    def __str__(self) -> str:
        lines = [
            f"op {self.op}: requested {self.requested.backend!r} by {self.requested.source}; "
            + (f"runs {self.chosen!r}" if self.chosen else f"ERROR: {self.error}")
        ]
        for name, prio, reasons in self.rows:
            mark = "->" if name == self.chosen else "  "
            status = "ok" if not reasons else "; ".join(reasons)
            lines.append(f"  {mark} {name:<14} priority {prio:>3}  {status}")
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)


COMPILE_NOTE = (
    f"code compiled with torch.compile chooses when it is traced: a use_backend()/set_backend() "
    f"change retraces it; a change of {ENV_VAR} retraces it only where dynamo guards "
    f"environment reads (torch 2.13 does; older releases may keep the traced choice: set "
    f"{ENV_VAR} before compiling, or use use_backend())"
)


def explain(op: str, inputs: dict[str, Any], backend: str | None = None) -> Explanation:
    """Every impl of `op` for these inputs, whether it could run, and which one would.

    ``print(lmkernels.explain("rms_norm", {"x": x, "weight": w}))``: `inputs` are the op's
    keyword arguments, `backend` as the ops' argument. Never raises for an impl that cannot
    run: the Explanation holds the error resolve() would raise."""
    op = canonical_op(op)
    requested = requested_backend(op, backend)
    auto = requested.backend == AUTO
    rows = [
        (i.backend, i.priority, i.not_supported_reasons(**inputs) or (_not_auto(i, inputs) if auto else []))
        for i in impls(op)
    ]
    try:
        chosen, error = resolve(op, inputs, backend).backend, None
    except LMKernelsError as e:
        chosen, error = None, str(e)
    note = COMPILE_NOTE if requested.source.startswith("env") else ""
    return Explanation(op, requested, chosen, error, rows, note)


def all_op_names() -> list[str]:
    """Every registered op's name."""
    return [s.name for s in ops()]
