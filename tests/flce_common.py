"""What the Triton FLCE test files share: the plan's sizes fixed through its environment
variables (16-token chunks by default, so that tiny shapes run several chunks), the two memory
modes as a fixture, and the OpSpec's inputs. A test file imports the fixtures it uses
(small_chunks is autouse there)."""

import pytest
import torch

from lmkernels.backends.triton import flce_kernels as kernels
from lmkernels.ops.flce import SPEC

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fix_sizes(monkeypatch, chunk_tokens: int | None, blocks: tuple[int, int] | None) -> None:
    """Fix the plan's sizes through its environment variables (None: the plan's own rule)."""
    if chunk_tokens is None:
        monkeypatch.delenv(kernels.CHUNK_ENV, raising=False)
    else:
        monkeypatch.setenv(kernels.CHUNK_ENV, str(chunk_tokens))
    if blocks is None:
        monkeypatch.delenv(kernels.BLOCKS_ENV, raising=False)
    else:
        monkeypatch.setenv(kernels.BLOCKS_ENV, f"{blocks[0]},{blocks[1]}")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """16 tokens per chunk unless a test says otherwise: BT=37 runs 16 + 16 + 5; the blocked
    backward runs super-chunks of 16 tokens (all tokens when grad_W is rounded once) and
    vocabulary blocks of 48 columns: V=131 runs 48 + 48 + 35."""
    fix_sizes(monkeypatch, 16, (16, 48))


BACKENDS = {"lean": "triton_lean", "fast": "triton"}
BACKEND = {"name": "triton_lean"}  # what triton_fn runs; the `mode` fixture switches it


@pytest.fixture(params=list(BACKENDS))
def mode(request, monkeypatch):
    """Both memory modes (lean: logsumexp-only forward, blocked backward; fast: gradients in
    the forward for mean/sum)."""
    monkeypatch.setitem(BACKEND, "name", BACKENDS[request.param])
    return request.param


def make(shape, dtype, case, seed=0):
    """Inputs for one OpSpec case; shape may give hidden_shape for a 3-D hidden."""
    dims = {k: shape[k] for k in ("BT", "H", "V")}
    inputs = SPEC.make_inputs(dims, dtype, DEVICE, seed, **case)
    if "hidden_shape" in shape:
        inputs["hidden"] = inputs["hidden"].reshape(*shape["hidden_shape"], shape["H"])
        inputs["target"] = inputs["target"].reshape(shape["hidden_shape"])
    return inputs
