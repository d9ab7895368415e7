"""The harness must catch broken backends: each toy below is wrong in one way and must fail."""

import pytest
import torch

import lmkernels
from lmkernels.harness.checks import check_case
from lmkernels.ops.rms_norm import rms_norm_reference
from lmkernels.registry import get_op, register, unregister
from lmkernels.utils import empty_like

SPEC = get_op("rms_norm")
SHAPE = {"M": 37, "N": 96}


def wrong_values(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
    return rms_norm_reference(x, weight, eps, offset, casting_mode) * 1.01


class _ScaledGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 1.1


def wrong_gradient(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
    return _ScaledGrad.apply(rms_norm_reference(x, weight, eps, offset, casting_mode))


def nan_output(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
    y = rms_norm_reference(x, weight, eps, offset, casting_mode).clone()
    y.view(-1)[5] = float("nan")
    return y


class _ForgetsOneElement(torch.autograd.Function):
    """Allocates its output like a kernel does and never writes the last element."""

    @staticmethod
    def forward(ctx, x, y_ref):
        out = empty_like(y_ref)
        out.view(-1)[:-1] = y_ref.reshape(-1)[:-1]
        return out

    @staticmethod
    def backward(ctx, g):
        return None, g


def unwritten_element(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
    return _ForgetsOneElement.apply(x, rms_norm_reference(x, weight, eps, offset, casting_mode))


def breaks_graph(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
    # Reading a raw pointer, as a kernel launched without a torch.library wrapper does: the
    # compiler cannot trace through it.
    assert x.data_ptr() != 0
    return rms_norm_reference(x, weight, eps, offset, casting_mode)


def modifies_input(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
    y = rms_norm_reference(x, weight, eps, offset, casting_mode)
    # .data bypasses autograd's version counter, as a kernel writing through a pointer does.
    x.data.view(-1)[0] += 1.0
    return y


TOYS = {
    "wrong_values": (wrong_values, "out: rel err"),
    "wrong_gradient": (wrong_gradient, "grad_x: rel err"),
    "nan_output": (nan_output, "out: non-finite"),
    "unwritten_element": (unwritten_element, "out: non-finite"),
    "modifies_input": (modifies_input, "input x was modified"),
}


@pytest.mark.parametrize("name", list(TOYS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_broken_backend_is_caught(name, dtype):
    fn, expected = TOYS[name]
    impl = register("rms_norm", f"toy_{name}", fn, priority=-100)
    try:
        result = check_case(SPEC, impl, SHAPE, dtype, {})
    finally:
        unregister("rms_norm", f"toy_{name}")
    assert result.status == "fail", f"{name} was not caught: {result.status} {result.reason}"
    assert expected in result.reason, result.reason


def test_graph_breaking_backend_is_caught():
    impl = register("rms_norm", "toy_breaks_graph", breaks_graph, priority=-100)
    try:
        result = check_case(SPEC, impl, SHAPE, torch.float32, {}, compile_backend="eager")
    finally:
        unregister("rms_norm", "toy_breaks_graph")
    assert result.compile_status.startswith("fail"), result.compile_status
    assert result.status == "fail"


def test_correct_backend_passes_the_same_checks():
    """The control: the same harness passes a correct impl, so the failures above are real."""
    impl = register("rms_norm", "toy_correct", rms_norm_reference, priority=-100)
    try:
        result = check_case(SPEC, impl, SHAPE, torch.bfloat16, {}, compile_backend="eager")
    finally:
        unregister("rms_norm", "toy_correct")
    assert result.status == "pass", result.reason
    assert result.compile_status == "pass"


def test_registered_toy_is_listed_and_dispatchable():
    register("rms_norm", "toy_correct", rms_norm_reference, priority=-100)
    try:
        assert "toy_correct" in lmkernels.backend_names()
        x = torch.randn(3, 8)
        torch.testing.assert_close(lmkernels.rms_norm(x, backend="toy_correct"), rms_norm_reference(x))
    finally:
        unregister("rms_norm", "toy_correct")


def test_allowed_error_never_drops_as_eagers_error_grows():
    """The ceiling is factor x eager + floor capped at the bound, and factor x eager where that
    passes the bound: continuous and non-decreasing in eager's error (an impl never fails for
    eager being slightly less accurate than in a case where it would pass)."""
    from lmkernels.harness.checks import allowed_error
    from lmkernels.registry.core import DEFAULT_TOLERANCES

    for tol in DEFAULT_TOLERANCES.values():
        errors = [tol.bound * i / 1000 for i in range(3001)]
        ceilings = [allowed_error(e, tol) for e in errors]
        assert all(b >= a for a, b in zip(ceilings, ceilings[1:]))
        assert allowed_error(0.0, tol) == tol.floor
        assert allowed_error(tol.bound / tol.factor / 2, tol) == tol.bound / 2 + tol.floor
        assert allowed_error(2 * tol.bound, tol) == 2 * tol.factor * tol.bound
        assert allowed_error(float("nan"), tol) == tol.bound


# --- FLCE's entropy: a dropped gradient term is caught ----------------------------------------------

FLCE = get_op("fused_linear_cross_entropy")
FLCE_SHAPE = {"BT": 9, "H": 8, "V": 13}


def _flce_stats(hidden, weight, target, **options):
    from lmkernels.ops.flce import fused_linear_cross_entropy_reference

    return fused_linear_cross_entropy_reference(hidden, weight, target, **options)


def entropy_detached(hidden, weight, target, **options):
    """The entropy returned without a gradient (marked non-differentiable)."""
    out = _flce_stats(hidden, weight, target, **options)
    if not options.get("return_stats"):
        return out
    loss, lse, entropy, top1 = out
    return loss, lse, entropy.detach(), top1


def entropy_term_dropped(hidden, weight, target, **options):
    """The entropy differentiable, its term of the gradient missing (zero)."""
    out = _flce_stats(hidden, weight, target, **options)
    if not options.get("return_stats"):
        return out
    loss, lse, entropy, top1 = out
    return loss, lse, entropy.detach() + 0.0 * hidden.sum(-1), top1


FLCE_TOYS = {
    "entropy_detached": (entropy_detached, "not differentiable"),
    "entropy_term_dropped": (entropy_term_dropped, "grad_hidden: rel err"),
}


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("name", list(FLCE_TOYS))
def test_missing_entropy_gradient_is_caught(name, reduction):
    """check_case (validate, test_correctness) and check_sample (the property tests, whose
    upstream gradients are drawn from the impl's own outputs) both fail a backend whose
    return_stats entropy lacks its gradient term; with entropy_grad=False (the entropy only
    logged) both pass it."""
    from lmkernels.harness.properties import Case, check_sample

    fn, expected = FLCE_TOYS[name]
    impl = register("fused_linear_cross_entropy", f"toy_{name}", fn, priority=-100)
    try:
        case = {"return_stats": True, "reduction": reduction}
        result = check_case(FLCE, impl, FLCE_SHAPE, torch.float32, case)
        assert result.status == "fail" and expected in result.reason, result.reason
        sample = Case(FLCE.name, impl.backend, FLCE_SHAPE, case, "fp32", {}, seed=3)
        prop = check_sample(FLCE, impl, sample)
        assert prop.status == "fail" and expected.split(":")[0] in prop.reason, prop.reason
        logged = {**case, "entropy_grad": False}
        assert check_case(FLCE, impl, FLCE_SHAPE, torch.float32, logged).status == "pass"
        sample.options = logged
        assert check_sample(FLCE, impl, sample).status == "pass"
    finally:
        unregister("fused_linear_cross_entropy", f"toy_{name}")


# --- few-element gradients: eager's error level is resampled, a small real error still fails ------

DISTILL = get_op("fused_linear_distillation")


class _SlightlyScaledGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * (1.0 + 1e-4)


def distill_grad_off_by_1e4(student_hidden, student_weight, teacher_hidden, teacher_weight, **options):
    from lmkernels.ops.distill import fused_linear_distillation_reference

    h = _SlightlyScaledGrad.apply(student_hidden)
    return fused_linear_distillation_reference(h, student_weight, teacher_hidden, teacher_weight, **options)


def test_few_element_gradient_off_by_1e4_is_caught():
    """One token's hidden gradient through 65537 classes (2 elements): check_sample takes eager's
    error as the largest over resampled backwards (one fp32 draw can be far below its level),
    and a gradient 1e-4 off, 20x that level, still fails; the reference itself passes."""
    from lmkernels.harness.properties import Case, check_sample

    options = {
        "divergence": "jsd",
        "beta": 0.5,
        "temperature": 2.0,
        "reduction": "mean",
        "with_target": False,
        "with_bias": False,
    }
    shape = {"BT": 1, "Hs": 2, "Ht": 2, "V": 65537}
    for name, fn, status in (
        ("toy_grad_off", distill_grad_off_by_1e4, "fail"),
        ("toy_distill_correct", DISTILL.reference, "pass"),
    ):
        impl = register(DISTILL.name, name, fn, priority=-100)
        try:
            result = check_sample(DISTILL, impl, Case(DISTILL.name, name, shape, options, "fp32", {}, seed=1))
        finally:
            unregister(DISTILL.name, name)
        assert result.status == status, result.reason
        if status == "fail":
            assert "grad_student_hidden: rel err" in result.reason, result.reason
