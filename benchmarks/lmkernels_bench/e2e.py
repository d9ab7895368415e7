"""End-to-end training benchmark: tokens/s and peak memory of Llama-shaped models, per configuration.

    lmkernels-bench e2e --quick --out DIR          # ~6 min on one H200
    lmkernels-bench e2e --out DIR [--budget 540]   # the full sweeps
    lmkernels-bench e2e --device cpu --tiny --out DIR --configs plain,lmk:eager

Models (e2e_setup.MODELS): "llama-1b" (Llama-3.2-1B's shape, vocab 128256) and "llama-1b-v256k"
(the same body, vocab 256000: the loss dominates), random init, bf16 parameters, fused AdamW,
gradient checkpointing, random token batches. Configurations: see e2e_setup.py (plain,
lmk[:BACKEND], liger, -noflce, -nocheck, -1thread, +compile).

Sweeps (--sweeps), at sequence 1024 unless said:
  batch    llama-1b, batch 1..64 (the memory timeline at --timeline-batch, 32)
  seq      llama-1b, batch 4, sequence 512..16384
  small    llama-1b, batch 1, 2, 4 x sequence 512, 1024 (the host-bound regime)
  vocab    llama-1b-v256k at a few batches
  compile  llama-1b, --compile-configs (plain+compile, lmk+compile) at batch 8 and 32

Each (model, configuration) runs in a fresh subprocess (patches are process-wide; peaks must not
leak); inside, the model and optimizer are built once and the points run in order, a point
shared by two sweeps measured once. A point that runs out of memory is recorded as OOM and the
larger points of its sweep are skipped. Timing: e2e_setup.time_steps (CUDA events over at least
MIN_TIMED_S seconds of steps). The budget (--budget) is shared among the workers in proportion
to their estimated cost; points that do not fit are recorded as skipped.

--quick arithmetic (H200): 3 configs x 11 distinct llama-1b points (~2.5 s each) + 15 s of start-up
= 128 s; 3 configs x 3 v256k points = 68 s; 2 compiled configs x (start-up + one compile of the
model, ~60 s, batch dynamic + 2 points) = 160 s: ~6 min, budget 360 s.
--rounds N: the whole plan N times, the configurations' order rotated each round; a point's
step time is the median over the rounds (per-round rows in e2e_rounds.json). In the host-bound
regime (small batches) the host's speed drifts by tens of percent within a run, and one
configuration measured after another takes the drift as its own difference.
--interleave: the configurations of a model run in resident workers, all at once (each holds its
model and optimizer: memory for all of them must fit), built once; each round, each point is
measured by every configuration in turn, the order rotated per point and round. Configurations
compared at a point are then measured seconds apart, and the start-ups are paid once. After
an OOM, a configuration skips the points of as many tokens or more. With --rounds, summary.md
also gives each configuration's speedups paired by round (median, range, rounds faster);
--report DIR writes the reports of such a run again.
Outputs in --out: e2e.csv, e2e.json, summary.md, e2e_<sweep>.png, memory_timeline.png
(--rounds: e2e_rounds.json, e2e_paired_<model>.png).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lmkernels_bench import e2e_setup as setup
from lmkernels_bench.data import command_line
from lmkernels_bench.e2e_report import write_reports

GRACE_S = 30.0  # a worker may run this long past its deadline before it is stopped
FULL = {
    "batch_seq": 1024,  # the sequence length of every sweep but "seq"
    "batch": [1, 2, 4, 8, 16, 32, 64],
    "seq": [512, 1024, 2048, 4096, 8192, 16384],
    "small": [(b, s) for s in (512, 1024) for b in (1, 2, 4)],
    "vocab": [4, 8, 16, 32],
    "compile": [8, 32],
}
QUICK = dict(FULL, seq=[512, 1024, 4096], vocab=[4, 16, 32])
# --tiny: a check of the script (CPU ok), one or two small points per sweep.
TINY = {"batch_seq": 32, "batch": [1, 2], "seq": [32, 64], "small": [(1, 16)], "vocab": [2], "compile": [2]}
SWEEP_MODEL = {"vocab": "llama-1b-v256k"}  # every other sweep runs llama-1b


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def blank(spec: dict[str, Any], point: dict[str, Any], status: str, note: str) -> dict[str, Any]:
    keep = {k: point[k] for k in ("sweep", "batch", "seq")}
    empty = dict.fromkeys(("tokens_per_s", "peak_gib", "step_ms", "steps", "loss"))
    return {
        "model": spec["model_name"],
        "config": spec["config"],
        **keep,
        **empty,
        "status": status,
        "note": note,
    }


# --- the worker: one (model, configuration), several points, in its own process ------------------


def run_point(model, optimizer, spec, point, compiled):
    device = spec["device"]
    ids = setup.make_batch(
        spec["model"]["vocab_size"], point["batch"], point["seq"], device, dynamic=compiled
    )
    step = lambda: setup.train_step(model, optimizer, ids)
    res = setup.time_steps(step, device, spec["steps"], spec["warmup_steps"], spec["min_timed_s"])
    row = blank(spec, point, "ok", "") | res
    row["tokens_per_s"] = point["batch"] * point["seq"] / (res["step_ms"] / 1e3)
    if point.get("timeline") and device.startswith("cuda"):
        tl = setup.memory_timeline(step, device)
        Path(spec["timeline"]).write_text(json.dumps({"config": spec["config"], **point, **tl}))
    return row


def measure(model, optimizer, spec, point, compiled) -> tuple[dict[str, Any], float]:
    """run_point, its failure as a row (OOM or error), and the cleanup before the next point.
    Returns (row, seconds it took without the first steps' compilation / autotuning)."""
    import torch

    started = time.time()
    try:
        row = run_point(model, optimizer, spec, point, compiled)
    except Exception as e:
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        note = first if oom else f"{type(e).__name__}: {first}"
        row = blank(spec, point, "OOM" if oom else "error", note[:300])
    took = time.time() - started
    if row["step_ms"]:  # compilation and autotuning happen once
        took = min(took, (row["steps"] + spec["warmup_steps"]) * row["step_ms"] / 1e3 + 1.0)
    optimizer.zero_grad(set_to_none=True)  # back to the model state before the next point
    gc.collect()
    if spec["device"].startswith("cuda"):
        torch.cuda.empty_cache()
    return row, took


def run_worker(spec: dict[str, Any]) -> None:
    import torch

    def emit(row):
        with open(spec["results"], "a") as f:  # one line per point: survives a crash or a timeout
            f.write(json.dumps(row) + "\n")
        rate = f"{row['tokens_per_s'] / 1e3:.1f}k tok/s" if row["tokens_per_s"] else row["status"]
        peak = f"{row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else "-"
        log(
            f"  [{spec['config']}] {row['sweep']} b{row['batch']} s{row['seq']}: {rate}, {peak} {row['note'][:80]}"
        )

    serving = spec.get("serve", False)
    if serving:  # the replies go to the parent through the real stdout; any print to stderr
        replies = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
    torch.manual_seed(0)
    if not spec["device"].startswith("cuda"):
        # One thread: on a shared CPU (CI) two OpenMP threads spin-wait 20x slower.
        torch.set_num_threads(1)
    try:
        model = setup.build_model(spec["model"], spec["device"])
        setup.patch(model, spec["config"])
        optimizer = setup.make_optimizer(model)
    except Exception as e:  # e.g. a patch that fails: every point gets the reason
        if serving:
            replies.write(json.dumps({"setup_error": f"{type(e).__name__}: {e}"[:300]}) + "\n")
            return
        for point in spec["points"]:
            emit(blank(spec, point, "error", f"setup: {type(e).__name__}: {e}"[:300]))
        return
    compiled = setup.parse_config(spec["config"])[3]
    if serving:  # one point per line on stdin, one row per line back, until stdin closes
        replies.write(json.dumps({"ready": True}) + "\n")
        for line in sys.stdin:
            row, _ = measure(model, optimizer, spec, json.loads(line), compiled)
            emit(row)
            replies.write(json.dumps(row) + "\n")
        return
    done: dict[tuple[int, int], dict[str, Any]] = {}
    oom_in: set[str] = set()
    last_s = 0.0
    for point in spec["points"]:
        key = (point["batch"], point["seq"])
        if key in done and not point.get("timeline"):
            emit(done[key] | {"sweep": point["sweep"]})
            continue
        if point["sweep"] in oom_in:
            emit(blank(spec, point, "skipped", "a smaller point of this sweep ran out of memory"))
            continue
        if time.time() + 2 * last_s > spec["deadline"]:  # sizes grow: expect twice the last point's
            emit(blank(spec, point, "skipped", "time budget"))
            continue
        row, last_s = measure(model, optimizer, spec, point, compiled)
        oom_in |= {point["sweep"]} if row["status"] == "OOM" else set()
        done[key] = row
        emit(row)


# --- the parent: plan, budget, subprocesses, reports ---------------------------------------------


def plan_workers(args) -> list[tuple[str, str, list[dict[str, Any]]]]:
    """[(model name, configuration, points)] in running order, the most important first."""
    grid: dict[str, Any] = TINY if args.tiny else QUICK if args.quick else FULL
    bs = grid["batch_seq"]
    at_bs = lambda sweep, batches: [{"sweep": sweep, "batch": b, "seq": bs} for b in batches]
    batch = at_bs("batch", args.batches or grid["batch"])
    points: dict[str, list[dict[str, Any]]] = {
        "batch": [p | {"timeline": p["batch"] == args.timeline_batch} for p in batch],
        "seq": [{"sweep": "seq", "batch": 4, "seq": s} for s in (args.seqs or grid["seq"])],
        "small": [{"sweep": "small", "batch": b, "seq": s} for b, s in grid["small"]],
        "vocab": at_bs("vocab", grid["vocab"]),
        "compile": at_bs("compile", grid["compile"]),
    }
    workers = []
    for model in ("llama-1b", "llama-1b-v256k"):
        sweeps = [s for s in args.sweeps if s != "compile" and SWEEP_MODEL.get(s, "llama-1b") == model]
        for config in args.configs if sweeps else []:
            workers.append((model, config, [p for s in sweeps for p in points[s]]))
    if "compile" in args.sweeps:
        workers += [("llama-1b", c, points["compile"]) for c in args.compile_configs]
    return workers


def rounds(workers, n: int) -> list[tuple]:
    """The plan n times; round r runs the configurations of each model rotated by r."""
    out = []
    for r in range(n):
        for model in dict.fromkeys(w[0] for w in workers):
            mine = [w for w in workers if w[0] == model]
            k = r % len(mine)
            out += [(*w, r) for w in mine[k:] + mine[:k]]
    return out


def median_over_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, config, sweep, point): the median step time of the rounds that ran
    it (tokens/s from that), the largest peak; the rounds' tokens/s in the note."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in ("model", "config", "sweep", "batch", "seq")), []).append(row)
    out = []
    for group in groups.values():
        ok = sorted((r for r in group if r["status"] == "ok"), key=lambda r: r["step_ms"])
        if not ok:
            out.append({k: v for k, v in group[0].items() if k != "round"})
            continue
        row = {k: v for k, v in ok[len(ok) // 2].items() if k != "round"}
        row["step_ms"] = statistics.median(r["step_ms"] for r in ok)
        row["tokens_per_s"] = row["batch"] * row["seq"] / (row["step_ms"] / 1e3)
        peaks = [r["peak_gib"] for r in ok if r["peak_gib"] is not None]  # None on the CPU
        row["peak_gib"] = max(peaks) if peaks else None
        rates = ", ".join(f"{r['tokens_per_s'] / 1e3:.1f}k" for r in sorted(ok, key=lambda r: r["round"]))
        row["note"] = f"median of {len(ok)} rounds ({rates})"
        out.append(row)
    return out


def cost(config: str, points: list[dict[str, Any]]) -> float:
    """Estimated seconds: start-up, ~2.5 s per distinct point, ~60 s for compiling the model."""
    distinct = {(p["batch"], p["seq"]) for p in points}
    return 15 + 2.5 * len(distinct) + (60 if config.endswith("+compile") else 0)


def worker_spec(model_name, config, points, args, out: Path, deadline: float, tag: str = "") -> dict:
    slug = "".join(c if c.isalnum() or c in "-." else "_" for c in f"{model_name}_{config}{tag}")
    results, timeline = out / "raw" / f"{slug}.jsonl", out / "raw" / f"timeline_{slug}.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    for stale in (results, timeline):  # from an earlier run into the same directory
        stale.unlink(missing_ok=True)
    return {
        "config": config,
        "model_name": "tiny" if args.tiny else model_name,
        "model": setup.MODELS["tiny" if args.tiny else model_name],
        "points": points,
        "deadline": deadline,
        "device": args.device,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "min_timed_s": args.min_timed_s,
        "results": str(results),
        "timeline": str(timeline),
    }


def worker_cmd(spec: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "lmkernels_bench.e2e", "--worker", json.dumps(spec)]


def run_config(
    model_name, config, points, args, out: Path, deadline: float, tag: str = ""
) -> list[dict[str, Any]]:
    spec = worker_spec(model_name, config, points, args, out, deadline, tag)
    results = Path(spec["results"])
    status, note = "skipped", "not reached"
    try:
        proc = subprocess.run(worker_cmd(spec), timeout=deadline - time.time() + GRACE_S)
        if proc.returncode != 0:
            status, note = "error", f"the worker exited with status {proc.returncode} (see its output)"
    except subprocess.TimeoutExpired:
        note = "the worker was stopped at the time budget"
    rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    reported = {(r["sweep"], r["batch"], r["seq"]) for r in rows}
    rows += [
        blank(spec, p, status, note) for p in points if (p["sweep"], p["batch"], p["seq"]) not in reported
    ]
    return rows


def run_interleaved(model_name, configs, points, args, out: Path, end: float) -> list[dict[str, Any]]:
    """--interleave: one resident worker per configuration, started together. Each round, every
    point is measured by each configuration in turn, in an order rotated per point and round, so
    that the configurations compared at a point run seconds apart instead of minutes."""
    specs = {c: worker_spec(model_name, c, points, args, out, end) | {"serve": True} for c in configs}
    procs = {
        c: subprocess.Popen(worker_cmd(spec), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for c, spec in specs.items()
    }

    def reply(config: str, wait_s: float) -> dict[str, Any] | None:
        """The worker's next line; None if it exited or did not answer within wait_s."""
        pipe = procs[config].stdout
        assert pipe is not None  # (Popen with stdout=PIPE)
        readable, _, _ = select.select([pipe], [], [], max(wait_s, 0.0))
        line = pipe.readline() if readable else ""
        return json.loads(line) if line else None

    failed: dict[str, str] = {}  # configuration -> why its remaining points are not measured
    for config in configs:
        got = reply(config, end - time.time())
        if got is None or "setup_error" in got:
            failed[config] = f"setup: {got['setup_error']}" if got else "the worker did not start in time"
    sweeps: dict[tuple[int, int], list[str]] = {}  # a point shared by two sweeps is measured once
    for point in points:
        sweeps.setdefault((point["batch"], point["seq"]), []).append(point["sweep"])
    distinct = [next(p for p in points if (p["batch"], p["seq"]) == key) for key in sweeps]
    oom_at: dict[str, float] = dict.fromkeys(configs, float("inf"))  # fewest tokens that ran out
    last_s: dict[str, float] = dict.fromkeys(configs, 0.0)
    rows: list[dict[str, Any]] = []
    round_s = 0.0
    try:
        for r in range(args.rounds):
            started = time.time()
            whole = started + round_s <= end  # a round that would not fit is not begun
            for i, point in enumerate(distinct):
                point = point | {"timeline": bool(point.get("timeline")) and r == 0}
                k = (r + i) % len(configs)
                for config in configs[k:] + configs[:k]:
                    row: dict[str, Any] | None
                    if config in failed:
                        row = blank(specs[config], point, "error", failed[config])
                    elif not whole or time.time() + 2 * last_s[config] > end:
                        row = blank(specs[config], point, "skipped", "time budget")
                    elif point["batch"] * point["seq"] >= oom_at[config]:
                        row = blank(specs[config], point, "skipped", "a point as small ran out of memory")
                    else:
                        t0 = time.time()
                        stdin = procs[config].stdin
                        assert stdin is not None  # (Popen with stdin=PIPE)
                        try:
                            stdin.write(json.dumps(point) + "\n")
                            stdin.flush()
                            row = reply(config, end - time.time() + GRACE_S)
                        except OSError:  # it exited: a broken pipe
                            row = None
                        if row is None:
                            failed[config] = "the worker stopped answering (see its output)"
                            procs[config].kill()
                            row = blank(specs[config], point, "error", failed[config])
                        last_s[config] = time.time() - t0
                        if row["status"] == "OOM":
                            oom_at[config] = min(oom_at[config], point["batch"] * point["seq"])
                    rows += [row | {"sweep": s, "round": r} for s in sweeps[(point["batch"], point["seq"])]]
            round_s = time.time() - started
    finally:
        for proc in procs.values():
            try:
                if proc.stdin is not None:  # (always: stdin=PIPE)
                    proc.stdin.close()
            except OSError:
                pass
        for proc in procs.values():
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
    return sorted(rows, key=lambda row: configs.index(row["config"]))  # stable: rounds, points in order


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmkernels-bench e2e", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", help="output directory (default lmkernels-results/e2e-<date>)")
    p.add_argument("--quick", action="store_true", help="the ~6 min selection (see above); budget 360 s")
    p.add_argument("--configs", help="configurations of the sweeps (default plain,lmk,liger[,lmk-noflce])")
    p.add_argument("--compile-configs", help="of the compile sweep (default plain+compile,lmk+compile)")
    p.add_argument("--sweeps", default="batch,seq,small,vocab,compile", help="comma-separated subset")
    p.add_argument("--batches", help="batch sizes of the batch sweep")
    p.add_argument("--seqs", help="sequence lengths of the sequence sweep")
    p.add_argument(
        "--timeline-batch", type=int, default=32, help="batch of the memory timeline (batch sweep)"
    )
    p.add_argument("--steps", type=int, help="timed steps per point, at least (default 4, quick 2)")
    p.add_argument("--warmup-steps", type=int, help="untimed steps first (default 2, quick 1)")
    p.add_argument(
        "--min-timed-s",
        type=float,
        help=f"seconds timed per point, at least (default {setup.MIN_TIMED_S}, quick 1)",
    )
    p.add_argument("--budget", type=float, help="seconds for the whole run (default 540, quick 360)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the plan, configurations rotated (median)")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="resident workers, configurations taking turns at each point (see above)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--tiny", action="store_true", help="a 2-layer model with vocab 1000 (script check, CPU ok)"
    )
    p.add_argument("--report", metavar="DIR", help="rewrite the reports of a --rounds run in DIR")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    ints = lambda s: [int(v) for v in s.split(",") if v.strip()] if s else None
    names = lambda s: [v.strip() for v in s.split(",") if v.strip()]
    args.configs = (
        names(args.configs)
        if args.configs
        else ["plain", "lmk", "liger", *([] if args.quick else ["lmk-noflce"])]
    )
    cc = args.compile_configs
    args.compile_configs = names(cc) if cc is not None else ["plain+compile", "lmk+compile"]
    args.sweeps = names(args.sweeps)
    args.batches, args.seqs = ints(args.batches), ints(args.seqs)
    args.steps = args.steps or (2 if args.quick else 4)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (1 if args.quick else 2)
    args.min_timed_s = (
        args.min_timed_s if args.min_timed_s is not None else (1.0 if args.quick else setup.MIN_TIMED_S)
    )
    args.budget = args.budget or (360.0 if args.quick else 540.0)
    if args.tiny:
        args.timeline_batch = 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(json.loads(args.worker))
        return 0
    if args.report:  # the reports again, from a run's e2e_rounds.json and e2e.json (its meta)
        out = Path(args.report)
        round_rows = json.loads((out / "e2e_rounds.json").read_text())
        meta = json.loads((out / "e2e.json").read_text())["meta"]
        write_reports(median_over_rounds(round_rows), meta, out, round_rows)
        log((out / "summary.md").read_text())
        return 0
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        log("lmkernels-bench e2e needs a CUDA device (or --device cpu --tiny to check the script).")
        return 2
    for name in [*args.configs, *args.compile_configs]:
        setup.parse_config(name)  # fail early on a typo
    out = Path(args.out or f"lmkernels-results/e2e-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    end = start + args.budget
    rows: list[dict[str, Any]] = []
    if args.interleave:
        groups: dict[tuple, list[str]] = {}  # workers with the same points share a group
        for model, config, points in plan_workers(args):
            groups.setdefault((model, json.dumps(points)), []).append(config)
        costs = {g: args.rounds * sum(cost(c, json.loads(g[1])) for c in cs) for g, cs in groups.items()}
        for i, ((model, points), configs) in enumerate(groups.items()):
            share = (end - time.time()) * costs[(model, points)] / sum(list(costs.values())[i:])
            log(f"[{i + 1}/{len(groups)}] {model} {','.join(configs)}: {args.rounds} rounds, {share:.0f} s")
            rows += run_interleaved(model, configs, json.loads(points), args, out, time.time() + share)
    workers = [] if args.interleave else rounds(plan_workers(args), args.rounds)
    for i, (model, config, points, r) in enumerate(workers):
        left = sum(cost(c, p) for _, c, p, _ in workers[i:])
        share = (end - time.time()) * cost(config, points) / left  # unused time passes on
        if share < 10:  # not even time to build the model
            who = {"model_name": "tiny" if args.tiny else model, "config": config}
            rows += [blank(who, p, "skipped", "time budget") | {"round": r} for p in points]
            continue
        log(f"[{i + 1}/{len(workers)}] {model} {config}: {len(points)} points, {share:.0f} s")
        tag = f"_r{r}" if args.rounds > 1 else ""
        got = run_config(model, config, points, args, out, time.time() + share, tag)
        rows += [row | {"round": r} for row in got]
    round_rows = rows if args.rounds > 1 else []
    if round_rows:
        (out / "e2e_rounds.json").write_text(json.dumps(rows, indent=1))
        rows = median_over_rounds(rows)
    meta = setup.environment() | {
        "models": {m: setup.MODEL_TITLES[m] for m in dict.fromkeys(r["model"] for r in rows)},
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "min_timed_s": args.min_timed_s,
        "timeline_batch": args.timeline_batch,
        "seconds": round(time.time() - start),
        "command": command_line("e2e", argv),
    }
    paths = write_reports(rows, meta, out, round_rows)
    log((out / "summary.md").read_text())
    log(f"wrote {len(paths)} files to {out} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
