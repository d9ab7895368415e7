"""Backend selection: precedence, env parsing, explicit-backend errors, auto, compile safety,
per-thread/per-task state and the cached fast path."""

import asyncio
import threading

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


def test_auto_named_at_any_level_means_the_automatic_choice(toys, monkeypatch):
    """ "auto" at a level stops the precedence there: it is the automatic choice, not "ask the
    next level"."""
    auto = resolve("rms_norm", INPUTS).backend
    with lmkernels.use_backend("toy_a", rms_norm="auto"):
        assert resolve("rms_norm", INPUTS).backend == auto
    with lmkernels.use_backend("toy_a"):
        assert resolve("rms_norm", INPUTS, backend="auto").backend == auto
    monkeypatch.setenv("LMKERNELS_BACKEND", "toy_b")
    with lmkernels.use_backend("auto"):
        assert resolve("rms_norm", INPUTS).backend == auto
    monkeypatch.setenv("LMKERNELS_BACKEND", "toy_a,rms_norm=auto")
    assert resolve("rms_norm", INPUTS).backend == auto
    assert toys == []


def test_auto_says_once_which_backend_it_chose(caplog):
    from lmkernels.registry import dispatch

    dispatch._AUTO_LOGGED.clear()
    caplog.set_level("INFO", logger="lmkernels")
    x = torch.randn(5, 8)
    lmkernels.rms_norm(x, W)
    lmkernels.rms_norm(x[:2], W)
    said = [r.getMessage() for r in caplog.records if "auto chose" in r.getMessage()]
    assert said == [
        "rms_norm: auto chose backend 'compile' on cpu (set one with backend=, use_backend or LMKERNELS_BACKEND)"
    ]


