"""End-to-end training benchmark: tokens/s and peak memory of a Llama-3.2-1B-shaped model.

    python benchmarks/e2e_train.py --out DIR [--quick] [--configs plain,lmk,liger] [--budget 480]

The model: transformers LlamaForCausalLM from a LlamaConfig (hidden 2048, intermediate 8192,
16 layers, 32/8 heads, vocab 128256, tied embeddings), random init, bf16 parameters, AdamW (fused
when available), gradient checkpointing, random token batches (labels = inputs, the model shifts
them). Sweeps: batch 4..64 at sequence 1024, and sequence 512..16384 at batch 4.

Configurations (--configs, comma-separated):
  plain               transformers as is
  lmk[:BACKEND]       lmkernels.integrations.transformers.apply(model, backend=BACKEND) with all
                      ops (rms_norm, rope, mlp, flce); no BACKEND: automatic choice
  liger               liger_kernel's apply_liger_kernel_to_llama(model=...) (rope, RMSNorm, SwiGLU, FLCE)
  ...-noflce          any of the patched ones without the fused loss (the ablation: all kernels,
                      all but FLCE, none = plain)

Each configuration runs in a fresh subprocess (patches are process-wide and peaks must not leak
between configurations); inside it, the model and optimizer are built once and the points run
in order, memory freed and the peak counter reset between them. A point that runs out of memory
is recorded as OOM and the larger points of its sweep are skipped. After warmup steps, N steps
are timed with CUDA events (N = --steps, raised for short steps so that at least MIN_TIMED_S
seconds are timed): tokens/s = batch * seq * N / time. Peak memory is
torch.cuda.max_memory_allocated() over those steps: parameters, gradients, optimizer states and
activations. At one point (--timeline-batch, sequence 1024) each configuration also records
the allocated memory over one step (torch.cuda.memory._record_memory_history).

A time budget (--budget seconds) is shared among the configurations: each gets an equal share
of what is left when it starts; points that do not fit are recorded as skipped. Outputs in --out:
e2e.csv, e2e.json, summary.md, e2e_batch.png, e2e_seq.png, memory_timeline.png.
`--tiny` runs a 2-layer model on the CPU, to check the script itself.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BATCHES = [4, 8, 16, 32, 64]
SEQS = [512, 1024, 2048, 4096, 8192, 16384]
DEFAULT_CONFIGS = ["plain", "lmk", "liger", "lmk-noflce", "lmk:compile"]
MIN_TIMED_S = 1.5  # time at least this many seconds of steps per point (see run_point)
MAX_STEPS = 40
GRACE_S = 30.0  # a worker may run this long past its deadline before it is stopped
ALL_OPS = ("rms_norm", "rope", "mlp", "flce")

LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
TINY = dict(
    LLAMA_1B,
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- the worker: one configuration, several points, in its own process ------------------------------


def build_model(model_cfg: dict[str, Any], device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**model_cfg)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # allocate the parameters in bf16 directly
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    # transformers 5 renamed gradient checkpointing to activation checkpointing.
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model


def parse_config(name: str) -> tuple[str, str | None, tuple[str, ...]]:
    """Split a configuration name: lmk:triton-noflce -> ("lmk", "triton", ops without flce)."""
    base, noflce = (name[: -len("-noflce")], True) if name.endswith("-noflce") else (name, False)
    kind, _, backend = base.partition(":")
    if kind not in ("plain", "lmk", "liger"):
        raise ValueError(
            f"unknown configuration {name!r} (plain, lmk[:BACKEND], liger, with optional -noflce)"
        )
    ops = tuple(o for o in ALL_OPS if not (noflce and o == "flce"))
    return kind, backend or None, ops


def patch(model, name: str) -> None:
    kind, backend, ops = parse_config(name)
    if kind == "lmk":
        from lmkernels.integrations.transformers import apply

        apply(model, backend=backend, ops=ops)
    elif kind == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(
            rope="rope" in ops,
            rms_norm="rms_norm" in ops,
            swiglu="mlp" in ops,
            fused_linear_cross_entropy="flce" in ops,
            cross_entropy=False,
            model=model,
        )


def make_optimizer(model):
    import torch

    try:
        return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    except (RuntimeError, TypeError, ValueError):  # no fused AdamW for this device / dtype
        return torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)


def train_step(model, optimizer, input_ids):
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def memory_timeline(step, device: str, max_points: int = 4000) -> dict[str, Any]:
    """Allocated memory over one call of `step`, from the caching allocator's trace."""
    import torch

    from lmkernels.harness.bench import allocated_timeline

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = torch.device(device).index or 0
    events = snapshot["device_traces"][index] if snapshot.get("device_traces") else []
    return allocated_timeline(events, base, max_points)


