"""The plain causal batch without a (B, 1, T, T) mask, also under torch.compile ("causal_mask").

transformers skips the causal mask (SDPA then runs with is_causal=True and GQA) only when it can
prove the batch needs none, and under torch.compile it cannot: it never reads tensor values
while tracing, and position_ids it made itself look like possibly packed ones. So a compiled
model builds the full mask, SDPA runs its masked kernel and repeats K/V for every query head.

The caller knows more. A base model called with no attention_mask, no position_ids and no
cache (past_key_values before transformers 5.24) gets position_ids = arange(T) (no packing),
an empty or no cache, and nothing padded: the plain causal case. The patched base-model
forward passes PLAIN_CAUSAL as attention_mask then, and the modeling module's mask functions
(create_causal_mask & co, replaced in its namespace while a patch holds them) map it back:
full causal attention under the stock SDPA gets None (is_causal), anything else the real
function's answer for attention_mask=None, exactly what transformers would build. Any other
call passes through unchanged. The marker is an argument, not state: threads never see each
other's, and dynamo folds the `is` test to a constant (one graph, no guards on values, no host
sync).

Fail closed: apply() reads the base forward's source and patches it only when attention_mask
reaches nothing but these mask functions (directly or through a kwargs dict) and position_ids
defaults to an arange; the marker raises if it ever reaches anything else.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from lmkernels.integrations.transformers.replacements import mark, positional_names

MASKING_MODULE = "transformers.masking_utils"
CAUSAL = "create_causal_mask"
# Arguments of create_causal_mask that may have any value when the answer is is_causal: with no
# cache (or the empty one the model made) they change nothing about a plain causal mask.
NEUTRAL_ARGS = {
    "config",
    "inputs_embeds",
    "attention_mask",
    "past_key_values",
    "cache",
    "position_ids",
    "layer_idx",
}
# The cache argument's names: past_key_values up to transformers 5.23, cache from 5.24 (which
# still takes the old name, renamed by a decorator).
CACHE_ARGS = ("past_key_values", "cache")


class MarkerMisuse(AttributeError):
    """The marker reached code that reads attention_mask as a tensor (a bug: apply() checks)."""


class _PlainCausal:
    """attention_mask of a plain causal call; only lmkernels' mask-function wrappers take it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "lmkernels.PLAIN_CAUSAL"

    def __getattr__(self, name: str) -> Any:
        raise MarkerMisuse(
            f"lmkernels' plain-causal attention_mask marker was used as a tensor (.{name}): this "
            "model's forward reads attention_mask outside the mask functions; "
            "revert() and apply with ops excluding 'causal_mask'"
        )


PLAIN_CAUSAL = _PlainCausal()


# --- the mask functions of a modeling module -------------------------------------------------------


