"""Tune the launch configurations of the RMSNorm, LayerNorm and RoPE Triton kernels (one GPU).

    lmkernels tune --out DIR                       # norms and RoPE, the tune grid
    lmkernels tune --out DIR --ops rope --grid final --table-only

A candidate (candidates.py) is an entry of the device's tables (configs.tables_for)
with some fields replaced (dataclasses.replace): a norm's NormEntry (forward fields, backward fields, const_n), the wide
path's WidePath and ColumnConfig, RoPE's RopeTileConfig and RopePosConfig. Each is resolved into
a launch configuration the way the op bodies resolve the table's (a copy of the table holding the
candidate) and passed to the launchers; nothing in the library is changed. Every candidate is
first checked against an fp32 reference (each output within 2x the eager bf16 error + 1e-3,
outputs poisoned with NaN first), then timed fwd+bwd: GPU time with the launch queue filled
ahead (lmkernels.harness.bench.measure.gpu_time_ms, L2 flushed), median of --reps, as a share of
the copy bandwidth measured in the same run. A norm's best forward and best backward candidates
are then timed as one entry ("tuned"). torch.compile of the eager reference and Liger (when
installed) run beside them (--no-peers skips them). --table-only times the committed tables and
the peers alone (the numbers the maintainers' suite records for the performance tables).

The Triton kernels and the compiled references are compiled first by --jobs worker processes,
whose on-disk caches then serve the timing process (--warm-budget seconds at most).

Writes DIR/tune.json (device, versions, command; every variant's row with its record's fields)
and DIR/tune.md (a table per point, then per table key the entry the timings suggest, as
configs.entry_text writes it, with its measured `why`). Where entries beat the tables it also
writes DIR/tuned-tables.json: the device's tables with those entries in place, in the file
format of configs.files; --install writes it where the package loads it on this GPU model
(~/.cache/lmkernels/configs/<gpu>-<arch>-triton<version>-v<schema>.json, LMKERNELS_CONFIG_DIR
moves it). Tuning results are data: the committed tables of a generation (hopper.py) change only
by hand, from tune.md's entries, after the maintainers' suite measures them.
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
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from lmkernels.backends.triton.configs.entry_text import entry_text
from lmkernels.backends.triton.configs.records import (
    ColumnConfig,
    NormEntry,
    RopePosConfig,
    RopeTileConfig,
    Tables,
    WidePath,
)
from lmkernels.harness.tune.candidates import (
    DEVICE,
    _block,
    as_json,
    base_entry,
    from_json,
    merged_entry,
    norm_table_with,
    rope_key,
    tables,
    variants,
)
from lmkernels.harness.tune.grids import NORMS, ROPES
from lmkernels.registry import LMKernelsError

E = 2  # bytes per bf16 element


# --- the measured cases ---------------------------------------------------------------------------


class _NormLaunch(torch.autograd.Function):
    """A norm's forward and backward through the launchers, launched as fwd and bwd say (the
    public ops' defaults: eps, Llama casting)."""

    @staticmethod
    def forward(ctx, op, fwd, bwd, x, weight, bias=None):
        from lmkernels.backends.triton import norms

        if op == "rms_norm":
            y, *stats = norms.rms_norm_forward(x, weight, 1e-6, 0.0, "llama", fwd)
        else:
            y, *stats = norms.layer_norm_forward(x, weight, bias, 1e-5, fwd)
        ctx.save_for_backward(x, weight, *stats)
        ctx.op, ctx.bwd = op, bwd
        return y

    @staticmethod
    def backward(ctx, dy):
        from lmkernels.backends.triton import norms

        x, weight, *stats = ctx.saved_tensors
        if ctx.op == "rms_norm":
            (rstd,) = stats
            return None, None, None, *norms.rms_norm_backward(dy, x, weight, rstd, 0.0, "llama", ctx.bwd)
        mean, rstd = stats
        return (
            None,
            None,
            None,
            *norms.layer_norm_backward(dy, x, weight, mean, rstd, weight.dtype, ctx.bwd),
        )


