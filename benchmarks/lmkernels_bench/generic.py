"""`lmkernels-bench generic`: the generic launch tables of GPUs nobody measured (lmkernels'
configs.generic: Hopper's entries fitted to a target's limits), forced on this GPU, against this
GPU's own tables, torch.compile and Liger, in one run.

    lmkernels-bench generic --out benchmarks/data                  # sm_80, sm_86, sm_120 on an H100/H200
    lmkernels-bench generic --targets sm_80 --ops rms_norm --out DIR
    lmkernels-bench generic --device cpu --tiny --out DIR          # the plumbing, on the CPU

Each point (op x shape, fwd+bwd, bf16; lmkernels' measure: GPU time with the launch queue
filled ahead, wall time, peak memory) times, in turn: `triton` (this GPU's tables: Hopper's on an
H100 or H200), `triton@<target>` for each target (the op inside
configs.targets.simulate(target): the target's generic tables, its pipeline stages fitted to its
shared memory, PDL and the L2 prefetch only where the target has them), `compile` (torch.compile
of the eager reference) and `liger` where installed. A target's configurations on a Hopper GPU
are not that GPU's timings, but the generic rule changes only launch parameters, so a generic
launch much slower than the Hopper one or than torch.compile here is one to look at on the
target itself (or to leave to compile there).

Rows (part "generic", one per impl and point: gpu_ms, wall_ms, peak_mib, `target`, `tables`, and
`vs_compile`: compile's GPU time over the impl's) are appended to OUT/<gpu>.jsonl as the suite's
other parts' rows are (data.py), and OUT/<gpu>-generic.md lists, per target and op, the points
where the generic tables were slower than compile: the entries for configs.generic.PREFER_COMPILE
(`auto` then picks compile for that op on an untuned GPU of that target). The suite runs it as
`lmkernels-bench suite readme --part generic`.
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import time
from pathlib import Path
from typing import Any

from lmkernels_bench import data
from lmkernels_bench.grids import DTYPE, FLCE, dims_of, ops_points, shape_label

# sm_89 has sm_86's limits (the same generic tables), sm_100 Hopper's; gfx942's halve the warps
# for 64-wide wavefronts, which on a 32-wide GPU would halve the threads (name it to run it).
TARGETS = ("sm_80", "sm_86", "sm_120")
OPS = ("rms_norm", "layer_norm", "rope", "swiglu", "geglu", FLCE)
PEERS = ("compile", "liger")
TINY = [
    ("rms_norm", (64, 256)),
    ("layer_norm", (64, 256)),
    ("rope", (1, 4, 2, 16, 64, None)),
    ("swiglu", (64, 256)),
    ("geglu", (64, 256)),
    (FLCE, (64, 32, 500)),
]
EXTRAS = [
    ("swiglu", (8192, 14336)),
    ("geglu", (8192, 14336)),
    (FLCE, (4096, 2048, 128256)),
    (FLCE, (8192, 4096, 128256)),
]


def points(ops, tiny: bool, grid: str = "final") -> list[tuple[str, tuple]]:
    """(op, shape): the norms' and RoPE's grid, the GLUs' design shape, two FLCE heads."""
    if tiny:
        return [(op, s) for op, s in TINY if op in ops]
    return ops_points(grid, tuple(ops)) + [(op, s) for op, s in EXTRAS if op in ops]


def _dims(op: str, shape: tuple) -> dict[str, int]:
    if op == FLCE:
        return dict(zip(("BT", "H", "V"), shape))
    return dims_of(op, shape)


def _inputs(op: str, shape: tuple, device: str) -> dict[str, Any]:
    import torch

    from lmkernels.registry import get_op

    if op != "rope":
        return get_op(op).make_inputs(_dims(op, shape), torch.bfloat16, device, 0)
    from lmkernels.ops.rope import rope_tables

    B, Hq, Hkv, T, D, R = shape
    g = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(B, H, T, D, device=device, generator=g, dtype=torch.bfloat16) for H in (Hq, Hkv))
    cos, sin = (t.to(device, torch.bfloat16) for t in rope_tables(torch.arange(T), R or D, "neox"))
    return dict(q=q, k=k, cos=cos, sin=sin, layout="neox", rotary_dim=R)


