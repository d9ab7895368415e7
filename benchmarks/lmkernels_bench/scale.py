"""Distributed benchmark: every distributed wrapping on 1, 2 and 4 GPUs, plain vs lmkernels vs Liger.

    lmkernels-bench dist-scale --out DIR [--gpus 1,2,4] [--modes ...] [--configs plain,lmk,liger]
    lmkernels-bench dist-scale --out DIR --dry-run        # the runs and their commands, nothing run
    lmkernels-bench dist-scale --out DIR --tiny --gpus 2  # a tiny model on the CPU (gloo): checks the script

(not under torchrun: it launches `torchrun --nproc-per-node N` once per (GPU count, mode,
config), since patches are process-wide). Model: transformers LlamaForCausalLM at the
Llama-3.2-1B shape (hidden 2048, intermediate 8192, 32/8 heads, vocab 128256) with --layers
layers (8) and untied embeddings, random init, same seed everywhere; AdamW (lr 3e-4) over
lmkernels.distributed.foreach_safe_param_groups; random token batches (labels = inputs), the same
batches for every config of a (GPU count, mode). bf16 compute everywhere on CUDA: FSDP2's
MixedPrecisionPolicy(param bf16, reduce fp32) over fp32 parameters; DeepSpeed's bf16 mode; bf16
weights under tensor parallel alone (as `from_pretrained(dtype=bfloat16)`); autocast under
pipeline parallel.

Modes (N = GPUs of the run; --batch B sequences of --seq S tokens per data-parallel replica):
  fsdp           fully_shard per decoder layer + root; each rank B sequences           N >= 1
  fsdp_lm_head   the same plus embeddings and lm_head sharded on their own              N >= 1
  tp             tensor parallel over the N GPUs: transformers' tp plan
                 (DistributedConfig(tp_size=N)); the N GPUs share B sequences            N >= 2
  fsdp_tp_hf     2-D, tp 2 x dp N/2: transformers' DistributedConfig(tp_size=2,
                 fsdp_size=N/2) (its tp plan, its fully_shard plan); B per tp group      N >= 4, even
  fsdp_tp_torch  2-D, tp 2 x dp N/2: torch's parallel styles with sequence parallel
                 (lmkernels.distributed.plans.sequence_parallel_plan) + fully_shard on
                 dp per layer, lm_head alone, root; B per tp group                      N >= 4, even
  zero2, zero3   DeepSpeed ZeRO-2 / ZeRO-3 (deepspeed.initialize, bf16); B per rank     N >= 1
  pp             pipeline parallel (torch.distributed.pipelining, 1F1B), N stages of
                 layers/N decoder layers, B sequences in 2N microbatches per step;
                 the last stage's loss: plain lm_head + cross entropy, lmkernels'
                 fused op (lmkernels.integrations.lm_head_loss.causal_lm_loss), Liger's
                 LigerFusedLinearCrossEntropyLoss                                        N >= 2
  titan_fsdp     torchtitan's own trainer on its Llama-3 1B (16 layers, untied;
                 scale_titan.py), FSDP2 over the N GPUs; B sequences per rank            N >= 1
  titan_tp       torchtitan, TP 2 x FSDP2 N/2 (sequence parallel: torchtitan's plan)     N >= 2, even
  titan_pp       torchtitan, PP 2 stages (1F1B, B micro-batches) x FSDP2 N/2             N >= 2, even
                 (the titan modes: configs plain = torchtitan as is, lmk = with
                 lmkernels.integrations.torchtitan; --layers does not apply; GPU only)
Configs (--configs): plain (transformers), lmk[:BACKEND] (lmkernels.integrations.transformers,
backend auto or a spec with '/' for its commas: lmk:triton/flce=eager), liger
(apply_liger_kernel_to_llama). Where transformers applies the parallelism while loading (tp,
fsdp_tp_hf) the patch is the class patch (lk_hf.apply("llama") / apply_liger_kernel_to_llama())
applied before loading; elsewhere the model is patched before it is wrapped. A run that fails
records its error (Liger under DTensor layouts, say).

Per run (rank 0 writes it): the loss of every step (mean over data-parallel ranks), tokens/s/GPU
(tokens of all replicas per step / median step time after the first 2 steps / N), peak
torch.cuda.max_memory_allocated over those timed steps (every rank's, and the largest, GiB; the
one-GPU benchmark's definition) and over all steps (`peak_all_steps_gib`). The driver adds, per (N, mode): each
config's largest loss difference to plain's (relative), its tokens/s and peak ratios to plain and
to Liger, and for the 2-D modes the ratio to the same config's fsdp run at the same N. Outputs
in --out: dist_scale.json (environment: device, GPU count, versions, lmkernels commit, command;
then one row per run), dist_scale.md (the table), logs/ (each run's output) and data.jsonl (the runs as rows of the data
files, with their provenance; --data benchmarks/data appends them to <gpu>.jsonl there, where the
README's and docs' tables come from). --budget (s) skips runs past it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lmkernels_bench import data
from lmkernels_bench.scale_worker import (
    CONFIGS,
    LLAMA_1B,
    MODES,
    NCCL_ENV,
    TINY,
    TP_2D,
    log,
    parse_config,
    run_worker,
    train,
)

DEFAULT_SIZE = (8, 1024, 8)  # a run's default size: sequences per replica, tokens each, layers


def check_config(name: str) -> str | None:
    """Why configuration `name` cannot run (None: it can), before any torchrun starts."""
    try:
        kind, backend = parse_config(name)
    except ValueError as e:
        return str(e)
    if kind == "lmk" and backend:
        from lmkernels.registry import LMKernelsError, parse_backend_spec

        try:
            parse_backend_spec(backend, where=f"configuration {name!r}")
        except LMKernelsError as e:
            return str(e)
    return None


def missing_package(mode: str, config: str) -> str | None:
    """The package a run needs that is not installed here, if any."""
    from importlib.util import find_spec

    if mode.startswith("zero") and find_spec("deepspeed") is None:
        return "deepspeed is not installed"
    if mode.startswith("titan") and find_spec("torchtitan") is None:
        return "torchtitan is not installed"
    if config.startswith("liger") and find_spec("liger_kernel") is None:
        return "liger-kernel is not installed"
    return None


def mode_problem(mode: str, n: int, layers: int) -> str | None:
    """Why `mode` cannot run on n GPUs (None: it can)."""
    least, even, _ = MODES[mode]
    if n < least:
        return f"needs >= {least} GPUs"
    if even and n % TP_2D:
        return f"needs a multiple of {TP_2D} GPUs"
    if mode == "pp" and layers < n:
        return f"needs >= {n} layers for {n} stages"
    return None


def run_problem(mode: str, config: str, tiny: bool) -> str | None:
    """Why this (mode, config) cannot run whatever the GPU count (None: it can)."""
    if mode.startswith("titan"):
        if config.startswith("liger"):
            return "Liger has no torchtitan integration"
        if tiny:
            return "torchtitan runs on GPUs here (the CPU checks: tests/test_integration_torchtitan.py)"
    return None


def loss_collectives(args, n: int, mode: str, config: str) -> dict:
    """The vocab-parallel loss's collectives per step under tensor parallel (the model of
    lmkernels.distributed.vocab_parallel.communication, checked on the CPU by the distributed
    checks): their count and payload bytes per rank; {} for other runs."""
    tp = {"tp": n, "fsdp_tp_hf": TP_2D, "fsdp_tp_torch": TP_2D}.get(mode)
    if tp is None or not config.startswith("lmk"):
        return {}
    from lmkernels.distributed.vocab_parallel import communication

    cfg = TINY if args.tiny else LLAMA_1B
    ops = communication(args.batch * args.seq, cfg["hidden_size"], cfg["vocab_size"], tp)
    return {"loss_collectives": len(ops), "loss_collective_bytes": sum(b for _, _, b in ops)}


def slug(config: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in config)


# --- the driver -----------------------------------------------------------------------------------


def environment(args, argv=None) -> dict:
    import torch

    env: dict[str, Any] = {"command": data.command_line("dist-scale", argv), "torch": torch.__version__}
    cuda = torch.cuda.is_available() and not args.tiny
    env["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    env["gpus_present"] = torch.cuda.device_count() if cuda else 0
    env["cuda"] = torch.version.cuda
    env["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    from importlib.metadata import PackageNotFoundError, version

    env["python"] = platform.python_version()
    env["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    for pkg in (
        "transformers",
        "accelerate",
        "deepspeed",
        "triton",
        "liger-kernel",
        "torchtitan",
        "lmkernels",
    ):
        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            env[pkg] = None
    env.update({k: os.environ.get(k) for k in NCCL_ENV})
    env["lmkernels_commit"] = data.commit()  # the lmkernels tree measured ($LMKERNELS_COMMIT on a copy)
    env["model"] = {"layers": args.layers, **(TINY if args.tiny else LLAMA_1B)}
    env["batch"], env["seq"], env["steps"] = args.batch, args.seq, args.steps
    return env


def command(args, n: int, mode: str, config: str, part: Path, ckpt_dir: str) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
    cmd += ["-m", "lmkernels_bench.scale", "--worker", "--mode", mode, "--config", config]
    cmd += [
        "--json",
        str(part),
        "--ckpt-dir",
        ckpt_dir,
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
    ]
    cmd += ["--seq", str(args.seq), "--layers", str(args.layers)] + ["--tiny"] * args.tiny
    return cmd


def launch(
    cmd: list[str], args, n: int, mode: str, config: str, part: Path, timeout: float, log_path: Path
) -> dict:
    """Run one worker; its output goes to log_path, its row comes back."""
    env = {**os.environ, **NCCL_ENV, "OMP_NUM_THREADS": "1" if args.tiny else "4"}
    if args.tiny:  # the CPU run: Triton kernels (lmk:triton...) on the interpreter
        env.setdefault("TRITON_INTERPRET", "1")
    row = {"gpus": n, "mode": mode, "config": config}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(log_path, "w") as f:
            proc = subprocess.run(
                cmd, env=env, timeout=timeout, stdout=f, stderr=subprocess.STDOUT, text=True
            )
    except subprocess.TimeoutExpired:
        return {**row, "status": "timeout", "error": f"over {timeout:.0f} s"}
    if part.exists():
        return json.loads(part.read_text())
    return {**row, "status": "crashed", "error": f"exit {proc.returncode}: " + log_path.read_text()[-600:]}


def compare_rows(rows: list[dict]) -> None:
    """Per (N, mode): each ok row's loss difference and ratios to plain / Liger; 2-D modes also
    against the same config's fsdp run at the same N."""
    ok = {(r["gpus"], r["mode"], r["config"]): r for r in rows if r.get("status") == "ok"}
    for (n, mode, config), r in ok.items():
        for peer in ("plain", "liger"):
            p = ok.get((n, mode, peer))
            if p is None or peer == config:
                continue
            r[f"tokens_vs_{peer}"] = r["tokens_per_s_per_gpu"] / p["tokens_per_s_per_gpu"]
            if p["peak_gib"]:
                r[f"peak_vs_{peer}"] = r["peak_gib"] / p["peak_gib"]
            if peer == "plain":
                r["max_loss_rel_diff_vs_plain"] = max(
                    abs(a - b) / abs(b) for a, b in zip(r["losses"], p["losses"])
                )
        f = ok.get((n, "fsdp", config))
        if mode.startswith("fsdp_tp") and f is not None:
            r["tokens_vs_fsdp"] = r["tokens_per_s_per_gpu"] / f["tokens_per_s_per_gpu"]
            if f["peak_gib"]:
                r["peak_vs_fsdp"] = r["peak_gib"] / f["peak_gib"]


