#!/usr/bin/env python3
"""Where a norm's forward + backward spends its GPU time, ours against torch.compile's (one GPU call).

For each (op, M, N): the torch profiler's kernel list (name, launches, GPU time per step) of the
Triton backend and of torch.compile of the eager reference (the roofline's compile peer, static
shapes), and inductor's generated source for the compiled one: what design reaches the bandwidth
that ours does not.

Usage (GPU machine, repo root): PYTHONPATH=src python3 scripts/norm_kernel_profile.py --out DIR
  [--points rms_norm:65536x11008,layer_norm:16384x16384]
Writes DIR/kernels.md (the kernel tables) and DIR/<op>_<M>x<N>_inductor.py (generated code).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline_cases import NormCase  # noqa: E402

STEPS = 5


def kernel_table(call):
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            call()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:70]
            n, us = rows.get(name, (0, 0.0))
            rows[name] = (n + 1, us + e.device_time)
    return sorted(((name, n / STEPS, us / STEPS) for name, (n, us) in rows.items()), key=lambda r: -r[2])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--points", default="rms_norm:65536x11008,rms_norm:65536x5120,layer_norm:16384x16384")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from torch._inductor.utils import run_and_get_code

    import lmkernels as lk

    md = [f"# Kernels per forward + backward ({torch.cuda.get_device_name()}, torch {torch.__version__})", ""]
    for point in args.points.split(","):
        op, shape = point.split(":")
        M, N = map(int, shape.split("x"))
        case = NormCase(op, M, N)
        ours = getattr(lk, op)
        fns = {
            "triton": lambda *a, ours=ours: ours(*a, backend="triton"),
            "compile": case.peers()["compile"],
        }
        for name, fn in fns.items():
            call = case.run_full(fn)[0]
            if name == "compile":
                _, code = run_and_get_code(call)
                with open(os.path.join(args.out, f"{op}_{M}x{N}_inductor.py"), "w") as f:
                    f.write("\n\n# ---- next graph ----\n\n".join(code))
            table = kernel_table(call)
            total = sum(r[2] for r in table)
            md += [
                f"## {op} {M}x{N} {name}: {total:.1f} us per step",
                "",
                "| kernel | launches | us |",
                "|---|---|---|",
            ]
            md += [f"| `{k}` | {n:g} | {us:.1f} |" for k, n, us in table]
            md.append("")
            print(f"{op} {M}x{N} {name}: {total:.1f} us", flush=True)
    with open(os.path.join(args.out, "kernels.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
