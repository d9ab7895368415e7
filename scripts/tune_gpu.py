"""GPU tuning probes (kernel times via torch.profiler, see profile_ops.py); prints a compact log.

Usage: python scripts/tune_gpu.py [probe ...]  probes: host, flce
"""

import cProfile
import io
import pstats
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_ops import SHAPES, kernel_times, make_step  # noqa: E402

from lmkernels.registry.core import get_impl, get_op  # noqa: E402


def prepared(op, backend, shape=None, **options):
    spec, impl = get_op(op), get_impl(op, backend)
    inputs = spec.make_inputs(shape or SHAPES[op], torch.bfloat16, "cuda", 0, **options)
    names = [n for n in spec.grad_inputs if isinstance(inputs.get(n), torch.Tensor)]
    for n in names:
        inputs[n].requires_grad_(True)
    out = impl.fn(**inputs)
    grads = [torch.randn_like(o) for o in (out if isinstance(out, tuple) else (out,))]
    return make_step(impl, inputs, names, grads)


def probe_host():
    """Host time per fwd+bwd call (GPU kept busy is irrelevant: we time the Python side)."""
    for op in ("rms_norm", "rope", "swiglu", "layer_norm"):
        for backend in ("triton", "liger", "compile"):
            step = prepared(op, backend)
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(50):
                step()
            host = (time.perf_counter() - t) / 50 * 1e3
            torch.cuda.synchronize()
            print(f"host {op:10s} {backend:8s} {host:.3f} ms/iter (launch-side)")
    step = prepared("rope", "triton")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        step()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    print(s.getvalue()[-3500:])


def probe_flce():
    import lmkernels.backends.triton.flce as fl

    for chunk in (1024, 2048, 4096):
        for accum in (None, torch.bfloat16):
            fl.CHUNK_TOKENS = chunk
            step = prepared("fused_linear_cross_entropy", "triton", grad_accum_dtype=accum)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            ms = sum(kernel_times(step, iters=3).values())
            print(f"flce chunk {chunk} accum {accum}: {ms:.2f} ms kernels, peak {peak:.0f} MiB")
    fl.CHUNK_TOKENS = None


if __name__ == "__main__":
    for name in sys.argv[1:] or ["host", "flce"]:
        globals()[f"probe_{name}"]()
