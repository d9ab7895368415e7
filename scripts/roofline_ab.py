#!/usr/bin/env python3
"""Norms' and RoPE's forward + backward over a roofline grid, for an A/B of two trees or two
settings in one call.

Times the library's public functions (triton backend) at every point of roofline_tune.py's
grid for each op, as roofline_tune.py does (GPU time, L2 flushed, queue filled ahead), and
checks each point's outputs and gradients against the fp32 truth (within 2x eager's error +
1e-3). Run it once per tree (PYTHONPATH picks the tree) or per setting (--set MODULE.NAME=VALUE,
a Python literal assigned to an attribute of a module under lmkernels.backends.triton, e.g.
rope.HEAD_STAGES=2), then --compare two tags.

Usage (GPU machine, repo root):
  PYTHONPATH=OLD/src python3 scripts/roofline_ab.py --out DIR --tag base
  PYTHONPATH=src python3 scripts/roofline_ab.py --out DIR --tag new
  python3 scripts/roofline_ab.py --out DIR --compare base new      # writes DIR/ab-base-new.md
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def measure(args):
    import torch
    import triton
    from roofline_candidates import NORM_GRID, ROPE_GRID
    from roofline_tune import copy_bandwidth_gbps, gpu_time_ms, make_case
    from tqdm import tqdm

    import lmkernels

    for setting in args.set:
        target, value = setting.split("=", 1)
        module, name = target.rsplit(".", 1)
        setattr(importlib.import_module(f"lmkernels.backends.triton.{module}"), name, ast.literal_eval(value))
    bw = copy_bandwidth_gbps(args.reps)
    rows = []
    points = [
        (op, shape)
        for op in args.ops.split(",")
        for shape in (ROPE_GRID if op == "rope" else NORM_GRID)[args.grid]
    ]
    for op, shape in tqdm(points, desc=args.tag, ncols=80):
        case = make_case(op, shape)
        fn = case.triton_fn()
        problem = case.check(fn)
        call, _, _ = case.run_full(fn)
        ms = gpu_time_ms(call, args.reps)
        point = "x".join(str(v) for v in shape if v is not None)
        rows.append(
            dict(op=op, shape=point, ms=ms, pct_copy=100 * case.bytes / (bw * 1e6) / ms, check=problem)
        )
        del case, call
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                lmkernels=os.path.dirname(lmkernels.__file__), copy_gbps=bw, command=" ".join(sys.argv),
                settings=args.set)  # fmt: skip
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    bad = [r for r in rows if r["check"]]
    for r in bad:
        print(f"FAILED {r['op']} {r['shape']}: {r['check']}")
    return 1 if bad else 0


def _shape(row):
    return row.get("shape") or f"{row['M']}x{row['N']}"  # the first runs' rows had M and N


def compare(args):
    a_tag, b_tag = args.compare
    a, b = (json.load(open(os.path.join(args.out, f"{t}.json"))) for t in (a_tag, b_tag))
    base = {(r["op"], _shape(r)): r for r in a["rows"]}
    md = [f"# fwd+bwd: {b_tag} against {a_tag} ({b['meta']['device']}, triton {b['meta']['triton']})", "",
          f"Copy bandwidth {b['meta']['copy_gbps']:.0f} GB/s. {a_tag}: `{a['meta']['command']}`; "
          f"{b_tag}: `{b['meta']['command']}`.", "",
          f"| op | shape | {a_tag} us | % copy | {b_tag} us | % copy | {a_tag} / {b_tag} |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    ratios = {}
    for r in b["rows"]:
        o = base.get((r["op"], _shape(r)))
        if o is None:
            continue
        ratio = o["ms"] / r["ms"]
        ratios.setdefault(r["op"], []).append(ratio)
        md.append(f"| {r['op']} | {_shape(r)} | {o['ms'] * 1e3:.1f} | {o['pct_copy']:.0f} | "
                  f"{r['ms'] * 1e3:.1f} | {r['pct_copy']:.0f} | {ratio:.3f} |")  # fmt: skip
    md.append("")
    for op, rs in ratios.items():
        gm = math.exp(sum(map(math.log, rs)) / len(rs))
        md.append(f"- {op}: {a_tag} / {b_tag} geometric mean {gm:.3f}, range {min(rs):.3f}-{max(rs):.3f} "
                  f"over {len(rs)} points (> 1: {b_tag} faster)")  # fmt: skip
    text = "\n".join(md) + "\n"
    with open(os.path.join(args.out, f"ab-{a_tag}-{b_tag}.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--ops", default="rms_norm,layer_norm")
    ap.add_argument("--grid", default="final")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--set", action="append", default=[], help="MODULE.NAME=VALUE (repeatable)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    return compare(args) if args.compare else measure(args)


if __name__ == "__main__":
    sys.exit(main())
