"""FLCE frontier benchmark: every FLCE variant against torch.compile of the naive loss
and Cut Cross-Entropy, on realistic shapes and logit regimes, in one run.

    lmkernels-bench frontier --out DIR                 # the full grid, one GPU, < 8 min
    lmkernels-bench frontier --device cpu --tiny --out DIR    # the script on the CPU

Grid: SHAPES below (the lm_heads of Llama 3 8B / 3B / 1B, Qwen 2.5 and Gemma 2 with its softcap,
4k to 32k tokens) x the three logit regimes of ops/flce.py's make_inputs (uniform =
random init, gaussian = logit std 2, zipf = trained-LM-like, targets sampled from the softmax).
Variants: VARIANTS below (one line each), then every other registered FLCE impl with its
defaults. Peers run their default call (see backends/adapters.py). Per case, fwd+bwd (bf16):
GPU time (launch queue filled ahead, variants alternating), wall time (do_bench median), peak
above the inputs, time and memory relative to compile_naive and to cce, % of the bf16 matmul rate
(6*BT*H*V flops) measured in the same run. An out-of-memory or other failure is recorded with
its reason. Outputs in --out: results.csv, results.json, summary.md, time_ratio.png,
memory_ratio.png.

Time arithmetic (H200): with fast impls at ~500 TFLOP/s a case takes flops / 5e14 s per call.
Summed over the 8 shapes (2.7e14 flops) that is 0.54 s per call of every variant at 1x; the
default run's 12 variants sum to ~14x (the lean mode and the small budgets ~1.4x, CCE 1-4x,
Liger with softcap ~4.6x). Calls per case: 13.5 for cases over 20 ms (one forward for the
gradients' shapes, a warm-up, a peak, do_bench's minimum of 8, one launch probe and 2 GPU-timed
calls), ~20 below: ~100 s per regime, plus ~12 s of compilation per shape (compile_naive) and
the inputs: ~5 min for two regimes. eager (fp32 matmuls, ~10x) is LEFT_OUT for that reason.
--budget (default 460 s) stops starting new cases beyond it (recorded as skipped), so a slower
machine still leaves a complete report.

GPU time is measured twice per variant: in a block of the variant's own calls (gpu_ms_alone),
then with every variant's calls alternating, each behind the same sleep, long enough for the
slowest launch of the calls that do not wait for the GPU on the host (gpu_ms, what the report
compares; measure.interleaved_gpu_ms; alternate). A run spends most of its time at the GPU's
power limit (docs/performance.md, Method), where a call's time depends on the load and the idle
before it: at 32768 x 2048 x 128256 the default timed alone measured 79 to 90 ms in three runs
on one H100. To settle a close call, --rounds N runs each case N times, the variants' order
rotated per round, and reports the median over rounds (gpu_ms_rounds keeps them); --only picks
the shapes by label.

The report's Pareto section (frontier_report.py) answers the questions a user asks of the
numbers: which peer point is both faster and leaner than lmkernels' default, which budget
setting matches each peer point, and where the lean end sits against compile_naive's time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lmkernels.harness.bench import (
    FLCE,
    add_rooflines,
    backends_for,
    cleanup,
    empty_row,
    environment,
    grad_tensors_of,
    interleaved_gpu_ms,
    is_oom,
    measure,
    prepare_inputs,
    reference_rates,
    timed_call,
)
from lmkernels.registry import get_op, impls
from lmkernels_bench.data import command_line
from lmkernels_bench.frontier_report import MEM_BASE, REGIMES, TIME_BASE, write_reports

LEAN = "weight dtype"  # grad_accum_dtype = the weight's dtype, filled in at run time

# GPU-timed calls per variant in the alternating pass (alternate): cheap beside the rest of a
# case (the 32k shape: 8 calls x 6 variants, ~5 s).
INTERLEAVED_CALLS = 8

BUDGETS = (0.0, 0.15, 0.25, 0.4, 0.5, 1.0)

# The FLCE variants: name -> (backend, options). The lead adds modes/options here, one line each.
# Peers get grad_accum_dtype = weight dtype: that is their default call (CCE has no other mode).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "triton": ("triton", {}),  # the fast mode, lmkernels' default
    "triton_lean": ("triton_lean", {}),
    # The memory budget's range (a fraction of the gradients' bytes the loss may hold beside
    # them): 0 is the lean floor; from the default's own need up (0.23-0.80 on the grid heads)
    # every budget runs the default.
    **{f"budget_{f:g}": ("triton", {"memory_budget": f}) for f in BUDGETS},
    "triton_accum_fp32": ("triton", {"grad_accum_dtype": torch.float32}),
    "compile": ("compile", {}),
    "compile_naive": ("compile_naive", {}),
    "cce": ("cce", {"grad_accum_dtype": LEAN}),
    "cce_exact": ("cce_exact", {"grad_accum_dtype": LEAN}),
    "liger": ("liger", {"grad_accum_dtype": LEAN}),
    "torch_native": ("torch_native", {"grad_accum_dtype": LEAN}),
}

# Registered backends left out unless --variants names them, and why.
LEFT_OUT = {
    "eager": "the fp32 reference: fp32 matmuls (no tensor cores) take ~10x a bf16 impl's time, "
    "a third of the time budget; --variants ...,eager runs it",
}

# (tokens BT, hidden H, vocabulary V, softcap), the most important first (a budget cut drops the
# last ones): the heads of the models people fine-tune, 4k to 32k tokens. Flops 6*BT*H*V: 2.6e13
# at the design shape.
SHAPES: list[tuple[int, int, int, float | None]] = [
    (8192, 4096, 128256, None),  # the design shape (Llama 3 8B head)
    (16384, 2560, 151936, None),  # Qwen 2.5 3B head (hidden 2048 in 2.5; Qwen 3 4B: 2560)
    (32768, 2048, 128256, None),  # Llama 3.2 1B head, 32k tokens
    (16384, 3584, 152064, None),  # Qwen 2.5 7B head
    (16384, 3072, 128256, None),  # Llama 3.2 3B head
    (4096, 2048, 128256, None),  # Llama 3.2 1B head, 4k tokens
    (4096, 2304, 256000, 30.0),  # Gemma 2 2B head, softcap 30
    (8192, 3584, 256000, 30.0),  # Gemma 2 9B head, softcap 30
]
TINY_SHAPES: list[tuple[int, int, int, float | None]] = [(64, 32, 256, None), (48, 40, 500, 30.0)]


def variants(requested: list[str] | None) -> dict[str, tuple[str, dict[str, Any]]]:
    """VARIANTS plus every registered FLCE backend the table does not name (defaults), less
    LEFT_OUT unless requested by name."""
    table = dict(VARIANTS)
    for impl in impls(FLCE):
        if all(backend != impl.backend for backend, _ in table.values()):
            table[impl.backend] = (impl.backend, {})
    if not requested:
        return {k: v for k, v in table.items() if k not in LEFT_OUT}
    if requested:
        unknown = [v for v in requested if v not in table]
        if unknown:
            raise SystemExit(f"--variants: unknown {unknown}; known: {list(table)}")
        table = {k: table[k] for k in requested}
    return table


def repeats(flops: float, device: str, mm_tflops: float | None) -> dict[str, Any]:
    """Fewer timed calls for big cases (see the module docstring's arithmetic)."""
    if not device.startswith("cuda"):
        return {"warmup": 1, "rep": 2, "min_runs": 3, "gpu_runs": None}
    est_ms = flops / (0.6 * (mm_tflops or 700) * 1e12) * 1e3
    if est_ms >= 20:
        return {"warmup": 1, "rep": 1, "min_runs": 1, "gpu_runs": 2}
    if est_ms >= 5:
        return {"warmup": 5, "rep": 40, "min_runs": 3, "gpu_runs": 3}
    return {"warmup": 10, "rep": 60, "min_runs": 10, "gpu_runs": 10}


def shape_label(bt: int, h: int, v: int, softcap: float | None) -> str:
    return f"{bt}x{h}x{v}" + (f" sc{softcap:g}" if softcap else "")


def run_case(table, shape, regime, dtype, device, rates, bar, task) -> list[dict[str, Any]]:
    """Every variant on one (shape, softcap, regime); inputs made once, copied per variant."""
    spec = get_op(FLCE)
    bt, h, v, softcap = shape
    dims = {"BT": bt, "H": h, "V": v}
    base = {
        "op": FLCE,
        "mode": "full",
        "dtype": str(dtype).removeprefix("torch."),
        "shape": shape_label(*shape),
        "dims": dims,
        "BT": bt,
        "H": h,
        "V": v,
        "softcap": softcap,
        "regime": regime,
    }
    extra = {} if softcap is None else {"softcap": softcap}
    stats: dict[str, float] = {}
    try:
        made = spec.make_inputs(dims, dtype, device, 0, regime=regime, stats=stats, **extra)
    except Exception as e:  # the inputs themselves may not fit
        note = f"inputs: {type(e).__name__}: {e}"[:200]
        bar.advance(task, len(table))
        cleanup(device)
        return [base | empty_row(n, "full", "OOM" if is_oom(e) else "error", note) for n in table]
    base["entropy"] = stats.get("mean_entropy")
    assert spec.flops is not None  # (FLCE has a flops model)
    reps = repeats(spec.flops(dims), device, rates.get("matmul_tflops"))
    rows, passed = [], {}
    for name, (backend, options) in table.items():
        bar.update(task, description=f"{base['shape']} {regime} {name}")
        opts = {k: (dtype if o == LEAN else o) for k, o in options.items()}
        try:
            inputs = prepare_inputs(spec, made | opts, device)
            row = measure(FLCE, backend, inputs, "full", profile=False, **reps)
            del inputs
        except Exception as e:
            row = empty_row(backend, "full", "OOM" if is_oom(e) else "error", f"inputs: {e}"[:200])
        cleanup(device)
        if row["status"] == "ok":
            passed[name] = (backend, opts)
        rows.append(base | row | {"variant": name, "backend": backend, "options": _options_id(opts)})
        bar.advance(task)
    alternate(rows, passed, made, device)
    return rows


def alternate(rows: list[dict[str, Any]], passed: dict[str, Any], made: dict[str, Any], device: str) -> None:
    """The GPU times again, the calls of the variants that passed alternating
    (interleaved_gpu_ms), each on its own copy of the inputs: gpu_ms becomes that time,
    gpu_ms_alone keeps the time of the variant's own block of calls, gpu_alternating says which
    one gpu_ms is, gpu_sleep_ms is the idle before each alternating call, gpu_host_waits says
    whether the sleep does not cover the variant's call (it waits for the GPU on the host, or
    launches for longer than measure.MAX_COVERED_LAUNCH_MS): its GPU time includes host time."""
    for r in rows:
        r["gpu_alternating"] = False
    if len(passed) < 2 or not device.startswith("cuda"):
        return
    runs: dict[str, Any] = {}
    try:
        runs.update(_calls(passed, made, device))
        gpu, sleep_ms, waits = interleaved_gpu_ms(runs, INTERLEAVED_CALLS)
    except Exception as e:  # e.g. the variants' inputs together do not fit: recorded, not hidden
        note = f"alternating timing failed ({type(e).__name__}: {str(e)[:120]}); gpu_ms timed alone"
        for r in rows:
            if r["variant"] in passed:
                r["note"] = "; ".join(filter(None, [r.get("note"), note]))
        return
    finally:
        runs.clear()  # the inputs' copies and their gradients
        cleanup(device)
    for r in rows:
        if r["variant"] in gpu:
            r["gpu_ms_alone"], r["gpu_ms"] = r["gpu_ms"], gpu[r["variant"]]
            r["gpu_alternating"], r["gpu_sleep_ms"] = True, sleep_ms
            r["gpu_host_waits"] = r["variant"] in waits


def _calls(passed: dict[str, Any], made: dict[str, Any], device: str) -> dict[str, Any]:
    """name -> (the timed call as measure builds it, on a fresh copy of the inputs, the tensors
    whose gradients it sets)."""
    spec, calls = get_op(FLCE), {}
    for name, (backend, opts) in passed.items():
        inputs = prepare_inputs(spec, made | opts, device)
        calls[name] = (timed_call(FLCE, backend, inputs, "full"), grad_tensors_of(inputs))
    return calls


def rotated(table: dict[str, Any], k: int) -> dict[str, Any]:
    """The table's variants starting at the k-th, wrapping around: each round leads with another."""
    items = list(table.items())
    k %= max(len(items), 1)
    return dict(items[k:] + items[:k])


def median_of_rounds(rounds: list[list[dict[str, Any]]], names: list[str]) -> list[dict[str, Any]]:
    """One row per variant (in `names` order) from its rows of several rounds: the median GPU and
    wall times, every round's GPU time, the peak and note of the first round timed as the
    median is; a round that failed, as is."""
    out = []
    for name in names:
        mine = [r for rows in rounds for r in rows if r["variant"] == name]
        failed = [r for r in mine if r["status"] != "ok"]
        if failed:
            out.append(failed[0])
            continue
        # One method per median: the alternating rounds where there are any (a round whose
        # alternating pass failed has its time alone in gpu_ms).
        timed = [r for r in mine if r.get("gpu_alternating")] or mine
        row = dict(timed[0])
        row["gpu_ms"] = _median([r.get("gpu_ms") for r in timed])
        if row.get("gpu_alternating"):
            alone = [r.get("gpu_ms_alone") if r.get("gpu_alternating") else r.get("gpu_ms") for r in mine]
            row["gpu_ms_alone"] = _median(alone)
            row["gpu_sleep_ms"] = _median([r.get("gpu_sleep_ms") for r in timed])
            row["gpu_host_waits"] = any(r.get("gpu_host_waits") for r in timed)
        for key in ("ms", "ms_p20", "ms_p80"):
            row[key] = _median([r.get(key) for r in mine])
        row["gpu_ms_rounds"] = [r.get("gpu_ms") for r in timed]
        row["rounds"] = len(mine)
        out.append(row)
    return out


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _options_id(options: dict[str, Any]) -> str:
    return ",".join(f"{k}={str(o).removeprefix('torch.')}" for k, o in options.items()) or "default"


def add_frontier_ratios(rows: list[dict[str, Any]]) -> None:
    """time_vs_X = GPU time / X's (wall time on the CPU), mem_vs_X = peak / X's, per case."""
    cases: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        cases.setdefault((r["shape"], r["regime"]), {})[r["variant"]] = r
    for r in rows:
        t = "gpu_ms" if r.get("gpu_ms") is not None else "ms"
        for base_name in (TIME_BASE, MEM_BASE):
            ref = cases[(r["shape"], r["regime"])].get(base_name, {})
            ok = ref.get(t) and r.get(t)
            r[f"time_vs_{base_name}"] = r[t] / ref[t] if ok else None
            ok = ref.get("peak_mib") and r.get("peak_mib") is not None
            r[f"mem_vs_{base_name}"] = r["peak_mib"] / ref["peak_mib"] if ok else None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmkernels-bench frontier",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", help="output directory (default lmkernels-results/flce-frontier-<date>)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a check of the script, CPU ok)")
    p.add_argument("--variants", help=f"comma-separated subset (default all: {','.join(VARIANTS)}, ...)")
    p.add_argument("--regimes", default=",".join(REGIMES), help="comma-separated subset of the regimes")
    p.add_argument("--shapes", type=int, help="only the first N shapes")
    p.add_argument("--only", help="comma-separated shape labels, e.g. 32768x2048x128256")
    p.add_argument("--rounds", type=int, default=1, help="runs of each case, variants rotated")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--budget", type=float, default=460.0, help="seconds; later cases are skipped")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    return p.parse_args(argv)


