"""The FLCE backward's in-place scaling by the upstream scalar: torch's mul_ by a 0-dim device
tensor, torch._foreach_mul_, and the Triton kernel of _flce_kernels.scale_ at a few block
sizes (time per call, and whether each equals the product taken in fp32 and rounded once).
Then scale_ itself with an upstream scalar of 0.37 and of exactly 1 (which it skips), and the
fast-mode FLCE forward + backward at the Llama-3.2-1B head with those two upstream gradients.

    source scripts/gpu_env.sh; export TRITON_INTERPRET=0
    python3 scripts/flce_scale_bench.py        # one GPU, under a minute
"""

from __future__ import annotations

import torch
import triton
from triton.testing import do_bench

import lmkernels
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
    upstream_one_vs_other()


def upstream_one_vs_other():
    """scale_ and the fast FLCE's fwd + bwd with the upstream gradient 0.37 and exactly 1."""
    print("scale_ (the library's call), us per call:")
    for shape, dtype in CASES:
        x = torch.randn(shape, device="cuda").to(dtype)
        times = {}
        for value in (0.37, 1.0):
            s = torch.tensor(value, device="cuda")
            times[value] = do_bench(lambda s=s, x=x: kernels.scale_(x, s), warmup=20, rep=200) * 1e3
        print(
            f"  {tuple(shape)} {str(dtype)[6:]}: upstream 0.37 {times[0.37]:6.0f}, upstream 1 {times[1.0]:6.0f}"
        )
    BT, H, V = 8192, 2048, 128256
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(BT, H, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(V, H, device="cuda", generator=g) * H**-0.5).bfloat16().requires_grad_()
    target = torch.randint(0, V, (BT,), device="cuda", generator=g)
    print(f"fast FLCE fwd + bwd, {BT} x {H} x {V} bf16, ms (do_bench median; the two upstream")
    print("gradients take turns, 6 rounds, so that clock drift falls on both):")
    upstreams = {value: torch.tensor(value, device="cuda") for value in (0.37, 1.0)}

    def step(upstream):
        loss = lmkernels.fused_linear_cross_entropy(hidden, weight, target, backend="triton")
        torch.autograd.grad(loss, (hidden, weight), upstream)

    times = {value: [] for value in upstreams}
    for _ in range(6):
        for value, upstream in upstreams.items():
            ms = do_bench(lambda upstream=upstream: step(upstream), warmup=5, rep=150, return_mode="median")
            times[value].append(ms)
    for value, runs in times.items():
        median = sorted(runs)[len(runs) // 2]
        print(
            f"  upstream {value}: median {median:.3f}, rounds " + " ".join(f"{t:.3f}" for t in runs),
            flush=True,
        )


if __name__ == "__main__":
    main()
