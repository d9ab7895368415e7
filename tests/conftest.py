"""Test configuration. Without a GPU the Triton kernels run on the CPU interpreter, which must be
switched on before triton (or lmkernels) is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests decide backends explicitly; an LMKERNELS_BACKEND left in the shell would change them.
os.environ.pop("LMKERNELS_BACKEND", None)

import pytest  # noqa: E402

# The compile backend must really compile in tests: past dynamo's recompile limit it would
# otherwise run the function eagerly without a word.
torch._dynamo.config.fail_on_recompile_limit_hit = True

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _reset_backend_choice():
    import lmkernels

    lmkernels.reset_backend()
    yield
    lmkernels.reset_backend()


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def triton_device() -> str:
    """Where the Triton impls run here: the CPU under the interpreter, else the GPU."""
    from lmkernels.backends.triton import interpreting

    return "cpu" if interpreting() else "cuda"


def pytest_collection_modifyitems(config, items):
    """A test marked `triton`, or whose name or `backend` parameter names the Triton backend,
    skips, with the reason, where the Triton kernels cannot run here (no triton, or an
    interpreter too old for them): the other backends' cases still run."""
    try:
        from lmkernels.backends.triton import triton_unavailable_reason
    except ImportError:  # lmkernels itself not importable: collection reports that
        return
    reason = triton_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        backend = params.get("backend")
        named = "triton" in item.originalname or (isinstance(backend, str) and backend.startswith("triton"))
        if named or item.get_closest_marker("triton"):
            item.add_marker(skip)
