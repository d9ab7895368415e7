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
]
