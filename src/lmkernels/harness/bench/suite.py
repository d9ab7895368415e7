"""`lmkernels bench --suite readme|validation --part PART --out DIR`: the measurements behind the
README and the docs, and the validation evidence, appended as rows to one data file per GPU kind
(DIR/<gpu>.jsonl, DIR/<gpu>-validation.jsonl; data.py has the format). Each part is sized for
one 10-minute call on one GPU (dist and dist-checks: two GPUs), its --budget (540 s unless the
part says otherwise) stopping it in time; `--part all` runs a suite's parts in turn.

A part's points already in the data file for the same commit and GPU kind are not measured
again: a part cut short by its time budget (--budget) finishes when the same command runs again.
`--again` measures them anew (the report takes the latest run of each point). `--dry-run` goes
through a part's plan with made-up timings and no GPU (a check of the plumbing: its rows say
"dry_run" and belong in a scratch folder).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmkernels.harness.bench import data

FLCE = "fused_linear_cross_entropy"
DTYPE = "bf16"

# --- the shapes -------------------------------------------------------------------------------------

# Norms (rows M, hidden N): "final" is the grid the launch tables are judged on (1k-64k rows,
# hidden 1024-16384 with Llama's 3584 / 5120 / 11008); "offgrid" real models' hidden sizes at
# row counts off the powers of two, which the tables were not tuned on.
NORM_GRIDS: dict[str, list[tuple[int, int]]] = {
    "final": [
        (m, n) for m in (1024, 4096, 16384, 65536) for n in (1024, 2048, 3584, 4096, 5120, 8192, 11008, 16384)
    ],
    "offgrid": [
        (m, n) for m in (3000, 12288, 40960) for n in (1536, 2304, 2560, 3072, 6144, 7168, 12288, 13824)
    ],
}
# RoPE: (B, Hq, Hkv, T, D, rotary dim or None for the whole head).
ROPE_GRIDS: dict[str, list[tuple[int, int, int, int, int, int | None]]] = {
    "final": [
        (1, 32, 8, 1024, 128, None),
        (1, 32, 8, 4096, 128, None),
        (1, 32, 8, 16384, 128, None),
        (1, 32, 8, 131072, 128, None),
        (8, 32, 8, 1024, 128, None),
        (4, 32, 32, 4096, 128, None),
        (1, 32, 32, 32768, 128, None),
        (2, 16, 16, 8192, 64, None),
        (1, 12, 12, 65536, 64, None),
        (1, 16, 4, 16384, 256, None),
        (1, 8, 8, 65536, 256, None),
        (1, 32, 8, 16384, 128, 64),
        (1, 32, 8, 65536, 128, 32),
    ],
    "offgrid": [
        (2, 28, 4, 4096, 128, None),  # Qwen2.5-7B
        (4, 12, 2, 2048, 128, None),  # Qwen2.5-1.5B
        (1, 64, 8, 8192, 128, None),  # Llama-3-70B
        (1, 28, 4, 32768, 128, None),
        (2, 32, 32, 4096, 96, None),  # Phi-3-mini: a head dim off the powers of two
        (4, 32, 32, 2048, 80, 32),  # Phi-2: partial rotary of an 80-dim head
        (2, 8, 4, 8192, 256, None),  # Gemma-2-2B
        (4, 16, 1, 4096, 64, None),  # multi-query
        (2, 32, 8, 8192, 64, None),
        (8, 16, 16, 1024, 64, None),
        (2, 16, 16, 2048, 128, 32),  # GPT-NeoX: a quarter of the head rotated
        (1, 40, 8, 131072, 128, None),
    ],
}
# The design shapes (plan.DESIGN_SHAPES) not in the final grid.
DESIGN_EXTRAS = [
    ("rope", (1, 32, 8, 8192, 128, None), "design"),
    ("swiglu", (8192, 14336), "design"),
    ("geglu", (8192, 14336), "design"),
]
OPS_IMPLS = ("triton", "compile", "liger")
FLCE_VARIANTS = ("triton", "triton_accum_fp32", "triton_lean", "compile_naive", "cce", "cce_exact", "liger")
FLCE_VARIANTS += ("torch_native",)
E2E_ARGS = {
    "e2e-small": "--sweeps small --configs plain,lmk,liger --interleave --rounds 7 --steps 6 "
    "--warmup-steps 3 --min-timed-s 2.0",
    "e2e-batch": "--sweeps batch --batches 8,16,32,64 --configs plain,lmk,liger --interleave --rounds 3",
    "e2e-compile": "--sweeps compile --compile-configs plain+compile,lmk+compile --interleave --rounds 4",
}
DIST_MODES = ("fsdp", "fsdp_lm_head", "tp")
DIST_CONFIGS = ("plain", "lmk", "liger")
GRID_PARTS = {  # part -> (ops, dtypes or None for all three)
    "grid-norms": ("rms_norm,layer_norm,rope", None),
    "grid-flce": (FLCE, "bf16,fp16"),
    "grid-flce-fp32": (FLCE, "fp32"),
    "grid-glu": ("swiglu,geglu", None),
}
TEST_PARTS = {  # part -> benchmarks/gpu_tests.py arguments
    "tests-kernels": ["suite", "kernels"],
    "tests-large": ["suite", "large"],
    "tests-triton-files": ["suite", "triton-files"],
    "tests-integration": ["suite", "integration"],
    "memcheck-kernels": ["memcheck", "kernels"],
    "racecheck": ["memcheck", "racecheck", "--racecheck"],
}


def shape_label(op: str, shape: tuple) -> str:
    """ "16384x4096" (norms, GLUs); RoPE "1x32x8x16384x128" plus "x64" for a partial rotary dim."""
    return "x".join(str(v) for v in shape if v is not None)


def dims_of(op: str, shape: tuple) -> dict[str, int]:
    if op == "rope":
        return dict(zip(("B", "Hq", "Hkv", "T", "D"), shape[:5]))
    return {"M": shape[0], "N": shape[1]}


def ops_points(grid: str, ops=("rms_norm", "layer_norm", "rope")) -> list[tuple[str, tuple]]:
    """(op, shape) of a grid, the ops taking turns (a budget that runs out trims each op's end)."""
    norms, ropes = NORM_GRIDS[grid], ROPE_GRIDS[grid]
    out = []
    for i in range(max(len(norms), len(ropes))):
        if i < len(norms):
            out += [(op, norms[i]) for op in ("rms_norm", "layer_norm") if op in ops]
        if i < len(ropes) and "rope" in ops:
            out.append(("rope", ropes[i]))
    return out


# --- running a part ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    """What a part needs: where its rows go, the provenance they carry, its time budget, and
    which of its units (points) the data file already holds for this commit and GPU kind."""

    path: Path
    part: str
    prov: dict[str, Any]
    budget_s: float
    dry_run: bool = False
    again: bool = False
    log: Callable[[str], None] = print
    started: float = dataclasses.field(default_factory=time.time)
    have: set = dataclasses.field(default_factory=set)
    skipped: list = dataclasses.field(default_factory=list)
    written: int = 0

    def time_left(self) -> float:
        return self.started + self.budget_s - time.time()

    def done(self, unit: tuple) -> bool:
        return not self.again and unit in self.have

    def emit(self, rows: list[dict[str, Any]], unit: tuple | None = None) -> None:
        """Append rows (with the part, the peers' configurations and the provenance)."""
        vers = self.prov["versions"]
        out = []
        for row in rows:
            row = {"part": self.part} | row
            name = row.get("impl") or row.get("config")
            if name and "peer" not in row and self.part in ("ops", "flce", "e2e", "dist"):
                row["peer"] = data.peer(name, self.part, vers)
            if unit is not None:
                row["unit"] = list(unit)
            out.append(row | self.prov | ({"dry_run": True} if self.dry_run else {}))
        data.append_rows(self.path, out)
        self.written += len(out)


def _unit_key(row: dict[str, Any]) -> tuple:
    return tuple(row.get("unit") or ())


def run_part(
    suite: str, part: str, out: Path, *, dry_run=False, again=False, budget=None, command="", log=print
):
    """Run one part; returns how many rows it appended."""
    spec = SUITES[suite][part]
    device = None
    if dry_run:
        device = os.environ.get("LMKERNELS_DRY_RUN_DEVICE", "dry run")
    else:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("lmkernels bench --suite measures on a CUDA device; none is here (--dry-run?)")
        if torch.cuda.device_count() < spec.gpus:
            raise SystemExit(f"--part {part} needs {spec.gpus} GPUs; {torch.cuda.device_count()} here")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    prov = data.provenance(command, f"{part}-{stamp}", spec.gpus, device)
    path = data.data_path(out, prov["gpu"], validation=suite == "validation")
    have = {
        _unit_key(r)
        for r in data.read_rows(path)
        if r.get("commit") == prov["commit"] and r.get("run", "").rsplit("-", 2)[0] == part
    }
    ctx = Context(path, spec.kind, prov, budget or spec.budget_s, dry_run, again, log, have=have)
    log(f"{suite} / {part} on {prov['device']} (commit {prov['commit']}): {spec.what}")
    spec.run(ctx, **spec.args)
    if ctx.skipped:
        log(f"not measured within the budget: {len(ctx.skipped)} points; the same command goes on with them")
    log(f"{ctx.written} rows appended to {path}")
    return ctx.written


# --- ops: norms, RoPE, GLUs -------------------------------------------------------------------------


def _ops_inputs(op: str, shape: tuple, layout: str) -> dict[str, Any]:
    import torch

    from lmkernels.registry.core import get_op

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

    from lmkernels.harness.bench.measure import gpu_time_ms

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

    from lmkernels.harness.bench.backends import backends_for
    from lmkernels.harness.bench.measure import cleanup, measure, prepare_inputs
    from lmkernels.registry.core import get_op

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

    from lmkernels.registry.core import get_op

    return get_op(op).bytes_moved(dims_of(op, shape), torch.bfloat16)


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
            from lmkernels.harness.bench.roofline import copy_bandwidth_gbps

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


def flce_rows(native: list[dict[str, Any]], meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Data rows from the frontier benchmark's rows (frontier.py's results.json)."""
    out = []
    for r in native:
        if r.get("status") != "skipped":
            row = {"op": FLCE} | {new: r.get(old) for new, old in FLCE_FIELDS.items()}
            row["dims"] = row["dims"] or {k: r.get(k) for k in ("BT", "H", "V")}
            out.append(
                row | {"dtype": meta.get("dtype", DTYPE), "mode": "full"} | _rate(meta, "matmul_tflops")
            )
    return out


def _rate(meta: dict[str, Any], key: str) -> dict[str, Any]:
    return {key: meta.get(key)}


def _fake_frontier(rng: random.Random) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from lmkernels.harness.bench.frontier import REGIMES, SHAPES, shape_label

    rows = []
    for bt, h, v, softcap in SHAPES:
        for regime, name in [(g, n) for g in REGIMES for n in FLCE_VARIANTS]:
            ms = 6 * bt * h * v / 5e11 * (1 + rng.random())
            row = dict(variant=name, backend=name, options="default", shape=shape_label(bt, h, v, softcap))
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
        from lmkernels.harness.bench import frontier

        with tempfile.TemporaryDirectory() as tmp:
            argv = ["--out", tmp, "--variants", ",".join(_available_flce_variants()), "--no-plots"]
            frontier.main([*argv, "--no-progress", "--budget", f"{max(ctx.time_left() - 30, 60):.0f}"])
            result = json.loads((Path(tmp) / "results.json").read_text())
        native, meta = result["rows"], result["meta"]
    ctx.emit(flce_rows(native, meta), ("frontier",))


def _available_flce_variants() -> list[str]:
    from lmkernels.harness.bench.backends import backends_for
    from lmkernels.harness.bench.frontier import VARIANTS

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
    from lmkernels.harness.bench import e2e

    parsed = e2e.parse_args(args)
    rows, round_rows = [], []
    for model, config, points in e2e.plan_workers(parsed):
        for p in points:
            base = dict(model=model, config=config, sweep=p["sweep"], batch=p["batch"], seq=p["seq"])
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
        from lmkernels.harness.bench import e2e

        with tempfile.TemporaryDirectory() as tmp:
            e2e.main([*argv, "--out", tmp, "--budget", f"{max(ctx.time_left() - 30, 60):.0f}"])
            rows = json.loads((Path(tmp) / "e2e.json").read_text())["rows"]
            rounds_file = Path(tmp) / "e2e_rounds.json"
            round_rows = json.loads(rounds_file.read_text()) if rounds_file.exists() else []
    ctx.emit(e2e_rows(rows, round_rows), ("e2e",))


# --- distributed --------------------------------------------------------------------------------------


def dist_rows(
    runs: list[dict[str, Any]], batch: int = 8, seq: int = 1024, layers: int = 8
) -> list[dict[str, Any]]:
    """Data rows from the distributed benchmark's runs (dist.py's dist.json)."""
    out = []
    for r in runs:
        if r["status"] == "skipped":
            continue
        peak = r.get("peak_gib")
        out.append(
            {"mode": r["mode"], "config": r["config"], "status": r["status"], "note": r.get("error", "")}
            | {"batch": batch, "seq": seq, "layers": layers}
            | {"tokens_per_s_per_gpu": r.get("tokens_per_s_per_gpu"), "step_ms": r.get("step_ms")}
            | {"peak_mib": peak * 1024 if peak else None, "losses": r.get("losses")}
        )
    return out


def dist_part(ctx: Context):
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
            from lmkernels.harness.bench import dist

            with tempfile.TemporaryDirectory() as tmp:
                argv = ["--out", tmp, "--modes", mode, "--configs", ",".join(DIST_CONFIGS)]
                dist.main([*argv, "--budget", f"{ctx.time_left() - 30:.0f}"])
                runs = json.loads((Path(tmp) / "dist.json").read_text())["runs"]
        ctx.emit(dist_rows(runs), (mode,))


# --- validation ---------------------------------------------------------------------------------------


def repo_root() -> Path:
    root = data.repo_root()
    if root is None and (Path.cwd() / "tests").is_dir() and (Path.cwd() / "benchmarks").is_dir():
        root = Path.cwd()
    if root is None:
        raise SystemExit("this part runs the repository's tests: run it from a checkout of lmkernels")
    return root


def _run(cmd: list[str], timeout: float, log, cwd: Path | None = None, env=None) -> int:
    log("  $ " + " ".join(cmd))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1", **(env or {}))
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, timeout=max(timeout, 60)).returncode
    except subprocess.TimeoutExpired:
        log(f"  stopped at the time budget ({timeout:.0f} s)")
        return -1


def grid_records(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (op, backend, dtype) of a validation report: cases by status, the worst error against
    what the policy allows, and the failing cases."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["op"], r["backend"], r["dtype"]), []).append(r)
    out = []
    for (op, backend, dtype), cases in groups.items():
        ratios = [e["impl"] / e["allowed"] for c in cases for e in c.get("errors") or () if e.get("allowed")]
        failed = [c for c in cases if c["status"] not in ("pass", "unsupported")]
        out.append(
            {"op": op, "impl": backend, "dtype": dtype, "cases": len(cases)}
            | {"passed": sum(c["status"] == "pass" for c in cases), "failed": len(failed)}
            | {"unsupported": sum(c["status"] == "unsupported" for c in cases)}
            | {"worst_ratio": max(ratios, default=None), "failures": [c.get("test_id") for c in failed][:20]}
            | {"grid": "full"}
        )
    return out


def grid_part(ctx: Context, ops: str, dtypes: str | None):
    if ctx.done(("grid",)):
        return
    if ctx.dry_run:
        cases = [(op, d) for op in ops.split(",") for d in (dtypes or "fp32,bf16,fp16").split(",")]
        errors = [{"impl": 1.0, "allowed": 2.0}]
        results = [dict(op=op, backend="triton", dtype=d, status="pass", errors=errors) for op, d in cases]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, *"-m lmkernels validate --device cuda --full --backend triton".split()]
            cmd += ["--op", ops, *(["--dtype", dtypes] if dtypes else []), "--out", tmp, "--no-progress"]
            _run(cmd, ctx.time_left(), ctx.log)
            report = Path(tmp) / "validation.json"
            results = json.loads(report.read_text())["results"] if report.exists() else []
    ctx.emit(grid_records(results), ("grid",))


def converge_records(report: dict[str, Any], dtype: str) -> list[dict[str, Any]]:
    out = []
    for fam in report["families"]:
        for case in fam["cases"]:
            checks = [{k: c[k] for k in ("metric", "value", "limit", "passed")} for c in case["checks"]]
            row = dict(family=fam["family"], dtype=dtype, impl=report["backend"], variant=case["variant"])
            out.append(row | dict(ops=case["ops"], passed=case["passed"], checks=checks))
    return out


def converge_part(ctx: Context):
    for dtype in ("bf16", "fp32"):
        if ctx.done((dtype,)):
            continue
        if ctx.dry_run:
            check = dict(metric="loss curve", value=1e-3, limit=2e-3, passed=True)
            case = dict(variant="all", ops=["rms_norm"], passed=True, checks=[check])
            report = {"backend": "triton", "families": [{"family": "llama", "cases": [case]}]}
        else:
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, *"-m lmkernels converge --family all --backend triton".split()]
                cmd += ["--dtype", dtype, "--device", "cuda", "--out", tmp, "--no-progress"]
                _run(cmd, ctx.time_left(), ctx.log)
                found = list(Path(tmp).glob("converge-*.json"))
                if not found:
                    continue
                report = json.loads(found[0].read_text())
        ctx.emit(converge_records(report, dtype), (dtype,))


def families_part(ctx: Context, stepcheck: bool):
    import torch

    from lmkernels.harness.bench import families as fam

    steps = 20
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = None
    for family in fam.DEFAULT:
        if ctx.done((family,)):
            continue
        if ctx.time_left() <= 0:
            ctx.skipped.append((family,))
            continue
        if ctx.dry_run:
            record = {"family": family, "passed": True, "ops": ["rms_norm"], "checks": []}
            if stepcheck:
                record = dict(family=family, passed=True, loss=[1e-5, 2e-5], grad=["w", 0.1, 0.2])
                record |= dict(module=[0.003, "mlp"], repeatable=True)
        else:
            batches = batches or fam.make_batches(steps, 8, 256)
            if stepcheck:
                runs = fam.stepcheck_runs(family, "triton", batches, 256, 2, device)
                record = {"family": family} | fam.stepcheck_verdict(runs)
            else:
                r = fam.trajectory(family, "triton", batches, steps, 8, 256, device)
                record = {k: r[k] for k in ("family", "passed", "ops", "checks")}
        ctx.emit([record | {"impl": "triton", "steps": steps}], (family,))


def dist_checks_part(ctx: Context):
    root = None if ctx.dry_run else repo_root()
    for backend in ("triton", "eager"):
        if ctx.done((backend,)):
            continue
        if ctx.dry_run:
            checks = {"fsdp_layers_root": [{"ok": True, "loss_rel_err": 1e-7}] * 2}
        else:
            from lmkernels.harness.bench.dist import NCCL_ENV

            with tempfile.TemporaryDirectory() as tmp:
                out = str(Path(tmp) / f"checks_{backend}.json")
                script = str(root / "tests" / "distributed_checks.py")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
                cmd += [script, "--device", "cuda", "--backend", backend, "--timeout", "150", "--out", out]
                _run(cmd, ctx.time_left() / 2, ctx.log, cwd=root, env=NCCL_ENV)
                _run([sys.executable, script, "--merge", "--out", out], 120, ctx.log, cwd=root)
                if not Path(out).exists():
                    continue
                checks = json.loads(Path(out).read_text())["checks"]
        records = []
        for name, ranks in checks.items():
            worst = lambda key, ranks=ranks: max(
                (r[key] for r in ranks if r.get(key) is not None), default=None
            )  # noqa: E731
            records.append(
                {"check": name, "impl": backend, "ok": all(r.get("ok") for r in ranks), "ranks": len(ranks)}
                | {
                    k: worst(k)
                    for k in ("loss_rel_err", "param_rel_err", "param_update_rel_err", "other_err")
                }
            )
        ctx.emit(records, (backend,))


def tests_part(ctx: Context, args: list[str]):
    if ctx.done(("tests",)):
        return
    if ctx.dry_run:
        record = {"group": args[1], "tool": "none", "pytest": "1 passed", "exit": 0, "seconds": 1.0}
    else:
        root = repo_root()
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, str(root / "benchmarks" / "gpu_tests.py"), *args, "--out", tmp]
            _run(
                [*cmd, "--timeout", f"{max(ctx.time_left() - 20, 60):.0f}"],
                ctx.time_left() + 60,
                ctx.log,
                cwd=root,
            )
            lines = (Path(tmp) / "gpu_tests.jsonl").read_text().splitlines()
        got = json.loads(lines[-1])
        record = {k: got.get(k) for k in ("group", "tool", "pytest", "exit", "seconds", "sanitizer_errors")}
    ctx.emit([record], ("tests",))


# --- the suites ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Part:
    what: str
    run: Callable[..., None]
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    gpus: int = 1
    budget_s: float = 540.0
    kind: str = ""  # the rows' "part" field (default: the part's name)


BTHD = dict(
    grid="final", layout="bthd", ops=("rope",), extras=[("rope", s, "offgrid") for s in ROPE_GRIDS["offgrid"]]
)
README = {
    "ops": Part(
        "RMSNorm, LayerNorm (32 shapes each), RoPE (13), fwd+bwd bf16: triton, torch.compile, Liger, "
        "the copy floor; RoPE, SwiGLU, GeGLU at their design shapes",
        ops_part,
        dict(grid="final", extras=DESIGN_EXTRAS),
    ),
    "ops-offgrid": Part(
        "the same at 60 model shapes the tables were not tuned on", ops_part, dict(grid="offgrid")
    ),
    "rope-bthd": Part("RoPE's 25 shapes on (B, T, H, D) memory, as transformers passes q, k", ops_part, BTHD),
    "flce": Part(
        "FLCE fwd+bwd, 13 shapes x 3 logit regimes, every variant and peer", flce_part, budget_s=480
    ),
    "e2e-small": Part(
        "end to end, batch 1-4 x seq 512/1024, 7 interleaved rounds",
        e2e_part,
        dict(args=E2E_ARGS["e2e-small"]),
    ),
    "e2e-batch": Part(
        "end to end, batch 8-64 x seq 1024, 3 interleaved rounds", e2e_part, dict(args=E2E_ARGS["e2e-batch"])
    ),
    "e2e-compile": Part(
        "end to end, torch.compile(model), batch 8/32, 4 rounds", e2e_part, dict(args=E2E_ARGS["e2e-compile"])
    ),
    "dist": Part("2 GPUs: FSDP2, FSDP2 + lm_head alone, TP=2; plain, lmkernels, Liger", dist_part, gpus=2),
}
VALIDATION = {
    name: Part(
        f"lmkernels validate --device cuda --full --backend triton --op {ops}",
        grid_part,
        dict(ops=ops, dtypes=dt),
    )
    for name, (ops, dt) in GRID_PARTS.items()
}
VALIDATION |= {
    "converge": Part("lmkernels converge --family all --backend triton, bf16 and fp32", converge_part),
    "families": Part(
        "bf16 trajectories of 10 patched families against plain", families_part, dict(stepcheck=False)
    ),
    "stepcheck": Part(
        "the same families per step on shared weights, twice", families_part, dict(stepcheck=True)
    ),
    "dist-checks": Part(
        "tests/distributed_checks.py on 2 GPUs, NCCL, triton and eager", dist_checks_part, gpus=2
    ),
}
VALIDATION |= {
    name: Part(f"gpu_tests.py {' '.join(a)}", tests_part, dict(args=a)) for name, a in TEST_PARTS.items()
}
KINDS = {
    "ops-offgrid": "ops",
    "rope-bthd": "ops",
    "e2e-small": "e2e",
    "e2e-batch": "e2e",
    "e2e-compile": "e2e",
}
KINDS |= {name: "grid" for name in GRID_PARTS} | {name: "tests" for name in TEST_PARTS}
for _name, _part in [*README.items(), *VALIDATION.items()]:
    _part.kind = KINDS.get(_name, _name)
SUITES: dict[str, dict[str, Part]] = {"readme": README, "validation": VALIDATION}


def describe(suite: str | None = None) -> str:
    lines = []
    for name, table in SUITES.items():
        if suite in (None, name):
            lines.append(f"{name}:")
            lines += [f"  {p:<18} {part.what}" for p, part in table.items()]
    return "\n".join(lines)
