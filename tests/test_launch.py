"""The launch cache (backends/triton/common.py): its key separates every launch that Triton
would compile differently, it hands the launcher the arguments in Triton's order, and it steps
aside where it cannot follow; on a GPU, the library's own launches all go through it and give
the same results as Triton's path, misaligned views included."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton", reason="needs triton")
import triton.language as tl  # noqa: E402

import lmkernels  # noqa: E402
from lmkernels.backends.triton import common  # noqa: E402
from lmkernels.backends.triton.common import pdl_enter  # noqa: E402
from lmkernels.registry import LMKernelsError  # noqa: E402

GPU = torch.cuda.is_available() and torch.version.hip is None and not common.interpreting()


def _key_spec(*args, **kwargs):
    return common.launch_key(args, kwargs)[1:]


def test_key_separates_constexprs_passed_by_position():
    """Positions 3 and 4 are constexprs: keyed by value, the others by specialization."""
    key = lambda *args: common.launch_key(args, {}, (3, 4))  # noqa: E731
    assert key(2, 3, 4, 5) != key(2, 3, 4, 6)
    assert key(2, 3, 4, 5) == key(18, 3, 4, 5)  # position 0: not divisible by 16 either way
    assert key(2, 3, 4, 5, True) != key(2, 3, 4, 5, 1)


def test_key_separates_what_triton_specializes():
    buf = torch.zeros(64, dtype=torch.bfloat16)
    aligned, shifted = buf[:32], buf[1:33]  # 2-byte offset: not 16-byte aligned
    assert _key_spec(aligned) == _key_spec(buf[8:40])  # 16 bytes further: aligned too
    assert _key_spec(aligned) != _key_spec(shifted)
    assert _key_spec(aligned) != _key_spec(aligned.float())
    ints = [1, 2, 16, 17, 32, -16, 2**31 - 16, 2**31, 2**32, 2**63 - 16, 2**63, 2**64 - 16]
    classes = {v: _key_spec(v) for v in ints}
    assert classes[16] == classes[32] == classes[-16] == classes[2**31 - 16] != classes[17]
    assert classes[1] not in (classes[2], classes[17], classes[16])
    assert classes[2] == classes[17]  # i32, not divisible by 16: one specialization
    assert classes[2**32] == classes[2**63 - 16] != classes[2**31 - 16]  # i64 against i32
    assert classes[2**31] == classes[2**32]  # both i64 and divisible by 16
    assert classes[2**64 - 16] != classes[2**63 - 16]  # u64 against i64
    assert _key_spec(1.0) != _key_spec(1)
    assert _key_spec(True) != _key_spec(1)
    assert _key_spec(None) != _key_spec(0)


def _triton_specialization():
    """Triton's own specialization of one argument (what its binder computes per launch), from
    the installed Triton with its NVIDIA backend; None where that is not importable."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend

        def specialize(arg):
            return native_specialize_impl(CUDABackend, arg, False, True, True)

        specialize(16)  # the call as Triton 3.6-3.9's binder makes it
    except Exception:  # another Triton: its internals differ
        return None
    return specialize


def test_same_key_means_same_triton_specialization():
    """Soundness against the installed Triton: two arguments the key cannot tell apart get the
    same specialization from Triton (else a cached launch could run code compiled for the other
    one), and the key tells apart no more than Triton does for these values."""
    specialize = _triton_specialization()
    if specialize is None:
        pytest.skip("this Triton has no native_specialize_impl(backend, arg, ...) to compare with")
    buf = torch.zeros(64, dtype=torch.bfloat16)
    values = [0, 1, 2, 16, 17, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, -(2**31), -(2**31) - 16, 2**32,
              2**63 - 16, 2**63, 2**64 - 16, 1.0, 0.0, True, False, None,
              buf[:8], buf[1:9], buf[8:16], buf.float()[:8], buf.float()[1:9]]  # fmt: skip
    for a in values:
        for b in values:
            same_key = _key_spec(a) == _key_spec(b)
            same_triton = specialize(a) == specialize(b)
            assert same_key == same_triton, (a, b, specialize(a), specialize(b))


