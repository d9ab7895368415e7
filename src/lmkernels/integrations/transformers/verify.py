"""Apply-time checks: each replacement against the code it replaces, on a small random input.

Every check runs in fp32 on a shallow copy of the module whose weights are swapped for small
random ones (so the real module, its weights, their gradients and the global RNG state are never
touched, and a 70B model's MLP costs as much to check as a tiny one's), under no_grad, with the
backend the patch will use. A replacement passes when its output is within TOL (max error
relative to the output's largest magnitude) of the original's: two correct fp32 implementations
differ by ~1e-7 here (summation order), a wrong offset, layout, scale or activation by O(1).

A check that fails raises Mismatch with what differed; the caller reports it (strict apply
raises). Casting modes (llama / gemma / none) are equal in fp32; the norm probe tells them apart
by running the original once in bf16 against lmkernels' reference of each mode.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch import nn

from lmkernels.integrations import peft as lk_peft
from lmkernels.integrations.transformers import replacements as rp
from lmkernels.ops.rms_norm import rms_norm_reference
from lmkernels.types import CastingMode

_F = TypeVar("_F", bound=Callable[..., Any])

TOL = 1e-5
CASTINGS: tuple[CastingMode, ...] = ("llama", "gemma", "none")
EPS_ATTRS = ("variance_epsilon", "eps", "epsilon")
DEFAULT_EPS = (1e-6, 1e-5)  # tried, and verified, when a norm keeps eps in its code, not an attribute
H_SMALL, I_SMALL = 16, 24  # the dims of the swapped-in weights


class Mismatch(Exception):
    """The replacement does not compute what the original does (message: what and by how much)."""


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.shape != ref.shape:
        return math.inf
    scale = ref.detach().float().abs().max().clamp_min(1e-30)
    return ((out.detach().float() - ref.detach().float()).abs().max() / scale).item()


def _randn(g: torch.Generator, *shape: int, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(device)


def _isolated(fn: _F) -> _F:
    """Run a check without gradients and without moving the global RNG state."""

    def run(*args: Any, device: torch.device, **kwargs: Any) -> Any:
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            return fn(*args, device=device, **kwargs)

    return cast(_F, run)


def _shallow(module: nn.Module, params: dict[str, torch.Tensor], children: dict[str, nn.Module]) -> nn.Module:
    """A copy of `module` that shares everything but its own parameters and the given children."""
    clone = copy.copy(module)
    clone._parameters = {
        **module._parameters,
        **{k: nn.Parameter(v, requires_grad=False) for k, v in params.items()},
    }
    clone._modules = {**module._modules, **children}
    clone.train(module.training)
    return clone


def norm_size(module: nn.Module) -> int:
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.shape[-1]
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        return int(shape[-1]) if isinstance(shape, (tuple, list)) else int(shape)
    return 32


def eps_attr_of(module: nn.Module) -> str | None:
    for name in EPS_ATTRS:
        if isinstance(getattr(module, name, None), (int, float)):
            return name
    return None


def _norm_clone(module: nn.Module, g: torch.Generator, device: torch.device) -> tuple[nn.Module, int]:
    n = norm_size(module)
    params = {}
    if isinstance(getattr(module, "weight", None), torch.Tensor):
        params["weight"] = _randn(g, n, device=device, scale=0.5) + 0.5
    if isinstance(getattr(module, "bias", None), torch.Tensor):
        params["bias"] = _randn(g, n, device=device, scale=0.5)
    return _shallow(module, params, {}), n


def _inputs(g: torch.Generator, n: int, device: torch.device) -> list[torch.Tensor]:
    x = _randn(g, 3, 5, n, device=device) + 0.3
    # the small copy makes eps matter: a wrong epsilon changes its output by O(1)
    return [x, x * 1e-3]


@_isolated
def probe_rms_norm(
    module: nn.Module, backend: str | None, *, device: torch.device
) -> tuple[Callable[[nn.Module, torch.Tensor], torch.Tensor], str]:
    """The RMSNorm replacement that matches `module` (epsilon, offset, casting), verified."""
    g = torch.Generator().manual_seed(0)
    clone, n = _norm_clone(module, g, device)
    weight = clone._parameters.get("weight")
    xs = _inputs(g, n, device)
    refs = [clone(x) for x in xs]
    eps_attr = eps_attr_of(module)
    eps_options = [getattr(module, eps_attr)] if eps_attr else list(DEFAULT_EPS)
    found = None
    for eps in eps_options:
        for offset in (0.0, 1.0) if weight is not None else (0.0,):
            if all(
                rel_err(rms_norm_reference(x, weight, eps, offset, "none"), r) <= TOL
                for x, r in zip(xs, refs)
            ):
                found = (eps, offset)
                break
        if found:
            break
    if found is None:
        errs = [rel_err(rms_norm_reference(xs[1], weight, eps_options[0], 0.0, "none"), refs[1])]
        raise Mismatch(
            f"no RMSNorm (x * rsqrt(mean(x^2) + eps) * (offset + w)) matches (error {errs[0]:.1e})"
        )
    eps, offset = found
    # casting mode: the original in bf16 against each mode's reference, same bf16 inputs
    xb = xs[0].bfloat16()
    wb = None if weight is None else weight.bfloat16()
    clone_b = _shallow(module, {} if wb is None else {"weight": wb}, {})
    ref_b = clone_b(xb)
    mode_errs = {m: rel_err(rms_norm_reference(xb, wb, eps, offset, m), ref_b) for m in CASTINGS}
    casting = min(CASTINGS, key=mode_errs.__getitem__)
    forward = rp.rms_norm_forward(eps_attr, eps, offset, casting, backend)
    err = max(rel_err(forward(clone, x), r) for x, r in zip(xs, refs))
    if err > TOL:
        raise Mismatch(f"lmkernels rms_norm differs by {err:.1e} (> {TOL:g})")
    where = f"eps attr {eps_attr!r}" if eps_attr else f"eps {eps:g} (fixed in code)"
    return forward, f"offset {offset:g}, casting {casting}, {where}"


@_isolated
def probe_layer_norm(
    module: nn.Module, backend: str | None, *, device: torch.device
) -> tuple[Callable[[nn.Module, torch.Tensor], torch.Tensor], str]:
    g = torch.Generator().manual_seed(0)
    clone, n = _norm_clone(module, g, device)
    xs = _inputs(g, n, device)
    refs = [clone(x) for x in xs]
    eps_attr = eps_attr_of(module)
    eps_options = [getattr(module, eps_attr)] if eps_attr else list(DEFAULT_EPS)
    errs = []
    for eps in eps_options:
        forward = rp.layer_norm_forward(eps_attr, eps, backend)
        err = max(rel_err(forward(clone, x), r) for x, r in zip(xs, refs))
        if err <= TOL:
            has = [
                p for p in ("weight", "bias") if p in clone._parameters and clone._parameters[p] is not None
            ]
            where = f"eps attr {eps_attr!r}" if eps_attr else f"eps {eps:g} (fixed in code)"
            return forward, f"{' + '.join(has) or 'no affine'}, {where}"
        errs.append(err)
    raise Mismatch(f"lmkernels layer_norm differs by {min(errs):.1e} (> {TOL:g})")


def _small_linear(
    linear: nn.Linear, g: torch.Generator, device: torch.device, n_in: int, n_out: int
) -> nn.Linear:
    small = nn.Linear(n_in, n_out, bias=linear.bias is not None, device="meta")
    small.weight = nn.Parameter(_randn(g, n_out, n_in, device=device, scale=n_in**-0.5), requires_grad=False)
    if linear.bias is not None:
        small.bias = nn.Parameter(_randn(g, n_out, device=device, scale=0.1), requires_grad=False)
    return small


@_isolated
def check_mlp(
    module: nn.Module, layout: str, forward: Callable[..., torch.Tensor], *, device: torch.device
) -> float:
    g = torch.Generator().manual_seed(0)
    H, I = H_SMALL, I_SMALL

    def linear(
        name: str,
    ) -> Any:  # a PEFT layer's nn.Linear: the replacement calls the projections as modules
        module_ = getattr(module, name)
        return lk_peft.base_linear(module_) or module_

    children: dict[str, nn.Module]
    if layout == "fused":
        children = {"gate_up_proj": _small_linear(linear("gate_up_proj"), g, device, H, 2 * I)}
    else:
        children = {
            "gate_proj": _small_linear(linear("gate_proj"), g, device, H, I),
            "up_proj": _small_linear(linear("up_proj"), g, device, H, I),
        }
    children["down_proj"] = _small_linear(linear("down_proj"), g, device, I, H)
    clone = _shallow(module, {}, children)
    x = _randn(g, 3, 5, H, device=device)
    err = rel_err(forward(clone, x), clone(x))
    if err > TOL:
        raise Mismatch(f"down(glu(gate, up)) differs from the module's forward by {err:.1e}")
    return err


@_isolated
def check_experts(module: nn.Module, forward: Callable[..., torch.Tensor], *, device: torch.device) -> float:
    g = torch.Generator().manual_seed(0)
    E, H, I = module.get_parameter("gate_up_proj").shape[0], H_SMALL, I_SMALL
    params = {
        "gate_up_proj": _randn(g, E, 2 * I, H, device=device, scale=H**-0.5),
        "down_proj": _randn(g, E, H, I, device=device, scale=I**-0.5),
    }
    clone = _shallow(module, params, {})
    n_tokens, k = 11, min(2, E)
    x = _randn(g, n_tokens, H, device=device)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n_tokens)]).to(device)
    weights = torch.rand(n_tokens, k, generator=g).to(device)
    err = rel_err(forward(clone, x, index, weights), clone(x, index, weights))
    if err > TOL:
        raise Mismatch(f"experts with lmkernels GLU differ from the module's forward by {err:.1e}")
    return err


@_isolated
def probe_rope(
    original: rp.RopeFunction,
    head_dim: int,
    rotary_dim: int,
    backend_of: Callable[[], str | None],
    *,
    device: torch.device,
) -> tuple[rp.RopeStyle, str]:
    """The rope style (layout, table form) under which lmkernels.rope equals `original`."""
    g = torch.Generator().manual_seed(0)
    q = _randn(g, 2, 3, 5, head_dim, device=device)
    k = _randn(g, 2, 2, 5, head_dim, device=device)
    # table width -> [(cos, sin, original's output)], or None where it raises
    cases: dict[int, list[tuple[torch.Tensor, torch.Tensor, Any]] | None] = {}

    def cases_of(
        width: int,
    ) -> (
        list[tuple[torch.Tensor, torch.Tensor, Any]] | None
    ):  # built when a style first needs them (the half width rarely)
        if width not in cases:
            tables = [(_randn(g, 2, 5, width, device=device), _randn(g, 2, 5, width, device=device))]
            tables.append((tables[0][0][:1], tables[0][1][:1]))  # one table for the whole batch
            try:
                cases[width] = [(c, s, original(q, k, c, s)) for c, s in tables]
            except RuntimeError:  # a table of the other width: a shape error
                cases[width] = None
        return cases[width]

    best = math.inf
    for style in rp.ROPE_STYLES:
        width_cases = cases_of(rotary_dim // 2 if style.half_width else rotary_dim)
        if width_cases is None:
            continue
        fn = rp.rope_function(original, style, backend_of)
        err = max(rel_err(o, r) for c, s, ref in width_cases for o, r in zip(fn(q, k, c, s), ref))
        if err <= TOL:
            partial = f", rotary dim {rotary_dim} of {head_dim}" if rotary_dim < head_dim else ""
            return style, style.describe() + partial
        best = min(best, err)
    if best == math.inf:
        raise Mismatch(f"the function raised on tables of {rotary_dim} and of {rotary_dim // 2} columns")
    raise Mismatch(f"no lmkernels rope layout matches (best error {best:.1e})")


_STUB_OUTPUT: list[type] = []


def _stub_output(**fields: Any) -> Any:
    """The base model's output for the head check: the given fields, None for any other the
    forward reads (router_logits, cross_attentions, ... vary by family)."""
    if not _STUB_OUTPUT:  # one class per process (transformers registers output classes with pytree)
        from transformers.modeling_outputs import MoeModelOutputWithPast

        class StubOutput(MoeModelOutputWithPast):
            def __getattr__(self, name: str) -> Any:
                if name.startswith("__"):
                    raise AttributeError(name)
                return None

        _STUB_OUTPUT.append(StubOutput)
    return _STUB_OUTPUT[0](**fields)


class _StubBase(nn.Module):
    """Stands in for the base model in the head check: returns fixed hidden states."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output

    def __getattr__(self, name: str) -> Any:
        # a causal LM that reaches its decoder through the base model (OPT, Bart: self.model.decoder)
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            return self


