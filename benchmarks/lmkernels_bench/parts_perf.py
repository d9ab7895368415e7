"""The measuring parts of the readme suite (`lmkernels-bench suite readme`): ops (norms, RoPE,
GLUs against their peers and the copy floor), flce (the frontier benchmark), e2e (end-to-end
training), dist (2 GPUs) and compare (the tree before a change against this one); each turns its
benchmark's results into data rows. With --dry-run
they make up timings instead (no GPU)."""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from lmkernels_bench.data import checkout
from lmkernels_bench.grids import DTYPE, FLCE, dims_of, ops_points, shape_label
from lmkernels_bench.parts import SUITE, Context, run_command

OPS_IMPLS = ("triton", "compile", "liger")
# The FLCE part: lmkernels' default, its lean backend and the memory-budget range against the
# peers' defaults, over the logit regimes that decide (uniform = random init, where only CCE's
# filter pays, runs through frontier.py --regimes). The budgets: the lean floor, the lean mode
# with larger blocks, and 0.4 (the 16 smaller bf16 chunks at the 16k-token heads, elsewhere the
# lean mode or the default); from the default's own need up (0.23-0.80 of the gradients on the
# grid heads) every budget runs the default.
FLCE_VARIANTS: tuple[str, ...] = ("triton", "triton_lean", "budget_0", "budget_0.15", "budget_0.4")
FLCE_VARIANTS += ("compile_naive", "cce", "liger")
FLCE_REGIMES = ("gaussian", "zipf")
DIST_MODES = ("fsdp", "fsdp_lm_head", "tp")
DIST_CONFIGS = ("plain", "lmk", "liger")


# --- ops: norms, RoPE, GLUs -------------------------------------------------------------------------


def _ops_inputs(op: str, shape: tuple, layout: str) -> dict[str, Any]:
    import torch

    from lmkernels.registry import get_op

    dtype = torch.bfloat16
    if op != "rope":
        return get_op(op).make_inputs(dims_of(op, shape), dtype, "cuda", 0)
    from lmkernels.ops.rope import rope_tables

    B, Hq, Hkv, T, D, R = shape
    g = torch.Generator(device="cuda").manual_seed(0)

    def heads(H):  # bthd: transposes of (B, T, H, D) memory, as transformers' attention passes them
        if layout == "bthd":
            return torch.randn(B, T, H, D, device="cuda", generator=g, dtype=dtype).transpose(1, 2)
        return torch.randn(B, H, T, D, device="cuda", generator=g, dtype=dtype)

    cos, sin = (t.to("cuda", dtype) for t in rope_tables(torch.arange(T), R or D, "neox"))
    return dict(q=heads(Hq), k=heads(Hkv), layout="neox", rotary_dim=R, cos=cos, sin=sin)


def copy_floor_ms(op: str, shape: tuple) -> float | None:
    """GPU time of plain copies moving the op's fwd+bwd bytes in 2 launches (norms: y = x, then
    dx = x + dy; RoPE: two copies of q's and k's elements): what a kernel pair with the op's
    launch structure can reach at that size. None for the GLUs."""
    import torch

    from lmkernels.harness.bench import gpu_time_ms

    if op in ("rms_norm", "layer_norm"):
        x, dy = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        y, dx = torch.empty_like(x), torch.empty_like(x)

        def run():
            y.copy_(x)
            torch.add(x, dy, out=dx)

    elif op == "rope":
        B, Hq, Hkv, T, D, _ = shape
        src = torch.randn(B * (Hq + Hkv) * T * D, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)

        def run():
            dst.copy_(src)
            src.copy_(dst)

    else:
        return None
    run()
    run()
    return gpu_time_ms(run, [], rep=100)


def measure_ops_point(op: str, shape: tuple, layout: str) -> list[dict[str, Any]]:
    """triton, torch.compile and Liger on one point, fwd+bwd, fresh inputs per implementation;
    then the copy floor."""
    import torch

    from lmkernels.harness.bench import backends_for, cleanup, measure, prepare_inputs
    from lmkernels.registry import get_op

    spec = get_op(op)
    torch._dynamo.reset()  # static shapes: forget the graphs compiled for the last point
    made = _ops_inputs(op, shape, layout)
    runnable, not_here = backends_for(op, list(OPS_IMPLS), "cuda")
    rows = []
    for impl in runnable:
        inputs = prepare_inputs(spec, made, "cuda")
        r = measure(op, impl, inputs, "full", profile=False)
        del inputs
        rows.append(_ops_row(impl, r))
    rows += [{"impl": impl, "status": "not run", "note": why} for impl, why in not_here.items()]
    del made
    cleanup("cuda")
    floor = copy_floor_ms(op, shape)
    if floor is not None:
        rows.append({"impl": "copy_floor", "status": "ok", "note": "", "gpu_ms": floor})
    cleanup("cuda")
    return rows