def measure_point(op: str, shape: tuple, targets, device: str) -> list[dict[str, Any]]:
    """Every impl at one point: this GPU's tables, each target's generic ones, the peers."""
    import torch

    from lmkernels.backends.triton.configs import tables_for
    from lmkernels.backends.triton.configs.targets import TARGETS as KNOWN
    from lmkernels.backends.triton.configs.targets import simulate
    from lmkernels.harness.bench import backends_for, cleanup, measure, prepare_inputs
    from lmkernels.registry import get_op

    spec = get_op(op)
    torch._dynamo.reset()
    made = _inputs(op, shape, device)
    runnable, not_here = backends_for(op, ["triton", *PEERS], device)
    quick = dict(warmup=1, rep=3, min_runs=2) if device == "cpu" else {}
    rows = []
    variants = [("triton", None)] + [(f"triton@{t}", t) for t in targets] if "triton" in runnable else []
    variants += [(p, None) for p in PEERS if p in runnable]
    for impl, target in variants:
        inputs = prepare_inputs(spec, made, device)
        if target is None:
            r = measure(op, impl, inputs, "full", profile=False, **quick)
            tables = tables_for(torch.device(device)).name if impl == "triton" else None
        else:
            with simulate(KNOWN[target]):
                r = measure(op, "triton", inputs, "full", profile=False, **quick)
                tables = tables_for(torch.device(device)).name
        del inputs
        row = {"impl": impl, "target": target, "tables": tables, "status": r["status"], "note": r["note"]}
        rows.append(row | {"gpu_ms": r["gpu_ms"], "wall_ms": r["ms"], "peak_mib": r["peak_mib"]})
        cleanup(device)
    rows += [{"impl": p, "status": "not run", "note": why} for p, why in not_here.items()]
    return rows


def fake_point(targets, rng: random.Random) -> list[dict[str, Any]]:
    """Made-up timings of one point (--dry-run)."""
    ms = 0.1 + rng.random()
    rows: list[dict[str, Any]] = [{"impl": "triton", "target": None, "tables": "hopper", "gpu_ms": ms}]
    rows += [{"impl": f"triton@{t}", "target": t, "tables": f"generic {t}", "gpu_ms": ms * (1 + rng.random() / 4)}
             for t in targets]  # fmt: skip
    rows += [{"impl": "compile", "target": None, "tables": None, "gpu_ms": ms * (1 + rng.random() / 2)}]
    return [r | {"status": "ok", "note": "", "wall_ms": r["gpu_ms"] * 1.2, "peak_mib": 1.0} for r in rows]


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """vs_compile: compile's time over the impl's (> 1: the impl is faster), GPU time (wall time on
    the CPU)."""
    key = "gpu_ms" if any(r.get("gpu_ms") for r in rows) else "wall_ms"
    compile_ms = next((r.get(key) for r in rows if r["impl"] == "compile" and r["status"] == "ok"), None)
    for r in rows:
        ok = compile_ms and r.get(key) and r["status"] == "ok"
        r["vs_compile"] = compile_ms / r[key] if ok else None


def run(
    ctx_emit, log, targets, ops, tiny: bool, device: str, budget: float, dry_run=False, done=lambda u: False
):
    """Measure every point (resumable: `done` says which units the data file has), emitting each
    point's rows with ctx_emit(rows, unit). Returns the rows."""
    rng = random.Random(0)
    start = time.time()
    out = []
    for op, shape in points(ops, tiny):
        label = shape_label(op, shape)
        unit = (op, label, ",".join(targets))
        if done(unit):
            continue
        if time.time() - start > budget:
            log(f"  time budget spent: {op} {label} not measured")
            continue
        rows = fake_point(targets, rng) if dry_run else measure_point(op, shape, targets, device)
        add_ratios(rows)
        for r in rows:
            r.update(op=op, shape=label, dims=_dims(op, shape), dtype=DTYPE, mode="full")
        ctx_emit(rows, unit)
        out += rows
        times = ", ".join(
            f"{r['impl']} {r.get('gpu_ms') or r.get('wall_ms') or 0:.4f}" for r in rows if r["status"] == "ok"
        )
        log(f"  {op} {label}: {times} ms")
    return out


