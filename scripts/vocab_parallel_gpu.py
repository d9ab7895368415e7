"""Per-rank cost of the vocab-parallel loss on one GPU: fast vs lean mode vs the unfused lm_head.

What one rank of TP=2 computes for a Llama-3.2-1B-shape lm_head (H 2048, V 128256, so V_local
64128 rows), bf16, forward + backward, in a world of one process (NCCL): the all-reduces are
there but move nothing across GPUs, so this is the compute side only. Compared with what
transformers' plain TP model runs on each rank: the local logits in bf16, gathered (not timed
here), upcast to fp32 and cross entropy. "-torch": the elementwise passes in torch ops rather
than the FLCE row kernel. Times are CUDA-event medians, peaks are above the inputs; then loss and
gradients of every kind against "fast-torch".

    python scripts/vocab_parallel_gpu.py --out OUT [--tokens 8192,16384]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import e2e_setup as es  # noqa: E402
import lmkernels.distributed.vocab_parallel as vp  # noqa: E402
from lmkernels.distributed.vocab_parallel import vocab_parallel_cross_entropy  # noqa: E402

H, V_LOCAL = 2048, 128256 // 2


KINDS = ("unfused", "fast", "fast-torch", "lean", "lean-torch")


def run(kind, h, w, t):
    """One loss; "-torch": the elementwise passes in torch ops instead of the Triton row kernel."""
    if kind == "unfused":
        z = h @ w.T
        return F.cross_entropy(z.float(), t)
    vp.TRITON_ROWS = False if kind.endswith("-torch") else None
    try:
        return vocab_parallel_cross_entropy(h, w, t, vocab_size=w.shape[0], lean=kind.startswith("lean"))
    finally:
        vp.TRITON_ROWS = None


def agreement(n):
    """Loss and gradients of every kind against "fast-torch" (relative max-norm differences)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    h0 = torch.randn(n, H, device="cuda", generator=g).bfloat16()
    w0 = (torch.randn(V_LOCAL, H, device="cuda", generator=g) * 0.02).bfloat16()
    t = torch.randint(0, V_LOCAL, (n,), device="cuda", generator=g)
    t[::7] = -100
    out = {}
    for kind in KINDS:
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = run(kind, h, w, t)
        loss.backward()
        out[kind] = (loss.detach().float(), h.grad.float(), w.grad.float())
    ref = out["fast-torch"]

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))

    return {k: [rel(a, b) for a, b in zip(v, ref)] for k, v in out.items()}


def measure(kind, n, reps=10):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(n, H, device="cuda", generator=g) * 1.0).bfloat16().requires_grad_()
    w = (torch.randn(V_LOCAL, H, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, V_LOCAL, (n,), device="cuda", generator=g)
    for _ in range(2):
        run(kind, h, w, t).backward()
    h.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run(kind, h, w, t).backward()
        b.record()
        h.grad = w.grad = None
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    ms = sorted(times)[len(times) // 2]
    tflops = 6 * n * H * V_LOCAL / ms / 1e9
    return {"kind": kind, "tokens": n, "ms": ms, "peak_gib_above_inputs": peak, "gemm_tflops_per_s": tflops}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", default="8192,16384")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        for kind in KINDS:
            r = measure(kind, n)
            rows.append(r)
            print(
                f"{n:>6} tokens {kind:<8} {r['ms']:7.2f} ms  {r['peak_gib_above_inputs']:5.2f} GiB",
                flush=True,
            )
    agree = agreement(4096)
    for kind, diffs in agree.items():
        print(f"{kind:<11} vs fast-torch: loss {diffs[0]:.1e}  grad_h {diffs[1]:.1e}  grad_w {diffs[2]:.1e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab_parallel.json").write_text(
        json.dumps(
            {
                "environment": es.environment(),
                "command": " ".join(sys.argv),
                "rows": rows,
                "agreement": agree,
            },
            indent=1,
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
