"""What an op's public function runs on every call: check the inputs, pick the impl (see
dispatch.py for the precedence rules), call it, with a host cost of a few microseconds.

The checks that need no data (OpSpec.check_inputs) and the resolution are remembered per
backend argument, override state (use_backend), env value, grad mode and input signature, so a
repeated call costs building one tuple and one dict lookup. Per input the signature holds a
tensor's shape, dtype, device and requires_grad (subclasses share their plain twin's entry: no
check or supports() looks at the type), any other value with its type (16 == 16.0 == True, but
a check may accept only one of them). Value checks (OpSpec.check_values) run on every call.
Under torch.compile everything is resolved afresh: dynamo traces it once per graph and guards
on what it read (a cache would only add guards).

Each op gets its own function, written out from its parameter names (as dataclasses writes
__init__): on a tiny op the generic version (a **kwargs dict, a loop building the key, one more
call) cost more than the resolution it saves. An impl whose signature starts with the op's
parameters in order (the eager references do) is called positionally, others by keyword.
"""

from __future__ import annotations

import inspect
import keyword
import linecache
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmkernels.registry.core import LMKernelsError, get_op, on_change
from lmkernels.registry.dispatch import _CONTEXT, ENV_VAR, resolve

# Per generated function: key -> (impl fn, check_values, whether fn takes the inputs positionally).
_CACHES: list[dict[tuple, tuple[Any, Any, bool]]] = []
_CACHE_LIMIT = 4096  # distinct signatures per op; past it the cache starts over (e.g. many shapes)
_GENERIC: dict[tuple[str, tuple[str, ...]], Callable[..., Any]] = {}

# os.environ.get costs microseconds when the variable is unset (a KeyError raised and caught
# inside); its backing dict, which os.environ updates on every change, answers in nanoseconds.
if hasattr(os.environ, "_data"):
    _env_get, _ENV_KEY = os.environ._data.get, os.environ.encodekey(ENV_VAR)
else:
    _env_get, _ENV_KEY = os.environ.get, ENV_VAR

# {required}: `x, q` style inputs without a default, expected to be tensors: their signature is
# written flat; any other input gets _OPTIONAL. A required input that is not a tensor gets no
# key: the call takes the slow path, where check_inputs says what is wrong with it.
_TEMPLATE = """
def {name}({header}):
    if _lk_is_compiling():
        return _lk_traced(_lk_op, backend, {kwargs})
    _lk_key = (
        (backend, _lk_context(), _lk_env_get(_lk_ENV_KEY), _lk_grad_enabled(), {sigs})
        if {guard}
        else None
    )
    try:
        _lk_fn, _lk_check_values, _lk_positional = _lk_cache[_lk_key]
    except (KeyError, TypeError):  # TypeError: an unhashable option value
        _lk_fn, _lk_check_values, _lk_positional = _lk_miss(_lk_cache, _lk_key, _lk_op, backend, {kwargs})
    if _lk_check_values is not None:
        _lk_check_values({kwargs})
    if _lk_positional:
        return _lk_fn({positional})
    return _lk_fn({kwargs})
"""
_REQUIRED = "{n}.shape, {n}.dtype, {n}.device, {n}.requires_grad"
_OPTIONAL = "(({n}.shape, {n}.dtype, {n}.device, {n}.requires_grad) if _lk_isinstance({n}, _lk_Tensor) else ({n}.__class__, {n}))"


def _build(op: str, name: str, header: str, params: Sequence[str], required: Sequence[str]):
    for p in params:
        if not p.isidentifier() or keyword.iskeyword(p) or p.startswith("_lk_") or p == "backend":
            raise LMKernelsError(f"{op}: parameter name {p!r} is not allowed for an op's input")
    sigs = [(_REQUIRED if p in required else _OPTIONAL).format(n=p) for p in params]
    source = _TEMPLATE.format(
        name=name,
        header=header,
        kwargs=", ".join(f"{p}={p}" for p in params),
        positional=", ".join(params),
        sigs=", ".join(sigs),
        guard=" and ".join(f"_lk_isinstance({p}, _lk_Tensor)" for p in required) or "True",
    )
    cache: dict[tuple, tuple[Any, Any, bool]] = {}
    namespace = {
        "_lk_op": op,
        "_lk_cache": cache,
        "_lk_miss": _resolve_and_remember,
        "_lk_traced": _traced,
        "_lk_is_compiling": torch.compiler.is_compiling,
        "_lk_context": _CONTEXT.get,
        "_lk_env_get": _env_get,
        "_lk_ENV_KEY": _ENV_KEY,
        "_lk_grad_enabled": torch.is_grad_enabled,
        "_lk_isinstance": isinstance,
        "_lk_Tensor": torch.Tensor,
    }
    filename = f"<lmkernels.registry.fastpath {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks
    exec(compile(source, filename, "exec"), namespace)
    _CACHES.append(cache)
    return namespace[name]