def main(argv=None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    args = parse_args(argv)
    console = Console(stderr=True)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        console.print("lmkernels-bench frontier needs a CUDA device (or --device cpu --tiny).")
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    table = variants(args.variants.split(",") if args.variants else None)
    _, not_run = backends_for(FLCE, [b for b, _ in table.values()])
    table = {n: (b, o) for n, (b, o) in table.items() if b not in not_run}
    shapes = (TINY_SHAPES if args.tiny else SHAPES)[: args.shapes]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        known = [shape_label(*s) for s in shapes]
        unknown = [w for w in wanted if w not in known]
        if unknown:
            raise SystemExit(f"--only: unknown shapes {unknown}; known: {known}")
        shapes = [s for s in shapes if shape_label(*s) in wanted]
    if args.rounds < 1:
        raise SystemExit(f"--rounds: expected at least 1, got {args.rounds}")
    regimes = [r.strip() for r in args.regimes.split(",")]
    out = Path(args.out or f"lmkernels-results/flce-frontier-{time.strftime('%Y%m%d-%H%M%S')}")
    start = time.time()
    meta = environment() | {
        "command": command_line("frontier", argv),
        "dtype": args.dtype,
        "variants": {n: f"{b} ({_options_id(o)})" for n, (b, o) in table.items()},
        "not_run": not_run | ({} if args.variants else LEFT_OUT),
    }
    meta |= reference_rates(args.device, console)
    rows: list[dict[str, Any]] = []
    columns = (TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=args.no_progress) as bar:
        task = bar.add_task("flce frontier", total=len(shapes) * len(regimes) * len(table) * args.rounds)
        for i, shape in enumerate(shapes):
            if i == 0 or shape[:3] != shapes[i - 1][:3]:
                torch._dynamo.reset()  # static shapes: drop the graphs compiled for the last shape
            for regime in regimes:
                if time.time() - start > args.budget:
                    skipped = empty_row("", "full", "skipped", f"time budget ({args.budget:.0f} s)")
                    base = {"op": FLCE, "shape": shape_label(*shape), "regime": regime, "softcap": shape[3]}
                    rows += [base | skipped | {"variant": n, "backend": b} for n, (b, _) in table.items()]
                    bar.advance(task, len(table) * args.rounds)
                    continue
                rounds = [
                    run_case(rotated(table, k), shape, regime, dtype, args.device, meta, bar, task)
                    for k in range(args.rounds)
                ]
                rows += rounds[0] if args.rounds == 1 else median_of_rounds(rounds, list(table))
                add_rooflines(rows, dtype, meta.get("copy_gbps"), meta.get("matmul_tflops"))
                add_frontier_ratios(rows)
                write_reports(rows, meta | {"partial": True}, out, plots=False)
    meta["seconds"] = round(time.time() - start)
    paths = write_reports(rows, meta, out, plots=not args.no_plots)
    console.print((out / "summary.md").read_text().split("\n## ")[1][:3000])
    console.print(f"wrote {len(paths)} files to {out} in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
