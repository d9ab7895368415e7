"""What an op's public function runs on every call: check the inputs, pick the impl (see
dispatch.py for the precedence rules), call it, with a host cost of a few microseconds.

The checks that need no data (OpSpec.check_inputs) and the resolution are remembered per
backend argument, override state (use_backend), env value, grad mode and input signature, so a
repeated call costs building one flat tuple and comparing it with the previous call's (a dict
lookup when that differs). In the signature a tensor is
its class, shape, dtype, device and requires_grad (only CPU tensors get True for the device: a
torch.device costs more to build, hash and compare than the other four together); an option is
its class and value (16 == 16.0 == True, but a check may accept only one of them). An input
that cannot be keyed (a required tensor that is something else, an unhashable option) takes the
slow path, where check_inputs says what is wrong with it; an option passed as a tensor is
resolved on every call (its key would hold the tensor). Value checks (OpSpec.check_values) run
on every call. Under torch.compile everything is resolved afresh: dynamo traces it once per
graph and guards on what it read (a cache would only add guards).

Host time here is mostly the tensor attribute reads (each a call into torch, ~0.1 us, two to
three times that right after the op's own kernels have evicted the caches): the key reads
each attribute once, and nothing else runs on a hit.

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
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lmkernels.registry.core import LMKernelsError, get_op, on_change
from lmkernels.registry.dispatch import _CONTEXT, ENV_VAR, resolve

# An entry: (key, impl fn, check_values, whether fn takes the inputs positionally). Per generated
# function: a dict key -> entry, and a 1-list holding the previous call's entry. Comparing the
# key with that one costs less than hashing it, and consecutive calls mostly share a signature
# (the same norm in every layer). _NEVER as an entry's key: an entry that was not remembered.
_Entry = tuple[Any, Callable[..., Any], Any, bool]
_NEVER = object()
_NO_ENTRY: _Entry = (_NEVER, None, None, False)
_CACHES: list[tuple[dict[tuple, _Entry], list[_Entry]]] = []
_CACHE_LIMIT = 4096  # distinct signatures per op; past it the cache starts over (e.g. many shapes)
_GENERIC: dict[tuple[str, tuple[str, ...]], Callable[..., Any]] = {}

# os.environ.get costs 1-2 us when the variable is unset (a KeyError raised and caught inside
# os._Environ.__getitem__; `in` and os.getenv take the same route): more than the rest of the
# state in the key. Its backing dict, which os.environ updates on every change, answers in
# nanoseconds; it is a CPython detail, so any other Python gets the public call.
if isinstance(getattr(os.environ, "_data", None), dict):
    _env_get, _ENV_KEY = os.environ._data.get, os.environ.encodekey(ENV_VAR)
else:
    _env_get, _ENV_KEY = os.environ.get, ENV_VAR

# Dynamo folds this to True while it traces (as it does torch.compiler.is_compiling, which costs
# one more Python call: it also covers non-strict export, where the code runs for real on fake
# tensors and the cached path below works as it does eagerly).
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling

# How each kind of input enters the key (see the module docstring):
# TENSOR: a parameter without a default (x, q): flat, 5 entries; anything but a tensor raises
#   while the key is built (AttributeError) and takes the slow path.
# MAYBE: default None (weight, position_ids, rotary_dim): None, or a nested tuple. Plain values
#   skip the isinstance(), which costs ~0.3 us for a non-tensor (torch.Tensor's metaclass
#   takes the slow route).
# OPTION: any other default (eps, layout): flat, 2 entries.
TENSOR, MAYBE, OPTION = "tensor", "maybe", "option"
_TENSOR_SIG = "{n}.__class__, {n}.shape, {n}.dtype, {n}.is_cpu or {n}.device, {n}.requires_grad"
_SIGNATURES = {
    TENSOR: _TENSOR_SIG,
    MAYBE: (
        "None if {n} is None else ({n}.__class__, {n}) if {n}.__class__ in _lk_VALUE_TYPES"
        " else ({sig}) if _lk_isinstance({n}, _lk_Tensor) else ({n}.__class__, {n})"
    ).format(n="{n}", sig=_TENSOR_SIG),
    OPTION: "{n}.__class__, {n}",
}

_TEMPLATE = """
def {name}({header}):
    if _lk_is_compiling():
        return _lk_traced(_lk_op, backend, {kwargs})
    try:
        _lk_key = (backend, _lk_context(), _lk_env_get(_lk_ENV_KEY), _lk_grad_enabled(), {sigs})
    except Exception:  # an input that cannot be keyed: the checks in _lk_miss say what it is
        _lk_key = None
    _lk_entry = _lk_last[0]
    if _lk_key != _lk_entry[0]:
        try:
            _lk_entry = _lk_cache[_lk_key]
        except (KeyError, TypeError):  # TypeError: an unhashable option value
            _lk_entry = _lk_miss(_lk_cache, _lk_key, _lk_op, backend, {kwargs})
        _lk_last[0] = _lk_entry
    _lk_key, _lk_fn, _lk_check_values, _lk_positional = _lk_entry
    if _lk_check_values is not None:
        _lk_check_values({kwargs})
    if _lk_positional:
        return _lk_fn({positional})
    return _lk_fn({kwargs})