class _RopeLaunch(torch.autograd.Function):
    """RoPE (neox) through the launcher, forward and backward (the inverse rotation) as cfg says:
    a RopeTileConfig runs the tile kernel, a RopePosConfig the position kernel."""

    @staticmethod
    def forward(ctx, cfg, q, k, cos, sin, R):
        from lmkernels.backends.triton import rope

        q_bthd, k_bthd = rope.is_bthd(q), rope.is_bthd(k)
        ctx.args = cfg, cos, sin, R, q_bthd, k_bthd
        return rope.rope_rotate_with(q, k, cos, sin, None, False, R, False, q_bthd, k_bthd, cfg)

    @staticmethod
    def backward(ctx, dq, dk):
        from lmkernels.backends.triton import rope

        cfg, cos, sin, R, q_bthd, k_bthd = ctx.args
        dq, dk = rope.rope_rotate_with(dq, dk, cos, sin, None, False, R, True, q_bthd, k_bthd, cfg)
        return None, dq, dk, None, None, None


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


class Case:
    """One point: its inputs, upstream gradients, fp32 truth, the table's record for it, and
    the check of a variant."""

    def __init__(self, op: str, shape: tuple, layout: str = "bhtd"):
        self.op, self.shape = op, shape
        g = torch.Generator(device=DEVICE).manual_seed(sum(s or 0 for s in shape))
        randn = lambda *size: torch.randn(*size, device=DEVICE, generator=g)  # noqa: E731
        if op == "rope":
            from lmkernels.backends.triton.rope import rope_config
            from lmkernels.ops.rope import rope_reference, rope_tables

            B, Hq, Hkv, T, D, R = shape

            def heads(H):  # bthd: transposes of (B, T, H, D) memory, as transformers passes q, k
                return (
                    randn(B, T, H, D).bfloat16().transpose(1, 2)
                    if layout == "bthd"
                    else randn(B, H, T, D).bfloat16()
                )

            self.R = R or D
            cos, sin = (t.to(DEVICE).bfloat16() for t in rope_tables(torch.arange(T), self.R, "neox"))
            self.tables = (cos, sin)
            self.inputs, self.grads = [heads(Hq), heads(Hkv)], [heads(Hq), heads(Hkv)]
            self.ref = lambda q, k: rope_reference(q, k, *self.tables, rotary_dim=R)
            self.triton = lambda q, k: _lk().rope(q, k, *self.tables, rotary_dim=R, backend="triton")
            self.table_record = rope_config(tables().rope, T, self.R, D, layout == "bhtd")
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
            self.table_record = base_entry(tables().norms, op, self.N)
            self.bytes = 5 * M * self.N * E
            self.names = ["y", "dx", "dw", "db"]

    def launch(self, record):
        """fwd+bwd launched as `record` (a table's record, or None: the op as called) says."""
        if record is None:
            return self.triton
        if self.op == "rope":
            return lambda q, k: _RopeLaunch.apply(record, q, k, *self.tables, self.R)
        from lmkernels.backends.triton.norms import bwd_config, fwd_config

        table = norm_table_with(tables().norms, record)
        fwd, bwd = fwd_config(table, self.op, self.N), bwd_config(table, self.op, self.N)
        return lambda *a: _NormLaunch.apply(self.op, fwd, bwd, *a)

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

    def errors(self, fn: Callable[..., Any]) -> list[float]:
        return [rel_err(o, t) for o, t in zip(self._outputs(fn, poison=True), self.truth)]

    def check(self, fn: Callable[..., Any]) -> str | None:
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
        out: dict[str, Callable[..., Any]] = {"compile": torch.compile(self.ref, dynamic=False)}
        try:
            from lmkernels.backends import adapters

            if adapters.liger_unavailable() is None:
                if self.op == "rope" and self.shape[5] is None:  # Liger rotates whole heads only
                    out["liger"] = lambda q, k: adapters.liger_rope(q, k, *self.tables)
                elif self.op != "rope":
                    out["liger"] = (
                        adapters.liger_rms_norm if self.op == "rms_norm" else adapters.liger_layer_norm
                    )
        except ImportError:
            pass
        return out


def _lk():
    import lmkernels

    return lmkernels


# --- the run ----------------------------------------------------------------------------------------