OPS_FIELDS = {"gpu_ms": "gpu_ms", "wall_ms": "ms", "wall_p20_ms": "ms_p20", "wall_p80_ms": "ms_p80"}


def _ops_row(impl: str, r: dict[str, Any]) -> dict[str, Any]:
    row = {"impl": impl, "status": r["status"], "note": r["note"], "peak_mib": r["peak_mib"]}
    return row | {new: r[old] for new, old in OPS_FIELDS.items()}


def _fake_ops_point(op: str, shape: tuple, rng: random.Random) -> list[dict[str, Any]]:
    ms = _bytes(op, shape) / 3.5e9 + 0.01  # at 3.5 TB/s, plus 10 us
    times = {impl: ms * f for impl, f in zip(OPS_IMPLS, (1.0, 1.0 + rng.random(), 1.2 + rng.random()))}
    fake = dict(status="ok", note="", ms_p20=None, ms_p80=None, peak_mib=1.0)
    rows = [_ops_row(impl, fake | dict(gpu_ms=t, ms=1.3 * t)) for impl, t in times.items()]
    return rows + [{"impl": "copy_floor", "status": "ok", "note": "", "gpu_ms": 0.9 * ms}]


def _bytes(op: str, shape: tuple) -> int:
    import torch

    from lmkernels.registry import get_op

    bytes_moved = get_op(op).bytes_moved
    assert bytes_moved is not None  # (the norms and RoPE have a bytes model)
    return bytes_moved(dims_of(op, shape), torch.bfloat16)


def ops_part(ctx: Context, grid: str, layout="bhtd", ops=("rms_norm", "layer_norm", "rope"), extras=()):
    """Every point of the grid, then `extras` ((op, shape, grid) each): one unit per point."""
    rng = random.Random(0)
    copy_gbps = 4000.0 if ctx.dry_run else None
    for op, shape, where in [*((op, s, grid) for op, s in ops_points(grid, ops)), *extras]:
        label = shape_label(op, shape)
        unit = (op, label, layout)
        if ctx.done(unit):
            continue
        if ctx.time_left() <= 0:
            ctx.skipped.append(unit)
            continue
        if copy_gbps is None:  # once per run, in the same process as the points
            from lmkernels.harness.bench import copy_bandwidth_gbps

            copy_gbps = copy_bandwidth_gbps("cuda")
            ctx.log(f"copy bandwidth {copy_gbps:.0f} GB/s")
        rows = _fake_ops_point(op, shape, rng) if ctx.dry_run else measure_ops_point(op, shape, layout)
        nbytes = _bytes(op, shape)
        rope = op == "rope"
        for r in rows:
            r.update(op=op, shape=label, dims=dims_of(op, shape), grid=where, dtype=DTYPE, mode="full")
            r.update(rotary_dim=shape[5] if rope else None, layout=layout if rope else None, bytes=nbytes)
            r["gbps"] = nbytes / (r["gpu_ms"] * 1e-3) / 1e9 if r.get("gpu_ms") else None
            r["pct_copy"] = 100 * r["gbps"] / copy_gbps if r["gbps"] else None
            r["copy_gbps"] = copy_gbps
        ctx.emit(rows, unit)
        times = ", ".join(f"{r['impl']} {r['gpu_ms']:.4f}" for r in rows if r.get("gpu_ms"))
        ctx.log(f"  {op} {label}: {times} ms")


# --- FLCE ---------------------------------------------------------------------------------------------


# frontier.py's row keys, as the data rows name them.
FLCE_FIELDS = {
    "impl": "variant",
    "backend": "backend",
    "options": "options",
    "shape": "shape",
    "dims": "dims",
}
FLCE_FIELDS |= {k: k for k in ("softcap", "regime", "entropy", "status", "note", "gpu_ms", "peak_mib")}
FLCE_FIELDS |= {"wall_ms": "ms", "wall_p20_ms": "ms_p20", "wall_p80_ms": "ms_p80"}
FLCE_FIELDS |= {"tflops": "tflops_gpu", "pct_matmul": "pct_matmul_gpu"}
# Carried where present: the alternating pass's (frontier.alternate) and --rounds N's.
FLCE_TIMING_FIELDS = (
    "gpu_alternating",
    "gpu_ms_alone",
    "gpu_sleep_ms",
    "gpu_host_waits",
    "rounds",
    "gpu_ms_rounds",
)


