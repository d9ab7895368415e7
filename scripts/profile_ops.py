"""GPU kernel time of one fwd+bwd per op and backend (torch.profiler), without host overhead.

do_bench measures wall time between CUDA events, which includes launch gaps when the host is
slower than the kernels; this script sums the device time of the kernels alone, and lists the
kernels, so a slow backend shows which of its kernels costs what.
Usage: python scripts/profile_ops.py [op ...] [--backends triton,compile,liger]
"""

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from lmkernels.registry.core import get_impl, get_op

SHAPES = {
    "rms_norm": {"M": 16384, "N": 4096},
    "layer_norm": {"M": 4096, "N": 16384},
    "swiglu": {"M": 8192, "N": 14336},
    "geglu": {"M": 8192, "N": 14336},
    "rope": {"B": 1, "Hq": 32, "Hkv": 8, "T": 8192, "D": 128},
    "fused_linear_cross_entropy": {"BT": 8192, "H": 4096, "V": 128256},
}


def kernel_times(fn, iters=5):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per_kernel = collections.Counter()
    for evt in prof.key_averages():
        if evt.device_type.name == "CUDA" and evt.self_device_time_total > 0:
            per_kernel[evt.key] += evt.self_device_time_total / iters / 1000.0  # ms
    return per_kernel


def make_step(impl, inputs, names, grads):
    def step():
        for n in names:
            inputs[n].grad = None
        out = impl.fn(**inputs)
        torch.autograd.backward(out if isinstance(out, tuple) else (out,), grads)

    return step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ops", nargs="*", default=list(SHAPES))
    p.add_argument("--backends", default="triton,compile,liger")
    args = p.parse_args()
    for op in args.ops:
        spec, shape = get_op(op), SHAPES[op]
        for backend in args.backends.split(","):
            try:
                impl = get_impl(op, backend)
            except Exception:
                continue
            inputs = spec.make_inputs(shape, torch.bfloat16, "cuda", 0)
            if impl.not_supported_reasons(**inputs):
                continue
            names = [n for n in spec.grad_inputs if isinstance(inputs.get(n), torch.Tensor)]
            for n in names:
                inputs[n].requires_grad_(True)
            out = impl.fn(**inputs)
            outs = out if isinstance(out, tuple) else (out,)
            grads = [torch.randn_like(o) for o in outs]

            try:
                times = kernel_times(make_step(impl, inputs, names, grads))
            except Exception as e:
                print(f"{op} {backend}: ERROR {type(e).__name__}: {str(e)[:200]}")
                continue
            total = sum(times.values())
            extra = ""
            if spec.bytes_moved:
                extra = f"  {spec.bytes_moved(shape, torch.bfloat16) / total / 1e6:6.0f} GB/s"
            print(f"== {op} {backend}: {total:.3f} ms of kernels per fwd+bwd{extra}")
            for name, ms in times.most_common(8):
                print(f"     {ms:8.3f} ms  {name[:110]}")
            del inputs, out, outs, grads
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
