"""FLCE's row kernel alone (the fast mode's forward: logsumexp, loss and bf16 dlogits written over
the fp32 logits), per launch configuration: (programs, BLOCK_V, warps) through
_flce_kernels.ROWS_CONFIG, against the default of one program per row.

    source scripts/gpu_env.sh; export TRITON_INTERPRET=0
    python3 scripts/flce_rows_probe.py --out OUT        # one GPU, about a minute

Why fewer programs than rows might pay: the kernel reads each row twice (pass 1: max and sum of
exp; pass 2: dlogits). With a program per row about 8 rows per SM are in flight, 1056 rows of
0.5 MB at V = 128k: far more than the 50 MB L2, so pass 2 reads the row from DRAM again. A
persistent grid of P programs looping over rows keeps P rows in flight.

Per configuration: kernel time (CUDA events around the launch only; the logits are restored
from a pristine copy before each launch, outside the events), the bytes the kernel must move
(read fp32 once, write the 16-bit dlogits) per second, and the largest difference of lse and
dlogits from the default configuration's. Writes OUT/rows_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from lmkernels.backends.triton import _flce_kernels as kernels
from lmkernels.harness.bench import environment

CASES = [(1024, 128256), (2048, 128256), (1024, 256000), (4096, 32000)]  # (rows, V)


def configs(sms):
    out = [None, (10**9, 8192, 16), (10**9, 2048, 4)]
    for k in (1, 2, 4):
        for block, warps in ((4096, 8), (8192, 16), (4096, 16), (2048, 4)):
            out.append((k * sms, block, warps))
    return out


def run_case(rows, V, cfgs, reps):
    g = torch.Generator(device="cuda").manual_seed(0)
    pristine = torch.randn(rows, V, device="cuda", generator=g) * 2
    target = torch.randint(0, V, (rows,), device="cuda", generator=g)
    grad = torch.tensor(1.0 / rows, device="cuda")
    buf = torch.empty_like(pristine)
    dl = kernels._dlogits_view(buf, torch.bfloat16)
    r = kernels.Rows(target, None, None, -100, 0.0, None, 0.0, V)
    lse = torch.empty(rows, device="cuda")
    loss = torch.empty(rows, device="cuda")
    results, ref = [], None
    for cfg in cfgs:
        kernels.ROWS_CONFIG = cfg
        times = []
        for i in range(reps + 3):
            buf.copy_(pristine)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            r.launch(buf, dl, slice(0, rows), lse, loss, grad, 0, lse_given=False)
            end.record()
            end.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end))
        out = (lse.clone(), dl.float().clone())
        if ref is None:
            ref = out
        ms = sorted(times)[len(times) // 2]
        moved = rows * V * (4 + 2)  # read fp32 once, write bf16
        results.append(
            {
                "rows": rows,
                "V": V,
                "config": "default (a program per row)"
                if cfg is None
                else f"P={cfg[0]} B={cfg[1]} w={cfg[2]}",
                "ms": ms,
                "gbps_min_bytes": moved / ms / 1e6,
                "lse_diff": (out[0] - ref[0]).abs().max().item(),
                "dlogits_diff": (out[1] - ref[1]).abs().max().item(),
            }
        )
        row = results[-1]
        print(
            f"{rows:5d} x {V:6d}  {row['config']:30s} {ms:7.3f} ms  {row['gbps_min_bytes']:6.0f} GB/s"
            f"  lse diff {row['lse_diff']:.1e}  dlogits diff {row['dlogits_diff']:.1e}",
            flush=True,
        )
    kernels.ROWS_CONFIG = None
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for n, V in CASES:
        rows += run_case(n, V, configs(sms), args.reps)
    meta = environment() | {"command": " ".join(["python3", *sys.argv]), "sms": sms}
    with open(os.path.join(args.out, "rows_probe.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
