#!/usr/bin/env python3
"""Where does the norm backward's time go at wide rows: the library's kernel, or its launcher?

A diagnostic, not library code. For each shape it times, in one run (GPU time, L2 flushed,
queue filled ahead, as roofline_tune.py):

- "launcher": the library's backward as the autograd Function calls it (allocations, the
  backward kernel, the partial-sum kernel);
- "kernel": the library's backward kernel alone at its table configuration, buffers allocated
  once; "+const_n" the same compiled for the row width; "sum": the partial-sum kernel alone;
- "probe": scripts/norm_probe.py's minimal RMSNorm backward (one row per loop iteration, 1-D
  blocks) with the same grid, with and without const_n.

--sweep: instead, the backward (the launcher, as above) at each of sweep_configs()'s configurations of
the one-row register path compiled for the row width (const_n), beside the table's, compiled
first in parallel worker processes.

Usage (GPU machine, repo root): PYTHONPATH=src python3 scripts/norm_bwd_probe.py --out DIR
Writes DIR/bwd_probe.json and DIR/bwd_probe.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import itertools
import json
import multiprocessing as mp
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from norm_probe import probe_bwd  # noqa: E402
from roofline_tune import copy_bandwidth_gbps, gpu_time_ms  # noqa: E402

from lmkernels.backends.triton import _norms, layer_norm, rms_norm  # noqa: E402


def _rms_kernel(dy, x, w, rstd, dx, partial, cfg, N_CONST):
    M, N = x.shape
    rms_norm._rms_norm_bwd_kernel[(partial.shape[0],)](
        dy, x, w, rstd, dx, partial, M, N, 0.0, MODE=0, HAS_WEIGHT=True, ACC=True, ROWS=cfg.rows,
        BLOCK=cfg.block, TAIL=cfg.tail, PATH=cfg.path, RELOAD_W=cfg.reload_w or cfg.path == _norms.PATH_MEM,
        NUM_STAGES=cfg.stages, SOFT_BF16=False, N_CONST=N_CONST, num_warps=cfg.num_warps,
    )  # fmt: skip


def rms_variants(M, N, x, w, dy):
    _, rstd = rms_norm._rms_norm_fwd(x, w, 1e-6, 0.0, "llama")
    cfg = _norms.bwd_config("rms_norm", N)
    P = _norms.persistent_programs(_norms.num_tiles(M, cfg.rows), cfg.programs_per_sm, x.device)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    partial = torch.empty((P, N), device=x.device, dtype=torch.float32)
    out = {"config": str(cfg)}
    out["launcher"] = lambda: rms_norm._rms_norm_bwd(dy, x, w, rstd, 0.0, "llama")
    out["kernel"] = lambda: _rms_kernel(dy, x, w, rstd, dx, partial, cfg, 0)
    out["kernel +const_n"] = lambda: _rms_kernel(dy, x, w, rstd, dx, partial, cfg, N)
    out["sum"] = lambda: _norms.sum_partials(partial, dw)
    if cfg.path != _norms.PATH_WIDE and cfg.tail == 0:
        pps = cfg.programs_per_sm
        base = dict(block=cfg.block, warps=cfg.num_warps, split=0, pps=pps, stages=cfg.stages)
        out["probe"] = probe_bwd(dy, x, w, rstd, dx, base)[0]
        out["probe +const_n"] = probe_bwd(dy, x, w, rstd, dx, dict(base, const_n=True))[0]
        rows2 = dataclasses.replace(cfg, rows=2)
        P2 = _norms.persistent_programs(_norms.num_tiles(M, 2), cfg.programs_per_sm, x.device)
        partial2 = torch.empty((P2, N), device=x.device, dtype=torch.float32)
        out["kernel rows=2"] = lambda: _rms_kernel(dy, x, w, rstd, dx, partial2, rows2, 0)
    return out


def ln_variants(M, N, x, w, dy):
    b = torch.zeros_like(w)
    _, mean, rstd = layer_norm._layer_norm_fwd(x, w, b, 1e-5)
    return {
        "config": str(_norms.bwd_config("layer_norm", N)),
        "launcher": lambda: layer_norm._layer_norm_bwd(dy, x, w, mean, rstd, torch.bfloat16),
    }


def sweep_configs(op, N, M=None, widths=("const_n",)):
    """The table's backward (for M rows), then one-row register configurations: warps, programs
    per SM, pipelining, (LayerNorm) which gradient sums go to the column kernel, and compiled
    for the row width or not (`widths`: "const_n", "runtime")."""
    cfgs = [_norms.bwd_config(op, N)]
    aparts = (_norms.APART_NONE, _norms.APART_DB, _norms.APART_ALL) if op == "layer_norm" else (0,)
    block = triton.next_power_of_2(N)
    for width, apart, warps, pps, stages in itertools.product(widths, aparts, (8, 16, 32), (1, 2), (1, 3)):
        if warps == 8 and block > 8192 and width == "const_n" and "runtime" not in widths:
            continue  # 64 elements per thread per tensor: spills (the first sweep's grid)
        cfgs.append(_norms.BwdConfig(1, block, _norms.PATH_REGS, warps, pps, True, apart=apart, stages=stages,
                                     const_n=width == "const_n"))  # fmt: skip
    return list(dict.fromkeys(cfgs))


def _backward(op, M, N, seed=0):
    """The library's backward launcher on random inputs of M x N, as a closure."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (1 + 0.1 * torch.randn(N, device="cuda", generator=g)).to(torch.bfloat16)
    if op == "rms_norm":
        _, rstd = rms_norm._rms_norm_fwd(x, w, 1e-6, 0.0, "llama")
        return lambda: rms_norm._rms_norm_bwd(dy, x, w, rstd, 0.0, "llama")
    _, mean, rstd = layer_norm._layer_norm_fwd(x, w, torch.zeros_like(w), 1e-5)
    return lambda: layer_norm._layer_norm_bwd(dy, x, w, mean, rstd, torch.bfloat16)


