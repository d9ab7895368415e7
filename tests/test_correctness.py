"""Every registered impl x quick shape x dtype x option case, checked by the harness policy.

Parametrized from the registry: a backend registered with lmkernels.register() is tested here
with no edits. Test ids read op-backend-shape-dtype[-options], e.g. rms_norm-triton-37x96-bf16.
On a GPU machine the same tests run on CUDA with all three dtypes.
"""

import pytest
import torch

from conftest import DEVICE
from lmkernels.harness.checks import DTYPE_NAMES, case_id, check_case
from lmkernels.harness.runner import quick_combos
from lmkernels.registry.core import impls, ops

# CPU: fp32 and bf16 (fp16 matmuls and reductions on the CPU are slow and add little: the
# kernels' fp16 paths are the bf16 paths with another cast, and the GPU run covers them).
DTYPES = (
    (torch.float32, torch.bfloat16, torch.float16) if DEVICE == "cuda" else (torch.float32, torch.bfloat16)
)


def _combos(spec, impl):
    """Every shape x dtype x option case, except for the compile backend on the CPU: there each
    combination is an inductor C++ build (seconds), so it gets the quick grid of `lmkernels
    validate --quick` (every shape, dtype and option case at least once; about a quarter of
    the product), which its eager-traced code paths do not need more of."""
    if impl.backend == "compile" and DEVICE == "cpu":
        return quick_combos(spec, DTYPES)
    return [(shape, dtype, case) for dtype in DTYPES for shape in spec.shapes["quick"] for case in spec.cases]


def _cases():
    for spec in ops():
        for impl in impls(spec.name):
            for shape, dtype, case in _combos(spec, impl):
                parts = [spec.name, impl.backend, spec.shape_id(shape), DTYPE_NAMES[dtype]]
                if case:
                    parts.append(case_id(case))
                yield pytest.param(spec, impl, shape, dtype, case, id="-".join(parts))


def _first_cases():
    for spec in ops():
        for impl in impls(spec.name):
            shape = spec.shapes["quick"][0]
            yield pytest.param(
                spec, impl, shape, id=f"{spec.name}-{impl.backend}-{spec.shape_id(shape)}-fp32"
            )


def _skip_if_unavailable(impl):
    if impl.external:
        pytest.skip(
            f"{impl.backend} is another project's kernel, registered for comparison: "
            "`lmkernels validate` checks and reports it, our suite does not own it"
        )
    reason = impl.unavailable_reason()
    if reason:
        pytest.skip(f"{impl.backend} unavailable here: {reason}")


@pytest.mark.parametrize(("spec", "impl", "shape", "dtype", "case"), list(_cases()))
def test_values_and_gradients(spec, impl, shape, dtype, case):
    _skip_if_unavailable(impl)
    result = check_case(spec, impl, shape, dtype, case, device=DEVICE)
    if result.status == "unsupported":
        pytest.skip(f"{impl.backend} does not support this case: {result.reason}")
    assert result.status == "pass", result.reason


@pytest.mark.parametrize(("spec", "impl", "shape"), list(_first_cases()))
def test_fullgraph_compile(spec, impl, shape):
    """A function calling the op through the public dispatch compiles with fullgraph=True
    (aot_eager: traces forward and backward through AOTAutograd without inductor codegen,
    which is what catches graph breaks and missing fake/autograd registrations)."""
    _skip_if_unavailable(impl)
    if not impl.compile_safe:
        pytest.skip(f"{impl.backend} declares compile_safe=False")
    result = check_case(spec, impl, shape, torch.float32, {}, device=DEVICE, compile_backend="aot_eager")
    assert result.compile_status == "pass", result.compile_status
    assert result.status == "pass", result.reason
