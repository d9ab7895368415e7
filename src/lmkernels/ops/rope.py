"""Rotary position embedding applied to q and k.

q: (B, Hq, T, D), k: (B, Hkv, T, D), Hq a multiple of Hkv (GQA) or not; both rotated in one call.
cos, sin: (T, R) or (B, T, R) with R = rotary_dim (default D), the full-width tables that
transformers builds (neox: [f, f] halves; interleaved: each frequency repeated twice). With
position_ids (B, T), cos and sin are tables (P, R) looked up at those positions.
Only the first R dims of each head rotate; dims R..D pass through unchanged.

out[..., :R] = x[..., :R] * cos + rotate(x[..., :R]) * sin, where rotate pairs dim j with
j + R/2 (layout "neox": rotate_half) or 2i with 2i+1 (layout "interleaved", GPT-J style):
rotate(x) = [-x2, x1]. Computed in fp32, rounded once to q's dtype. Gradients: q and k.
"""

from __future__ import annotations

import math

import torch

from lmkernels.ops._common import generator, op_function, randn
from lmkernels.registry.core import OpSpec, register_op
from lmkernels.utils import check_choice, check_same_device, check_tensor, fail

LAYOUTS = ("neox", "interleaved")


def rotate(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "neox":
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rope_reference(q, k, cos, sin, position_ids=None, layout="neox", rotary_dim=None):
    rdim = q.shape[-1] if rotary_dim is None else rotary_dim
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    cos, sin = cos.float(), sin.float()
    if cos.dim() == 3:  # (B, T, R) -> (B, 1, T, R), broadcast over heads
        cos, sin = cos[:, None], sin[:, None]

    def apply(x):
        x32 = x.float()
        xr, rest = x32[..., :rdim], x32[..., rdim:]
        return torch.cat((xr * cos + rotate(xr, layout) * sin, rest), dim=-1).to(x.dtype)

    return apply(q), apply(k)


def check_inputs(q, k, cos, sin, position_ids=None, layout="neox", rotary_dim=None):
    check_tensor("q", q, ndim=4)
    check_tensor("k", k, ndim=4)
    B, Hq, T, D = q.shape
    if k.shape[0] != B or k.shape[2:] != (T, D):
        fail(f"k: expected shape ({B}, Hkv, {T}, {D}) to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if k.dtype != q.dtype:
        fail(f"k: expected dtype {q.dtype} (same as q), got {k.dtype}")
    check_choice("layout", layout, LAYOUTS)
    rdim = D if rotary_dim is None else rotary_dim
    if not (isinstance(rdim, int) and 0 < rdim <= D and rdim % 2 == 0):
        fail(f"rotary_dim: expected an even int in (0, {D}], got {rotary_dim!r}")
    check_tensor("cos", cos, ndim=(2, 3))
    check_tensor("sin", sin, ndim=(2, 3))
    if cos.shape != sin.shape:
        fail(f"sin: expected the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if cos.shape[-1] != rdim:
        fail(f"cos: expected last dim {rdim} (rotary_dim), got shape {tuple(cos.shape)}")
    if position_ids is not None:
        check_tensor("position_ids", position_ids, ndim=2, dtypes=(torch.int32, torch.int64))
        if tuple(position_ids.shape) != (B, T):
            fail(f"position_ids: expected shape ({B}, {T}), got {tuple(position_ids.shape)}")
        if cos.dim() != 2:
            fail(f"cos: with position_ids, expected a (positions, {rdim}) table, got {tuple(cos.shape)}")
    elif cos.dim() == 2 and cos.shape[0] != T:
        fail(f"cos: expected shape ({T}, {rdim}) or ({B}, {T}, {rdim}), got {tuple(cos.shape)}")
    elif cos.dim() == 3 and tuple(cos.shape[:2]) != (B, T):
        fail(f"cos: expected shape ({B}, {T}, {rdim}), got {tuple(cos.shape)}")
    check_same_device(q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)


def rope_tables(positions: torch.Tensor, rdim: int, layout: str, base: float = 10000.0):
    """cos/sin tables (len(positions), rdim) in the layout's full-width form, fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rdim, 2, dtype=torch.float64) / rdim))
    angles = positions.double()[:, None] * inv_freq[None]
    if layout == "neox":
        angles = torch.cat((angles, angles), dim=-1)
    else:
        angles = angles.repeat_interleave(2, dim=-1)
    return angles.cos().float(), angles.sin().float()


def make_inputs(shape, dtype, device, seed=0, layout="neox", partial=False, positions=None, **options):
    """positions: None (cos/sin (T, R)), "batched" ((B, T, R)) or "ids" (position_ids + table)."""
    g = generator(seed)
    B, Hq, Hkv, T, D = shape["B"], shape["Hq"], shape["Hkv"], shape["T"], shape["D"]
    rdim = 2 * math.ceil(D / 4) if partial else D
    q = randn((B, Hq, T, D), dtype, device, g)
    k = randn((B, Hkv, T, D), dtype, device, g)
    out = {"q": q, "k": k, "layout": layout, "rotary_dim": rdim if partial else None, **options}
    if positions == "ids":
        table_len = T + 7
        position_ids = torch.randint(0, table_len, (B, T), generator=g)
        cos, sin = rope_tables(torch.arange(table_len), rdim, layout)
        out["position_ids"] = position_ids.to(device)
    elif positions == "batched":
        offsets = torch.randint(0, 100, (B, 1), generator=g)
        cos, sin = rope_tables((offsets + torch.arange(T)).flatten(), rdim, layout)
        cos, sin = cos.view(B, T, rdim), sin.view(B, T, rdim)
    else:
        cos, sin = rope_tables(torch.arange(T), rdim, layout)
    out["cos"], out["sin"] = cos.to(device, dtype), sin.to(device, dtype)
    return out


SPEC = register_op(
    OpSpec(
        name="rope",
        reference=rope_reference,
        make_inputs=make_inputs,
        check_inputs=check_inputs,
        grad_inputs=("q", "k"),
        shapes={
            "quick": [
                {"B": 2, "Hq": 4, "Hkv": 2, "T": 7, "D": 16},
                {"B": 1, "Hq": 3, "Hkv": 3, "T": 5, "D": 24},
            ],
            "full": [
                {"B": 2, "Hq": 4, "Hkv": 2, "T": 7, "D": 16},
                {"B": 1, "Hq": 3, "Hkv": 3, "T": 5, "D": 24},
                {"B": 2, "Hq": 32, "Hkv": 8, "T": 1023, "D": 128},
                {"B": 4, "Hq": 12, "Hkv": 12, "T": 512, "D": 64},
                {"B": 1, "Hq": 32, "Hkv": 8, "T": 8192, "D": 128},
            ],
        },
        cases=[
            {},
            {"layout": "interleaved"},
            {"partial": True},
            {"positions": "ids"},
            {"positions": "batched", "layout": "interleaved"},
        ],
        bytes_moved=lambda s, dtype: 4 * s["B"] * s["T"] * s["D"] * (s["Hq"] + s["Hkv"]) * dtype.itemsize,
        description="rotary embedding of q and k (neox/interleaved, partial, GQA, position_ids)",
    )
)


@op_function("rope")  # writes the body: check the inputs, pick the backend, call it
def rope(q, k, cos, sin, position_ids=None, layout="neox", rotary_dim=None, *, backend=None):
    """Rotate q and k; returns (q_out, k_out). See the module docstring for the semantics."""
