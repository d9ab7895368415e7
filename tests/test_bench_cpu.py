"""CPU benchmark suite (pytest-benchmark): forward+backward of every op on tiny shapes, eager
and compile backends, through the public functions. A smoke test of the benchmark path that CI
can afford (< 60 s); the GPU numbers come from `lmkernels bench` (harness/bench/).

    pytest tests/test_bench_cpu.py              # --benchmark-disable: run each once
"""

from __future__ import annotations

import pytest
import torch

import lmkernels
from lmkernels.harness.bench import prepare_inputs

OPS = [spec.name for spec in lmkernels.ops()]
BACKENDS = ["eager", "compile"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # The CI machine has 2 shared cores: with 2 OpenMP threads a tiny matmul can take 30 ms of
    # spinning when the other core is busy. One thread gives stable timings.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _outputs(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_fwd_bwd(benchmark, op, backend):
    spec = lmkernels.get_op(op)
    shape = spec.shapes["quick"][0]
    inputs = prepare_inputs(spec, spec.make_inputs(shape, torch.float32, "cpu", 0), "cpu")
    leaves = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    public = getattr(lmkernels, op)
    benchmark.extra_info.update(op=op, backend=backend, shape=spec.shape_id(shape))

    def step():
        for t in leaves:
            t.grad = None
        outs = _outputs(public(**inputs, backend=backend))
        # A scalar loss gets 1 (loss.backward()); other outputs a fixed weighting.
        loss = sum((o.float() * (1.0 + 0.01 * torch.arange(o.numel()).view(o.shape))).sum() for o in outs)
        loss.backward()
        return outs

    step()  # compile (the compile backend) outside the timed rounds
    outs = benchmark.pedantic(step, rounds=5, iterations=1, warmup_rounds=1)
    for o in outs:
        assert torch.isfinite(o).all(), f"{op}/{backend}: non-finite output"
    for t in leaves:
        assert t.grad is not None and torch.isfinite(t.grad).all(), f"{op}/{backend}: bad gradient"
