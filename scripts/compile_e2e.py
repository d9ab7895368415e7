"""torch.compile(model) end to end: does the compiled patched model pay? (issue 12.3)

    source scripts/gpu_env.sh
    python3 scripts/compile_e2e.py --out OUT                      # ~8 min on one H200
    python3 scripts/compile_e2e.py --device cpu --tiny --out OUT  # a check of the script

The Llama-3.2-1B-shape training step of benchmarks/e2e_setup.py (bf16, fused AdamW, activation
checkpointing, no KV cache, random tokens, seq 1024), at batch 8 and 32, per configuration:

  plain, plain+compile   transformers as is (model.compile(), batch dimension dynamic)
  lmk, lmk+compile       apply(model): every op, "causal_mask" included
  lmk-nomask+compile     apply without "causal_mask": the mask transformers builds when compiled
  lmk-fuse+compile       backend "eager,flce=triton": RMSNorm, RoPE and the GLU as torch code that
                         inductor fuses with its neighbours; FLCE stays the Triton op
  lmk-glu+compile        backend "swiglu=eager": only the GLU left to inductor, which can
                         fuse checkpointing's recompute of it into its backward

Each configuration runs in its own process (patches are process-wide; peaks must not leak);
the timing is e2e_setup.time_steps. Writes OUT/results.json (rows, device, versions, command)
and OUT/summary.md (tokens/s and peak per batch, and the ratios the issue asks for).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import e2e_setup as setup  # noqa: E402

CONFIGS = (
    "plain+compile",
    "lmk+compile",
    "lmk",
    "plain",
    "lmk-fuse+compile",
    "lmk-nomask+compile",
    "lmk-glu+compile",
)
BACKENDS = {"lmk-fuse": "eager,flce=triton", "lmk-glu": "swiglu=eager"}
OPS = ("rms_norm", "rope", "mlp", "flce", "causal_mask")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def patch(model, config: str):
    base, compiled = config.removesuffix("+compile"), config.endswith("+compile")
    if base != "plain":
        from lmkernels.integrations.transformers import apply

        ops = tuple(o for o in OPS if not (base == "lmk-nomask" and o == "causal_mask"))
        apply(model, backend=BACKENDS.get(base), ops=ops)
    if compiled:
        model.compile()
    return compiled


def worker(spec: dict) -> None:
    import torch

    torch.manual_seed(0)
    model = setup.build_model(setup.MODELS[spec["model"]], spec["device"])
    compiled = patch(model, spec["config"])
    optimizer = setup.make_optimizer(model)
    for batch in spec["batches"]:
        row = {"config": spec["config"], "batch": batch, "seq": spec["seq"]}
        try:
            ids = setup.make_batch(
                model.config.vocab_size, batch, spec["seq"], spec["device"], dynamic=compiled
            )
            step = lambda ids=ids: setup.train_step(model, optimizer, ids)
            res = setup.time_steps(step, spec["device"], 6, 3, spec["min_timed_s"])
            row |= res | {"tokens_per_s": batch * spec["seq"] / (res["step_ms"] / 1e3), "status": "ok"}
        except Exception as e:  # OOM or a failure: recorded, the next point still runs
            row |= {"status": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        optimizer.zero_grad(set_to_none=True)
        with open(spec["results"], "a") as f:
            f.write(json.dumps(row) + "\n")
        rate = f"{row['tokens_per_s'] / 1e3:.1f}k tok/s" if "tokens_per_s" in row else row["status"]
        log(f"  [{spec['config']}] b{batch}: {rate}")


def summary(rows: list[dict], batches: list[int], meta: dict) -> str:
    by = {(r["config"], r["batch"]): r for r in rows}

    def cell(config, batch):
        r = by.get((config, batch))
        if not r or "tokens_per_s" not in r:
            return r["status"][:20] if r else "-"
        peak = f", {r['peak_gib']:.1f}" if r.get("peak_gib") is not None else ""
        return f"{r['tokens_per_s'] / 1e3:.1f}{peak}"

    def ratio(a, b, batch):
        ra, rb = by.get((a, batch), {}), by.get((b, batch), {})
        if "tokens_per_s" in ra and "tokens_per_s" in rb:
            return f"{ra['tokens_per_s'] / rb['tokens_per_s']:.2f}x"
        return "-"

    configs = list(dict.fromkeys(r["config"] for r in rows))
    lines = [
        f"# torch.compile end to end ({meta['model']}, seq {meta['seq']})",
        "",
        f"{meta.get('device', '?')}; torch {meta.get('torch', '?')}, transformers {meta.get('transformers', '?')}",
        f"Command: `{meta['command']}`",
        "",
        "Thousands of tokens/s, peak GiB:",
        "",
        "| batch | " + " | ".join(configs) + " |",
        "|---" * (len(configs) + 1) + "|",
    ]
    lines += [f"| {b} | " + " | ".join(cell(c, b) for c in configs) + " |" for b in batches]
    pairs = [
        ("lmk+compile", "plain+compile"),
        ("lmk+compile", "lmk"),
        ("lmk-fuse+compile", "plain+compile"),
        ("lmk-fuse+compile", "lmk"),
        ("lmk-glu+compile", "plain+compile"),
        ("lmk-glu+compile", "lmk+compile"),
        ("lmk+compile", "lmk-nomask+compile"),
    ]
    lines += [
        "",
        "| ratio | " + " | ".join(f"b{b}" for b in batches) + " |",
        "|---" * (len(batches) + 1) + "|",
    ]
    lines += [f"| {a} / {b} | " + " | ".join(ratio(a, b, n) for n in batches) + " |" for a, b in pairs]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="output directory (required)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--min-timed-s", type=float, default=2.5)
    p.add_argument("--budget", type=float, default=520, help="seconds; a configuration past it is stopped")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the 2-layer tiny model (script check, CPU ok)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if not args.out:
        p.error("--out is required")
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; expected names from {CONFIGS}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    results.unlink(missing_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    model = "tiny" if args.tiny else "llama-1b"
    end = time.time() + args.budget
    for i, config in enumerate(configs):
        spec = dict(config=config, model=model, device=args.device, batches=batches, seq=args.seq)
        spec |= dict(min_timed_s=args.min_timed_s, results=str(results))
        left = end - time.time()
        log(f"[{i + 1}/{len(configs)}] {config} ({left:.0f} s of the budget left)")
        if left < 20:
            log("  skipped: time budget")
            continue
        try:
            cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
            subprocess.run(cmd, timeout=left, check=False)
        except subprocess.TimeoutExpired:
            log("  stopped at the time budget")
    rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    meta = setup.environment() | {
        "model": setup.MODEL_TITLES[model],
        "seq": args.seq,
        "command": shlex.join(["python3", "scripts/compile_e2e.py", *(argv or sys.argv[1:])]),
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = summary(rows, batches, meta)
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
