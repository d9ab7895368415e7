#!/usr/bin/env python3
"""The copy floor of the roofline grid: how much of the copy bandwidth plain copies reach when
they move a norm's or RoPE's fwd+bwd bytes in as many launches as the op needs at least.

roofline_tune.py's "% of copy" divides an op's bytes by the bandwidth of one 2 GiB copy. Small
tensors cannot reach it: each launch pays a fixed cost. This times, per grid point, the least
launches that move the same bytes (GPU time, L2 flushed, queue filled ahead, as roofline_tune.py):

- norms: `y.copy_(x)` (the forward's read of x and write of y) then `torch.add(x, dy, out=dx)`
  (the backward's reads of x and dy and write of dx): 5 M N elements in 2 launches (the library
  needs 3: forward, backward, the weight-gradient partial sums);
- RoPE: two copies of a buffer of q's and k's elements (forward and backward each read q and k
  and write two outputs): 4 (|q| + |k|) elements in 2 launches (the library: 2).

and reports it as a share of the 2 GiB copy's bandwidth: the most any kernel pair with that
launch structure can show on the grid's % of copy.

Usage (GPU machine, repo root): PYTHONPATH=src python3 scripts/copy_floor.py --out DIR
  [--grid final|offgrid]
Writes DIR/copy_floor.json and DIR/copy_floor.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline_candidates import NORM_GRID, ROPE_GRID  # noqa: E402
from roofline_tune import copy_bandwidth_gbps, gpu_time_ms  # noqa: E402


def norm_floor(M, N, reps):
    x, dy = (torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    y, dx = torch.empty_like(x), torch.empty_like(x)

    def run():
        y.copy_(x)
        torch.add(x, dy, out=dx)

    return gpu_time_ms(run, reps), 5 * M * N * 2


def rope_floor(B, Hq, Hkv, T, D, reps):
    n = B * (Hq + Hkv) * T * D
    src, dst = (
        torch.randn(n, device="cuda", dtype=torch.bfloat16),
        torch.empty(n, device="cuda", dtype=torch.bfloat16),
    )

    def run():
        dst.copy_(src)
        src.copy_(dst)

    return gpu_time_ms(run, reps), 4 * n * 2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--grid", default="final", choices=["final", "offgrid"])
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    bw = copy_bandwidth_gbps(args.reps)
    rows = []
    points = [("norms", shape) for shape in NORM_GRID[args.grid]] + [
        ("rope", shape) for shape in ROPE_GRID[args.grid]
    ]
    for kind, shape in points:
        ms, nbytes = norm_floor(*shape, args.reps) if kind == "norms" else rope_floor(*shape[:5], args.reps)
        pct = 100 * nbytes / (bw * 1e6) / ms
        name = "x".join(str(v) for v in shape if v is not None)
        rows.append(dict(kind=kind, shape=name, ms=ms, bytes=nbytes, pct_copy=pct))
        print(f"{kind:5} {name:22} {ms * 1e3:9.1f} us {pct:5.1f}%", flush=True)
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_gbps=bw, command=" ".join(sys.argv))  # fmt: skip
    with open(os.path.join(args.out, "copy_floor.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    md = [f"# Copy floor of the roofline grid ({meta['device']}, torch {meta['torch']})", "",
          f"2 GiB copy: {bw:.0f} GB/s. `{meta['command']}`", "",
          "| points | shape | floor us | % of copy |", "|---|---|---|---|"]  # fmt: skip
    md += [f"| {r['kind']} | {r['shape']} | {r['ms'] * 1e3:.1f} | {r['pct_copy']:.0f} |" for r in rows]
    with open(os.path.join(args.out, "copy_floor.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
