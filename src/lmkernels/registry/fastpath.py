"""What an op's public function runs on every call: check the inputs, pick the impl (see
dispatch.py for the precedence rules), call it, with a host cost of a few microseconds.

The checks that need no data (OpSpec.check_inputs) and the resolution are remembered per
backend argument, override state (use_backend), env value, grad mode and input signature, so a
repeated call costs building one tuple and comparing it with the previous call's (a dict
lookup when that differs). In the signature a tensor is its class, shape, dtype, device and
requires_grad (only CPU tensors get True for the device: a torch.device costs more to build,
hash and compare than the other four together); an option is its class and value
(16 == 16.0 == True, but a check may accept only one of them). An input the key cannot stand
for (an unhashable option; a tensor passed for an option with a value default, such as eps,
which the key would hold by its signature, not its value) is checked and resolved on every call
and never remembered, as is a call whose checks fail (say, a required tensor that is something
else: check_inputs says what). An option defaulting to None (rotary_dim, softcap) is keyed as an
optional tensor would be: a tensor there by its signature (the ops' checks refuse one). Value
checks (OpSpec.check_values) run on every call. Under torch.compile everything is resolved
afresh: dynamo traces it once per graph and guards on what it read (a cache would only add
guards).

Its cost per call is held to a bound by `lmkernels-bench dispatch-overhead`; docs/performance.md
("What we tried") has the alternatives tried against it.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, cast

import torch

from lmkernels.registry.core import LMKernelsError, get_op, on_change
from lmkernels.registry.dispatch import _CONTEXT, ENV_VAR, resolve

# An entry: (key, impl fn, check_values, whether fn takes the inputs positionally). Per op: a
# dict key -> entry, and a 1-list holding the previous call's entry. Comparing the key with
# that one costs less than hashing it, and consecutive calls mostly share a signature (the same
# norm in every layer). _NEVER as an entry's key: an entry that was not remembered. A key is
# None for inputs that cannot be keyed (looked up, never found).
_Key = tuple[Any, ...] | None
_Entry = tuple[Any, Callable[..., Any], Callable[..., None] | None, bool]
_Cache = dict[_Key, _Entry]
_NEVER = object()


def _no_impl(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("the placeholder entry is never called: its key matches no call")


_NO_ENTRY: _Entry = (_NEVER, _no_impl, None, False)
_MISSING = object()
_CACHES: list[tuple[_Cache, list[_Entry]]] = []
_CACHE_LIMIT = 4096  # distinct signatures per op; past it the cache starts over (e.g. many shapes)
_VALUE_TYPES = frozenset({int, float, bool, str, type(None)})
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})

# os.environ.get raises and catches a KeyError inside os._Environ.__getitem__ when the variable
# is unset (os.getenv and `in` take the same route): a large share of the cached dispatch. Its
# backing dict, which os.environ updates on every change, answers directly; it is a CPython
# detail, so any other Python gets the public call.
_env_get: Callable[[Any], object]
_ENV_KEY: object
_env_data = getattr(os.environ, "_data", None)
if isinstance(_env_data, dict):
    _env_get, _ENV_KEY = _env_data.get, os.environ.encodekey(ENV_VAR)
else:
    _env_get, _ENV_KEY = os.environ.get, ENV_VAR


def _key(v: Any) -> tuple[Any, ...]:
    """How an input enters the key: a tensor as its class, shape, dtype, device and
    requires_grad; anything else as its class and value. The common classes are tested by
    identity: isinstance(v, torch.Tensor) takes the tensor metaclass's slow route for a
    non-tensor."""
    cls = v.__class__
    if cls in _PLAIN_TENSORS or (cls not in _VALUE_TYPES and isinstance(v, torch.Tensor)):
        return (cls, v.shape, v.dtype, v.is_cpu or v.device, v.requires_grad)
    return (cls, v)


def _op_body(op: str, params: list[inspect.Parameter]) -> Callable[..., Any]:
    """One op's public function: bind the arguments, key them, check and resolve on a new key,
    call the impl."""
    names = tuple(p.name for p in params)
    defaults = tuple(_MISSING if p.default is p.empty else p.default for p in params)
    n_positional = sum(p.kind == p.POSITIONAL_OR_KEYWORD for p in params)
    n_required = max((i + 1 for i, d in enumerate(defaults) if d is _MISSING), default=0)
    options = tuple(p.name for p in params if p.default is not p.empty and p.default is not None)
    cache: _Cache = {}
    last = [_NO_ENTRY]
    _CACHES.append((cache, last))

    # per count of positional arguments: the names and defaults of the inputs after them
    tails = [(names[n:], defaults[n:]) for n in range(len(names) + 1)]

    def body(*args: Any, backend: str | None = None, **kwargs: Any) -> Any:
        n = len(args)
        if n > n_positional:
            raise TypeError(f"{op}() takes {n_positional} positional arguments, got {n}")
        tail_names, tail_defaults = tails[n]
        if kwargs:
            values = args + tuple(map(kwargs.pop, tail_names, tail_defaults))  # binds at C speed
            if kwargs:
                raise TypeError(f"{op}() got unexpected keyword arguments {sorted(kwargs)}")
        else:
            values = args + tail_defaults
        if n < n_required:  # required inputs passed by keyword, or missing
            for name, value in zip(names[n:n_required], values[n:]):
                if value is _MISSING:
                    raise TypeError(f"{op}() missing required argument {name!r}")
        if torch.compiler.is_dynamo_compiling():
            return _traced(op, backend, **dict(zip(names, values)))
        key: _Key
        try:
            key = (backend, _CONTEXT.get(), _env_get(_ENV_KEY), torch.is_grad_enabled(), *map(_key, values))
        except Exception:  # an input that cannot be keyed: the checks on the slow path say why
            key = None
        entry = last[0]
        if key != entry[0]:
            try:
                entry = cache[key]
            except (KeyError, TypeError):  # TypeError: an unhashable option value
                entry = _resolve_and_remember(cache, key, op, backend, options, **dict(zip(names, values)))
            last[0] = entry
        _, fn, check_values, positional = entry
        if check_values is not None:
            check_values(**dict(zip(names, values)))
        if positional:
            return fn(*values)
        return fn(**dict(zip(names, values)))

    return body


F = TypeVar("F", bound=Callable[..., Any])


def op_function(op: str) -> Callable[[F], F]:
    """Decorator that gives an op's public function its body: check, resolve, call (above).

    The decorated function declares the public signature and docstring: the op's inputs
    (positional-or-keyword or keyword-only; those without a default are tensors, those with
    default None optional tensors or options, the others options) and a last keyword-only
    ``backend=None``. Type checkers see the declared function; inspect.signature, help() and
    typing.get_type_hints see its signature with the annotations evaluated."""

    def decorate(declared: F) -> F:
        signature = inspect.signature(declared, eval_str=True)
        parameters = list(signature.parameters.values())
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
        public = _op_body(op, inputs)
        annotations = {p.name: p.annotation for p in parameters if p.annotation is not p.empty}
        if signature.return_annotation is not signature.empty:
            annotations["return"] = signature.return_annotation
        metadata = {
            attr: getattr(declared, attr) for attr in ("__module__", "__name__", "__qualname__", "__doc__")
        }
        metadata.update(__signature__=signature, __annotations__=annotations)
        for attr, value in metadata.items():
            setattr(public, attr, value)
        return cast(F, public)

    return decorate


_GENERIC: dict[tuple[str, tuple[str, ...]], Callable[..., Any]] = {}


def dispatch(op: str, backend: str | None, **inputs: Any) -> Any:
    """``dispatch("rms_norm", None, x=x, weight=w)``: the same as the op's public function, for
    callers that have the inputs as a dict (the harness)."""
    if torch.compiler.is_compiling():
        return _traced(op, backend, **inputs)
    names = tuple(inputs)
    body = _GENERIC.get((op, names))
    if body is None:
        params = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in names]
        body = _GENERIC[(op, names)] = _op_body(op, params)
    return body(backend=backend, **inputs)


def _resolve_and_remember(
    cache: _Cache, key: _Key, op: str, backend: str | None, options: tuple[str, ...], /, **inputs: Any
) -> _Entry:
    """Check and resolve; remember the entry under `key` unless the key cannot stand for the
    inputs: an unhashable option value, or a tensor passed for one of `options` (the parameters
    with a value default), which the key holds by signature, not by value."""
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
    if any(isinstance(inputs[name], torch.Tensor) for name in options):
        return (_NEVER, fn, check_values, positional)
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