def flce_rows(native: list[dict[str, Any]], meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Data rows from the frontier benchmark's rows (frontier.py's results.json)."""
    out = []
    for r in native:
        if r.get("status") != "skipped":
            row = {"op": FLCE} | {new: r.get(old) for new, old in FLCE_FIELDS.items()}
            row["dims"] = row["dims"] or {k: r.get(k) for k in ("BT", "H", "V")}
            row |= {k: r[k] for k in FLCE_TIMING_FIELDS if k in r}
            out.append(
                row | {"dtype": meta.get("dtype", DTYPE), "mode": "full"} | _rate(meta, "matmul_tflops")
            )
    return out


def _rate(meta: dict[str, Any], key: str) -> dict[str, Any]:
    return {key: meta.get(key)}


def _fake_frontier(rng: random.Random) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from lmkernels_bench.frontier import SHAPES, shape_label

    rows = []
    for bt, h, v, softcap in SHAPES:
        for regime, name in [(g, n) for g in FLCE_REGIMES for n in FLCE_VARIANTS]:
            ms = 6 * bt * h * v / 5e11 * (1 + rng.random())
            row: dict[str, Any] = dict(
                variant=name, backend=name, options="default", shape=shape_label(bt, h, v, softcap)
            )
            row |= dict(dims={"BT": bt, "H": h, "V": v}, softcap=softcap, regime=regime, entropy=2.5)
            rows.append(
                row | dict(status="ok", note="", gpu_ms=ms, ms=ms * 1.02, peak_mib=1e3 + rng.random())
            )
    return rows, {"dtype": DTYPE, "matmul_tflops": 700.0}


def flce_part(ctx: Context):
    if ctx.done(("frontier",)):
        return
    if ctx.dry_run:
        native, meta = _fake_frontier(random.Random(0))
    else:
        from lmkernels_bench import frontier

        with tempfile.TemporaryDirectory() as tmp:
            argv = ["--out", tmp, "--variants", ",".join(_available_flce_variants()), "--no-plots"]
            argv += ["--regimes", ",".join(FLCE_REGIMES)]
            frontier.main([*argv, "--no-progress", "--budget", f"{max(ctx.time_left() - 30, 60):.0f}"])
            result = json.loads((Path(tmp) / "results.json").read_text())
        native, meta = result["rows"], result["meta"]
    ctx.emit(flce_rows(native, meta), ("frontier",))


def _available_flce_variants() -> list[str]:
    from lmkernels.harness.bench import backends_for
    from lmkernels_bench.frontier import VARIANTS

    runnable, _ = backends_for(FLCE, [VARIANTS[v][0] for v in FLCE_VARIANTS], "cuda")
    return [v for v in FLCE_VARIANTS if VARIANTS[v][0] in runnable]


# --- end to end ---------------------------------------------------------------------------------------


def e2e_rows(rows: list[dict[str, Any]], round_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Data rows from the end-to-end benchmark's median rows and, with rounds, each round's step."""
    rounds: dict[tuple, dict[int, float]] = {}
    for r in round_rows:
        if r["status"] == "ok":
            key = (r["model"], r["config"], r["sweep"], r["batch"], r["seq"])
            rounds.setdefault(key, {})[r["round"]] = r["step_ms"]
    out = []
    for r in rows:
        per_round = rounds.get((r["model"], r["config"], r["sweep"], r["batch"], r["seq"]), {})
        n = 1 + max((x["round"] for x in round_rows), default=0)
        out.append(
            {k: r.get(k) for k in ("model", "config", "sweep", "batch", "seq", "status", "note")}
            | {k: r.get(k) for k in ("tokens_per_s", "step_ms", "steps", "loss")}
            | {"peak_mib": r["peak_gib"] * 1024 if r.get("peak_gib") is not None else None}
            | {"round_step_ms": [per_round.get(i) for i in range(n)] if round_rows else None}
        )
    return out