"""


def _build(op: str, name: str, header: str, kinds: Mapping[str, str]):
    for p in kinds:
        if not p.isidentifier() or keyword.iskeyword(p) or p.startswith("_lk_") or p == "backend":
            raise LMKernelsError(f"{op}: parameter name {p!r} is not allowed for an op's input")
    source = _TEMPLATE.format(
        name=name,
        header=header,
        kwargs=", ".join(f"{p}={p}" for p in kinds),
        positional=", ".join(kinds),
        sigs=", ".join(_SIGNATURES[kind].format(n=p) for p, kind in kinds.items()),
    )
    cache: dict[tuple, _Entry] = {}
    last = [_NO_ENTRY]
    namespace = {
        "_lk_op": op,
        "_lk_cache": cache,
        "_lk_last": last,
        "_lk_miss": _resolve_and_remember,
        "_lk_traced": _traced,
        "_lk_is_compiling": _is_dynamo_compiling,
        "_lk_context": _CONTEXT.get,
        "_lk_env_get": _env_get,
        "_lk_ENV_KEY": _ENV_KEY,
        "_lk_grad_enabled": torch.is_grad_enabled,
        "_lk_isinstance": isinstance,
        "_lk_Tensor": torch.Tensor,
        "_lk_VALUE_TYPES": frozenset({int, float, bool, str}),
    }
    filename = f"<lmkernels.registry.fastpath {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks
    exec(compile(source, filename, "exec"), namespace)
    _CACHES.append((cache, last))
    return namespace[name]


def op_function(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator that writes the body of an op's public function from its signature.

    The decorated function declares the public signature and docstring: the op's inputs
    (positional-or-keyword or keyword-only; those without a default are tensors, those with
    default None optional tensors or options, the others options) and a last keyword-only
    ``backend=None``. Its body is replaced by: check, resolve, call (see above)."""

    def decorate(declared: Callable[..., Any]) -> Callable[..., Any]:
        parameters = list(inspect.signature(declared).parameters.values())
        if (
            not parameters
            or parameters[-1].name != "backend"
            or parameters[-1].kind != inspect.Parameter.KEYWORD_ONLY
        ):
            raise LMKernelsError(f"op_function({op!r}): the last parameter must be keyword-only `backend`")
        inputs = parameters[:-1]
        allowed = {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY}
        if any(p.kind not in allowed for p in inputs):
            raise LMKernelsError(f"op_function({op!r}): no *args, **kwargs or positional-only inputs")
        positional = [p.name for p in inputs if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
        keyword_only = [p.name for p in inputs if p.kind == inspect.Parameter.KEYWORD_ONLY]
        header = ", ".join([*positional, "*", *keyword_only, "backend"])
        kinds = {
            p.name: TENSOR if p.default is p.empty else MAYBE if p.default is None else OPTION for p in inputs
        }
        fn = _build(op, declared.__name__, header, kinds)
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
        fn = _GENERIC[(op, params)] = _build(op, "dispatch_generic", header, dict.fromkeys(params, MAYBE))
    return fn(backend, *inputs.values())


def _resolve_and_remember(cache, key, op, backend, **inputs) -> _Entry:
    spec = get_op(op)
    spec.check_inputs(**inputs)
    fn = resolve(op, inputs, backend).fn
    check_values, positional = spec.check_values, _takes_positionally(fn, tuple(inputs))
    if key is None:
        return (_NEVER, fn, check_values, positional)
    try:
        hash(key)
    except TypeError:  # an unhashable option value: resolved on every call, never remembered
        return (_NEVER, fn, check_values, positional)
    if any(isinstance(v, torch.Tensor) for v in key):
        return (_NEVER, fn, check_values, positional)  # an option passed as a tensor: kept alive
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    entry = cache[key] = (key, fn, check_values, positional)
    return entry


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
    for cache, last in _CACHES:
        cache.clear()
        last[0] = _NO_ENTRY


on_change(clear_cache)
