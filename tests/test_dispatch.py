"""Backend selection: precedence, env parsing, explicit-backend errors, auto, compile safety."""

import pytest
import torch

import lmkernels
from lmkernels.ops.rms_norm import rms_norm_reference
from lmkernels.registry import (
    BackendNotSupportedError,
    UnknownBackendError,
    UnknownOpError,
    explain,
    parse_backend_spec,
    register,
    resolve,
    unregister,
)

X = torch.randn(4, 8)
W = torch.randn(8)
INPUTS = {"x": X, "weight": W}


@pytest.fixture
def toys():
    """Two extra rms_norm backends that tag their output so a test sees which one ran."""
    calls = []

    def make(name):
        def fn(**kw):
            calls.append(name)
            return rms_norm_reference(**kw)

        return fn

    register("rms_norm", "toy_a", make("toy_a"), priority=-50)
    register("rms_norm", "toy_b", make("toy_b"), priority=-60, dtypes=(torch.float32,))
    yield calls
    unregister("rms_norm", "toy_a")
    unregister("rms_norm", "toy_b")


def test_precedence_argument_over_context_over_env_over_auto(toys, monkeypatch):
    monkeypatch.setenv("LMKERNELS_BACKEND", "toy_a")
    assert resolve("rms_norm", INPUTS).backend == "toy_a"
    with lmkernels.use_backend("toy_b"):
        assert resolve("rms_norm", INPUTS).backend == "toy_b"
        assert resolve("rms_norm", INPUTS, backend="eager").backend == "eager"
    assert resolve("rms_norm", INPUTS).backend == "toy_a"
    monkeypatch.delenv("LMKERNELS_BACKEND")
    auto = resolve("rms_norm", INPUTS).backend
    assert auto == "compile"  # CPU: compile outranks eager; triton is never auto on CPU


def test_env_per_op_form_routes_as_written(toys, monkeypatch):
    monkeypatch.setenv("LMKERNELS_BACKEND", "eager,rms_norm=toy_a,flce=compile")
    assert resolve("rms_norm", INPUTS).backend == "toy_a"
    assert resolve("swiglu", {"gate": X, "up": X}).backend == "eager"
    lmkernels.rms_norm(X, W)
    assert toys == ["toy_a"]
    text = str(explain("rms_norm", INPUTS))
    assert "requested 'toy_a' by env LMKERNELS_BACKEND; runs 'toy_a'" in text


def test_use_backend_per_op_and_nesting(toys):
    with lmkernels.use_backend(rms_norm="toy_a"):
        assert resolve("rms_norm", INPUTS).backend == "toy_a"
        with lmkernels.use_backend("eager"):
            assert resolve("rms_norm", INPUTS).backend == "toy_a"  # per-op beats global
            assert resolve("swiglu", {"gate": X, "up": X}).backend == "eager"
        assert resolve("swiglu", {"gate": X, "up": X}).backend == "compile"
    lmkernels.set_backend("toy_b")
    assert resolve("rms_norm", INPUTS).backend == "toy_b"
    lmkernels.reset_backend()
    assert resolve("rms_norm", INPUTS).backend == "compile"


def test_explicit_backend_that_cannot_run_raises_with_reasons(toys):
    xb = X.to(torch.bfloat16)
    with pytest.raises(
        BackendNotSupportedError, match=r"toy_b.*requested by argument.*dtype torch.bfloat16 not supported"
    ):
        lmkernels.rms_norm(xb, backend="toy_b")
    with (
        lmkernels.use_backend("toy_b"),
        pytest.raises(BackendNotSupportedError, match="requested by use_backend"),
    ):
        lmkernels.rms_norm(xb)
    assert toys == []  # never silently fell back to another backend


def test_auto_skips_unsupported_impls(toys):
    register(
        "rms_norm", "toy_top", lambda **kw: 1 / 0, priority=1000, supports=lambda **kw: ["toy limitation"]
    )
    try:
        assert resolve("rms_norm", INPUTS).backend == "compile"
        e = explain("rms_norm", INPUTS)
        assert ("toy_top", 1000, ["toy limitation"]) in e.rows
        assert e.chosen == "compile"
    finally:
        unregister("rms_norm", "toy_top")


def test_triton_is_not_chosen_automatically_on_cpu():
    if X.device.type != "cpu":
        pytest.skip("CPU-only property")
    chosen = resolve("swiglu", {"gate": X, "up": X}).backend
    assert chosen != "triton"


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("nosuchbackend", UnknownBackendError, "unknown backend 'nosuchbackend'"),
        ("eager,nosuchop=compile", UnknownOpError, "unknown op 'nosuchop'"),
        ("eager,rope=nosuch", UnknownBackendError, "unknown backend 'nosuch'"),
        ("eager,compile", lmkernels.LMKernelsError, "more than one global backend"),
    ],
)
def test_env_var_errors_name_the_problem(spec, error, match, monkeypatch):
    with pytest.raises(error, match=match):
        parse_backend_spec(spec)
    monkeypatch.setenv("LMKERNELS_BACKEND", spec)
    with pytest.raises(error, match="LMKERNELS_BACKEND"):
        lmkernels.rms_norm(X, W)


def test_env_aliases_and_whitespace():
    assert parse_backend_spec(" triton , flce = compile,rmsnorm=eager") == {
        "*": "triton",
        "fused_linear_cross_entropy": "compile",
        "rms_norm": "eager",
    }


def test_unknown_backend_argument_and_op():
    with pytest.raises(UnknownBackendError, match="backend: unknown backend 'nope'"):
        lmkernels.rms_norm(X, W, backend="nope")
    with pytest.raises(UnknownOpError, match="unknown op 'nope'"):
        resolve("nope", INPUTS)


def test_dispatch_inside_fullgraph_compile_follows_use_backend(toys):
    """Resolution is traced by dynamo (no graph break) and guarded: changing the choice
    recompiles instead of reusing a stale backend."""
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: lmkernels.rms_norm(x, w) * 2, fullgraph=True, backend="eager")
    with lmkernels.use_backend("toy_a"):
        f(X, W)
    with lmkernels.use_backend("toy_b"):
        f(X, W)
    assert toys == ["toy_a", "toy_b"]