def test_explicit_backend_that_cannot_run_raises_with_reasons(toys):
    xb = X.to(torch.bfloat16)
    with pytest.raises(
        BackendNotSupportedError,
        match=r"toy_b.*requested by argument.*dtype of x \(torch.bfloat16\) not supported",
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


def test_generic_dispatch_inside_fullgraph_compile(toys):
    """The harness's dispatch(op, backend, **inputs) traces too, even on its first call for a
    set of input names (the per-op function it builds is made outside the graph)."""
    from lmkernels.ops._common import dispatch

    lmkernels.impls()  # the backends load on first lookup, which dynamo cannot trace
    torch._dynamo.reset()
    f = torch.compile(
        lambda x, w: dispatch("rms_norm", "toy_a", weight=w, x=x, eps=1e-6), fullgraph=True, backend="eager"
    )
    torch.testing.assert_close(f(X, W), rms_norm_reference(X, W))
    assert dispatch("rms_norm", "toy_a", weight=W, x=X, eps=1e-6) is not None
    assert toys == ["toy_a", "toy_a"]


def _in_thread(fn):
    """Run fn in a thread; returns (thread, result list)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    return t, out


def test_use_backend_is_per_thread(toys):
    """A thread inside use_backend() never changes what another thread resolves, even while
    both are inside their blocks."""
    entered, main_inside, worker_done = threading.Event(), threading.Event(), threading.Event()

    def worker():
        with lmkernels.use_backend("toy_b"):
            entered.set()
            main_inside.wait(10)
            backend = resolve("rms_norm", INPUTS).backend
            worker_done.set()
            return backend

    t, worker_seen = _in_thread(worker)
    assert entered.wait(10)
    with lmkernels.use_backend("toy_a"):
        main_inside.set()
        assert worker_done.wait(10)
        main_seen = resolve("rms_norm", INPUTS).backend
        lmkernels.rms_norm(X, W)
    t.join(10)
    assert (main_seen, worker_seen) == ("toy_a", ["toy_b"])
    assert toys == ["toy_a"]
    lmkernels.set_backend("toy_a")  # set_backend is per thread too
    t, other = _in_thread(lambda: resolve("rms_norm", INPUTS).backend)
    t.join(10)
    assert other == ["compile"]
    assert resolve("rms_norm", INPUTS).backend == "toy_a"


def test_use_backend_is_per_asyncio_task(toys):
    async def task(name, started, peer_started):
        with lmkernels.use_backend(name):
            started.set()
            await peer_started.wait()
            await asyncio.sleep(0)  # let the peer run inside its own block first
            backend = resolve("rms_norm", INPUTS).backend
            await asyncio.sleep(0)
            return backend

    async def main():
        a, b = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(task("toy_a", a, b), task("toy_b", b, a))

    assert asyncio.run(main()) == ["toy_a", "toy_b"]


def test_compiled_graph_follows_each_threads_choice(toys):
    """Under fullgraph compile the choice is guarded per thread: while a thread runs the
    compiled function inside use_backend("toy_b"), the main thread's calls keep its own choice
    (auto, then toy_a) and recompile or reuse graphs accordingly."""
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: lmkernels.rms_norm(x, w) + 1, fullgraph=True, backend="eager")
    with lmkernels.use_backend("toy_a"):
        f(X, W)
    entered, release = threading.Event(), threading.Event()

    def worker():
        with lmkernels.use_backend("toy_b"):
            y = f(X, W)
            entered.set()
            release.wait(60)
            return y

    t, out = _in_thread(worker)
    assert entered.wait(120)
    auto = f(X, W)  # no choice in this thread: auto (compile on CPU), not the worker's toy_b
    with lmkernels.use_backend("toy_a"):
        f(X, W)
    release.set()
    t.join(60)
    assert toys == ["toy_a", "toy_b", "toy_a"]
    torch.testing.assert_close(out[0], rms_norm_reference(X, W) + 1)
    torch.testing.assert_close(auto, rms_norm_reference(X, W) + 1)


def test_fast_path_remembers_resolution_per_signature(toys, monkeypatch):
    """A repeated call skips check_inputs and resolve; anything in the key (backend choice, env,
    shapes, dtypes, requires_grad, option values) or a new registration resolves again."""
    from lmkernels.registry.fastpath import clear_cache

    spec = lmkernels.get_op("rms_norm")
    checks = []
    real_check = spec.check_inputs
    monkeypatch.setattr(spec, "check_inputs", lambda **kw: (checks.append(1), real_check(**kw)))
    clear_cache()
    for _ in range(3):
        lmkernels.rms_norm(X, W, backend="toy_a")
    assert len(checks) == 1
    lmkernels.rms_norm(X, W, backend="toy_b")
    lmkernels.rms_norm(X, W, eps=1e-5, backend="toy_b")
    lmkernels.rms_norm(X[:2], W, backend="toy_b")
    lmkernels.rms_norm(X.clone().requires_grad_(), W, backend="toy_b")
    with lmkernels.use_backend("toy_a"):
        lmkernels.rms_norm(X, W)
    monkeypatch.setenv("LMKERNELS_BACKEND", "toy_b")
    lmkernels.rms_norm(X, W)
    assert len(checks) == 7
    assert toys == ["toy_a"] * 3 + ["toy_b"] * 4 + ["toy_a", "toy_b"]
    with pytest.raises(lmkernels.LMKernelsError, match="weight: expected shape"):
        lmkernels.rms_norm(X, W[:3], backend="toy_b")  # a new shape is checked, not waved through
    register("rms_norm", "toy_a", lambda **kw: "replaced")
    assert lmkernels.rms_norm(X, W, backend="toy_a") == "replaced"


def test_fast_path_key_edge_cases(toys, monkeypatch):
    """Right after a remembered call with the same shapes, what the key cannot or must not hold
    still goes through the checks: a non-tensor (even one with a tensor's attributes), an option
    passed as a tensor (never remembered, nor kept alive), another option value. Alternating
    signatures each get their own resolution."""
    import weakref

    from lmkernels.registry.fastpath import clear_cache

    spec = lmkernels.get_op("rms_norm")
    checks = []
    real_check = spec.check_inputs
    monkeypatch.setattr(spec, "check_inputs", lambda **kw: (checks.append(1), real_check(**kw)))
    clear_cache()
    for _ in range(2):
        lmkernels.rms_norm(X, W, backend="toy_a")
        lmkernels.rms_norm(X, W, backend="toy_b")
        lmkernels.rms_norm(X[:2], W, backend="toy_a")
    assert (len(checks), toys) == (3, ["toy_a", "toy_b", "toy_a"] * 2)

    class LooksLikeX:  # every attribute the key reads, equal to X's
        shape, dtype, device, requires_grad, is_cpu = X.shape, X.dtype, X.device, False, True

    with pytest.raises(lmkernels.LMKernelsError, match="x: expected a torch.Tensor, got LooksLikeX"):
        lmkernels.rms_norm(LooksLikeX(), W, backend="toy_a")
    with pytest.raises(lmkernels.LMKernelsError, match="x: expected a torch.Tensor, got list"):
        lmkernels.rms_norm(X.tolist(), W, backend="toy_a")
    with pytest.raises(lmkernels.LMKernelsError, match="eps: expected a non-negative number"):
        lmkernels.rms_norm(X, W, eps=-1.0, backend="toy_a")
    checks.clear()
    eps = torch.tensor(1e-6)
    for _ in range(2):  # an option passed as a tensor: checked (and refused) on every call
        with pytest.raises(lmkernels.LMKernelsError, match="eps: expected a non-negative number"):
            lmkernels.rms_norm(X, W, eps=eps, backend="toy_a")
    assert len(checks) == 2
    ref = weakref.ref(eps)
    del eps
    assert ref() is None  # no cache entry keeps it alive
    lmkernels.rms_norm(X, torch.nn.Parameter(W), backend="toy_a")  # a subclass: its own entry
    assert len(checks) == 3
    checks.clear()
    monkeypatch.setattr(spec, "check_inputs", lambda **kw: checks.append(1))  # accepts the tensor
    eps = torch.tensor(1e-6)
    for _ in range(2):  # an option passed as a tensor that the checks accept: never remembered
        lmkernels.rms_norm(X, W, eps=eps, backend="toy_a")
    assert len(checks) == 2


def test_value_checks_run_on_every_call(monkeypatch):
    """FLCE's target range check reads values: it must not be cached with the signature."""
    h, w = torch.randn(6, 8), torch.randn(10, 8)
    good, bad = torch.tensor([1, 2, 3, -100, 4, 5]), torch.tensor([1, 2, 3, 99, 4, 5])
    lmkernels.fused_linear_cross_entropy(h, w, good, backend="eager")
    with pytest.raises(lmkernels.LMKernelsError, match="target: expected class indices"):
        lmkernels.fused_linear_cross_entropy(h, w, bad, backend="eager")
    monkeypatch.setenv("LMKERNELS_CHECK_VALUES", "0")  # off: a nan loss, never a read out of bounds
    assert lmkernels.fused_linear_cross_entropy(h, w, bad, backend="eager").isnan()


def test_first_op_call_inside_fullgraph_compile():
    """A fresh process whose very first op call is traced by torch.compile(fullgraph=True): the
    backends load at trace time (not traced: imports and entry points cannot be) and the graph
    has no break."""
    import subprocess
    import sys

    code = (
        "import torch, lmkernels as lk\n"
        "w = torch.randn(8)\n"
        "f = torch.compile(lambda x: lk.rms_norm(x, w, backend='eager'), fullgraph=True, backend='eager')\n"
        "x = torch.randn(4, 8)\n"
        "torch.testing.assert_close(f(x), lk.rms_norm(x, w, backend='eager'))\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_triton_call_routes_each_kind_of_argument():
    """backends/triton/_common.call: the raw launcher without a graph to record, the eager
    Function when an input needs a gradient, the custom op for tensor subclasses and under a
    dispatch mode; non-tensor options of any type are no tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lmkernels.backends.triton.common import call

    ran = []

    class Function:
        @staticmethod
        def raw_forward(*args):
            ran.append("raw")

        @staticmethod
        def apply(*args):
            ran.append("function")

    def op(*args):
        ran.append("op")

    class Sub(torch.Tensor):
        pass

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    w = torch.randn(8, requires_grad=True)
    call(op, Function, X, None, 1e-6, "llama", (1, 2))
    call(op, Function, X, w, 1e-6)
    with torch.no_grad():
        call(op, Function, X, w, 1e-6)
    call(op, Function, X, X.as_subclass(Sub), 1e-6)
    with Mode():
        call(op, Function, X, W)
    assert ran == ["raw", "function", "raw", "op", "op"]


def test_flce_options_are_defined_once():
    """FlceOptions is FLCE's one option set: the public function and the reference spell it out
    (users read them) with its names, order and defaults; the wrappers take subsets with its
    defaults; the backends read FlceOptions(**options), so an unknown option names itself."""
    import dataclasses
    import inspect

    from lmkernels.distributed.dtensor_loss import dtensor_linear_cross_entropy
    from lmkernels.distributed.vocab_parallel import vocab_parallel_cross_entropy
    from lmkernels.nn import LinearCrossEntropyLoss
    from lmkernels.ops._common import dispatch
    from lmkernels.ops.flce import FlceOptions, fused_linear_cross_entropy_reference
    from lmkernels.registry.core import impls

    fields = {f.name: f.default for f in dataclasses.fields(FlceOptions)}
    for fn in (lmkernels.fused_linear_cross_entropy, fused_linear_cross_entropy_reference):
        params = inspect.signature(fn).parameters.values()
        options = {
            p.name: p.default for p in params if p.name not in ("hidden", "weight", "target", "backend")
        }
        assert list(options.items()) == list(fields.items()), fn.__name__
    for fn in (LinearCrossEntropyLoss, dtensor_linear_cross_entropy, vocab_parallel_cross_entropy):
        shared = [p for p in inspect.signature(fn).parameters.values() if p.name in fields]
        assert shared and all(p.default == fields[p.name] for p in shared), fn.__name__
    h, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.randint(0, 5, (3,))
    with pytest.raises(TypeError, match="'label_smoothin'"):
        dispatch("fused_linear_cross_entropy", None, hidden=h, weight=w, target=t, label_smoothin=0.1)
    for impl in impls("fused_linear_cross_entropy"):
        with pytest.raises(TypeError, match="'softcapping'"):
            impl.fn(h, w, t, softcapping=30.0)


def _dynamo_guards_environment() -> bool:
    """Whether this torch's dynamo retraces a function whose os.environ read changed."""
    import os

    def probe(x):
        return x + 1 if os.environ.get("LMKERNELS_TEST_PROBE") == "a" else x - 1

    compiled = torch.compile(probe, backend="eager", fullgraph=True)
    x = torch.zeros(1)
    os.environ["LMKERNELS_TEST_PROBE"] = "a"
    try:
        first = compiled(x)
        os.environ["LMKERNELS_TEST_PROBE"] = "b"
        return not torch.equal(compiled(x), first)
    finally:
        os.environ.pop("LMKERNELS_TEST_PROBE")


def test_compiled_code_follows_the_environment_or_explain_says_it_does_not(toys, monkeypatch):
    """A function compiled with torch.compile chooses when traced. Where dynamo guards
    environment reads, a later LMKERNELS_BACKEND change retraces it (as it retraces on a
    use_backend change); elsewhere `explain` says the traced choice stays."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: lmkernels.rms_norm(x, w), backend="eager", fullgraph=True)
    monkeypatch.setenv("LMKERNELS_BACKEND", "toy_a")
    compiled(X, W)
    monkeypatch.setenv("LMKERNELS_BACKEND", "toy_b")
    compiled(X, W)
    if _dynamo_guards_environment():
        assert toys == ["toy_a", "toy_b"]
    else:
        assert "set LMKERNELS_BACKEND before compiling" in explain("rms_norm", INPUTS).note
    with lmkernels.use_backend("toy_a"):
        compiled(X, W)
    assert toys[-1] == "toy_a"
