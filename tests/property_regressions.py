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
    # One token's hidden gradient through V = 65537 classes, 2 elements: eager's fp32 rounding
    # error drew 1.7e-7 while the same GEMM (dlogits @ W, a 65k-long fp32 sum) has 1e-6 to 6e-6
    # under other upstream gradients, and the kernel's 4.3e-6 failed 4x eager + floor. The
    # policy now takes eager's error level over resampled backwards (properties.check_sample).
    Case(
        op="fused_linear_distillation",
        backend="triton",
        shape={"BT": 1, "Hs": 2, "Ht": 2, "V": 65537},
        options={
            "divergence": "jsd",
            "beta": 0.5,
            "temperature": 2.0,
            "reduction": "mean",
            "soft_weight": 1.0,
            "hard_weight": 0.0,
            "ignore_index": -100,
            "ignore_fraction": 0.0,
            "with_target": False,
            "with_bias": False,
        },
        dtype="fp32",
        layouts={},
        seed=1,
    ),
    # The same for 4 bf16 elements (2 tokens, H = 2, one row expanded): eager drew 8e-4, its
    # level over resampled backwards is 2.5e-3 (one bf16 rounding), compile's 4.1e-3 failed.
    Case(
        op="fused_linear_cross_entropy",
        backend="compile",
        shape={"BT": 2, "H": 2, "V": 65537},
        options={
            "reduction": "mean",
            "label_smoothing": 1.0,
            "softcap": 1.5,
            "z_loss_scale": 0.0,
            "ignore_index": 0,
            "ignore_fraction": 0.5,
            "with_bias": False,
            "with_class_weight": False,
            "return_lse": True,
            "return_stats": False,
            "entropy_grad": False,
            "temperature": 1.0,
            "memory_budget": 0.01,
            "lean": False,
            "regime": "zipf",
        },
        dtype="bf16",
        layouts={"hidden": "expanded", "target": "expanded", "weight": "contiguous"},
        seed=466,
    ),
    # One token of bf16 FLCE through one hidden feature and 7 classes: grad_hidden is a single
    # element, a sum of 7 terms that cancels to a few of its ulps. triton_lean was off by 0.0068
    # relative where eager's draws stayed under 0.0019; with a softcap, 0.0078 against 0.0022.
    # Few-element gradients are judged by levels over resampled runs (the impl's median, eager's
    # largest), and at least the dtype's eps is allowed.
    Case(
        op="fused_linear_cross_entropy",
        backend="triton_lean",
        shape={"BT": 1, "H": 1, "V": 7},
        options={
            "reduction": "mean",
            "label_smoothing": 0.0,
            "softcap": None,
            "z_loss_scale": 0.0,
            "ignore_index": -100,
            "ignore_fraction": 0.0,
            "with_bias": False,
            "with_class_weight": False,
            "return_lse": False,
            "return_stats": False,
            "entropy_grad": False,
            "temperature": 0.7,
            "memory_budget": None,
            "lean": False,
            "regime": "uniform",
        },
        dtype="bf16",
        layouts={"hidden": "contiguous", "target": "contiguous", "weight": "contiguous"},
        seed=65535,
    ),
    Case(
        op="fused_linear_cross_entropy",
        backend="triton_lean",
        shape={"BT": 1, "H": 1, "V": 7},
        options={
            "reduction": "mean",
            "label_smoothing": 0.0,
            "softcap": 30.0,
            "z_loss_scale": 0.0,
            "ignore_index": -100,
            "ignore_fraction": 0.0,
            "with_bias": False,
            "with_class_weight": False,
            "return_lse": False,
            "return_stats": False,
            "entropy_grad": False,
            "temperature": 0.7,
            "memory_budget": None,
            "lean": False,
            "regime": "uniform",
        },
        dtype="bf16",
        layouts={"hidden": "contiguous", "target": "contiguous", "weight": "contiguous"},
        seed=65535,
    ),
    # fp32 reverse KL of one token over 65537 classes: the loss is one sum over the vocabulary,
    # eager's error one lucky draw (1.3e-7) against triton's blocked sum (4.3e-6), judged by the
    # default fp32 floor (2e-6). Distillation now has FLCE's tolerances (ops._common
    # .VOCAB_TOLERANCES): the same sums over the vocabulary.
    Case(
        op="fused_linear_distillation",
        backend="triton",
        shape={"BT": 1, "Hs": 2, "Ht": 2, "V": 65537},
        options={
            "divergence": "reverse_kl",
            "beta": 0.0,
            "temperature": 1.0,
            "reduction": "mean",
            "soft_weight": 1.0,
            "hard_weight": 0.0,
            "ignore_index": -100,
            "ignore_fraction": 0.0,
            "with_target": False,
            "with_bias": False,
        },
        dtype="fp32",
        layouts={
            "student_hidden": "contiguous",
            "student_weight": "contiguous",
            "teacher_hidden": "contiguous",
            "teacher_weight": "contiguous",
        },
        seed=1,
    ),
    # One class, a softcap and a z-loss, fp32, on a GPU: the cross-entropy is 0 and the loss the
    # z-loss alone; the row kernel's fused multiply-adds took the capped logit's product
    # unrounded into lse - z_t, which missed 0 by half an ulp of the logit (loss error 3.3e-4
    # against eager's 1.5e-7). Scaled logits compile unfused
    # (test_compile_targets.test_scaled_logits_are_rounded_once_for_every_use).
    Case(
        op="fused_linear_cross_entropy",
        backend="triton",
        shape={"BT": 1, "H": 1, "V": 1},
        options={
            "reduction": "mean",
            "label_smoothing": 0.0,
            "softcap": 30.0,
            "z_loss_scale": 0.0001,
            "ignore_index": -100,
            "ignore_fraction": 0.0,
            "with_bias": False,
            "with_class_weight": False,
            "return_lse": False,
            "return_stats": False,
            "entropy_grad": False,
            "temperature": 1.0,
            "memory_budget": None,
            "lean": False,
            "regime": "gaussian",
        },
        dtype="fp32",
        layouts={"hidden": "contiguous", "target": "contiguous", "weight": "contiguous"},
        seed=0,
    ),
]