def mask_functions(namespace: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    """The transformers mask functions (create_*, with an attention_mask argument) in a namespace."""
    found = {}
    for name, fn in namespace.items():
        fn = getattr(fn, "__wrapped__", fn) if getattr(fn, "_lmkernels_patch", False) else fn
        if name.startswith("create_") and getattr(fn, "__module__", None) == MASKING_MODULE:
            if "attention_mask" in _params(fn):
                found[name] = fn
    return found


def _params(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _stock_objects() -> tuple[Any, ...]:
    """transformers' objects that the wrapper compares against on every call, imported here, at
    patch time: dynamo (torch 2.11) refuses an import statement inside traced code when the
    package is transformers' _LazyModule ("Bad import result"), which broke fullgraph compiles.
    (mask functions, stock sdpa mask, attention functions, stock sdpa attention, DynamicCache)"""
    from transformers import masking_utils
    from transformers.cache_utils import DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return (
        masking_utils.ALL_MASK_ATTENTION_FUNCTIONS,
        masking_utils.sdpa_mask,
        ALL_ATTENTION_FUNCTIONS,
        sdpa_attention_forward,
        DynamicCache,
    )


def _sdpa_is_stock(stock: tuple[Any, ...]) -> bool:
    """The "sdpa" mask and attention functions are transformers' own (None means is_causal)."""
    masks, sdpa_mask, attention, sdpa_attention, _ = stock
    return masks["sdpa"] is sdpa_mask and attention["sdpa"] is sdpa_attention


def _empty_cache(cache: Any, stock: tuple[Any, ...]) -> bool:
    """No cache, or the empty DynamicCache the base model makes when use_cache is on."""
    if cache is None:
        return True
    return type(cache) is stock[4] and cache.get_seq_length() == 0


def _is_causal_answer(args: dict[str, Any], stock: tuple[Any, ...]) -> bool:
    """Whether create_causal_mask(attention_mask=None, **args) means exactly SDPA's is_causal."""
    config = args.get("config")
    if config is None or not getattr(config, "is_causal", True):
        return False  # bidirectional configs go to create_bidirectional_mask
    if getattr(config, "_attn_implementation", None) != "sdpa" or not _sdpa_is_stock(stock):
        return False
    if args.get("allow_is_causal_skip", True) is False:
        return False
    if any(
        value is not None
        for name, value in args.items()
        if name not in NEUTRAL_ARGS | {"allow_is_causal_skip"}
    ):
        return False  # or/and mask functions, block overlays, arguments of a newer transformers
    return all(_empty_cache(args.get(name), stock) for name in CACHE_ARGS)


def mask_function_wrapper(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    """`real` (a transformers mask function) that also takes PLAIN_CAUSAL as attention_mask."""
    from transformers import masking_utils

    names = _params(real)
    index = names.index("attention_mask")
    may_skip = name == CAUSAL and real is masking_utils.create_causal_mask
    stock = _stock_objects()

    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("attention_mask") is PLAIN_CAUSAL:
            kwargs = dict(kwargs, attention_mask=None)
        elif len(args) > index and args[index] is PLAIN_CAUSAL:
            args = args[:index] + (None,) + args[index + 1 :]
        else:
            return real(*args, **kwargs)
        if may_skip and _is_causal_answer(dict(zip(names, args)) | kwargs, stock):
            return None
        return real(*args, **kwargs)

    return mark(wrapper)


# --- the base model's forward -------------------------------------------------------------------------


def plain_causal_forward(
    original: Callable[..., Any], call_original: Callable[..., Any]
) -> Callable[..., Any]:
    """The base model's forward: PLAIN_CAUSAL as attention_mask when the call is plain causal.
    `call_original(self, *args, **kwargs)` runs the unpatched forward."""
    names = positional_names(original)
    where = {
        n: names.index(n) if n in names else None for n in ("attention_mask", "position_ids", *CACHE_ARGS)
    }
    inner = inspect.unwrap(original)
    namespace = inner.__globals__
    receivers = tuple(n for n in mask_functions(namespace) if n in inner.__code__.co_names)

    def given(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
        i = where[name]
        return args[i] if i is not None and len(args) > i else kwargs.get(name)

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # The marker only goes where the mask functions take it: a deep copy of a patched model
        # outlives the patch that holds them (then it runs as transformers does).
        ready = all(getattr(namespace.get(n), "_lmkernels_patch", False) for n in receivers)
        if ready and all(given(args, kwargs, n) is None for n in where):
            i = where["attention_mask"]
            if i is not None and len(args) > i:
                args = args[:i] + (PLAIN_CAUSAL,) + args[i + 1 :]
            else:
                kwargs["attention_mask"] = PLAIN_CAUSAL
        return call_original(self, *args, **kwargs)

    return mark(forward)


# --- apply-time check of a base model -------------------------------------------------------------------


def base_model(model: nn.Module) -> nn.Module | None:
    """The module whose forward builds the masks: the model itself or its base model."""
    candidates = [model, getattr(model, getattr(model, "base_model_prefix", "") or "", None)]
    for module in candidates:
        if not isinstance(module, nn.Module):
            continue
        fn = inspect.unwrap(type(module).forward)
        code = getattr(fn, "__code__", None)
        if code is not None and mask_functions({n: fn.__globals__.get(n) for n in code.co_names}):
            return module
    return None


def forward_problem(module: nn.Module) -> str | None:
    """Why the marker cannot be passed to this base model's forward (None: it can)."""
    outer = type(module).forward
    inner = inspect.unwrap(outer)
    for params in (_params(outer), _params(inner)):
        missing = [n for n in ("attention_mask", "position_ids") if n not in params]
        if not any(n in params for n in CACHE_ARGS):
            missing.append(" or ".join(CACHE_ARGS))
        if missing:
            return f"forward has no {', '.join(missing)} argument"
    layer: Any = outer
    while layer is not inner:  # decorators (transformers': config defaults, output capture)
        if _mentions(getattr(layer, "__code__", None), "attention_mask"):
            return f"decorator {layer.__qualname__} reads attention_mask"
        layer = layer.__wrapped__
    try:
        tree = ast.parse(textwrap.dedent(_source(inner)))
    except SyntaxError as e:
        return f"forward source unreadable ({e})"
    used = {n for n in mask_functions(inner.__globals__) if n in inner.__code__.co_names}
    return _SourceCheck(tree.body[0], used).problem()


def _mentions(code: types.CodeType | None, name: str) -> bool:
    """Whether a code object (or one nested in it) names `name`; no code: assume it does."""
    if code is None:
        return True
    if name in code.co_names or name in code.co_varnames or name in code.co_consts:
        return True
    return any(_mentions(c, name) for c in code.co_consts if hasattr(c, "co_names"))


def own_sdpa_call(model: nn.Module) -> str | None:
    """A module that calls SDPA itself (not through transformers' attention functions): it may
    not read a missing mask as causal."""
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        code = getattr(inspect.unwrap(cls.forward), "__code__", None)
        if code is not None and _mentions(code, "scaled_dot_product_attention"):
            return cls.__name__
    return None


def _source(fn: Callable[..., Any]) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return "attention_mask (source not available)"


class _SourceCheck:
    """attention_mask reaches only the mask functions (directly, through an alias such as
    `f = create_causal_mask if ... else create_sliding_window_causal_mask`, or through a
    kwargs dict used only as **kwargs of them); position_ids defaults to an arange."""

    def __init__(self, func: ast.stmt, mask_fns: set[str]) -> None:
        # func: the forward's definition (or, its source unavailable, a statement naming
        # attention_mask, which the check then reports)
        self.func = func
        self.parent = {child: node for node in ast.walk(func) for child in ast.iter_child_nodes(node)}
        self.callables = set(mask_fns)
        self.kwarg_dicts: set[str] = set()
        for node in ast.walk(func):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                target = node.targets[0].id
                if self._is_mask_fn(node.value):
                    self.callables.add(target)
                elif isinstance(node.value, ast.Dict) and any(
                    isinstance(k, ast.Constant) and k.value == "attention_mask" for k in node.value.keys
                ):
                    self.kwarg_dicts.add(target)

    def _is_mask_fn(self, node: ast.AST) -> bool:
        if isinstance(node, ast.IfExp):
            return self._is_mask_fn(node.body) and self._is_mask_fn(node.orelse)
        return isinstance(node, ast.Name) and node.id in self.callables

    def _mask_call(self, node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.callables
        )

    def problem(self) -> str | None:
        if not self.callables:
            return "builds no mask with transformers' mask functions"
        for node in ast.walk(self.func):
            if not isinstance(node, ast.Name):
                continue
            if node.id == "attention_mask" and not self._mask_use(node):
                return f"attention_mask reaches `{self._snippet(node)}` (line {node.lineno} of forward)"
            if node.id in self.kwarg_dicts and isinstance(node.ctx, ast.Load) and not self._kwargs_use(node):
                return f"{node.id} (holds attention_mask) reaches `{self._snippet(node)}`"
        if not self._positions_default_to_arange():
            return "position_ids left None are not made by an arange (packing could not be ruled out)"
        return None

    def _snippet(self, node: ast.AST) -> str:
        return ast.unparse(self.parent.get(node, node))[:60]

    def _mask_use(self, node: ast.Name) -> bool:
        if not isinstance(node.ctx, ast.Load):
            return False  # reassigned: the check below would not hold for the new value
        up = self.parent[node]
        if isinstance(up, ast.keyword):
            return up.arg == "attention_mask" and self._mask_call(self.parent[up])
        if isinstance(up, ast.Call):  # isinstance(attention_mask, dict), or a positional argument
            if self._isinstance_test(node):
                return True
            return self._mask_call(up) and node in up.args and up.args.index(node) == 2
        if isinstance(up, ast.Dict):  # {"attention_mask": attention_mask, ...} assigned to a kwargs dict
            key = up.keys[up.values.index(node)] if node in up.values else None
            holder = self.parent.get(up)
            return (
                isinstance(key, ast.Constant)
                and key.value == "attention_mask"
                and isinstance(holder, ast.Assign)
                and isinstance(holder.targets[0], ast.Name)
                and holder.targets[0].id in self.kwarg_dicts
            )
        if isinstance(up, ast.NamedExpr):  # if not isinstance(mapping := attention_mask, dict): mapping = ...
            return self._isinstance_test(up) and self._reassigned_in_body(up)
        return False

    def _isinstance_test(self, node: ast.AST) -> bool:
        call = self.parent.get(node)
        return (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id == "isinstance"
            and call.args[0] is node
        )

    def _reassigned_in_body(self, walrus: ast.NamedExpr) -> bool:
        negation = self.parent.get(self.parent[walrus])
        if not (isinstance(negation, ast.UnaryOp) and isinstance(negation.op, ast.Not)):
            return False
        branch = self.parent.get(negation)
        if not (isinstance(branch, ast.If) and branch.test is negation):
            return False
        name = walrus.target.id
        return any(
            isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in s.targets)
            for s in branch.body
        )

    def _kwargs_use(self, node: ast.Name) -> bool:
        up = self.parent[node]
        if isinstance(up, ast.keyword) and up.arg is None:
            return self._mask_call(self.parent[up])
        return isinstance(up, ast.Subscript) and isinstance(up.ctx, ast.Store)  # mask_kwargs["x"] = ...

    def _positions_default_to_arange(self) -> bool:
        for node in ast.walk(self.func):
            if not (isinstance(node, ast.If) and ast.unparse(node.test) == "position_ids is None"):
                continue
            body = ast.Module(body=node.body, type_ignores=[])
            assigns = [
                n
                for n in ast.walk(body)
                if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "position_ids" for t in n.targets)
            ]
            if assigns and "arange" in ast.unparse(assigns[0].value):
                return True
        return False
