#!/usr/bin/env python3
"""Which features of inductor's RMSNorm kernels make them faster than ours at 11008 columns?

A probe, not library code: a minimal RMSNorm backward ("llama" casting, with a weight) and a
chunked forward, written with every feature in which inductor's generated kernels differ from
ours as a switch, timed beside the library's table kernels and torch.compile in one run:

- const_n (N_CONST): the row width a compile-time constant (inductor compiles static shapes);
- SPLIT: a grid of cdiv(M, RSPLIT) programs over RSPLIT consecutive rows each (inductor's
  mix-order reduction), instead of the persistent grid over strided rows;
- HINTS: x and dy loaded with evict_first, the weight with evict_last (inductor's policy);
- I32: int32 offsets (inductor indexes in int32 where the numel allows);
- STAGES: software pipelining of the loop over rows; BLOCK / TAIL, warps, RELOAD_W as ours.

Usage (GPU machine, repo root): PYTHONPATH=src python3 scripts/norm_probe.py --out DIR
Writes DIR/probe.json (every variant's median GPU time) and DIR/probe.md (a table), and prints
each row as it is measured. Timing as in roofline_tune.py (L2 flushed, queue filled ahead).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline_tune import copy_bandwidth_gbps, gpu_time_ms  # noqa: E402

from lmkernels.backends.triton._norms import load_block  # noqa: E402


@triton.jit
def _block_bwd(x_ptr, dy_ptr, w_ptr, base, cols, N, HINTS: tl.constexpr):
    mask = cols < N
    x = load_block(x_ptr + base + cols, mask, HINTS, False)
    dy = load_block(dy_ptr + base + cols, mask, HINTS, False)
    w = load_block(w_ptr + cols, mask, HINTS, True)
    return x, dy, dy * w, mask


@triton.jit
def _probe_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, partial_ptr, M, N,
    N_CONST: tl.constexpr, SPLIT: tl.constexpr, RSPLIT: tl.constexpr,
    BLOCK: tl.constexpr, TAIL: tl.constexpr, HINTS: tl.constexpr, I32: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    if N_CONST > 0:  # the library's convention (rms_norm.py)
        N = N_CONST
    pid = tl.program_id(0)
    dtype = dx_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    cols_t = BLOCK + tl.arange(0, TAIL if TAIL > 0 else 1)
    if SPLIT:
        first = pid * RSPLIT
        count = tl.minimum(RSPLIT, M - first)
        step = 1
    else:
        first = pid
        step = tl.num_programs(0)
        count = tl.cdiv(M - pid, step)
    acc = tl.zeros([BLOCK], tl.float32)
    acc_t = tl.zeros([TAIL if TAIL > 0 else 1], tl.float32)
    for i in tl.range(0, count, num_stages=STAGES):
        row = first + i * step
        if I32:
            base = row * N
        else:
            base = row.to(tl.int64) * N
        rstd = tl.load(rstd_ptr + row)
        x, dy, g, mask = _block_bwd(x_ptr, dy_ptr, w_ptr, base, cols, N, HINTS)
        dot = tl.sum(g * x, axis=0)
        if TAIL > 0:
            x_t, dy_t, g_t, mask_t = _block_bwd(x_ptr, dy_ptr, w_ptr, base, cols_t, N, HINTS)
            dot += tl.sum(g_t * x_t, axis=0)
        scale = rstd * rstd * dot / N
        tl.store(dx_ptr + base + cols, ((g - x * scale) * rstd).to(dtype), mask=mask)
        acc += dy * (x * rstd).to(dtype).to(tl.float32)
        if TAIL > 0:
            tl.store(dx_ptr + base + cols_t, ((g_t - x_t * scale) * rstd).to(dtype), mask=mask_t)
            acc_t += dy_t * (x_t * rstd).to(dtype).to(tl.float32)
    out = partial_ptr + pid.to(tl.int64) * N
    tl.store(out + cols, acc, mask=cols < N)
    if TAIL > 0:
        tl.store(out + cols_t, acc_t, mask=cols_t < N)


@triton.jit
def _probe_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, N, eps,
    N_CONST: tl.constexpr, CHUNK: tl.constexpr, HINTS: tl.constexpr,
    I32: tl.constexpr, SINGLE: tl.constexpr,
):  # fmt: skip
    if N_CONST > 0:  # the library's convention (rms_norm.py)
        N = N_CONST
    row = tl.program_id(0)
    if I32:
        base = row * N
    else:
        base = row.to(tl.int64) * N
    dtype = y_ptr.dtype.element_ty
    cols = tl.arange(0, CHUNK)
    if SINGLE:
        mask = cols < N
        x = load_block(x_ptr + base + cols, mask, HINTS, False)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        w = load_block(w_ptr + cols, mask, HINTS, True)
        tl.store(y_ptr + base + cols, ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype), mask=mask)
    else:
        acc = tl.zeros([CHUNK], tl.float32)
        for start in range(0, N, CHUNK):
            mask = start + cols < N
            x = load_block(x_ptr + base + start + cols, mask, HINTS, True)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
        for start in range(0, N, CHUNK):
            mask = start + cols < N
            x = load_block(x_ptr + base + start + cols, mask, HINTS, False)
            w = load_block(w_ptr + start + cols, mask, HINTS, True)
            tl.store(
                y_ptr + base + start + cols, ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype), mask=mask
            )
    tl.store(rstd_ptr + row, rstd)


def _sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


def probe_bwd(dy, x, w, rstd, dx, cfg):
    M, N = x.shape
    split = cfg.get("split", 0)
    grid = triton.cdiv(M, split) if split else min(M, _sms() * cfg.get("pps", 1))
    block, tail = cfg["block"], cfg.get("tail", 0)
    partial = torch.empty((grid, N), device=x.device, dtype=torch.float32)

    def run():
        _probe_bwd_kernel[(grid,)](
            dy, x, w, rstd, dx, partial, M, N, N_CONST=N if cfg.get("const_n") else 0,
            SPLIT=bool(split), RSPLIT=max(split, 1), BLOCK=block, TAIL=tail,
            HINTS=cfg.get("hints", False), I32=cfg.get("i32", False), STAGES=cfg.get("stages", 1),
            num_warps=cfg["warps"],
        )  # fmt: skip

    return run, partial


def probe_fwd(x, w, y, rstd, cfg):
    M, N = x.shape
    chunk = cfg["chunk"]

    def run():
        _probe_fwd_kernel[(M,)](
            x, w, y, rstd, N, 1e-6, N_CONST=N if cfg.get("const_n") else 0, CHUNK=chunk,
            HINTS=cfg.get("hints", False), I32=cfg.get("i32", False), SINGLE=chunk >= N,
            num_warps=cfg["warps"],
        )  # fmt: skip

    return run


ABLATE = False  # --ablate: the second run's variants (run1's fastest, one feature at a time)


def bwd_variants(N):
    """Named backward configurations: the table's layout, inductor's, and one feature at a time."""
    block = triton.next_power_of_2(N)
    half, tail = block // 2, triton.next_power_of_2(N - block // 2)
    two = dict(block=half, tail=tail) if 4 * N <= 3 * block else dict(block=block)
    ind = dict(
        block=block, warps=16 if block > 4096 else 8, split=32, const_n=True, hints=True, i32=True, stages=2
    )
    if ABLATE:
        one = dict(ind, stages=1)  # run1's fastest at 11008 columns
        return {
            "ind1": one,
            "ind1 -const_n": dict(one, const_n=False),
            "ind1 -hints": dict(one, hints=False),
            "ind1 -i32": dict(one, i32=False),
            "ind1 persistent 1/SM": dict(one, split=0, pps=1),
            "ind1 persistent 2/SM": dict(one, split=0, pps=2),
            "ind1 split 64": dict(one, split=64),
            "ind1 split 16": dict(one, split=16),
            "ind1 split 8": dict(one, split=8),
            "ind1 two blocks": dict(one, **two),
            "ind1 two blocks 8w": dict(one, **two, warps=8),
            "ind1 8w": dict(one, warps=8),
            "ind1 32w": dict(one, warps=32),
            "ind1 -hints -i32": dict(one, hints=False, i32=False),
            # The library's table at 16384 columns is the last one without hints and int32.
            "ind1 p1 -hints": dict(one, split=0, pps=1, hints=False),
            "ind1 p1 -i32": dict(one, split=0, pps=1, i32=False),
            "ind1 p1 -hints -i32": dict(one, split=0, pps=1, hints=False, i32=False),
        }
    v = {
        "ours-layout": dict(two, warps=16, pps=2),
        "inductor-layout": ind,
        "ind -const_n": dict(ind, const_n=False),
        "ind -hints": dict(ind, hints=False),
        "ind -i32": dict(ind, i32=False),
        "ind -stages": dict(ind, stages=1),
        "ind persistent 1/SM": dict(ind, split=0, pps=1),
        "ind persistent 2/SM": dict(ind, split=0, pps=2),
        "ind split 64": dict(ind, split=64),
        "ind split 16": dict(ind, split=16),
        "ind 32 warps": dict(ind, warps=32),
        "ind stages 3": dict(ind, stages=3),
        "ind two blocks": dict(ind, **two),
        "ind two blocks 32w": dict(ind, **two, warps=32),
        "ind two blocks 8w": dict(ind, **two, warps=8),
        "ours +const_n": dict(two, warps=16, pps=2, const_n=True),
        "ours +hints": dict(two, warps=16, pps=2, hints=True),
        "ours +i32": dict(two, warps=16, pps=2, i32=True),
        "ours +stages2": dict(two, warps=16, pps=2, stages=2),
        "ours +split32": dict(two, warps=16, split=32),
        "ours +all": dict(two, warps=16, split=32, const_n=True, hints=True, i32=True, stages=2),
    }
    return v


def fwd_variants(N):
    block = triton.next_power_of_2(N)
    v = {}
    for chunk in (1024, 2048, 4096):
        for warps in (4, 8, 16):
            if chunk // (32 * warps) < 2:
                continue
            v[f"chunk {chunk} {warps}w const hints i32"] = dict(
                chunk=chunk, warps=warps, const_n=True, hints=True, i32=True
            )
    v["chunk 4096 8w hints (ours)"] = dict(chunk=4096, warps=8, hints=True)
    v["chunk 2048 8w const"] = dict(chunk=2048, warps=8, const_n=True)
    v["chunk 2048 8w hints"] = dict(chunk=2048, warps=8, hints=True)
    v[f"single {block} 16w const hints i32"] = dict(chunk=block, warps=16, const_n=True, hints=True, i32=True)
    return v


def library_and_compile(M, N, x, w, dy, reps):
    """The library's table forward and backward (alone), and fwd+bwd of ours and of compile."""
    import lmkernels as lk
    from lmkernels.backends.triton import rms_norm as ours
    from lmkernels.ops.rms_norm import rms_norm_reference

    out = {}
    _, rstd = ours._rms_norm_fwd(x, w, 1e-6, 0.0, "llama")
    out["lib fwd"] = gpu_time_ms(lambda: ours._rms_norm_fwd(x, w, 1e-6, 0.0, "llama"), reps)
    out["lib bwd"] = gpu_time_ms(lambda: ours._rms_norm_bwd(dy, x, w, rstd, 0.0, "llama"), reps)
    xg = x.detach().requires_grad_()
    wg = w.detach().requires_grad_()
    compiled = torch.compile(rms_norm_reference)
    for name, fn in (
        ("lib fwd+bwd", lambda a, b: lk.rms_norm(a, b, backend="triton")),
        ("compile fwd+bwd", compiled),
    ):

        def step(fn=fn):
            fn(xg, wg).backward(dy)
            xg.grad = wg.grad = None

        out[name] = gpu_time_ms(step, reps)
    return out, rstd


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="65536x11008,65536x5120,65536x8192")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--budget", type=float, default=400.0)
    ap.add_argument("--ablate", action="store_true", help="the second run: backward ablations only")
    args = ap.parse_args(argv)
    global ABLATE
    ABLATE = args.ablate
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    bw = copy_bandwidth_gbps(args.reps)
    meta = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, copy_gbps=bw
    )
    print(json.dumps(meta), flush=True)
    rows = []
    for shape in args.shapes.split(","):
        M, N = map(int, shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
        w = (1 + 0.1 * torch.randn(N, device="cuda", generator=g)).to(torch.bfloat16)
        floor_fwd = 2 * M * N * 2 / bw / 1e6
        floor_bwd = 3 * M * N * 2 / bw / 1e6

        def record(kind, name, ms, floor, shape=shape):
            rows.append(dict(shape=shape, kind=kind, name=name, ms=ms, pct_copy=100 * floor / ms))
            print(f"{shape:>12} {kind:4} {name:36} {ms * 1e3:8.1f} us {100 * floor / ms:5.1f}%", flush=True)

        lib, rstd = library_and_compile(M, N, x, w, dy, args.reps)
        for name, ms in lib.items():
            kind = "bwd" if name == "lib bwd" else "fwd" if name == "lib fwd" else "both"
            record(kind, name, ms, {"bwd": floor_bwd, "fwd": floor_fwd}.get(kind, floor_fwd + floor_bwd))
        dx = torch.empty_like(x)
        ref_dx = None
        for name, cfg in bwd_variants(N).items():
            if time.time() - t0 > args.budget:
                break
            run, _ = probe_bwd(dy, x, w, rstd, dx, cfg)
            run()
            if ref_dx is None:
                ref_dx = dx.clone()
            else:  # every variant computes the same dx (up to the order of the row sum)
                err = (dx.float() - ref_dx.float()).abs().max().item()
                if err > 1e-2 * ref_dx.float().abs().max().item():
                    print(f"  {name}: dx differs from the first variant's by {err:.3g}", flush=True)
            record("bwd", name, gpu_time_ms(run, args.reps), floor_bwd)
        y, r = torch.empty_like(x), torch.empty_like(rstd)
        for name, cfg in ({} if ABLATE else fwd_variants(N)).items():
            if time.time() - t0 > args.budget:
                break
            run = probe_fwd(x, w, y, r, cfg)
            record("fwd", name, gpu_time_ms(run, args.reps), floor_fwd)
        del x, dy, dx, y
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    md = [f"# Norm probe ({meta['device']}, torch {meta['torch']}, triton {meta['triton']})", ""]
    md += [
        f"Copy bandwidth {bw:.0f} GB/s.",
        "",
        "| shape | kind | variant | us | % copy |",
        "|---|---|---|---|---|",
    ]
    md += [
        f"| {r['shape']} | {r['kind']} | {r['name']} | {r['ms'] * 1e3:.1f} | {r['pct_copy']:.0f} |"
        for r in rows
    ]
    with open(os.path.join(args.out, "probe.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