def _fake_e2e(args: list[str], rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from lmkernels_bench import e2e

    parsed = e2e.parse_args(args)
    rows: list[dict[str, Any]] = []
    round_rows: list[dict[str, Any]] = []
    for model, config, points in e2e.plan_workers(parsed):
        for p in points:
            base: dict[str, Any] = dict(
                model=model, config=config, sweep=p["sweep"], batch=p["batch"], seq=p["seq"]
            )
            steps = [
                (20 + p["batch"] * p["seq"] / 400) * (1 + 0.2 * rng.random()) for _ in range(parsed.rounds)
            ]
            round_rows += [base | dict(round=i, step_ms=ms, status="ok") for i, ms in enumerate(steps)]
            ms = sorted(steps)[len(steps) // 2]
            tps = p["batch"] * p["seq"] / ms * 1e3
            rows.append(base | dict(status="ok", note="", step_ms=ms, tokens_per_s=tps, steps=4, loss=11.9))
            rows[-1]["peak_gib"] = 10.0 + p["batch"] * rng.random()
    return rows, round_rows


def e2e_part(ctx: Context, args: str):
    if ctx.done(("e2e",)):
        return
    argv = args.split()
    if ctx.dry_run:
        rows, round_rows = _fake_e2e(argv, random.Random(0))
    else:
        from lmkernels_bench import e2e

        with tempfile.TemporaryDirectory() as tmp:
            e2e.main([*argv, "--out", tmp, "--budget", f"{max(ctx.time_left() - 30, 60):.0f}"])
            rows = json.loads((Path(tmp) / "e2e.json").read_text())["rows"]
            rounds_file = Path(tmp) / "e2e_rounds.json"
            round_rows = json.loads(rounds_file.read_text()) if rounds_file.exists() else []
    ctx.emit(e2e_rows(rows, round_rows), ("e2e",))


# --- distributed --------------------------------------------------------------------------------------


def dist_part(ctx: Context):
    from lmkernels_bench.scale import DEFAULT_SIZE, dist_rows

    for mode in DIST_MODES:
        if ctx.done((mode,)):
            continue
        if ctx.time_left() < 60:
            ctx.skipped.append((mode,))
            continue
        if ctx.dry_run:
            runs = [
                {"mode": mode, "config": c, "status": "ok", "tokens_per_s_per_gpu": 6e4 + 1e3 * i}
                | {"step_ms": 120.0, "peak_gib": 12.0 + i, "losses": [11.9 - 0.1 * s for s in range(12)]}
                for i, c in enumerate(DIST_CONFIGS)
            ]
        else:
            from lmkernels_bench import scale

            with tempfile.TemporaryDirectory() as tmp:
                argv = ["--out", tmp, "--gpus", "2", "--modes", mode, "--configs", ",".join(DIST_CONFIGS)]
                scale.main([*argv, "--budget", f"{ctx.time_left() - 30:.0f}"])
                runs = json.loads((Path(tmp) / "dist_scale.json").read_text())["runs"]
        ctx.emit(dist_rows(runs, *DEFAULT_SIZE), (mode,))


# --- other GPUs' generic launch tables, on this one ---------------------------------------------------


def generic_part(ctx: Context):
    """`lmkernels-bench generic`'s points, resumable, into the data file (lmkernels_bench.generic)."""
    from lmkernels_bench import generic

    budget = ctx.time_left()
    generic.run(ctx.emit, ctx.log, generic.TARGETS, generic.OPS, False, "cuda", budget, ctx.dry_run, ctx.done)


# --- before / after a change -------------------------------------------------------------------------

COMPARE_OLD_ENV = "LMKERNELS_COMPARE_OLD"  # src/ of the checkout before the change


def compare_part(ctx: Context):
    """`lmkernels-bench compare-trees`: the ops, FLCE modes and end-to-end steps of the tree before a
    change ($LMKERNELS_COMPARE_OLD, e.g. `git archive REV src | tar -x -C /tmp/old`: /tmp/old/src)
    against this one, in turns, in one run."""
    if ctx.done(("compare",)):
        return
    if ctx.dry_run:
        rows = [
            {"case": c, "old_ms": 1.0, "new_ms": 1.0 + d, "ratio": 1.0 + d, "noise": 0.01, "rounds": 3}
            | {"old_peak_mib": 100.0, "new_peak_mib": 100.0}
            for c, d in (("rms_norm 16384x4096", 0.001), ("flce 8192x4096x128256", -0.002))
        ]
        old: str | None = "dry-run"
    else:
        old = os.environ.get(COMPARE_OLD_ENV)
        if not old or not Path(old, "lmkernels").is_dir():
            raise SystemExit(
                f"part compare: set {COMPARE_OLD_ENV} to the src/ folder of the tree before the change"
            )
        root = checkout()
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, *SUITE, "compare-trees", "--out", tmp]
            run_command(
                [*cmd, "--trees", f"old={old},new={root / 'src'}"], ctx.time_left(), ctx.log, cwd=root
            )
            rows = json.loads((Path(tmp) / "compare.json").read_text())["rows"]
    method = "GPU time, launch queue filled ahead, L2 flushed (ops, FLCE); wall time per step (e2e)"
    ctx.emit([{"old_tree": old, "method": method} | r for r in rows], ("compare",))