def run_point(model, optimizer, spec: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    """Warmup steps, then at least spec["steps"] timed steps of one (batch, seq); the result row."""
    import torch

    device, batch, seq = spec["device"], point["batch"], point["seq"]
    cuda = device.startswith("cuda")
    row = {
        "config": spec["config"],
        "sweep": point["sweep"],
        "batch": batch,
        "seq": seq,
        "status": "ok",
        "tokens_per_s": None,
        "peak_gib": None,
        "step_ms": None,
        "loss": None,
        "note": "",
    }
    input_ids = torch.randint(0, spec["model"]["vocab_size"], (batch, seq), device=device)
    for _ in range(spec["warmup_steps"]):
        t_step = time.perf_counter()
        train_step(model, optimizer, input_ids)
        if cuda:
            torch.cuda.synchronize()
        t_step = time.perf_counter() - t_step
    # Short steps are timed over more of them (at least MIN_TIMED_S): a few 70 ms steps
    # varied by 1.6x between runs on the H200's host.
    steps = spec["steps"]
    if spec["warmup_steps"]:
        steps = min(MAX_STEPS, max(steps, math.ceil(MIN_TIMED_S / max(t_step, 1e-3))))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = train_step(model, optimizer, input_ids)
    if cuda:
        end.record()
        torch.cuda.synchronize()
        elapsed_ms = start.elapsed_time(end)
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        elapsed_ms = (time.perf_counter() - t0) * 1e3
    row["step_ms"] = elapsed_ms / steps
    row["tokens_per_s"] = batch * seq * steps / (elapsed_ms / 1e3)
    row["steps"] = steps
    row["loss"] = float(loss)  # a sanity check: about ln(vocab) = 11.8 at random init
    if cuda and point.get("timeline"):
        tl = memory_timeline(lambda: train_step(model, optimizer, input_ids), device)
        Path(spec["timeline"]).write_text(
            json.dumps({"config": spec["config"], "batch": batch, "seq": seq, **tl})
        )
    return row


def run_worker(spec: dict[str, Any]) -> None:
    import torch

    name = spec["config"]

    def emit(row: dict[str, Any]) -> None:
        with open(spec["results"], "a") as f:  # one line per point: survives a crash or a timeout
            f.write(json.dumps(row) + "\n")
        peak = f"{row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else "-"
        rate = f"{row['tokens_per_s'] / 1e3:.1f}k tok/s" if row["tokens_per_s"] else row["status"]
        log(
            f"  [{name}] batch {row['batch']:>3} seq {row['seq']:>5}: {rate}, peak {peak} {row['note'][:100]}"
        )

    def blank(point: dict[str, Any], status: str, note: str) -> dict[str, Any]:
        return {
            "config": name,
            "sweep": point["sweep"],
            "batch": point["batch"],
            "seq": point["seq"],
            "status": status,
            "tokens_per_s": None,
            "peak_gib": None,
            "step_ms": None,
            "loss": None,
            "note": note,
        }

    torch.manual_seed(0)
    try:
        model = build_model(spec["model"], spec["device"])
        patch(model, name)
        optimizer = make_optimizer(model)
    except Exception as e:  # e.g. a patch that fails: every point gets the reason
        for point in spec["points"]:
            emit(blank(point, "error", f"setup: {type(e).__name__}: {e}"[:300]))
        return
    oom_in: set[str] = set()
    last_seconds: dict[str, float] = {}  # per sweep: how long its previous point took
    for point in spec["points"]:
        sweep = point["sweep"]
        if sweep in oom_in:
            emit(blank(point, "skipped", "a smaller point of this sweep ran out of memory"))
            continue
        # The sizes double along a sweep: expect about twice the previous point's time.
        if time.time() + 2 * last_seconds.get(sweep, 0.0) > spec["deadline"]:
            emit(blank(point, "skipped", "time budget"))
            continue
        started = time.time()
        try:
            row = run_point(model, optimizer, spec, point)
        except Exception as e:
            oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            row = blank(
                point, "OOM" if oom else "error", (first if oom else f"{type(e).__name__}: {first}")[:300]
            )
            if oom:
                oom_in.add(sweep)
        last_seconds[sweep] = time.time() - started
        # Free the activations and cached blocks so the next point starts from the model state.
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if spec["device"].startswith("cuda"):
            torch.cuda.empty_cache()
        emit(row)


# --- the parent: plan, budget, subprocesses, reports -------------------------------------------------


def plan_points(args) -> list[dict[str, Any]]:
    points = []
    if "batch" in args.sweeps:
        points += [
            {"sweep": "batch", "batch": b, "seq": args.batch_seq, "timeline": b == args.timeline_batch}
            for b in args.batches
        ]
    if "seq" in args.sweeps:
        points += [{"sweep": "seq", "batch": args.seq_batch, "seq": s, "timeline": False} for s in args.seqs]
    return points


def run_config(name: str, points, args, out: Path, deadline: float) -> list[dict[str, Any]]:
    results = out / "raw" / f"{name.replace(':', '_')}.jsonl"
    timeline = out / "raw" / f"timeline_{name.replace(':', '_')}.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    for stale in (results, timeline):  # from an earlier run into the same directory
        stale.unlink(missing_ok=True)
    spec = {
        "config": name,
        "points": points,
        "deadline": deadline,
        "device": args.device,
        "model": TINY if args.tiny else LLAMA_1B,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "results": str(results),
        "timeline": str(timeline),
    }
    # Grace beyond the deadline for the point running then (a batch-64 step takes about 1 s).
    timeout = deadline - time.time() + GRACE_S
    status, note = "skipped", "not reached"
    try:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)], timeout=timeout
        )
        if proc.returncode != 0:
            status, note = "error", f"the worker exited with status {proc.returncode} (see its output)"
    except subprocess.TimeoutExpired:
        note = "the worker was stopped at the time budget"
    rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    done = {(r["sweep"], r["batch"], r["seq"]) for r in rows}
    for p in points:  # points the worker never reported: it crashed or was killed first
        if (p["sweep"], p["batch"], p["seq"]) not in done:
            rows.append(
                {
                    "config": name,
                    "sweep": p["sweep"],
                    "batch": p["batch"],
                    "seq": p["seq"],
                    "status": status,
                    "tokens_per_s": None,
                    "peak_gib": None,
                    "step_ms": None,
                    "loss": None,
                    "note": note,
                }
            )
    return rows


