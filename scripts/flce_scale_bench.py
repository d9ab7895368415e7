"""The FLCE backward's in-place scaling by the upstream scalar: torch's mul_ by a 0-dim device
tensor, torch._foreach_mul_, and the Triton kernel of _flce_kernels.scale_ at a few block
sizes (time per call, and whether each equals the product taken in fp32 and rounded once).

    source scripts/gpu_env.sh; export TRITON_INTERPRET=0
    python3 scripts/flce_scale_bench.py        # one GPU, under a minute
"""

from __future__ import annotations

import torch
import triton
from triton.testing import do_bench

from lmkernels.backends.triton import _flce_kernels as kernels

# (shape, dtype): grad_W of the Llama-3.2-1B head, its grad_hidden at 8 x 1024 tokens, a bias
# gradient, grad_W of a 256k x 8192 head.
CASES = [
    ((128256, 2048), torch.bfloat16),
    ((8192, 2048), torch.bfloat16),
    ((128256,), torch.float32),
    ((256000, 8192), torch.bfloat16),
]
BLOCKS = [(2048, 4), (4096, 4), (8192, 8), (16384, 8)]  # (elements per program, warps)


def triton_scale(x, s, block, warps):
    n = x.numel()
    kernels._scale_kernel[(triton.cdiv(n, block),)](x, s, n, BLOCK=block, num_warps=warps)


def main():
    s = torch.tensor(0.37, device="cuda")
    for shape, dtype in CASES:
        x = torch.randn(shape, device="cuda").to(dtype)
        expected = (x.float() * s).to(dtype)
        runs = {
            "mul_": lambda y: y.mul_(s),
            "foreach": lambda y: torch._foreach_mul_([y], s),
            **{f"triton {b}/{w}": (lambda y, b=b, w=w: triton_scale(y, s, b, w)) for b, w in BLOCKS},
        }
        ideal_us = 2 * x.numel() * x.element_size() / 4.8e12 * 1e6
        print(f"{tuple(shape)} {str(dtype)[6:]}: one read + write at 4.8 TB/s {ideal_us:.0f} us")
        for name, fn in runs.items():
            y = x.clone()
            fn(y)
            exact = torch.equal(y, expected)
            us = do_bench(lambda fn=fn, y=y: fn(y), warmup=20, rep=200) * 1e3
            print(f"  {name:14s} {us:8.0f} us  equals fp32 product rounded once: {exact}", flush=True)


if __name__ == "__main__":
    main()
