"""The bench package's tests run like the library's (tests/conftest.py): without a GPU the Triton
kernels run on the CPU interpreter, switched on before triton (or lmkernels) is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("LMKERNELS_BACKEND", None)  # tests decide backends explicitly

import pytest  # noqa: E402

# The compile backend must really compile in tests: past dynamo's recompile limit it would
# otherwise run the function eagerly without a word.
torch._dynamo.config.fail_on_recompile_limit_hit = True


def pytest_collection_modifyitems(config, items):
    """A test marked `triton` skips, with the reason, where the Triton kernels cannot run here
    (as in tests/conftest.py)."""
    from lmkernels.backends.triton import triton_unavailable_reason

    reason = triton_unavailable_reason()
    for item in items:
        if reason is not None and item.get_closest_marker("triton"):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _reset_backend_choice():
    import lmkernels

    lmkernels.reset_backend()
    yield
    lmkernels.reset_backend()
