"""Programmatic dependent launch (PDL, backends/triton/_common.py): where it is switched on, the
rule that keeps it correct (every kernel waits for the previous one before touching memory),
and, on a GPU that has it, that it changes no result."""

import ast
import importlib
import inspect
import os
import pkgutil
import textwrap

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import lmkernels  # noqa: E402
from lmkernels.registry import get_op  # noqa: E402

common = pytest.importorskip("lmkernels.backends.triton.common", reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = DEVICE == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability() >= (9, 0)


def _launched_name(node) -> str | None:
    """The kernel a call launches: `launch(kernel, grid, ...)` or `kernel[grid](...)`."""
    if not isinstance(node, ast.Call):
        return None
    if isinstance(node.func, ast.Name) and node.func.id == "launch" and node.args:
        first = node.args[0]
        return first.id if isinstance(first, ast.Name) else None
    if isinstance(node.func, ast.Subscript) and isinstance(node.func.value, ast.Name):
        return node.func.value.id
    return None


def _kernels():
    """Every kernel the Triton backend launches: the jit functions that its modules launch
    (`launch(kernel, grid, ...)` or `kernel[grid](...)`), found in their source."""
    import lmkernels.backends.triton as package

    out = []
    for name in sorted(m.name for m in pkgutil.iter_modules(package.__path__)):
        module = importlib.import_module(f"lmkernels.backends.triton.{name}")
        names = {_launched_name(node) for node in ast.walk(ast.parse(inspect.getsource(module)))}
        launched = {n for n in names if n is not None and hasattr(getattr(module, n, None), "fn")}
        out += [pytest.param(getattr(module, k), id=f"{name}.{k}") for k in sorted(launched)]
    return out


KERNELS = _kernels()


def test_kernels_are_found():
    assert len(KERNELS) >= 10  # 10 kernels when this was written (the norms: three kernels for both)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_waits_before_anything_else(kernel):
    """The rule PDL needs: a PDL constexpr, and pdl_enter(PDL) as the first statement (after the
    docstring), before any load or store."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
    fn = tree.body[0]
    params = [a.arg for a in fn.args.args]
    assert "PDL" in params, f"{fn.name} takes no PDL constexpr"
    body = (
        fn.body[1:]
        if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
        else fn.body
    )
    first = ast.unparse(body[0])
    assert first == "pdl_enter(PDL)", f"{fn.name} starts with {first!r}, not pdl_enter(PDL)"


def test_pdl_only_on_hopper_cuda_devices():
    assert common.pdl(torch.zeros(1)) == {"PDL": False}  # no launch_pdl keyword: old Triton rejects it
    if DEVICE == "cuda":
        on = common.pdl(torch.zeros(1, device=DEVICE))
        assert on["PDL"] == (HOPPER and not common.interpreting() and torch.version.hip is None)
        assert on.get("launch_pdl", False) == on["PDL"]


# --- on the GPU ---------------------------------------------------------------------------------

# Per op, the shapes its Triton kernels run at here: GPU-sized where listed, else (an op added
# later) its OpSpec's quick shapes.
_SIZED = {
    "rms_norm": [{"M": 3000, "N": 4096}, {"M": 1000, "N": 12285}],
    "layer_norm": [{"M": 3000, "N": 4096}, {"M": 1000, "N": 12285}],
    "rope": [{"B": 2, "Hq": 8, "Hkv": 2, "T": 1024, "D": 128}],
    "swiglu": [{"M": 1024, "N": 4096}],
    "geglu": [{"M": 1024, "N": 4096}],
    "fused_linear_cross_entropy": [{"BT": 1024, "H": 256, "V": 5000}],
    "fused_linear_distillation": [{"BT": 1024, "Hs": 256, "Ht": 384, "V": 5000}],
}
SHAPES = {spec.name: _SIZED.get(spec.name, spec.shapes["quick"]) for spec in lmkernels.ops()}


def _fwd_bwd(op, shape):
    spec = get_op(op)
    inputs = spec.make_inputs(shape, torch.bfloat16, DEVICE, 0)
    wrt = [inputs[n].requires_grad_() for n in spec.grad_inputs if isinstance(inputs.get(n), torch.Tensor)]
    out = getattr(lmkernels, op)(**inputs, backend="triton")
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    grads_out = [torch.randn(o.shape, generator=g, device=DEVICE, dtype=o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, wrt, grads_out)
    return [o.detach() for o in outs] + list(grads)


@pytest.mark.skipif(not HOPPER, reason="PDL needs an NVIDIA GPU of sm_90 or later")
@pytest.mark.parametrize("op", list(SHAPES))
def test_pdl_changes_no_result(monkeypatch, op):
    """Every output and gradient bit for bit the same with and without PDL."""
    for shape in SHAPES[op]:
        with_pdl = _fwd_bwd(op, shape)
        monkeypatch.setattr(common, "USE_PDL", False)
        without = _fwd_bwd(op, shape)
        monkeypatch.setattr(common, "USE_PDL", True)
        for a, b in zip(with_pdl, without, strict=True):
            assert torch.equal(a, b), f"{op} {shape}: PDL changed a result"


@pytest.mark.skipif(not HOPPER, reason="PDL needs an NVIDIA GPU of sm_90 or later")
def test_pdl_chain_reads_every_previous_write(monkeypatch):
    """Long chains of dependent kernels, ours and torch's alternating, no sync in between: each
    kernel must see the previous one's output in full (a kernel that read before its wait would
    see a stale or half-written tensor)."""

    def chain():
        g = torch.Generator(device=DEVICE).manual_seed(0)
        x = torch.randn(4096, 2048, generator=g, device=DEVICE, dtype=torch.bfloat16)
        w = torch.rand(2048, generator=g, device=DEVICE, dtype=torch.bfloat16) + 0.5
        cos = torch.randn(1, 4096, 64, generator=g, device=DEVICE, dtype=torch.bfloat16)
        sin = torch.randn(1, 4096, 64, generator=g, device=DEVICE, dtype=torch.bfloat16)
        for i in range(40):
            x = lmkernels.rms_norm(x, w, backend="triton")
            x.mul_(1.0 + i / 64)  # torch's kernel between two of ours
            q = x.view(1, 4096, 32, 64).transpose(1, 2)
            q, _ = lmkernels.rope(q, q, cos, sin, backend="triton")
            x = lmkernels.swiglu(q.transpose(1, 2).reshape(4096, 2048), x, backend="triton")
        return x

    with_pdl = chain()
    monkeypatch.setattr(common, "USE_PDL", False)
    assert torch.equal(with_pdl, chain())