@_isolated
def check_head(model: nn.Module, spec: rp.HeadSpec, backend: str | None, *, device: torch.device) -> float:
    """The fused loss against the model's own forward, on random hidden states and labels, for
    the mean, num_items_in_batch and (MoE) router aux loss paths."""

    g = torch.Generator().manual_seed(0)
    head = getattr(model, spec.head_attr)
    head = (
        lk_peft.base_linear(head) or head
    )  # sizes and bias of the nn.Linear (PEFT: peft.py checks the rest)
    V, B, T, H = head.out_features, 2, 6, H_SMALL
    hidden = _randn(g, B, T, H, device=device, scale=4.0)  # logits of O(10): softcapping matters
    labels = torch.randint(0, V, (B, T), generator=g).to(device)
    labels[0, 1] = labels[1, -2] = -100
    if spec.moe:
        moe_model: Any = model  # (head_spec checked its MoE attributes)
        E = int(moe_model.num_experts)
        layers = tuple(_randn(g, B * T, E, device=device) for _ in range(2))
        output = _stub_output(last_hidden_state=hidden, router_logits=layers)
    else:
        output = _stub_output(last_hidden_state=hidden)
    clone = _shallow(
        model, {}, {spec.base_attr: _StubBase(output), spec.head_attr: _small_linear(head, g, device, H, V)}
    )
    cases: list[dict[str, Any]] = [{}, {"num_items_in_batch": torch.tensor(17, device=device)}]
    if spec.moe:
        cases.append({"output_router_logits": True})
    worst = 0.0
    for extra in cases:
        ref = type(model).forward(clone, labels=labels, **extra)
        out = rp.fused_forward(clone, spec, backend, labels=labels, **extra)
        err = rel_err(out.loss, ref.loss)
        if spec.moe and extra.get("output_router_logits"):
            err = max(err, rel_err(out.aux_loss, ref.aux_loss))
        if err > TOL:
            what = ", ".join(f"{k}" for k in extra) or "mean loss"
            raise Mismatch(f"fused loss differs from the model's forward by {err:.1e} ({what})")
        worst = max(worst, err)
    return worst