def op_function(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator that writes the body of an op's public function from its signature.

    The decorated function declares the public signature and docstring: the op's inputs
    (positional-or-keyword or keyword-only, those without a default are tensors) and a last
    keyword-only ``backend=None``. Its body is replaced by: check, resolve, call (see above)."""

    def decorate(declared: Callable[..., Any]) -> Callable[..., Any]:
        parameters = list(inspect.signature(declared).parameters.values())
        if (
            not parameters
            or parameters[-1].name != "backend"
            or parameters[-1].kind != inspect.Parameter.KEYWORD_ONLY
        ):
            raise LMKernelsError(f"op_function({op!r}): the last parameter must be keyword-only `backend`")
        inputs = parameters[:-1]
        kinds = {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY}
        if any(p.kind not in kinds for p in inputs):
            raise LMKernelsError(f"op_function({op!r}): no *args, **kwargs or positional-only inputs")
        positional = [p.name for p in inputs if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
        keyword_only = [p.name for p in inputs if p.kind == inspect.Parameter.KEYWORD_ONLY]
        header = ", ".join([*positional, "*", *keyword_only, "backend"])
        params = [p.name for p in inputs]
        required = [p.name for p in inputs if p.default is inspect.Parameter.empty]
        fn = _build(op, declared.__name__, header, params, required)
        fn.__defaults__ = declared.__defaults__
        fn.__kwdefaults__ = declared.__kwdefaults__
        for attr in ("__module__", "__qualname__", "__doc__", "__annotations__"):
            setattr(fn, attr, getattr(declared, attr))
        return fn

    return decorate


def dispatch(op: str, backend: str | None, **inputs: Any) -> Any:
    """``dispatch("rms_norm", None, x=x, weight=w)``: the same as the op's public function, for
    callers that have the inputs as a dict (the harness); a dict and a lookup more per call."""
    if torch.compiler.is_compiling():
        return _traced(op, backend, **inputs)  # building a function (exec) cannot be traced
    params = tuple(inputs)
    fn = _GENERIC.get((op, params))
    if fn is None:
        header = ", ".join(["backend", *params])
        fn = _GENERIC[(op, params)] = _build(op, "dispatch_generic", header, params, ())
    return fn(backend, *inputs.values())


def _resolve_and_remember(cache, key, op, backend, **inputs):
    spec = get_op(op)
    spec.check_inputs(**inputs)
    fn = resolve(op, inputs, backend).fn
    hit = (fn, spec.check_values, _takes_positionally(fn, tuple(inputs)))
    if key is not None:
        try:
            hash(key)
        except TypeError:  # an unhashable option value: resolved on every call, never cached
            return hit
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = hit
    return hit


def _takes_positionally(fn: Callable[..., Any], params: tuple[str, ...]) -> bool:
    """Whether fn(*values) binds as fn(**dict(zip(params, values))): its first parameters are
    `params`, positional-or-keyword, in order, and any others have defaults."""
    try:
        sig = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):
        return False
    fn_params = list(sig.parameters.values())
    if len(fn_params) < len(params):
        return False
    for p, name in zip(fn_params, params):
        if p.name != name or p.kind is not p.POSITIONAL_OR_KEYWORD:
            return False
    return all(
        p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        for p in fn_params[len(params) :]
    )


def _traced(op: str, backend: str | None, **inputs: Any) -> Any:
    get_op(op).check_inputs(**inputs)
    return resolve(op, inputs, backend).fn(**inputs)


def clear_cache() -> None:
    """Forget every remembered resolution (done on every register/unregister)."""
    for cache in _CACHES:
        cache.clear()


on_change(clear_cache)