def dist_rows(runs: list[dict], batch: int, seq: int, layers: int) -> list[dict]:
    """Data rows from the distributed benchmark's runs (scale.py's dist_scale.json) of that
    size (a torchtitan run names its own layers)."""
    out = []
    for r in runs:
        if r["status"] == "skipped":
            continue
        peak = r.get("peak_gib")
        keep = ("rank_peaks_gib", "peak_all_steps_gib", "layout", "torch_shims", "cuda_graphs")
        extra = {k: r[k] for k in keep if k in r}
        out.append(
            {"mode": r["mode"], "config": r["config"], "status": r["status"], "note": r.get("error", "")}
            | {"batch": batch, "seq": seq, "layers": r.get("layers", layers)}
            | {"tokens_per_s_per_gpu": r.get("tokens_per_s_per_gpu"), "step_ms": r.get("step_ms")}
            | {"peak_mib": peak * 1024 if peak else None, "losses": r.get("losses")}
            | extra
        )
    return out


def data_rows(rows: list[dict], env: dict) -> list[dict]:
    """The runs as rows of the benchmark data files (benchmarks/data/<gpu>.jsonl, part dist):
    each with the peer's configuration in words and the run's provenance."""

    gpu = data.gpu_kind(env["device"])
    vers = {"python": env.get("python"), "torch": env["torch"], "cuda": env.get("cuda")}
    vers |= {
        k: env.get(k) for k in ("triton", "transformers", "liger-kernel", "deepspeed", "torchtitan", "nccl")
    }
    date = env["date"]
    run = f"dist-scale-{date[:16]}-{gpu}x{env['gpus_present']}"
    out = []
    ran = [r for r in rows if r["status"] not in ("n/a", "skipped", "planned")]
    for r, row in zip(ran, dist_rows(ran, env["batch"], env["seq"], env["model"]["layers"])):
        kind = r["config"].split(":")[0]
        words = data.peer(r["config"], "dist", vers)
        if r["mode"].startswith("zero"):
            words += f", DeepSpeed {vers['deepspeed']} ZeRO-{r['mode'][-1]} bf16"
        elif r["mode"].startswith("titan"):  # torchtitan's trainer, not transformers' model
            how = "as is" if kind == "plain" else "with lmkernels.integrations.torchtitan"
            backend = words.partition(", backend ")[2]
            words = f"torchtitan {env.get('torchtitan')} Llama-3 1B {how} (scale_titan.py)"
            words += f", backend {backend}" if backend else ""
        row |= {"part": "dist", "peer": words, "loss_collectives": r.get("loss_collectives")}
        row |= {"loss_collective_bytes": r.get("loss_collective_bytes")}
        row |= {"device": env["device"], "gpu": gpu, "gpus": r["gpus"], "versions": vers}
        row |= {"commit": env["lmkernels_commit"], "date": date, "command": env["command"], "run": run}
        out.append(data.ordered(row))
    return out


