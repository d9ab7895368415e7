"""Bad input gets an LMKernelsError that names the argument and what was expected."""

import pytest
import torch

import lmkernels
from lmkernels import LMKernelsError

H, V = 8, 11


def flce_args(**over):
    args = {"hidden": torch.randn(5, H), "weight": torch.randn(V, H), "target": torch.randint(0, V, (5,))}
    args.update(over)
    return args


BAD_CALLS = [
    # op, kwargs, expected fragment of the message
    ("rms_norm", {"x": torch.randn(4, 8), "weight": torch.randn(7)}, r"weight: expected shape \(8,\)"),
    ("rms_norm", {"x": torch.randint(0, 3, (4, 8))}, "x: expected a float32, bfloat16 or float16 tensor"),
    ("rms_norm", {"x": torch.randn(4, 8), "casting_mode": "mistral"}, "casting_mode: expected one of"),
    (
        "rms_norm",
        {"x": torch.randn(4, 8), "weight": torch.randn(8, device="meta")},
        "weight: expected device cpu",
    ),
    ("layer_norm", {"x": torch.randn(4, 8), "bias": torch.randn(9)}, r"bias: expected shape \(8,\)"),
    ("swiglu", {"gate": torch.randn(4, 8), "up": torch.randn(4, 9)}, "up: expected the same shape as gate"),
    (
        "swiglu",
        {"gate": torch.randn(4, 8), "up": torch.randn(4, 8).bfloat16()},
        "up: expected dtype torch.float32",
    ),
    (
        "geglu",
        {"gate": torch.randn(4, 8), "up": torch.randn(4, 8), "approximate": "erf"},
        "approximate: expected one of",
    ),
    (
        "rope",
        {
            "q": torch.randn(1, 2, 3, 8),
            "k": torch.randn(1, 2, 4, 8),
            "cos": torch.randn(3, 8),
            "sin": torch.randn(3, 8),
        },
        "k: expected shape",
    ),
    (
        "rope",
        {
            "q": torch.randn(1, 2, 3, 8),
            "k": torch.randn(1, 1, 3, 8),
            "cos": torch.randn(3, 6),
            "sin": torch.randn(3, 6),
        },
        "cos: expected last dim 8",
    ),
    (
        "rope",
        {
            "q": torch.randn(1, 2, 3, 8),
            "k": torch.randn(1, 1, 3, 8),
            "cos": torch.randn(3, 8),
            "sin": torch.randn(3, 8),
            "rotary_dim": 5,
        },
        "rotary_dim: expected an even int",
    ),
    (
        "rope",
        {
            "q": torch.randn(1, 2, 3, 8),
            "k": torch.randn(1, 1, 3, 8),
            "cos": torch.randn(3, 8),
            "sin": torch.randn(3, 8),
            "layout": "gptj",
        },
        "layout: expected one of",
    ),
    (
        "rope",
        {
            "q": torch.randn(1, 2, 3, 8),
            "k": torch.randn(1, 1, 3, 8),
            "cos": torch.randn(9, 8),
            "sin": torch.randn(9, 8),
            "position_ids": torch.zeros(1, 4, dtype=torch.long),
        },
        r"position_ids: expected shape \(1, 3\)",
    ),
    (
        "fused_linear_cross_entropy",
        flce_args(hidden=torch.randn(5, H + 1)),
        r"hidden: expected shape \(..., 8\)",
    ),
    (
        "fused_linear_cross_entropy",
        flce_args(target=torch.randint(0, V, (6,))),
        r"target: expected shape \(5,\)",
    ),
    ("fused_linear_cross_entropy", flce_args(target=torch.randn(5)), "target: expected dtype in"),
    (
        "fused_linear_cross_entropy",
        flce_args(weight=torch.randn(V, H).bfloat16()),
        "weight: expected dtype torch.float32",
    ),
    (
        "fused_linear_cross_entropy",
        flce_args(target=torch.tensor([0, 1, V, 2, -100])),
        rf"target: expected class indices in \[0, {V}\) or ignore_index=-100, found {V}",
    ),
    ("fused_linear_cross_entropy", flce_args(target=torch.tensor([0, 1, -3, 2, 3])), "found -3"),
    ("fused_linear_cross_entropy", flce_args(reduction="avg"), "reduction: expected one of"),
    ("fused_linear_cross_entropy", flce_args(label_smoothing=1.5), "label_smoothing: expected a number in"),
    ("fused_linear_cross_entropy", flce_args(softcap=0.0), "softcap: expected None or a positive number"),
    ("fused_linear_cross_entropy", flce_args(bias=torch.randn(V - 1)), r"bias: expected shape \(11,\)"),
    (
        "fused_linear_cross_entropy",
        flce_args(class_weight=torch.randn(3)),
        r"class_weight: expected shape \(11,\)",
    ),
    (
        "fused_linear_cross_entropy",
        flce_args(target=torch.randint(0, V, (5,), device="meta")),
        "target: expected device cpu",
    ),
]

OPS = {
    "rms_norm": lmkernels.rms_norm,
    "layer_norm": lmkernels.layer_norm,
    "swiglu": lmkernels.swiglu,
    "geglu": lmkernels.geglu,
    "rope": lmkernels.rope,
    "fused_linear_cross_entropy": lmkernels.fused_linear_cross_entropy,
}


@pytest.mark.parametrize(
    ("op", "kwargs", "match"), BAD_CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CALLS)]
)
@pytest.mark.parametrize("backend", ["eager", "compile", "triton"])
def test_bad_input_raises_naming_the_argument(op, kwargs, match, backend, triton_device):
    if backend == "triton" and triton_device == "cuda" and torch.cuda.is_available():
        # Triton runs on the GPU only here: CPU inputs would fail on their device first.
        kwargs = {
            k: v.cuda() if isinstance(v, torch.Tensor) and not v.is_meta else v for k, v in kwargs.items()
        }
        match = match.replace("expected device cpu", "expected device cuda")
    with pytest.raises(LMKernelsError, match=match):
        OPS[op](**kwargs, backend=backend)


def test_target_range_check_can_be_disabled(monkeypatch):
    monkeypatch.setenv("LMKERNELS_CHECK_VALUES", "0")
    # With checks off the reference must still not crash on an ignored-only batch.
    loss = lmkernels.fused_linear_cross_entropy(**flce_args(target=torch.full((5,), -100)), backend="eager")
    assert loss.item() == 0.0
