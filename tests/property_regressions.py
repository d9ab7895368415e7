"""Cases the property-based tests (test_properties.py) found failing, kept as regression cases:
each one is replayed by test_properties.test_regressions. Add a failing Case exactly as the test
printed it, with a comment naming what was wrong."""

from lmkernels.harness.properties import Case

REGRESSIONS: list[Case] = [
    # fp16 FLCE over an empty batch with reduction="none": the backward's fp16 gradient scaling
    # took the max of an empty tensor and raised.
    Case(
        op="fused_linear_cross_entropy",
        backend="triton",
        shape={"BT": 0, "H": 8, "V": 65537},
        options={
            "reduction": "none",
            "label_smoothing": 0.0,
            "softcap": None,
            "z_loss_scale": 0.0,
            "ignore_index": -100,
            "ignore_fraction": 0.0,
            "with_bias": False,
            "with_class_weight": False,
            "return_lse": False,
            "return_stats": False,
            "memory_budget": None,
            "lean": False,
            "regime": "gaussian",
        },
        dtype="fp16",
        layouts={},
    ),
    # One class with a z-loss (its gradient 2 s z alone, z = h . w cancelling over H terms): in
    # fp32 eager's own error sat just under the bound (7.8e-5 of 1e-4) and every backend's at
    # 1.1-2.2x eager's failed the bound, while an eager error just over it would have allowed
    # 4x: the ceiling now never drops as eager's error grows (checks.allowed_error).
    Case(
        op="fused_linear_cross_entropy",
        backend="compile",
        shape={"BT": 5, "H": 8, "V": 1},
        options={
            "reduction": "mean",
            "label_smoothing": 0.0,
            "softcap": None,
            "z_loss_scale": 1e-4,
            "ignore_index": -100,
            "ignore_fraction": 0.0,
            "with_bias": False,
            "with_class_weight": False,
            "return_lse": False,
            "return_stats": False,
            "memory_budget": None,
            "lean": False,
            "regime": "gaussian",
        },
        dtype="fp32",
        layouts={},
        seed=0,
    ),
    Case(
        op="fused_linear_cross_entropy",
        backend="triton",
        shape={"BT": 5, "H": 8, "V": 1},
        options={
            "reduction": "mean",
            "label_smoothing": 0.0,
            "softcap": None,
            "z_loss_scale": 1e-4,
            "ignore_index": -100,
            "ignore_fraction": 0.0,
            "with_bias": False,
            "with_class_weight": False,
            "return_lse": False,
            "return_stats": False,
            "memory_budget": None,
            "lean": False,
            "regime": "gaussian",
        },
        dtype="fp32",
        layouts={},
        seed=0,
    ),
    Case(
        op="fused_linear_cross_entropy",
        backend="triton_lean",
        shape={"BT": 37, "H": 64, "V": 1},
        options={
            "reduction": "mean",
            "label_smoothing": 0.0,
            "softcap": None,
            "z_loss_scale": 1e-4,
            "ignore_index": -100,
            "ignore_fraction": 0.0,
            "with_bias": False,
            "with_class_weight": False,
            "return_lse": False,
            "return_stats": False,
            "memory_budget": None,
            "lean": False,
            "regime": "gaussian",
        },
        dtype="fp32",
        layouts={},
        seed=1,
    ),
]