def test_key_keeps_keyword_names_types_and_values():
    assert _key_spec(A=1, B=2) != _key_spec(A=2, B=1)
    assert _key_spec(A=True) != _key_spec(A=1)  # equal and hash-equal in a dict, not to Triton
    assert _key_spec(A=1.0) != _key_spec(A=1)
    assert _key_spec(A=1, num_warps=4) != _key_spec(A=1, num_warps=8)
    assert _key_spec(B=1) != _key_spec(A=1)


def test_key_leaves_other_argument_types_to_triton():
    class Sub(torch.Tensor):
        pass

    assert _key_spec(torch.zeros(2).as_subclass(Sub))[0] is None
    assert _key_spec(torch.nn.Parameter(torch.zeros(2)))[0] is not None
    assert _key_spec("text")[0] is None


def _probe(x_ptr, n, scale, A: tl.constexpr, B: tl.constexpr = 7, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    tl.store(x_ptr + tl.arange(0, 4), tl.full([4], A + B, tl.float32) * scale, mask=tl.arange(0, 4) < n)


# A jit function as compiled code sees it (triton.jit gives the interpreter's under TRITON_INTERPRET).
_probe_kernel = triton.runtime.jit.JITFunction(_probe)


def _two_tensors(x_ptr, y_ptr, n):
    tl.store(y_ptr + tl.arange(0, 4), tl.load(x_ptr + tl.arange(0, 4)), mask=tl.arange(0, 4) < n)


_two_tensors_kernel = triton.runtime.jit.JITFunction(_two_tensors)


class _Recorder:
    """Stands in for a jit function (its parameters, its source) whose launches through Triton's
    path ("slow") return a compiled kernel whose launcher records the launches ("fast")."""

    def __init__(self, kernel):
        self.params = kernel.params
        self.fn = kernel.fn
        self.calls = []

    def __getitem__(self, grid):
        def slow(*args, **kwargs):
            self.calls.append(("slow", grid, args, kwargs))
            return self

        return slow

    # The compiled kernel's side (the same object: the test needs only the records).
    function = "function"
    packed_metadata = "metadata"

    @property
    def run(self):
        return lambda *args: self.calls.append(("fast", args))


@pytest.fixture
def enabled(monkeypatch):
    """The cache switched on as on a CUDA machine, device 0, no launch hooks."""
    monkeypatch.setattr(common, "_ENABLED", True)
    monkeypatch.setattr(common, "_JIT_FUNCTION", _Recorder)
    monkeypatch.setattr(common, "_current_device", lambda: 0)
    monkeypatch.setattr(common, "_hooks_set", lambda: False)
    monkeypatch.setattr(common, "_stream_getter", lambda: lambda device: f"stream{device}")


def test_launcher_gets_every_parameter_in_order(enabled):
    kernel = _Recorder(_probe_kernel)
    x = torch.zeros(4)
    common.launch(kernel, (3,), x, 4, 0.5, A=2, PDL=True)
    common.launch(kernel, (5, 2), x, 4, 0.5, A=2, PDL=True)
    (kind0, *_), (kind1, args) = kernel.calls
    assert kind0 == "slow" and kind1 == "fast"
    # grid, stream, function, metadata, launch metadata and hooks (none), then x, n, scale, A,
    # B (its default), PDL: the constexprs too, as Triton passes them.
    assert args == (5, 2, 1, "stream0", "function", "metadata", None, None, None, x, 4, 0.5, 2, 7, True)


def test_new_specialization_goes_through_triton(enabled):
    kernel = _Recorder(_probe_kernel)
    buf = torch.zeros(16)
    common.launch(kernel, (1,), buf[:4], 4, 0.5, A=2)
    common.launch(kernel, (1,), buf[1:5], 4, 0.5, A=2)  # misaligned: another key
    common.launch(kernel, (1,), buf[:4], 16, 0.5, A=2)  # n divisible by 16: another key
    common.launch(kernel, (1,), buf[:4], 4, 0.5, A=3)  # another constexpr value
    common.launch(kernel, (1,), buf[4:8], 5, 0.25, A=2)  # the first key again
    assert [c[0] for c in kernel.calls] == ["slow", "slow", "slow", "slow", "fast"]


def test_launches_the_cache_cannot_follow_stay_on_triton(enabled, monkeypatch):
    kernel = _Recorder(_probe_kernel)
    x = torch.zeros(4)
    for _ in range(2):
        common.launch(kernel, (1,), x, n=4, scale=0.5, A=2)  # non-constexprs by keyword
        common.launch(kernel, (1,), x, 4, 0.5, A=[2])  # an unhashable keyword value
        common.launch(kernel, (1,), "text", 4, 0.5, A=2)  # an argument type the key lacks
    assert [c[0] for c in kernel.calls] == ["slow"] * 6
    monkeypatch.setattr(common, "_hooks_set", lambda: True)  # a profiler's launch hook
    common.launch(kernel, (1,), x, 4, 0.5, A=2)
    common.launch(kernel, (1,), x, 4, 0.5, A=2)
    assert [c[0] for c in kernel.calls[6:]] == ["slow", "slow"]


def test_constexprs_by_position_are_keyed_by_value(enabled):
    kernel = _Recorder(_probe_kernel)
    x = torch.zeros(4)
    common.launch(kernel, (1,), x, 4, 0.5, 2)
    common.launch(kernel, (1,), x, 4, 0.5, 3)  # another value: Triton compiles it apart
    common.launch(kernel, (1,), x, 4, 0.5, 2.0)  # equal, of another type: apart too
    common.launch(kernel, (1,), x, 4, 0.5, 2, 9)
    common.launch(kernel, (1,), x, 4, 0.5, 3)
    common.launch(kernel, (1,), x, 4, 0.5, 2, 9)
    assert [c[0] for c in kernel.calls] == ["slow", "slow", "slow", "slow", "fast", "fast"]
    # The positional constexprs go through in place, the remaining one (PDL) from its default.
    assert kernel.calls[-1][1][9:] == (x, 4, 0.5, 2, 9, False)


def _freed(n=4, offset=0, device="cpu"):
    """A tensor with elements whose storage was resized to 0 (as FSDP2 frees an unsharded
    parameter between its uses): its data_ptr() is its offset from 0, torch does not raise."""
    t = torch.zeros(n + offset, device=device)[offset:]
    t.untyped_storage().resize_(0)
    return t


def test_no_launch_with_a_freed_tensor(enabled):
    """A tensor argument without memory never reaches a kernel, first launch or cached: the
    kernel would access address 0 (an illegal memory access on a GPU, ending the process's CUDA
    context). The error names the kernel and the argument."""
    kernel = _Recorder(_probe_kernel)
    x = torch.zeros(4)
    common.launch(kernel, (1,), x, 4, 0.5, A=2)
    common.launch(kernel, (1,), x, 4, 0.5, A=2)
    for freed in (_freed(), _freed(), _freed(offset=2)):  # a view of a freed storage too
        with pytest.raises(
            LMKernelsError, match=r"_probe: tensor argument 0 \(shape \(4,\), torch.float32\) has no"
        ):
            common.launch(kernel, (1,), freed, 4, 0.5, A=2)
    two = _Recorder(_two_tensors_kernel)  # not the first argument; then past a key the cache lacks
    with pytest.raises(LMKernelsError, match="tensor argument 1 "):
        common.launch(two, (1,), x, _freed(), 4)
    with pytest.raises(LMKernelsError, match="tensor argument 1 "):
        common.launch(two, (1,), "text", _freed(), 4)
    assert [c[0] for c in kernel.calls] == ["slow", "fast"] and two.calls == []
    empty = torch.zeros(0)  # no elements: nothing to read, a null pointer is fine
    common.launch(kernel, (1,), empty, 0, 0.5, A=2)


def test_triton_ops_refuse_freed_tensors_forward_and_backward(triton_device):
    """Through the library, on the path this machine takes (the GPU, else the interpreter): a
    freed weight in the forward, and a weight freed between the forward and the backward (what
    torch reports as "data is not allocated yet" for its own ops)."""
    x = torch.randn(4, 64, device=triton_device, requires_grad=True)
    with pytest.raises(LMKernelsError, match="no allocated memory"):
        lmkernels.rms_norm(x, _freed(64, device=triton_device), backend="triton")
    w = torch.ones(64, device=triton_device, requires_grad=True)
    y = lmkernels.rms_norm(x, w, backend="triton")
    w.untyped_storage().resize_(0)
    with pytest.raises(LMKernelsError, match="no allocated memory"):
        y.sum().backward()


def test_other_kernel_objects_stay_on_triton(enabled):
    """Wrappers of jit functions (an autotuner, a test's stand-in) launch through their own
    __getitem__, every time."""
    kernel = _Recorder(_probe_kernel)
    wrapper = type("Wrapper", (), {"__getitem__": lambda self, grid: kernel[grid]})()
    x = torch.zeros(4)
    for _ in range(2):
        common.launch(wrapper, (1,), x, 4, 0.5, A=2)
    assert [c[0] for c in kernel.calls] == ["slow", "slow"]


def test_cache_off_without_compiled_kernels():
    """Under the interpreter (CI) and without CUDA the cache never switches on."""
    if common.interpreting() or not torch.cuda.is_available():
        assert not common._enabled()


def test_hooks_read_as_set_only_when_they_are():
    assert not common._hook_set(None)
    chain = type("Chain", (), {"calls": []})()
    assert not common._hook_set(chain)
    chain.calls.append(print)
    assert common._hook_set(chain)
    assert common._hook_set(print)


# --- on the GPU ---------------------------------------------------------------------------------


@pytest.mark.skipif(not GPU, reason="the cache runs on NVIDIA GPUs with compiled kernels")
def test_library_launches_all_use_the_cache():
    """After a forward and backward of every op, each kernel that launched has cache entries,
    and none of them is one the cache could not follow (its launches would all pay Triton's
    binding)."""
    import test_pdl

    assert common._enabled()
    for op, shapes in test_pdl.SHAPES.items():
        for shape in shapes:
            for _ in range(2):
                test_pdl._fwd_bwd(op, shape)
    launched = 0
    for param in test_pdl.KERNELS:
        cache = param.values[0].__dict__.get("_lmk_launches", ({}, ()))[0]
        launched += bool(cache)
        assert all(e is not common._NOT_CACHED for e in cache.values()), param.id
    assert launched >= 8


@pytest.mark.skipif(not GPU, reason="the cache runs on NVIDIA GPUs with compiled kernels")
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "swiglu"])
def test_cached_launches_match_triton_path_on_misaligned_views(monkeypatch, op):
    """Aligned inputs, then views 2 bytes off (a specialization Triton compiles apart), then
    aligned again: bit for bit what Triton's own path gives for each."""
    g = torch.Generator(device="cuda").manual_seed(0)
    buf = torch.randn(4097 * 512, generator=g, device="cuda", dtype=torch.bfloat16)
    other = torch.randn(4097 * 512, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(512, generator=g, device="cuda", dtype=torch.bfloat16) + 0.5

    def run(offset):
        x = buf[offset : offset + 4096 * 512].view(4096, 512)
        if op == "swiglu":
            return lmkernels.swiglu(x, other[offset : offset + 4096 * 512].view(4096, 512), backend="triton")
        return getattr(lmkernels, op)(x, w, backend="triton")

    cached = [run(o) for o in (0, 1, 0, 1)]
    monkeypatch.setattr(common, "_ENABLED", False)
    triton_path = [run(o) for o in (0, 1)]
    for i, out in enumerate(cached):
        assert torch.equal(out, triton_path[i % 2]), f"{op}: call {i} differs from Triton's path"