def _warm(op, N, cfg):
    """Worker: compile one configuration (a small M specializes the same way)."""
    os.environ.pop("TRITON_INTERPRET", None)
    _norms.FORCE_BWD = cfg
    _backward(op, 64, N)()
    torch.cuda.synchronize()
    return cfg


def sweep(args, bw):
    points = [
        (op, tuple(map(int, s.split("x")))) for op in args.ops.split(",") for s in args.shapes.split(",")
    ]
    widths = args.widths.split(",")
    todo = {(op, N, cfg) for op, (M, N) in points for cfg in sweep_configs(op, N, M, widths)}
    with cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_warm, *zip(*todo)))
    rows = []
    for op, (M, N) in points:
        run = _backward(op, M, N)
        floor = 3 * M * N * 2 / bw / 1e6
        for i, cfg in enumerate(sweep_configs(op, N, M, widths)):
            _norms.FORCE_BWD = cfg
            ms = gpu_time_ms(run, args.reps)
            name = ("table " if i == 0 else "") + _cfg_name(cfg)
            rows.append(
                dict(op=op, shape=f"{M}x{N}", variant=name, ms=ms, pct_copy=100 * floor / ms, config=str(cfg))
            )
            print(f"{op} {M}x{N} {name:44} {ms * 1e3:8.1f} us {100 * floor / ms:5.1f}%", flush=True)
        _norms.FORCE_BWD = None
        del run
        torch.cuda.empty_cache()
    return rows


def _cfg_name(cfg):
    apart = {_norms.APART_NONE: "", _norms.APART_DB: " apart-db", _norms.APART_ALL: " apart-all"}[cfg.apart]
    flags = (" reload" if cfg.reload_w else "") + (" const_n" if cfg.const_n else "")
    return (
        f"rows{cfg.rows} b{cfg.block} w{cfg.num_warps} pps{cfg.programs_per_sm} st{cfg.stages}{apart}{flags}"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="65536x16384,16384x16384,65536x11008,65536x8192")
    ap.add_argument("--ops", default="rms_norm,layer_norm")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--sweep", action="store_true", help="the backward at sweep_configs()'s configurations")
    ap.add_argument("--jobs", type=int, default=12, help="--sweep: compile workers")
    ap.add_argument("--widths", default="const_n", help="--sweep: const_n and / or runtime (comma-separated)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    bw = copy_bandwidth_gbps(args.reps)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_gbps=bw, command=" ".join(sys.argv))  # fmt: skip
    print(json.dumps(meta), flush=True)
    rows = sweep(args, bw) if args.sweep else []
    for op in [] if args.sweep else args.ops.split(","):
        for shape in args.shapes.split(","):
            M, N = map(int, shape.split("x"))
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
            dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
            w = (1 + 0.1 * torch.randn(N, device="cuda", generator=g)).to(torch.bfloat16)
            floor = 3 * M * N * 2 / bw / 1e6  # read x, dy; write dx
            variants = (rms_variants if op == "rms_norm" else ln_variants)(M, N, x, w, dy)
            config = variants.pop("config")
            print(f"{op} {shape}: {config}", flush=True)
            for name, fn in variants.items():
                ms = gpu_time_ms(fn, args.reps)
                pct = 100 * floor / ms if name != "sum" else float("nan")
                rows.append(dict(op=op, shape=shape, variant=name, ms=ms, pct_copy=pct, config=config))
                print(f"  {name:20} {ms * 1e3:8.1f} us {pct:5.1f}%", flush=True)
            del x, dy, variants
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "bwd_probe.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    md = [f"# Norm backward probe ({meta['device']}, torch {meta['torch']}, triton {meta['triton']})", "",
          f"Copy bandwidth {bw:.0f} GB/s. `{meta['command']}`", "",
          "| op | shape | variant | us | % copy |", "|---|---|---|---|---|"]  # fmt: skip
    md += [
        f"| {r['op']} | {r['shape']} | {r['variant']} | {r['ms'] * 1e3:.1f} | {r['pct_copy']:.0f} |"
        for r in rows
    ]
    with open(os.path.join(args.out, "bwd_probe.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