def summary(rows: list[dict[str, Any]]) -> str:
    """Per target and op: the points where the generic tables were slower than compile, and the
    PREFER_COMPILE entries that follow (an op slower than compile at most of its points)."""
    lines = ["# Generic launch tables on this GPU against its own and torch.compile", ""]
    lines += [
        "| target | op | points | slower than compile | slower than this GPU's tables (>5%) | worst vs compile |"
    ]
    lines += ["|---|---|---|---|---|---|"]
    prefer: dict[str, list[str]] = {}
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("target") and r["status"] == "ok":
            by.setdefault((r["target"], r["op"]), []).append(r)
    own = {(r["op"], r["shape"]): r for r in rows if r["impl"] == "triton" and r["status"] == "ok"}
    key = "gpu_ms" if any(r.get("gpu_ms") for r in rows) else "wall_ms"
    for (target, op), rs in sorted(by.items()):
        slower = [r for r in rs if r["vs_compile"] is not None and r["vs_compile"] < 1]
        behind = [r for r in rs if (o := own.get((op, r["shape"]))) and r[key] > 1.05 * o[key]]
        worst = min((r["vs_compile"] for r in rs if r["vs_compile"]), default=None)
        lines.append(f"| {target} | {op} | {len(rs)} | {len(slower)} | {len(behind)} | "
                     f"{f'{worst:.2f}x' if worst else '-'} |")  # fmt: skip
        if rs and len(slower) > len(rs) / 2:
            prefer.setdefault(target, []).append(op)
    lines += [
        "",
        "configs.generic.PREFER_COMPILE from these points (an op slower than compile at most of them):",
        "",
    ]
    lines += ["```python", "PREFER_COMPILE = {"]
    lines += [f'    "{t}": frozenset({sorted(ops)}),' for t, ops in sorted(prefer.items())]
    lines += ["}", "```", ""]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmkernels-bench generic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="the folder of the data files (rows go to OUT/<gpu>.jsonl)")
    p.add_argument(
        "--targets", default=",".join(TARGETS), help=f"comma-separated (default {','.join(TARGETS)})"
    )
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated (default: all)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a check of the command, CPU ok)")
    p.add_argument("--budget", type=float, default=540.0, help="seconds; later points are skipped")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import os

    if args.device == "cpu":  # the kernels on the CPU interpreter (set before they are imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from lmkernels.backends import load_builtin
    from lmkernels.backends.triton.configs.targets import target

    load_builtin()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("lmkernels-bench generic needs a CUDA device (or --device cpu --tiny).", file=sys.stderr)
        return 2
    try:
        targets = [target(t).name for t in args.targets.split(",") if t.strip()]
    except KeyError as e:
        raise SystemExit(f"--targets: {e.args[0]}") from None
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise SystemExit(f"--ops: {', '.join(unknown)} not among {', '.join(OPS)}")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    prov = data.provenance(data.command_line("generic", argv), f"generic-{stamp}", 1, device_name)
    path = data.data_path(Path(args.out), prov["gpu"])

    def emit(rows, unit):
        data.append_rows(path, [{"part": "generic"} | r | {"unit": list(unit)} | prov for r in rows])

    rows = run(emit, print, targets, ops, args.tiny, args.device, args.budget)
    text = summary(rows)
    (Path(args.out) / f"{prov['gpu']}-generic.md").write_text(text)
    print(text)
    print(f"{len(rows)} rows appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