def _x(v, fmt="{:.2f}x"):
    return fmt.format(v) if isinstance(v, float) else "-"


def summary(rows: list[dict], env: dict) -> str:
    lines = [
        f"# Scaling: {env.get('device')} ({env.get('gpus_present')} present), torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}, deepspeed {env.get('deepspeed')}, liger-kernel "
        f"{env.get('liger-kernel')}, lmkernels {env.get('lmkernels_commit')}",
        "",
        f"`{env.get('command')}`; {env.get('model', {}).get('layers')} layers, batch {env.get('batch')} x "
        f"seq {env.get('seq')} per replica, {env.get('steps')} steps",
        "",
        "| mode | GPUs | config | tokens/s/GPU | vs plain | vs Liger | vs FSDP2 | peak GiB | peak vs plain | "
        "max loss diff vs plain | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = r.get("status") == "ok"
        tok = f"{r['tokens_per_s_per_gpu']:,.0f}" if ok else "-"
        peak = f"{r['peak_gib']:.1f}" if ok else "-"
        status = r.get("status", "?") + (f": {r['error'][:90]}" if r.get("error") else "")
        lines.append(
            f"| {r['mode']} | {r['gpus']} | {r['config']} | {tok} | {_x(r.get('tokens_vs_plain'))} | "
            f"{_x(r.get('tokens_vs_liger'))} | {_x(r.get('tokens_vs_fsdp'))} | {peak} | "
            f"{_x(r.get('peak_vs_plain'))} | {_x(r.get('max_loss_rel_diff_vs_plain'), '{:.1e}')} | "
            f"{status.replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmkernels-bench dist-scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="output folder (driver)")
    p.add_argument("--gpus", default="1,2,4", help="GPU counts, comma-separated")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--configs", default=",".join(CONFIGS), help="plain, lmk[:BACKEND], liger")
    p.add_argument("--steps", type=int, default=12)
    batch, seq, layers = DEFAULT_SIZE
    p.add_argument("--batch", type=int, default=batch, help="sequences per data-parallel replica per step")
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--budget", type=float, default=3600.0, help="seconds; later runs are skipped")
    p.add_argument("--tiny", action="store_true", help="hidden-64 vocab-1000 model on the CPU (gloo)")
    p.add_argument("--dry-run", action="store_true", help="write the planned runs and commands, run nothing")
    p.add_argument(
        "--data", metavar="DIR", help="also append the runs' rows to DIR/<gpu>.jsonl (e.g. benchmarks/data)"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if not args.worker and not args.out:
        p.error("--out is required")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        if args.mode.startswith("titan"):  # torchtitan's own trainer, loop and measurements
            from lmkernels_bench.scale_titan import run_titan

            run_worker(args, run_titan)
        else:
            run_worker(args, train)
        return 0
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    gpus = [int(n) for n in args.gpus.split(",")]
    for config in configs:
        problem = check_config(config)
        if problem:
            log(f"--configs: {problem}")
            return 2
    unknown = set(modes) - set(MODES)
    if unknown:
        log(f"--modes: unknown {sorted(unknown)}; known: {', '.join(MODES)}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args, argv)
    deadline = time.monotonic() + args.budget
    rows: list[dict] = []

    def save():  # after every run too: a driver stopped by a time limit keeps what it measured
        compare_rows(rows)
        (out / "dist_scale.json").write_text(json.dumps({"environment": env, "runs": rows}, indent=1))
        (out / "dist_scale.md").write_text(summary(rows, env))
        if not args.dry_run:  # the rows of the data files: append them to benchmarks/data/<gpu>.jsonl
            lines = [json.dumps(r) for r in data_rows(rows, env)]
            (out / "data.jsonl").write_text("".join(line + "\n" for line in lines))

    with tempfile.TemporaryDirectory(prefix="lmk-scale-") as tmp:
        for n in gpus:
            for mode in modes:
                problem = mode_problem(mode, n, args.layers)
                for config in configs:
                    row = {"gpus": n, "mode": mode, "config": config}
                    why_not = problem or run_problem(mode, config, args.tiny) or missing_package(mode, config)
                    if why_not:
                        rows.append({**row, "status": "n/a", "error": why_not})
                        continue
                    part = Path(tmp) / f"{n}-{mode}-{slug(config)}.json"
                    cmd = command(args, n, mode, config, part, tmp)
                    if args.dry_run:
                        rows.append({**row, "status": "planned", "command": " ".join(cmd)})
                        continue
                    left = deadline - time.monotonic()
                    if left < 20:
                        rows.append({**row, "status": "skipped", "error": "budget"})
                        continue
                    log(f"{n} GPUs / {mode} / {config} ({left:.0f} s of budget left)")
                    start = time.monotonic()
                    log_path = out / "logs" / f"{n}-{mode}-{slug(config)}.log"
                    row = launch(cmd, args, n, mode, config, part, left + 30, log_path)
                    row["wall_s"] = round(time.monotonic() - start, 1)
                    row.update(loss_collectives(args, n, mode, config))
                    log(f"  -> {row['status']} {row.get('error', '')[:100]}")
                    rows.append(row)
                    save()
    save()
    if args.data and not args.dry_run:
        path = data.data_path(Path(args.data), data.gpu_kind(env["device"]))
        data.append_rows(path, data_rows(rows, env))
        log(f"appended the runs' rows to {path}")
    print(summary(rows, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