def measure(
    op: str,
    shape: tuple[int | None, ...],
    args: argparse.Namespace,
    copy_gbps: float,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    from lmkernels.harness.bench.measure import gpu_time_ms

    case = Case(op, shape, args.rope_layout)
    rows = []

    def record(name, config, fn, kind):
        row = {"op": op, "shape": list(shape), "variant": name, "kind": kind, "config": as_json(config)}
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

    for name, rec in variants(op, case, args.table_only):
        record(name, rec or case.table_record, case.launch(rec), "triton")
    tuned = tuned_entry(rows, case.table_record) if op != "rope" else None
    if tuned is not None:
        record("tuned", tuned, case.launch(tuned), "triton")
    for name, peer in case.peers().items() if args.peers else ():
        record(name, None, peer, "peer")
    log(summary_line(op, shape, rows))
    return rows


def tuned_entry(rows, base):
    """`base` (a norm entry) with the fastest forward candidate's forward and the fastest
    backward candidate's backward, where both beat the table; None otherwise (one alone is a
    candidate already timed)."""
    table_ms = _ms(rows, "table")
    if table_ms is None or not isinstance(base, NormEntry):
        return None
    best = {}
    for half in ("fwd", "bwd"):
        mine = [r for r in rows if r["status"] == "ok" and r["variant"].startswith(half + " ")]
        mine = [r for r in mine if r["ms"] < table_ms]
        if mine:
            best[half] = from_json(min(mine, key=lambda r: r["ms"])["config"])
    return merged_entry(base, best["fwd"], best["bwd"]) if len(best) == 2 else None


def _ms(rows, name):
    return next((r["ms"] for r in rows if r["variant"] == name and r["status"] == "ok"), None)


def summary_line(op: str, shape: tuple[int | None, ...], rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if r["status"] == "ok" and r["kind"] == "triton"]
    best = min(ok, key=lambda r: r["ms"]) if ok else {"variant": "-", "ms": None}
    f = lambda v: f"{v:.4f}" if v else "-"  # noqa: E731
    times = " ".join(f"{n} {f(_ms(rows, n))}" for n in ("table", "compile", "liger"))
    return f"{op} {'x'.join(str(s) for s in shape if s)}: {times}; best {best['variant']} {f(best['ms'])}"


def _why(speedups: Sequence[float]) -> str:
    lo, hi = f"{min(speedups):.2f}", f"{max(speedups):.2f}"
    n = len(speedups)
    return f"fwd+bwd {lo if lo == hi else f'{lo}-{hi}'}x the entry it replaces ({n} shape{'s' * (n > 1)})"


def entry_for(record: Any, key: tuple[Any, ...], why: str) -> str:
    """`record` as the generation's module holds it (configs.entry_text), with `why`."""
    if isinstance(record, (WidePath, ColumnConfig)):  # one each per table, not keyed entries
        return f"    {'wide' if isinstance(record, WidePath) else 'column'}={replace(record, why=why)!r},"
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    fields = {k: v for k, v in fields.items() if k not in ("op", "cols", "why", "half", "block_half")}
    if isinstance(record, NormEntry):
        return entry_text(record.op, record.cols[1], fields, why, cols=record.cols)
    kind = "rope_tile" if isinstance(record, RopeTileConfig) else "rope_position"
    return entry_text(kind, key[1], fields, why)


@dataclasses.dataclass(frozen=True)
class Winner:
    """The record the timings suggest for one table key: the least geometric mean of its time over
    the table's entry at every point of the key (score: the mean speedup)."""

    key: tuple  # ("rms_norm", (first, last)), ("wide",), ("rope", half, partial)
    points: int
    score: float
    record: Any
    speedups: tuple[float, ...]

    @property
    def why(self) -> str:
        return _why(self.speedups)


def winners(rows: list[dict[str, Any]]) -> list[Winner]:
    """Per table key (a norm entry's columns, the wide path, RoPE's rotary half width) and kind
    of record: of the records timed at every point of the key, the one with the least geometric
    mean of its time over the table's, where that beats the table. RoPE's tile and position
    records compete (a tile entry, or none and the position kernel)."""
    points: dict = {}
    for r in rows:
        if r["kind"] == "triton" and r["status"] == "ok":
            points.setdefault((r["op"], tuple(r["shape"])), {})[r["variant"]] = r
    by_key: dict = {}
    for (op, shape), named in points.items():
        table = named.get("table")
        if table is None:
            continue
        cols = (table["config"] or {}).get("cols")  # a norm entry's; the wide path has none
        key = ("rope", *rope_key(shape)) if op == "rope" else (op, tuple(cols)) if cols else ("wide",)
        by_key.setdefault(key, []).append(named)
    out = []
    for key, pts in by_key.items():
        timed: dict = {}  # (kind, record) -> the speedup over the table at each point
        for named in pts:
            for r in named.values():
                if r["variant"] != "table" and r["config"]:
                    kind = "rope" if key[0] == "rope" else r["config"]["record"]
                    speedup = named["table"]["ms"] / r["ms"]
                    timed.setdefault((kind, from_json(r["config"])), {})[r["op"], tuple(r["shape"])] = speedup
        best: dict = {}
        for (kind, rec), speedups in timed.items():
            score = math.exp(sum(map(math.log, speedups.values())) / len(pts))
            if len(speedups) == len(pts) and score > best.get(kind, (1.0,))[0]:
                best[kind] = (score, rec, tuple(speedups.values()))
        out += [Winner(key, len(pts), score, rec, speedups) for score, rec, speedups in best.values()]
        if not best:
            out.append(Winner(key, len(pts), 1.0, None, ()))
    return out


def suggestions(rows: list[dict[str, Any]]) -> list[str]:
    """The winners as the entries of a generation's module (configs.entry_text), with their
    measured `why`."""
    lines = ["", "## The entries the timings suggest", ""]
    for w in winners(rows):
        label = " ".join(map(str, w.key))
        if w.record is None:
            lines.append(f"- {label}: the table's entry is the fastest ({w.points} points)")
            continue
        kernel = ", the position kernel: no tile entry" if isinstance(w.record, RopePosConfig) else ""
        lines += [f"- {label} ({w.points} points, geometric mean {w.score:.3f}x{kernel}):", "", "```python"]
        lines += [entry_for(w.record, w.key, w.why).rstrip("\n"), "```", ""]
    return lines


def tuned_tables(base: Tables, found: list[Winner], name: str) -> Tables:
    """`base` (the tables the run measured against) with every winner in the place of the entry
    it beat: the tables `--install` writes (configs.files)."""
    norms, rope = base.norms, base.rope
    entries = {(e.op, e.cols): e for e in norms.entries}
    position = {(e.block_half, e.partial): e for e in rope.position}
    tile = {(e.half, e.partial): e for e in rope.tile}
    for w in found:
        rec = w.record
        if rec is None:
            continue
        rec = replace(rec, why=w.why)
        if isinstance(rec, NormEntry):
            entries[(rec.op, rec.cols)] = rec
        elif isinstance(rec, WidePath):
            norms = replace(norms, wide=rec)
        elif isinstance(rec, ColumnConfig):
            norms = replace(norms, column=rec)
        elif isinstance(rec, RopeTileConfig):
            tile[(rec.half, rec.partial)] = rec
        elif isinstance(rec, RopePosConfig):
            position[(rec.block_half, rec.partial)] = rec
            tile.pop(w.key[1:], None)  # the position kernel beat the tile entry: none for the width
    norms = replace(norms, entries=tuple(entries.values()))
    rope = replace(rope, position=tuple(position.values()), tile=tuple(tile.values()))
    return replace(base, name=name, norms=norms, rope=rope)


def install(
    rows: list[dict[str, Any]], meta: dict[str, Any], out: str, install_file: bool, log: Callable[[str], None]
) -> None:
    """Write the tuned tables: DIR/tuned-tables.json always (where winners beat the table), and
    with `install_file` the file the package loads on this GPU (configs.files)."""
    from lmkernels.backends.triton.configs import files

    found = [w for w in winners(rows) if w.record is not None]
    if not found:
        log("no candidate beat the tables at every point of a key: no tuned tables written")
        return
    identity = files.identity_of(torch.cuda.current_device())
    tuned = tuned_tables(tables(), found, f"tuned {identity.name}")
    content = files.file_content(tuned, identity, meta["command"])
    files.check_content(content, identity)
    with open(os.path.join(out, "tuned-tables.json"), "w") as f:
        json.dump(content, f, indent=1)
    log(f"{len(found)} entries beat the tables: {os.path.join(out, 'tuned-tables.json')}")
    if install_file:
        path = files.write_tuned(tuned, identity, command=meta["command"])
        log(f"installed: {path} (loaded on {identity.name} from now on; {files.ENV} moves it)")
    else:
        where = files.config_path(identity)
        log(f"to use them on this GPU: --install, or copy the file to {where}")


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
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
        best: dict[str, Any] = min(ok, key=lambda r: r["ms"]) if ok else {}
        table: dict[str, Any] = next((r for r in ok if r["variant"] == "table"), {})
        pct = lambda r: f"{r['pct_copy']:.0f}" if r.get("pct_copy") else "-"  # noqa: E731
        ms = lambda v: f"{v:.4f}" if v else "-"  # noqa: E731
        lines.append(
            f"| {op} | {'x'.join(str(s) for s in shape if s)} | {ms(table.get('ms'))} | {pct(table)} | "
            f"{ms(best.get('ms'))} | {pct(best)} | {best.get('variant', '-')} | {ms(_ms(rs, 'compile'))} | {ms(_ms(rs, 'liger'))} |"
        )
    wrong = sorted({f"{r['op']} {r['variant']}" for r in rows if r["status"] != "ok"})
    lines += ["", f"Failed the check or errored: {len(wrong)} variants (tune.json has the reasons)."]
    return "\n".join(lines + suggestions(rows)) + "\n"


def warm(group, table_only, layout, part, parts):
    """Worker: compile every variant and peer of a group of points once (fills the disk caches)."""
    torch._dynamo.config.cache_size_limit = torch._dynamo.config.accumulated_cache_size_limit = 4096
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # the workers already run side by side
    for op, shape in group:
        case = Case(op, shape, layout)
        for _, rec in variants(op, case, table_only)[part::parts]:
            try:
                case.step(case.launch(rec))()
            except Exception:  # noqa: BLE001  (the timing process records the error)
                pass
        for peer in case.peers().values() if part == 0 else ():
            try:
                case.step(peer)()
            except Exception:  # noqa: BLE001
                pass
        del case
        torch.cuda.empty_cache()
    return f"{group[0][0]} {[s for _, s in group]} part {part + 1}/{parts}"


def run(args: argparse.Namespace, command: str) -> int:
    """Tune the points of args on this GPU; `command` is recorded in the report."""
    grids = {op: (ROPES if op == "rope" else NORMS).get(args.grid, []) for op in args.ops}
    if not any(grids.values()):
        raise LMKernelsError(f"--grid {args.grid} has no points for {', '.join(args.ops)}")
    if not torch.cuda.is_available():
        raise LMKernelsError("lmkernels tune times kernels on a CUDA GPU; none is visible here")
    try:
        os.makedirs(args.out, exist_ok=True)  # now, not after minutes of compiling
    except OSError as e:
        raise LMKernelsError(f"--out {args.out}: cannot create it ({e.strerror})") from None
    torch._dynamo.config.cache_size_limit = torch._dynamo.config.accumulated_cache_size_limit = 4096
    os.environ.pop("TRITON_INTERPRET", None)
    start = time.time()
    log = lambda msg: print(f"[{time.time() - start:6.1f}s] {msg}", flush=True)  # noqa: E731
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
            for done in cf.as_completed(futures, timeout=args.warm_budget):
                try:
                    log(f"warm {done.result()}")
                except Exception as e:  # noqa: BLE001  (e.g. out of memory: that group compiles later)
                    log(f"warm: {type(e).__name__}: {str(e)[:200]}")
        except cf.TimeoutError:
            log("warm-up budget spent: the rest compiles while it is timed")
        pool.shutdown(wait=False, cancel_futures=True)
    from lmkernels.harness.bench import copy_bandwidth_gbps, environment

    meta = environment()
    meta["command"] = command
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
    if not args.table_only:
        install(rows, meta, args.out, args.install, log)
    return 0
