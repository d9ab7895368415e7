"""Tune the launch configurations of the RMSNorm, LayerNorm and RoPE Triton kernels (one GPU).

    python benchmarks/tune_norms.py --out DIR                      # norms and RoPE, the tune grid
    python benchmarks/tune_norms.py --out DIR --ops rope --grid final --table-only

For each op and shape of the grid: every candidate configuration (CANDIDATES below: forward and
backward of the norms, tried independently with the other half at the table's choice; RoPE's tile
kernel and position kernel) is first checked against an fp32 reference (each output within 2x
the eager bf16 error + 1e-3, outputs poisoned with NaN first), then timed fwd+bwd: GPU time with
the launch queue filled ahead (lmkernels.harness.bench.measure.gpu_time_ms, L2 flushed), median
of --reps, as a share of the copy bandwidth measured in the same run. The norms' best forward
and best backward are then timed together ("tuned"). torch.compile of the eager reference and
Liger (when installed) run beside them (--no-peers skips them). --table-only times the committed
tables and the peers alone (the numbers `lmkernels bench --suite readme --part ops` records).

The Triton kernels and the compiled references are compiled first by --jobs worker processes,
whose on-disk caches then serve the timing process (--warm-budget seconds at most).

Writes DIR/tune.json (device, versions, command; every variant's row; per point the table's and
the best configurations as fields of _norms.FwdConfig / BwdConfig or rope.TILE_TUNED's tuple)
and DIR/tune.md (a table per point; for RoPE the tile-table entry each key's timings suggest).
The winners go into the tables by hand (backends/triton/_norms_config.py TUNED, rope.py
TILE_TUNED), then `lmkernels bench --suite readme --part ops` measures the result.

The candidates are set through the backends' tuning hooks, all in set_norm_config and
set_rope_config below: _norms.FORCE_FWD / FORCE_BWD / COL_CONFIG and rope.TILE_ELEMENTS /
NUM_WARPS / MIN_PROGRAMS / KERNEL / TILE_CONFIG / TILE_TUNED.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import json
import math
import multiprocessing as mp
import os
import shlex
import sys
import time

import torch

from lmkernels.harness.bench.suite import NORM_GRIDS, ROPE_GRIDS

DEVICE = "cuda"
E = 2  # bytes per bf16 element
NORMS = {
    **NORM_GRIDS,
    "tune": [(16384, n) for n in (1024, 2048, 3584, 4096, 5120, 8192, 11008, 16384)]
    + [(4096, 1024), (4096, 16384), (65536, 1024), (65536, 4096), (65536, 16384)],
}
ROPES = {
    **ROPE_GRIDS,
    "tune": [
        (1, 32, 8, 1024, 128, None),
        (1, 32, 8, 8192, 128, None),
        (1, 32, 8, 131072, 128, None),
        (4, 32, 32, 4096, 128, None),
        (2, 16, 16, 8192, 64, None),
        (1, 16, 4, 16384, 256, None),
        (1, 32, 8, 16384, 128, 64),
    ],
    # The tile table's keys over batch sizes, for the choice between the tile and position kernel.
    "tiles": [
        (b, hq, hkv, t, d, r)
        for b in (1, 4, 8)
        for t in (1024, 8192)
        for hq, hkv, d, r in ((16, 16, 64, None), (16, 4, 256, None), (32, 8, 128, 64), (32, 32, 128, None))
    ],
}
for _grids in (NORMS, ROPES):
    _grids["all"] = _grids["final"] + _grids["offgrid"]


# --- the candidates -------------------------------------------------------------------------------


def _block(N: int) -> int:
    return 1 << (N - 1).bit_length()


def norm_fwd_candidates(N: int, op: str) -> list:
    """Forward layouts: rows x warps of a register-held row; for wide rows the row in chunks
    read again from L2 (eviction hints); each also compiled for the width (const_n)."""
    from lmkernels.backends.triton import _norms

    block, out = _block(N), [dataclasses.replace(_norms.fwd_config(op, N), const_n=True)]
    for rows in (1, 2, 4, 8) if N <= _norms.MAX_FUSED_N else ():
        for warps in (2, 4, 8, 16, 32):
            per_thread = rows * block // (32 * warps)
            if (2048 <= rows * block <= 16384 and 8 <= per_thread <= 32) or (
                block >= 16384 and warps == 32 and rows == 1
            ):
                out.append(_norms.FwdConfig(rows, block, True, warps))
    for chunk, warps in ((1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (4096, 16)):
        if block >= 4096 and chunk < N:
            for hints, const_n in ((False, False), (True, False), (True, True)):
                out.append(_norms.FwdConfig(1, chunk, False, warps, hints, const_n=const_n))
    return list(dict.fromkeys(out))


def _splits(N: int, block: int) -> tuple:
    """(block, tail) of a row held as one padded register block, or as two: the largest power of
    two <= N, then the rest rounded up to a power of two."""
    return ((block, 0), (block // 2, _block(N - block // 2)))


def norm_bwd_candidates(N: int, op: str) -> list:
    """Backward layouts: rows x warps x programs per SM, partial sums in registers or in memory;
    the table's own compiled for the width and pipelined (stages); above 4096 columns the row as
    one or two register blocks with x and dy read again after the row sums (reload_x) and the
    weight gradients left to the column kernel (apart); wider than MAX_FUSED_N the column-block
    path."""
    from lmkernels.backends.triton import _norms

    B, regs, block = _norms.BwdConfig, _norms.PATH_REGS, _block(N)
    if N > _norms.MAX_FUSED_N:
        return [
            B(1, b, _norms.PATH_WIDE, w, pps, apart=apart, stages=st)
            for b, w in ((2048, 8), (4096, 8), (4096, 16))
            for pps in (1, 2)
            for st in (1, 3)
            for apart in (_norms.APART_NONE, _norms.APART_ALL)
        ]
    table = _norms.bwd_config(op, N)
    out = [dataclasses.replace(table, const_n=True)]
    out += [dataclasses.replace(table, stages=st) for st in (1, 2, 3, 4, 5) if st != table.stages]
    for path in [regs] + ([_norms.PATH_MEM] if block >= 4096 else []):
        for rows in (1, 2, 4, 8):
            for warps in (4, 8, 16, 32):
                if 1024 <= rows * block <= 16384 and 8 <= rows * block // (32 * warps) <= 16:
                    for pps in sorted({max(1, 32 // warps), max(1, 64 // warps)}):
                        out.append(B(rows, block, path, warps, pps))
    if block >= 8192:
        aparts = [_norms.APART_NONE] + ([_norms.APART_DB, _norms.APART_ALL] if op == "layer_norm" else [])
        for lo, tail in _splits(N, block):
            for warps in (8, 16, 32):
                for pps, st in ((1, 1), (1, 3), (2, 3)):
                    for apart in aparts:
                        out.append(B(1, lo, regs, warps, pps, True, tail, apart, st, True, reload_x=True))
    return list(dict.fromkeys(out))


# Column-kernel configurations tried with the "apart" candidates: (BLOCK_M, BLOCK_N, warps, per SM).
COL_CANDIDATES = [(32, 128, 4, 8), (16, 256, 4, 8), (64, 64, 8, 4)]
# RoPE's position kernel: (TILE_ELEMENTS, NUM_WARPS, MIN_PROGRAMS); 2**30: one head group a program.
POS_CANDIDATES = [
    (t, w, p) for t in (1024, 2048, 4096) for w in (2, 4, 8) for p in (8192, 2**30) if (t, w) != (1024, 8)
]
# RoPE's tile kernel: rope.TILE_TUNED's values (tile elements, warps, least programs, tables
# kept over the head loop, head-loop stages).
TILE_CANDIDATES = [
    (e, w, p, once, st)
    for e, w in ((1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 8))
    for p, once in ((2048, True), (8192, True), (8192, False), (2**30, True))
    for st in (1, 2)
]


def fwd_name(f) -> str:
    tag = f"fwd r{f.rows} w{f.num_warps}" if f.single_block else f"fwd-wide b{f.block} w{f.num_warps}"
    return (
        tag
        + (" hints" if f.hints else "")
        + (f" s{f.stages}" if f.stages > 1 else "")
        + (" const" if f.const_n else "")
    )


def bwd_name(b) -> str:
    from lmkernels.backends.triton import _norms

    path = {_norms.PATH_REGS: "regs", _norms.PATH_MEM: "mem", _norms.PATH_WIDE: "wide"}[b.path]
    tag = f"bwd {path}{'-rw' if b.reload_w else ''} r{b.rows} b{b.block} w{b.num_warps} p{b.programs_per_sm}"
    tag += f" t{b.tail}" if b.tail else ""
    tag += {_norms.APART_DB: " apart-db", _norms.APART_ALL: " apart-all"}.get(b.apart, "")
    tag += f" s{b.stages}" if b.stages > 1 else ""
    flags = (("const", b.const_n), ("rx", b.reload_x), ("pf", b.prefetch), ("hx", b.hold_x), ("fma", b.fma))
    return tag + "".join(f" {name}" for name, on in flags if on)


def tile_name(cfg) -> str:
    e, w, p, once, st = cfg
    return f"tile e{e} w{w} p{p} {'once' if once else 'reload'}" + (f" st{st}" if st > 1 else "")


# --- setting a configuration through the backends' hooks ------------------------------------------

_DEFAULTS: dict = {}


def set_norm_config(fwd=None, bwd=None, col=None) -> None:
    from lmkernels.backends.triton import _norms

    default = _DEFAULTS.setdefault("col", _norms.COL_CONFIG)
    _norms.FORCE_FWD, _norms.FORCE_BWD, _norms.COL_CONFIG = fwd, bwd, col or default


def set_rope_config(pos=None, kernel=None, tile=None) -> None:
    """pos: the position kernel's (TILE_ELEMENTS, NUM_WARPS, MIN_PROGRAMS); kernel: "pos" or
    "tile" forced; tile: a tile-kernel configuration. None everywhere: the committed tables."""
    from lmkernels.backends.triton import rope

    default = _DEFAULTS.setdefault("rope", (rope.TILE_ELEMENTS, rope.NUM_WARPS, rope.MIN_PROGRAMS))
    rope.TILE_ELEMENTS, rope.NUM_WARPS, rope.MIN_PROGRAMS = pos or default
    rope.KERNEL, rope.TILE_CONFIG = kernel, tile


def reset(op: str) -> None:
    set_rope_config() if op == "rope" else set_norm_config()


def variants(op: str, case, table_only: bool) -> list:
    """(name, config as JSON, setter) for each variant of a point; the table first."""
    out = [("table", None, lambda: reset(op))]
    if table_only:
        return out
    if op == "rope":
        out.append(("pos table", None, lambda: set_rope_config(kernel="pos")))
        out += [
            (tile_name(c), c, lambda c=c: set_rope_config(kernel="tile", tile=c)) for c in TILE_CANDIDATES
        ]
        out += [
            (f"pos e{c[0]} w{c[1]} p{c[2]}", c, lambda c=c: set_rope_config(c, kernel="pos"))
            for c in POS_CANDIDATES
        ]
        return out
    N = case.N
    out += [
        (fwd_name(f), dataclasses.asdict(f), lambda f=f: set_norm_config(fwd=f))
        for f in norm_fwd_candidates(N, op)
    ]
    for b in norm_bwd_candidates(N, op):
        cols = COL_CANDIDATES if b.apart and b.programs_per_sm == 1 else [None]
        for col in cols:
            name = bwd_name(b) + (f" c{'x'.join(map(str, col))}" if col and col != cols[0] else "")
            config = dataclasses.asdict(b) | ({"col": list(col)} if col else {})
            out.append((name, config, lambda b=b, col=col: set_norm_config(bwd=b, col=col)))
    return list({name: (name, cfg, setter) for name, cfg, setter in out}.values())


# --- the measured cases ---------------------------------------------------------------------------


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


class Case:
    """One point: its inputs, upstream gradients, fp32 truth and the check of a variant."""

    def __init__(self, op: str, shape: tuple, layout: str = "bhtd"):
        self.op, self.shape = op, shape
        g = torch.Generator(device=DEVICE).manual_seed(sum(s or 0 for s in shape))
        randn = lambda *size: torch.randn(*size, device=DEVICE, generator=g)  # noqa: E731
        if op == "rope":
            from lmkernels.ops.rope import rope_reference, rope_tables

            B, Hq, Hkv, T, D, R = shape

            def heads(H):  # bthd: transposes of (B, T, H, D) memory, as transformers passes q, k
                return (
                    randn(B, T, H, D).bfloat16().transpose(1, 2)
                    if layout == "bthd"
                    else randn(B, H, T, D).bfloat16()
                )

            cos, sin = (t.to(DEVICE).bfloat16() for t in rope_tables(torch.arange(T), R or D, "neox"))
            self.inputs, self.grads = [heads(Hq), heads(Hkv)], [heads(Hq), heads(Hkv)]
            self.ref = lambda q, k: rope_reference(q, k, cos, sin, rotary_dim=R)
            self.triton = lambda q, k: _lk().rope(q, k, cos, sin, rotary_dim=R, backend="triton")
            self.bytes = 4 * B * (Hq + Hkv) * T * D * E
            self.names = ["q_out", "k_out", "dq", "dk"]
        else:
            from lmkernels.ops.layer_norm import layer_norm_reference
            from lmkernels.ops.rms_norm import rms_norm_reference

            M, self.N = shape
            ln = op == "layer_norm"
            x = (randn(M, self.N) + (0.5 if ln else 0.0)).bfloat16()
            params = [(randn(self.N) * 0.5 + 1).bfloat16()] + (
                [(randn(self.N) * 0.5).bfloat16()] if ln else []
            )
            self.inputs, self.grads = [x, *params], [randn(M, self.N).bfloat16()]
            self.ref = layer_norm_reference if ln else rms_norm_reference
            public = "layer_norm" if ln else "rms_norm"
            self.triton = lambda *a: getattr(_lk(), public)(*a, backend="triton")
            self.bytes = 5 * M * self.N * E
            self.names = ["y", "dx", "dw", "db"]

    @functools.cached_property
    def truth(self) -> list:  # computed where a variant is checked, not in the compiling workers
        return self._outputs(self.ref, torch.float32)

    @functools.cached_property
    def eager_err(self) -> list[float]:
        return self.errors(self.ref)

    def _outputs(self, fn, dtype=None, poison=False):
        from lmkernels.utils import poison_outputs

        leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in self.inputs]
        with poison_outputs() if poison else contextlib.nullcontext():
            out = fn(*leaves)
            out = list(out) if isinstance(out, tuple) else [out]
            torch.autograd.backward(out, [g.to(dtype or g.dtype) for g in self.grads])
        return [o.detach() for o in out] + [t.grad for t in leaves]

    def errors(self, fn) -> list[float]:
        return [rel_err(o, t) for o, t in zip(self._outputs(fn, poison=True), self.truth)]

    def check(self, fn) -> str | None:
        """None if every output is within 2x the eager bf16 error + 1e-3, else why not."""
        for name, e, ee in zip(self.names, self.errors(fn), self.eager_err):
            if not e <= 2 * ee + 1e-3:
                return f"{name} rel err {e:.3g} > 2 x eager {ee:.3g} + 1e-3"
        return None

    def step(self, fn):
        """The timed call: forward and backward from fresh leaves."""
        leaves = [t.detach().requires_grad_() for t in self.inputs]

        def run():
            for t in leaves:
                t.grad = None
            out = fn(*leaves)
            torch.autograd.backward(list(out) if isinstance(out, tuple) else [out], self.grads)

        return run

    def peers(self) -> dict:
        out = {"compile": torch.compile(self.ref, dynamic=False)}
        try:
            from lmkernels.backends import adapters

            if adapters.liger_unavailable() is None:
                if self.op == "rope" and self.shape[5] is None:  # Liger rotates whole heads only
                    out["liger"] = lambda q, k: adapters.liger_rope(q, k, *_tables(self.shape))
                elif self.op != "rope":
                    out["liger"] = (
                        adapters.liger_rms_norm if self.op == "rms_norm" else adapters.liger_layer_norm
                    )
        except ImportError:
            pass
        return out


def _tables(shape):
    from lmkernels.ops.rope import rope_tables

    T, D = shape[3], shape[4]
    return tuple(t.to(DEVICE).bfloat16() for t in rope_tables(torch.arange(T), D, "neox"))


def _lk():
    import lmkernels

    return lmkernels


# --- the run ----------------------------------------------------------------------------------------


def measure(op, shape, args, copy_gbps, log) -> list[dict]:
    from lmkernels.harness.bench.measure import gpu_time_ms

    case = Case(op, shape, args.rope_layout)
    rows = []

    def record(name, config, fn, kind):
        row = {"op": op, "shape": list(shape), "variant": name, "kind": kind, "config": config}
        try:
            reason = case.check(fn)
            if reason:
                row.update(status="wrong", note=reason)
            else:
                run = case.step(fn)
                run()
                ms = gpu_time_ms(run, [], runs=args.reps)
                row.update(status="ok", ms=ms, pct_copy=100 * case.bytes / (ms * 1e-3) / 1e9 / copy_gbps)
        except Exception as e:  # noqa: BLE001  (recorded, the sweep goes on)
            row.update(status="error", note=f"{type(e).__name__}: {str(e)[:200]}")
        rows.append(row)

    for name, config, setter in variants(op, case, args.table_only):
        setter()
        record(name, config, case.triton, "triton")
    reset(op)
    best = best_norm_configs(rows) if op != "rope" and not args.table_only else {}
    if best:
        set_norm_config(best.get("fwd"), best.get("bwd"), best.get("col"))
        record(
            "tuned",
            {k: dataclasses.asdict(v) if k != "col" else v for k, v in best.items()},
            case.triton,
            "triton",
        )
        reset(op)
    for name, peer in case.peers().items() if args.peers else ():
        record(name, None, peer, "peer")
    log(summary_line(op, shape, rows))
    return rows


def best_norm_configs(rows) -> dict:
    """The fastest correct forward and backward (each timed with the other half at the table's)."""
    from lmkernels.backends.triton import _norms

    out = {}
    for half, cls in (("fwd", _norms.FwdConfig), ("bwd", _norms.BwdConfig)):
        mine = [r for r in rows if r["status"] == "ok" and r["variant"].startswith(half)]
        if mine:
            config = dict(min(mine, key=lambda r: r["ms"])["config"])
            col = config.pop("col", None)
            out[half] = cls(**config)
            if col:
                out["col"] = tuple(col)
    return out


def _ms(rows, name):
    return next((r["ms"] for r in rows if r["variant"] == name and r["status"] == "ok"), None)


def summary_line(op, shape, rows) -> str:
    ok = [r for r in rows if r["status"] == "ok" and r["kind"] == "triton"]
    best = min(ok, key=lambda r: r["ms"]) if ok else {"variant": "-", "ms": None}
    f = lambda v: f"{v:.4f}" if v else "-"  # noqa: E731
    times = " ".join(f"{n} {f(_ms(rows, n))}" for n in ("table", "compile", "liger"))
    return f"{op} {'x'.join(str(s) for s in shape if s)}: {times}; best {best['variant']} {f(best['ms'])}"


def rope_suggestions(rows) -> list[str]:
    """Per rope.TILE_TUNED key (rotary half width, partial): the variant with the least geometric
    mean of its time over each point's fastest, as the entry it suggests."""
    points: dict = {}
    for r in rows:
        if r["op"] == "rope" and r["status"] == "ok" and r["kind"] == "triton":
            points.setdefault(tuple(r["shape"]), {})[r["variant"]] = (r["ms"], r["config"])
    by_key: dict = {}
    for shape, times in points.items():
        by_key.setdefault(((shape[5] or shape[4]) // 2, shape[4] > (shape[5] or shape[4])), []).append(times)
    lines = ["", "## RoPE: the tile-table entry each key's timings suggest", ""]
    for key, pts in sorted(by_key.items()):
        names = [n for n in pts[0] if n != "table" and all(n in t for t in pts)]
        if not names:
            continue
        score = lambda n, pts=pts, names=names: math.exp(  # noqa: E731
            sum(math.log(t[n][0] / min(t[m][0] for m in names)) for t in pts) / len(pts)
        )
        best = min(names, key=score)
        entry = (
            "no entry (the position kernel)"
            if best.startswith("pos")
            else f"TILE_TUNED[{key}] = {tuple(pts[0][best][1])}"
        )
        table = f"table {score('table'):.3f}" if all("table" in t for t in pts) else ""
        lines.append(f"- {key}: **{best}** ({score(best):.3f}) -> {entry}; {table}")
    return lines


def markdown(rows, meta) -> str:
    lines = [f"# Tuning, fwd+bwd bf16 GPU time, {meta['device']}", "", f"`{meta['command']}`", ""]
    lines += [
        f"torch {meta['torch']}, triton {meta['triton']}; copy bandwidth {meta['copy_gbps']:.0f} GB/s.",
        "",
    ]
    lines += ["| op | shape | table ms | % copy | best ms | % copy | best | compile ms | liger ms |"]
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    points: dict = {}
    for r in rows:
        points.setdefault((r["op"], tuple(r["shape"])), []).append(r)
    for (op, shape), rs in points.items():
        ok = [r for r in rs if r["status"] == "ok" and r["kind"] == "triton"]
        best, table = (
            (min(ok, key=lambda r: r["ms"]) if ok else {}),
            next((r for r in ok if r["variant"] == "table"), {}),
        )
        pct = lambda r: f"{r['pct_copy']:.0f}" if r.get("pct_copy") else "-"  # noqa: E731
        ms = lambda v: f"{v:.4f}" if v else "-"  # noqa: E731
        lines.append(
            f"| {op} | {'x'.join(str(s) for s in shape if s)} | {ms(table.get('ms'))} | {pct(table)} | "
            f"{ms(best.get('ms'))} | {pct(best)} | {best.get('variant', '-')} | {ms(_ms(rs, 'compile'))} | {ms(_ms(rs, 'liger'))} |"
        )
    wrong = sorted({f"{r['op']} {r['variant']}" for r in rows if r["status"] != "ok"})
    lines += ["", f"Failed the check or errored: {len(wrong)} variants (tune.json has the reasons)."]
    return "\n".join(lines + rope_suggestions(rows)) + "\n"


def warm(group, table_only, layout, part, parts):
    """Worker: compile every variant and peer of a group of points once (fills the disk caches)."""
    torch._dynamo.config.cache_size_limit = torch._dynamo.config.accumulated_cache_size_limit = 4096
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # the workers already run side by side
    for op, shape in group:
        case = Case(op, shape, layout)
        for _, _, setter in variants(op, case, table_only)[part::parts]:
            try:
                setter()
                case.step(case.triton)()
            except Exception:  # noqa: BLE001  (the timing process records the error)
                pass
        reset(op)
        for peer in case.peers().values() if part == 0 else ():
            try:
                case.step(peer)()
            except Exception:  # noqa: BLE001
                pass
        del case
        torch.cuda.empty_cache()
    return f"{group[0][0]} {[s for _, s in group]} part {part + 1}/{parts}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--ops", default="rms_norm,layer_norm,rope")
    p.add_argument("--grid", default="tune", choices=sorted(set(NORMS) | set(ROPES)))
    p.add_argument("--reps", type=int, default=30, help="GPU-timed calls per variant (median)")
    p.add_argument("--jobs", type=int, default=12, help="compiling worker processes")
    p.add_argument("--warm-budget", type=float, default=150.0, help="seconds for the parallel compile")
    p.add_argument("--budget", type=float, default=330.0, help="seconds; later points are skipped")
    p.add_argument("--table-only", action="store_true", help="the committed tables and the peers only")
    p.add_argument("--no-peers", dest="peers", action="store_false", help="no torch.compile, no Liger")
    p.add_argument(
        "--rope-layout", default="bhtd", choices=["bhtd", "bthd"], help="bthd: as transformers passes q, k"
    )
    args = p.parse_args(argv)
    torch._dynamo.config.cache_size_limit = torch._dynamo.config.accumulated_cache_size_limit = 4096
    os.environ.pop("TRITON_INTERPRET", None)
    start = time.time()
    log = lambda msg: print(f"[{time.time() - start:6.1f}s] {msg}", flush=True)  # noqa: E731
    grids = {op: (ROPES if op == "rope" else NORMS).get(args.grid, []) for op in args.ops.split(",")}
    # The ops take turns, so that a budget that runs out cuts every op's last points.
    jobs = [(op, g[i]) for i in range(max(map(len, grids.values()))) for op, g in grids.items() if i < len(g)]
    if args.jobs > 1:
        groups: dict = {}
        for op, shape in jobs:  # a group shares its Triton kernels (same op and row block)
            groups.setdefault((op, shape) if op == "rope" else (op, _block(shape[1])), []).append((op, shape))
        parts = 1 if args.table_only else 3
        pool = cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn"))
        futures = [
            pool.submit(warm, g, args.table_only, args.rope_layout, part, parts)
            for g in sorted(groups.values(), key=len, reverse=True)
            for part in range(parts)
        ]
        try:
            for f in cf.as_completed(futures, timeout=args.warm_budget):
                try:
                    log(f"warm {f.result()}")
                except Exception as e:  # noqa: BLE001  (e.g. out of memory: that group compiles later)
                    log(f"warm: {type(e).__name__}: {str(e)[:200]}")
        except cf.TimeoutError:
            log("warm-up budget spent: the rest compiles while it is timed")
        pool.shutdown(wait=False, cancel_futures=True)
    from lmkernels.harness.bench.data import versions
    from lmkernels.harness.bench.roofline import copy_bandwidth_gbps

    meta = {"device": torch.cuda.get_device_name(), **versions(), "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    meta["command"] = shlex.join(["python", *sys.argv]) if argv is None else shlex.join(argv)
    meta["copy_gbps"] = copy_bandwidth_gbps(DEVICE)
    log(f"copy bandwidth {meta['copy_gbps']:.0f} GB/s")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for op, shape in jobs:
        if time.time() - start > args.budget:
            log(f"budget spent: skipping {op} {shape}")
            continue
        try:
            rows += measure(op, shape, args, meta["copy_gbps"], log)
        except Exception as e:  # noqa: BLE001  (e.g. out of memory: the other points go on)
            log(f"{op} {shape} failed: {type(e).__name__}: {str(e)[:300]}")
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "tune.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    md = markdown(rows, meta)
    with open(os.path.join(args.out, "tune.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
