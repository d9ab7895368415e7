"""`lmkernels-bench suite readme|validation --part PART --out DIR`: the measurements behind the
README and the docs, and the validation evidence, appended as rows to one data file per GPU kind
(DIR/<gpu>.jsonl, DIR/<gpu>-validation.jsonl; data.py has the format). Each part is sized for
one 10-minute call on one GPU (dist and dist-checks: two GPUs), its --budget (540 s unless the
part says otherwise) stopping it in time; `--part all` runs a suite's parts in turn.

A part's points already in the data file for the same commit and GPU kind are not measured
again: a part cut short by its time budget (--budget) finishes when the same command runs again.
`--again` measures them anew (the report takes the latest run of each point). `--dry-run` goes
through a part's plan with made-up timings and no GPU (a check of the plumbing: its rows say
"dry_run" and belong in a scratch folder).

This module runs a part and holds the suites' table of parts; the parts themselves are in
parts_perf.py (readme) and parts_validation.py (validation), their shapes in grids.py.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path
from typing import Any

from lmkernels_bench import data
from lmkernels_bench.grids import DESIGN_EXTRAS, FLCE, ROPE_GRIDS
from lmkernels_bench.parts import Context, Part
from lmkernels_bench.parts_perf import compare_part, dist_part, e2e_part, flce_part, generic_part, ops_part
from lmkernels_bench.parts_validation import (
    converge_part,
    dist_checks_part,
    families_part,
    grid_part,
    tests_part,
)

E2E_ARGS = {
    "e2e-small": "--sweeps small --configs plain,lmk,liger --interleave --rounds 7 --steps 6 "
    "--warmup-steps 3 --min-timed-s 2.0",
    "e2e-batch": "--sweeps batch --batches 8,16,32,64 --configs plain,lmk,liger --interleave --rounds 3",
    "e2e-compile": "--sweeps compile --compile-configs plain+compile,lmk+compile --interleave --rounds 4",
}
GRID_PARTS = {  # part -> (ops, dtypes or None for all three)
    "grid-norms": ("rms_norm,layer_norm,rope", None),
    "grid-flce": (FLCE, "bf16,fp16"),
    "grid-flce-fp32": (FLCE, "fp32"),
    "grid-glu": ("swiglu,geglu", None),
}
TEST_PARTS = {  # part -> `lmkernels-bench gpu-tests` arguments
    "tests-kernels": ["suite", "kernels"],
    "tests-large": ["suite", "large"],
    "tests-triton-files": ["suite", "triton-files"],
    "tests-triton-features": ["suite", "triton-features"],
    "tests-integration": ["suite", "integration"],
    "tests-posttrain": ["suite", "posttrain"],
    "props-long-norms": ["suite", "properties-long", "-k", "rms_norm-triton or layer_norm-triton"],
    "props-long-rope-glu": ["suite", "properties-long", "-k", "rope-triton or swiglu-triton or geglu-triton"],
    "props-long-flce": [
        "suite",
        "properties-long",
        "-k",
        "fused_linear_cross_entropy-triton and not triton_lean",
    ],
    "props-long-flce-lean": ["suite", "properties-long", "-k", "fused_linear_cross_entropy-triton_lean"],
    "props-long-distill": ["suite", "properties-long", "-k", "fused_linear_distillation-triton"],
    "memcheck-kernels": ["memcheck", "kernels"],
    "racecheck": ["memcheck", "racecheck", "--racecheck"],
}


# --- running a part ---------------------------------------------------------------------------------


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
            raise SystemExit("lmkernels-bench suite measures on a CUDA device; none is here (--dry-run?)")
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


# --- the suites ---------------------------------------------------------------------------------------


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
        "FLCE fwd+bwd, 8 lm_head shapes x 2 logit regimes, budgets and peers", flce_part, budget_s=480
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
    "compare": Part(
        "the tree before a change ($LMKERNELS_COMPARE_OLD) against this one, in turns", compare_part
    ),
    "generic": Part(
        "the generic launch tables of sm_80, sm_86, sm_120 forced on this GPU against its own, "
        "torch.compile and Liger (norms, RoPE: the tuning grid; GLUs, FLCE)",
        generic_part,
    ),
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
    name: Part(f"lmkernels-bench gpu-tests {' '.join(a)}", tests_part, dict(args=a))
    for name, a in TEST_PARTS.items()
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


# --- the command ----------------------------------------------------------------------------------


def _part_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = {p for table in SUITES.values() for p in table} | {"all"}
    for name in names:
        if name not in known:
            raise argparse.ArgumentTypeError(f"unknown part {name!r}; known: {', '.join(sorted(known))}")
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmkernels-bench suite",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("suite", nargs="?", choices=list(SUITES), help="readme or validation")
    p.add_argument(
        "--part",
        action="extend",
        type=_part_names,
        help="the suite's parts (repeatable or comma-separated; all: every part)",
    )
    p.add_argument("--out", help="the folder of the data files, e.g. benchmarks/data")
    p.add_argument("--list", action="store_true", help="print the suites' parts and exit")
    p.add_argument("--again", action="store_true", help="measure points the data file already has")
    p.add_argument("--dry-run", action="store_true", help="made-up timings, no GPU: a check of the plumbing")
    p.add_argument("--budget", type=float, help="seconds (default: the part's own, 540 for most)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.list:
        print(describe(args.suite))
        return 0
    if not args.suite or not args.part or not args.out:
        p.error(
            "needs a suite (readme or validation), --part (or --part all) and --out DIR; --list: the parts"
        )
    table = SUITES[args.suite]
    parts = list(table) if "all" in args.part else args.part
    wrong = [part for part in parts if part not in table]
    if wrong:
        p.error(f"--part: {', '.join(wrong)} not in suite {args.suite} ({', '.join(table)})")
    command = data.command_line("suite", argv)
    for part in parts:
        run_part(
            args.suite,
            part,
            Path(args.out),
            dry_run=args.dry_run,
            again=args.again,
            budget=args.budget,
            command=command,
        )
    return 0
