#!/usr/bin/env python3
"""Tune and measure RMSNorm, LayerNorm and RoPE against the copy-bandwidth roofline (one GPU call).

For each op and shape: every candidate launch configuration of the Triton kernels is checked
against an fp32 reference (error <= 2x the eager bf16 error + 1e-3, DESIGN.md's bf16 policy),
then timed; torch.compile of the eager reference (static shapes) and Liger (when importable) are
checked and timed the same way. GPU time: an L2 flush, a torch.cuda._sleep that keeps the GPU
busy while the host queues the whole call, CUDA events around the call; median of --reps.
Minimum bytes fwd+bwd: norms 5*M*N*e, RoPE 4*(|q|+|k|)*e, over the copy bandwidth measured here.

Triton kernels and the compiled references are compiled first in --jobs worker processes (their
on-disk caches then serve the timing process).

Usage (GPU machine, repo root): PYTHONPATH=src python3 scripts/roofline_tune.py --out DIR
  [--ops rms_norm,layer_norm,rope] [--grid tune|wide|final|rope] [--short | --lean] [--reps 30]
  [--jobs 12]
RoPE's tile kernel against the position kernel (which table entry wins, roofline_rope.py):
  --ops rope --grid rope --short
Writes DIR/roofline.json and DIR/roofline.md; prints a short table last.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import roofline_rope  # noqa: E402
from roofline_candidates import (  # noqa: E402
    BWD_FAMILIES,
    COL_CANDIDATES,
    NORM_GRID,
    PREVIOUS,
    PREVIOUS_ROPE_TILES,
    ROPE_CANDIDATES,
    ROPE_GRID,
    SUM_CANDIDATES,
    bwd_name,
    const_n_fwd_candidates,
    fwd_name,
    norm_bwd_candidates,
    norm_fwd_candidates,
)
from roofline_cases import DEVICE, E, NormCase, RopeCase  # noqa: E402

# --- timing -------------------------------------------------------------------------------------

_STATE = {}


def _flush():
    buf = _STATE.get("flush")
    if buf is None:
        buf = _STATE["flush"] = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEVICE)
    buf.zero_()


def _cycles_per_ms():
    if "cpm" not in _STATE:
        torch.cuda._sleep(1000)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(10_000_000)
        e.record()
        torch.cuda.synchronize()
        _STATE["cpm"] = 10_000_000 / s.elapsed_time(e)
    return _STATE["cpm"]


def gpu_time_ms(fn, reps, before=None):
    """Median GPU time of fn() (the whole call queued behind a sleep, so host time is hidden)."""
    for _ in range(2):
        if before:
            before()
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if before:
        before()
    fn()
    torch.cuda.synchronize()
    host_ms = (time.perf_counter() - t0) * 1e3
    cycles = int(_cycles_per_ms() * min(50.0, 1.5 * host_ms + 0.2))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if before:
            before()
        _flush()
        torch.cuda._sleep(cycles)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def copy_bandwidth_gbps(reps):
    src = torch.randn(2**30, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = gpu_time_ms(lambda: dst.copy_(src), reps)
    return 2 * 2**31 / (ms * 1e-3) / 1e9


# --- variants: set a configuration, run, restore ---------------------------------------------------


def set_norm_config(fwd=None, bwd=None, col=None):
    from lmkernels.backends.triton import _norms

    default = _STATE.setdefault("col_default", _norms.COL_CONFIG)
    _norms.FORCE_FWD, _norms.FORCE_BWD = fwd, bwd
    _norms.COL_CONFIG = col or default


def set_rope_config(cfg=None, kernel=None, tile=None, tile_table=None):
    """cfg: position-kernel hooks (TILE_ELEMENTS, NUM_WARPS, MIN_PROGRAMS); kernel: "pos" /
    "tile" forced; tile: a tile-kernel config; tile_table: instead of TILE_TUNED. None
    everywhere: the committed tables."""
    from lmkernels.backends.triton import rope

    default = _STATE.setdefault("rope_default", (rope.TILE_ELEMENTS, rope.NUM_WARPS, rope.MIN_PROGRAMS))
    default_tiles = _STATE.setdefault("rope_tiles", rope.TILE_TUNED)
    rope.TILE_ELEMENTS, rope.NUM_WARPS, rope.MIN_PROGRAMS = default if cfg is None else cfg
    rope.KERNEL, rope.TILE_CONFIG = kernel, tile
    rope.TILE_TUNED = default_tiles if tile_table is None else tile_table


# Variant name -> the (fwd, bwd, column kernel) configuration it sets: best_variants' lookup.
NAMED: dict[str, dict] = {}


def norm_variants(case):
    """(name, setter) for each Triton variant: forward and backward configs tried independently
    (the other one at the table's choice), then the table itself."""

    def variant(name, **cfg):
        NAMED[name] = cfg
        return name, lambda: set_norm_config(**cfg)

    out = [("table", lambda: set_norm_config())]
    if FAMILY["name"]:  # the table, and one family of backward candidates (--prefetch, --hold)
        family = BWD_FAMILIES[FAMILY["name"]][0](case.N, case.op)
        return out + [variant(bwd_name(b), bwd=b) for b in family]
    fwds = const_n_fwd_candidates(case.N, case.op) if SHORT["on"] else norm_fwd_candidates(case.N)
    out += [variant(fwd_name(f), fwd=f) for f in dict.fromkeys(fwds)]
    if not SHORT["on"]:
        out += [variant(bwd_name(b), bwd=b) for b in norm_bwd_candidates(case.N, case.op)]
    for b in norm_bwd_candidates(case.N, case.op, new_only=True):
        cols = COL_CANDIDATES if b.apart and b.num_warps == 32 and b.programs_per_sm == 1 else [None]
        for col in cols:
            tag = bwd_name(b) + (f" c{col[0]}x{col[1]}w{col[2]}p{col[3]}" if col and col != cols[0] else "")
            out.append(variant(tag, bwd=b, col=col))
    seen = set()  # a configuration in both candidate lists is timed once
    return [v for v in out if not (v[0] in seen or seen.add(v[0]))]


def rope_variants(case):
    """The table, the position kernel at the previous table ("pos table"), the tile kernel's
    candidates, and (not --short) the position kernel's candidates."""
    out = [
        ("table", lambda: set_rope_config(None)),
        (roofline_rope.POS, lambda: set_rope_config(kernel="pos")),
    ]
    for cfg in roofline_rope.TILE_CANDIDATES:
        out.append((roofline_rope.tile_name(cfg), lambda cfg=cfg: set_rope_config(kernel="tile", tile=cfg)))
    if not SHORT["on"]:
        for cfg in ROPE_CANDIDATES:
            name = f"tile{cfg[0]} w{cfg[1]} p{cfg[2]}"
            out.append((name, lambda cfg=cfg: set_rope_config(cfg, kernel="pos")))
    return out


def make_case(op, shape):
    return RopeCase(*shape) if op == "rope" else NormCase(op, *shape)


SHORT = {"on": False}
LEAN = {"on": False}
FAMILY = {"name": None}


def lean_variants(op, case):
    out = [("table", lambda: reset(op))]
    if op == "rope":
        from lmkernels.backends.triton import rope

        B, Hq, Hkv, T, D, R = case.shape
        set_rope_config(tile_table=PREVIOUS_ROPE_TILES)
        previous = rope._tile_config(B, T, Hq, Hkv, R or D, D, True)
        reset(op)
        if previous != rope._tile_config(B, T, Hq, Hkv, R or D, D, True):
            out.append(("previous table", lambda: set_rope_config(tile_table=PREVIOUS_ROPE_TILES)))
        return out
    from lmkernels.backends.triton import _norms

    block = 1 << (case.N - 1).bit_length()
    previous = PREVIOUS.get(_norms.tuned_key(op, case.N, block))  # the entry these rows get
    if previous is not None:
        fwd, bwd = previous
        fwd = _norms.FwdConfig(*fwd) if fwd else None
        bwd = _norms.BwdConfig(*bwd) if bwd else None
        # A key's previous entry may still be what some widths get: nothing to compare there.
        if fwd is not None or bwd != _norms.bwd_config(op, case.N):
            out.append(("previous table", lambda: set_norm_config(fwd=fwd, bwd=bwd)))
    return out


def variants(op, case):
    if LEAN["on"]:  # the table, and the table before this session's changes where they differ
        return lean_variants(op, case)
    if op == "rope":
        return rope_variants(case)
    # --short: the table, and what the last tuning run did not cover (norm_variants).
    return norm_variants(case)


def reset(op):
    set_rope_config(None) if op == "rope" else set_norm_config()
    set_pdl(True)


def set_pdl(on):
    from lmkernels.backends.triton import _common

    _common.USE_PDL = on


def warm(group, short=False, lean=False, part=0, parts=1, family=None, peers=True):
    """Worker: compile every variant and peer of a group of (op, shape) points once (fills the
    disk caches). A group shares its Triton kernels (same op and row block). part / parts: this
    worker's share of the variants (the peers with part 0)."""
    SHORT["on"], LEAN["on"], FAMILY["name"] = short, lean, family
    torch._dynamo.config.cache_size_limit = 4096
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # the workers already run side by side
    n = 0
    for op, shape in group:
        case = make_case(op, shape)
        fn = case.triton_fn()
        for _, setter in variants(op, case)[part::parts]:
            try:
                setter()
                case.run_full(fn)[0]()
                n += 1
            except Exception:  # noqa: BLE001 (the timing process records the error)
                pass
        reset(op)
        for peer in case.peers().values() if part == 0 and peers else ():
            try:
                case.run_full(peer)[0]()
            except Exception:  # noqa: BLE001
                pass
        del case
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return f"{group[0][0]} {[g[1] for g in group]} part {part + 1}/{parts}: {n} runs"


def warm_groups(jobs):
    groups = {}
    for op, shape in jobs:
        key = (
            (op, shape)
            if op == "rope" or SHORT["on"] or LEAN["on"]
            else (op, 1 << (shape[1] - 1).bit_length())
        )
        groups.setdefault(key, []).append((op, shape))
    # Largest groups first, so that the pool's last round is short. A RoPE point has some 25
    # variants of its own: over 3 workers.
    out = []
    for g in sorted(groups.values(), key=len, reverse=True):
        parts = 3 if g[0][0] == "rope" and not LEAN["on"] else 1
        out += [(g, part, parts) for part in range(parts)]
    return out


# --- measure ------------------------------------------------------------------------------------


def measure(op, shape, reps, bw, log, peers=True):
    case = make_case(op, shape)
    case.truth()
    rows = []

    def record(name, fn, kind):
        row = {"op": op, "shape": list(shape), "variant": name, "kind": kind}
        try:
            reason = case.check(fn)
            if reason:
                row.update(status="wrong", note=reason)
            else:
                call = case.run_full(fn)[0]
                ms = gpu_time_ms(call, reps)
                row.update(status="ok", ms=ms, pct_copy=100 * case.bytes / (ms * 1e-3) / 1e9 / bw)
        except Exception as e:  # noqa: BLE001 (recorded, the sweep goes on)
            row.update(status="error", note=f"{type(e).__name__}: {str(e)[:200]}")
        rows.append(row)
        return row

    fn = case.triton_fn()
    for name, setter in variants(op, case):
        setter()
        record(name, fn, "triton")
    reset(op)
    breakdown(op, case, fn, rows, reps)
    best = best_variants(op, rows)
    if op != "rope" and best:
        set_norm_config(best.get("fwd"), best.get("bwd"), best.get("col"))
        record("tuned", fn, "triton")
        reset(op)
    for name, peer in case.peers().items() if peers else ():
        record(name, peer, "peer")
    log(summary_line(op, shape, rows))
    return rows


def breakdown(op, case, fn, rows, reps):
    """GPU time of the table's forward alone, backward alone and (norms) of each partial-sum
    configuration alone: where the time goes."""
    shape = list(case.shape) if op == "rope" else [case.M, case.N]
    base = {"op": op, "shape": shape, "status": "ok", "kind": "part"}
    ins, grads = (
        ((case.q, case.k), (case.dq, case.dk)) if op == "rope" else ((case.x, *case.params), (case.dy,))
    )
    try:
        rows.append({**base, "variant": "table fwd only", "ms": gpu_time_ms(lambda: fn(*ins), reps)})
        leaves = [t.detach().requires_grad_() for t in ins]
        out = fn(*leaves)
        out = out if isinstance(out, tuple) else (out,)

        def bwd():
            for t in leaves:
                t.grad = None
            torch.autograd.backward(out, grads, retain_graph=True)

        rows.append({**base, "variant": "table bwd only", "ms": gpu_time_ms(bwd, reps)})
        if op != "rope" and not LEAN["on"]:
            from lmkernels.backends.triton import _norms

            cfg = _norms.bwd_config(op, case.N)
            tiles = _norms.num_tiles(case.M, cfg.rows)
            P = _norms.persistent_programs(tiles, cfg.programs_per_sm, case.x.device)
            partial = torch.randn(P, case.N, device=DEVICE)
            total = torch.empty(case.N, device=DEVICE, dtype=torch.bfloat16)
            saved = _norms.SUM_CONFIG
            for sc in SUM_CANDIDATES:
                _norms.SUM_CONFIG = sc
                ms = gpu_time_ms(lambda: _norms.sum_partials(partial, total), reps)
                rows.append({**base, "variant": f"sum P{P} bp{sc[0]} bn{sc[1]} w{sc[2]}", "ms": ms})
            _norms.SUM_CONFIG = saved
    except Exception as e:  # noqa: BLE001 (recorded, the sweep goes on)
        rows.append({**base, "variant": "breakdown", "status": "error", "note": str(e)[:200]})


def best_variants(op, rows):
    """The fastest correct forward and backward config (norms), by full fwd+bwd time: the
    keyword arguments of set_norm_config."""
    ok = [r for r in rows if r["status"] == "ok" and r["kind"] == "triton" and r["variant"] in NAMED]
    out = {}
    if op == "rope" or SHORT["on"] or LEAN["on"]:
        return out
    for half in ("fwd", "bwd"):
        mine = [r for r in ok if r["variant"].startswith(half)]
        if mine:
            cfg = NAMED[min(mine, key=lambda r: r["ms"])["variant"]]
            out[half] = cfg[half]
            if half == "bwd" and cfg.get("col"):
                out["col"] = cfg["col"]
    return out


def _get(rows, name):
    r = next((r for r in rows if r["variant"] == name and r["status"] == "ok"), None)
    return r["ms"] if r else None


def point_summary(op, shape, rows):
    ok = [r for r in rows if r["status"] == "ok" and r["kind"] == "triton"]
    table, comp, lig = _get(rows, "table"), _get(rows, "compile"), _get(rows, "liger")
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    if op != "rope":
        tuned = _get(rows, "tuned")
        best = {"variant": "tuned", "ms": tuned} if tuned else best
    b = make_bytes(op, shape)
    return {
        "op": op,
        "shape": "x".join(str(s) for s in shape if s is not None),
        "table_ms": table,
        "best_ms": best["ms"] if best else None,
        "best": best["variant"] if best else None,
        "compile_ms": comp,
        "liger_ms": lig,
        "bytes": b,
        "wrong": [r["variant"] for r in rows if r["status"] != "ok"],
    }


def make_bytes(op, shape):
    if op == "rope":
        B, Hq, Hkv, T, D, _ = shape
        return 4 * B * (Hq + Hkv) * T * D * E
    return 5 * shape[0] * shape[1] * E


def summary_line(op, shape, rows):
    s = point_summary(op, shape, rows)
    f = lambda v: f"{v:.4f}" if v else "-"  # noqa: E731
    return f"{op} {s['shape']}: table {f(s['table_ms'])} best {f(s['best_ms'])} ({s['best']}) compile {f(s['compile_ms'])} liger {f(s['liger_ms'])}"


def markdown(summaries, bw, meta, rows=()):
    lines = [
        "# Roofline tuning (fwd+bwd, bf16, GPU time)",
        "",
        f"Device {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, liger {meta['liger']}; "
        f"copy bandwidth {bw:.0f} GB/s (2 GiB device copy, read + write).",
        f"Command: `{meta['command']}`",
        "",
        "| op | shape | table ms | % copy | best ms | % copy | best variant | compile ms | liger ms | table/compile | table/liger |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        pct = lambda ms, s=s: f"{100 * s['bytes'] / (ms * 1e-3) / 1e9 / bw:.0f}" if ms else "-"  # noqa: E731
        ratio = lambda a, b: f"{b / a:.2f}x" if a and b else "-"  # noqa: E731
        ms = lambda v: f"{v:.4f}" if v else "-"  # noqa: E731
        lines.append(
            f"| {s['op']} | {s['shape']} | {ms(s['table_ms'])} | {pct(s['table_ms'])} | {ms(s['best_ms'])} | "
            f"{pct(s['best_ms'])} | {s['best']} | {ms(s['compile_ms'])} | {ms(s['liger_ms'])} | "
            f"{ratio(s['table_ms'], s['compile_ms'])} | {ratio(s['table_ms'], s['liger_ms'])} |"
        )
    lines.append("")
    lines.append("Ratios: peer time / our table time (> 1: ours faster). 'wrong' variants failed the check.")
    if any(s["op"] == "rope" for s in summaries) and not LEAN["on"]:
        lines += roofline_rope.suggestions(rows)
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ops", default="rms_norm,layer_norm,rope")
    ap.add_argument("--grid", default="tune", choices=sorted({*NORM_GRID, *ROPE_GRID}))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--budget", type=float, default=330.0, help="seconds; stop starting new points after")
    ap.add_argument(
        "--short", action="store_true", help="only the table and the variants added since the last tuning run"
    )
    ap.add_argument(
        "--lean", action="store_true", help="only the table and the previous table where it changed"
    )
    for name, (_, help_text) in BWD_FAMILIES.items():  # --prefetch, --hold, ...
        ap.add_argument(f"--{name}", dest="family", action="store_const", const=name, help=help_text)
    ap.add_argument(
        "--rope-layout",
        default="bhtd",
        choices=["bhtd", "bthd"],
        help="RoPE's q, k: contiguous (B, H, T, D), or transposes of (B, T, H, D) (transformers)",
    )
    ap.add_argument(
        "--no-peers", dest="peers", action="store_false", help="time no peers (A/B runs of our variants)"
    )
    ap.add_argument("--warm-budget", type=float, default=150.0, help="seconds for the parallel compile")
    args = ap.parse_args(argv)
    SHORT["on"], LEAN["on"], FAMILY["name"] = args.short, args.lean, args.family
    os.environ["ROOFLINE_ROPE_LAYOUT"] = args.rope_layout  # read by RopeCase, workers included
    # One compiled reference per shape, all of the same function: past dynamo's default limit
    # of 8 recompiles the peer silently ran eager (run 4's 12-17x slower compile column).
    torch._dynamo.config.cache_size_limit = 4096
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    if DEVICE == "cuda":
        os.environ.pop("TRITON_INTERPRET", None)
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    ops = args.ops.split(",")
    grids = {op: (ROPE_GRID if op == "rope" else NORM_GRID).get(args.grid, []) for op in ops}
    # The ops take turns, so that a budget that runs out cuts every op's last shapes.
    jobs = [(op, g[i]) for i in range(max(map(len, grids.values()))) for op, g in grids.items() if i < len(g)]
    log = lambda msg: print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)  # noqa: E731
    if args.jobs > 1:
        pool = cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn"))
        futures = [
            pool.submit(warm, g, args.short, args.lean, p, n, args.family, args.peers)
            for g, p, n in warm_groups(jobs)
        ]
        try:
            for f in cf.as_completed(futures, timeout=args.warm_budget):
                log(f"warm {f.result()}")
        except cf.TimeoutError:
            log("warm-up budget spent: the rest compiles while it is timed")
        pool.shutdown(wait=False, cancel_futures=True)
    import triton

    lig = None
    try:
        from importlib.metadata import version

        lig = version("liger-kernel")
    except Exception:  # noqa: BLE001
        pass
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "liger": lig,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    bw = copy_bandwidth_gbps(args.reps)
    log(f"copy bandwidth {bw:.0f} GB/s")
    rows, summaries = [], []
    for op, shape in jobs:
        if time.time() - t_start > args.budget:
            log(f"budget spent: skipping {op} {shape}")
            continue
        try:
            point = measure(op, shape, args.reps, bw, log, args.peers)
        except Exception as e:  # noqa: BLE001 (e.g. out of memory: the other points go on)
            log(f"{op} {shape} failed: {type(e).__name__}: {str(e)[:300]}")
            torch.cuda.empty_cache()
            continue
        rows += point
        summaries.append(point_summary(op, shape, point))
        with open(os.path.join(args.out, "roofline.json"), "w") as f:
            json.dump({"meta": meta, "copy_gbps": bw, "summary": summaries, "rows": rows}, f, indent=1)
    md = markdown(summaries, bw, meta, rows)
    with open(os.path.join(args.out, "roofline.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