def environment() -> dict[str, Any]:
    from importlib import metadata

    import torch

    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    for dist in ("transformers", "triton", "liger-kernel", "lmkernels"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist] = None
    return env


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """speedup / memory relative to plain transformers and to Liger at the same point."""
    by_point = {(r["sweep"], r["batch"], r["seq"], r["config"]): r for r in rows}
    for r in rows:
        for base in ("plain", "liger"):
            ref = by_point.get((r["sweep"], r["batch"], r["seq"], base))
            ok = ref is not None and ref["tokens_per_s"] and r["tokens_per_s"]
            r[f"speedup_vs_{base}"] = r["tokens_per_s"] / ref["tokens_per_s"] if ok else None
            ok = ref is not None and ref["peak_gib"] and r["peak_gib"]
            r[f"mem_vs_{base}"] = r["peak_gib"] / ref["peak_gib"] if ok else None


FIELDS = [
    "config",
    "sweep",
    "batch",
    "seq",
    "status",
    "tokens_per_s",
    "peak_gib",
    "step_ms",
    "steps",
    "loss",
    "speedup_vs_plain",
    "speedup_vs_liger",
    "mem_vs_plain",
    "mem_vs_liger",
    "note",
]


def summary(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# End-to-end training benchmark", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if not isinstance(v, (dict, list))]
    lines += [
        "",
        "tokens/s (k) and peak GiB per point; speedup and memory relative to plain and to liger.",
        "",
    ]
    for sweep in ("batch", "seq"):
        group = [r for r in rows if r["sweep"] == sweep]
        if not group:
            continue
        lines += [
            f"## {sweep} sweep",
            "",
            "| config | batch | seq | k tokens/s | peak GiB | vs plain | vs liger | status |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in group:
            tps = f"{r['tokens_per_s'] / 1e3:.1f}" if r["tokens_per_s"] else "-"
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
            rel = []
            for base in ("plain", "liger"):
                if r["config"] == base:
                    rel.append("-")
                    continue
                speed, mem = r.get(f"speedup_vs_{base}"), r.get(f"mem_vs_{base}")
                parts = [f"{speed:.2f}x speed"] if speed else []
                parts += [f"{mem:.2f}x mem"] if mem else []
                rel.append(", ".join(parts) or "-")
            status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['note']}"
            lines.append(
                f"| {r['config']} | {r['batch']} | {r['seq']} | {tps} | {peak} | {rel[0]} | {rel[1]} | "
                f"{status.replace('|', '/')[:120]} |"
            )
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=False, help="output directory")
    p.add_argument(
        "--quick",
        action="store_true",
        help="plain, lmk, liger; batches 4,16; seqs 1024,4096; 1+2 steps; budget 240 s",
    )
    p.add_argument("--configs", help=f"comma-separated (default {','.join(DEFAULT_CONFIGS)})")
    p.add_argument("--sweeps", default="batch,seq", help="batch, seq or both (default)")
    p.add_argument("--batches", help=f"batch sizes of the batch sweep (default {BATCHES})")
    p.add_argument("--seqs", help=f"sequence lengths of the sequence sweep (default {SEQS})")
    p.add_argument("--batch-seq", type=int, default=1024, help="sequence length of the batch sweep")
    p.add_argument("--seq-batch", type=int, default=4, help="batch size of the sequence sweep")
    p.add_argument(
        "--timeline-batch",
        type=int,
        help="batch of the memory timeline, at sequence --batch-seq (default 8, else the first batch)",
    )
    p.add_argument("--steps", type=int, help="timed steps per point (default 4)")
    p.add_argument("--warmup-steps", type=int, help="untimed steps first (default 2)")
    p.add_argument("--budget", type=float, help="seconds for the whole run (default 480)")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--tiny", action="store_true", help="a 2-layer model with vocab 1000 (script check, CPU ok)"
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    ints = lambda s: [int(v) for v in s.split(",") if v.strip()]
    args.configs = (
        args.configs.split(",")
        if args.configs
        else (["plain", "lmk", "liger"] if args.quick else DEFAULT_CONFIGS)
    )
    args.sweeps = [s.strip() for s in args.sweeps.split(",")]
    args.batches = ints(args.batches) if args.batches else ([4, 16] if args.quick else BATCHES)
    args.seqs = ints(args.seqs) if args.seqs else ([1024, 4096] if args.quick else SEQS)
    args.steps = args.steps or (2 if args.quick else 4)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (1 if args.quick else 2)
    args.budget = args.budget or (240.0 if args.quick else 480.0)
    if args.timeline_batch is None:
        args.timeline_batch = 8 if 8 in args.batches else args.batches[0]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(json.loads(args.worker))
        return 0
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        log("e2e_train.py needs a CUDA device (or --tiny --device cpu to check the script).")
        return 2
    for name in args.configs:
        parse_config(name)  # fail early on a typo
    out = Path(args.out or f"benchmarks/results/e2e-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    points = plan_points(args)
    start = time.time()
    end = start + args.budget
    rows: list[dict[str, Any]] = []
    for i, name in enumerate(args.configs):
        share = (end - time.time()) / (len(args.configs) - i)  # unused time passes to the next ones
        if share < GRACE_S:  # not even time to build the model
            rows += [
                dict(
                    p,
                    config=name,
                    status="skipped",
                    tokens_per_s=None,
                    peak_gib=None,
                    step_ms=None,
                    loss=None,
                    note="time budget",
                )
                for p in points
            ]
            continue
        log(f"[{i + 1}/{len(args.configs)}] {name}: {len(points)} points, {share:.0f} s")
        rows += run_config(name, points, args, out, time.time() + share)
    add_ratios(rows)
    meta = environment() | {
        "model": "tiny" if args.tiny else "Llama-3.2-1B shape",
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "seconds": round(time.time() - start),
        "command": " ".join(sys.argv),
    }
    with open(out / "e2e.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (out / "e2e.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "summary.md").write_text(summary(rows, meta))
    from lmkernels.harness.plots import plot_e2e, plot_memory_timeline

    paths = plot_e2e(rows, out)
    timelines = {}
    for name in args.configs:
        f = out / "raw" / f"timeline_{name.replace(':', '_')}.json"
        if f.exists():
            tl = json.loads(f.read_text())
            timelines[f"{name} (peak {max(tl['mib'], default=0) / 1024:.1f} GiB)"] = tl
    if timelines:
        paths.append(
            plot_memory_timeline(
                timelines,
                out / "memory_timeline.png",
                f"allocated memory over one step, batch {args.timeline_batch}, seq {args.batch_seq}",
            )
        )
    log(summary(rows, meta))
    log(f"wrote e2e.csv, e2e.json, summary.md and {len(paths)} plots to {out} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
