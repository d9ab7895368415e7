#!/usr/bin/env python3
"""Hardware counters of the norm kernels (Nsight Compute): where a kernel's time goes.

A diagnostic, not library code. For each point (op:MxN) it runs one forward + backward of the
Triton backend under `ncu` (caches flushed before each kernel, clocks left alone, as
METHOD.md asks) and reduces ncu's raw page to one row per kernel: duration, DRAM bytes and
throughput, L1 / L2 hit rates, issue-slot use, achieved occupancy, registers, and the stall
reasons that cost the most cycles per issued instruction.

Usage (GPU machine with ncu, repo root):
  PYTHONPATH=src python3 scripts/ncu_norms.py --out DIR [--points layer_norm:16384x16384,...]
  [--force-bwd "BwdConfig(...)"]
Writes DIR/ncu_raw.csv (ncu's raw page) and DIR/ncu.md (the summary).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys

DEFAULT_POINTS = "layer_norm:16384x16384,rms_norm:16384x16384,layer_norm:16384x11008,layer_norm:16384x5120"
SECTIONS = ["SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "SchedulerStats"]
METRICS = [
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "lts__t_sector_hit_rate.pct",
    "l1tex__t_sector_hit_rate.pct",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "smsp__inst_executed.sum",
    "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio",
]
COLUMNS = {  # summary column: raw metric
    "us": "gpu__time_duration.sum",
    "DRAM % peak": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "read MB": "dram__bytes_read.sum",
    "write MB": "dram__bytes_write.sum",
    "L2 hit %": "lts__t_sector_hit_rate.pct",
    "L1 hit %": "l1tex__t_sector_hit_rate.pct",
    "issue %": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "occupancy %": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "regs": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "threads": "launch__block_size",
}
STALL_PREFIX = "smsp__average_warps_issue_stalled_"


def driver(points: list[str], force_bwd: str | None) -> None:
    """Warms each point up, then runs one forward + backward inside the profiled range."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from roofline_cases import NormCase

    import lmkernels as lk
    from lmkernels.backends.triton import _norms

    if force_bwd:  # an expression over _norms' names, e.g. "BwdConfig(1, 8192, PATH_REGS, 16, 1)"
        _norms.FORCE_BWD = eval(force_bwd, dict(vars(_norms)))
    for point in points:
        op, shape = point.split(":")
        M, N = map(int, shape.split("x"))
        case = NormCase(op, M, N)
        fn = getattr(lk, op)
        call = case.run_full(lambda *a, fn=fn: fn(*a, backend="triton"))[0]
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        print(f"point {point} bwd {_norms.bwd_config(op, N)}", flush=True)
        torch.cuda.cudart().cudaProfilerStart()
        call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def summarize(raw_csv: str) -> list[str]:
    rows = list(csv.reader(io.StringIO(raw_csv)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    header, body = rows[start], [r for r in rows[start + 2 :] if len(r) == len(rows[start])]
    col = {name: i for i, name in enumerate(header)}

    def value(r, metric):
        try:
            return float(r[col[metric]].replace(",", ""))
        except (KeyError, ValueError):
            return float("nan")

    md = [
        "| kernel | " + " | ".join(COLUMNS) + " | top stalls (cycles / issued instr.) |",
        "|---|" + "---|" * (len(COLUMNS) + 1),
    ]
    for r in body:
        vals = []
        for name, metric in COLUMNS.items():
            v = value(r, metric)
            if metric == "gpu__time_duration.sum":
                v /= 1e3  # ns -> us
            if metric.startswith("dram__bytes"):
                v /= 1e6
            vals.append(
                f"{v:.0f}" if name in ("regs", "grid", "threads", "read MB", "write MB") else f"{v:.1f}"
            )
        stalls = sorted(
            (
                (name[len(STALL_PREFIX) :].split("_per_")[0], value(r, name))
                for name in col
                if name.startswith(STALL_PREFIX)
            ),
            key=lambda s: -s[1] if s[1] == s[1] else 0,
        )
        top = ", ".join(f"{n} {v:.1f}" for n, v in stalls[:4])
        kernel = r[col["Kernel Name"]][:40]
        md.append(f"| `{kernel}` | " + " | ".join(vals) + f" | {top} |")
    return md


def _csv_lines(text: str) -> str:
    """ncu's CSV rows, without the profiled program's own output mixed into stdout."""
    return "\n".join(line for line in text.splitlines() if line.startswith('"'))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--points", default=DEFAULT_POINTS)
    ap.add_argument("--force-bwd", help="a BwdConfig(...) expression used instead of the table")
    ap.add_argument("--from-raw", help="summarize an earlier run's ncu_raw.csv instead")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    points = args.points.split(",")
    if args.driver:
        return driver(points, args.force_bwd)
    if args.from_raw:
        text = open(args.from_raw).read()
        print("\n".join(summarize(_csv_lines(text))))
        return
    os.makedirs(args.out, exist_ok=True)
    cmd = ["ncu", "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "all"]
    cmd += [a for s in SECTIONS for a in ("--section", s)]
    cmd += ["--metrics", ",".join(METRICS), "--csv", "--page", "raw"]
    cmd += [sys.executable, os.path.abspath(__file__), "--driver", "--points", args.points]
    if args.force_bwd:
        cmd += ["--force-bwd", args.force_bwd]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    with open(os.path.join(args.out, "ncu_raw.csv"), "w") as f:
        f.write(proc.stdout)
    with open(os.path.join(args.out, "ncu_stderr.txt"), "w") as f:
        f.write(proc.stderr)
    if proc.returncode != 0:
        sys.exit(f"ncu failed ({proc.returncode}); see {args.out}/ncu_stderr.txt")
    printed = [line for line in proc.stdout.splitlines() if line.startswith("point ")]
    csv_text = _csv_lines(proc.stdout)
    md = ["# Nsight Compute, one forward + backward per point", "", "```", " ".join(cmd), "```", ""]
    md += [f"- {p}" for p in printed] + [""]
    md += summarize(csv_text)
    with open(os.path.join(args.out, "ncu.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
