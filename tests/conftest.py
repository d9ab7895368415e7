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
