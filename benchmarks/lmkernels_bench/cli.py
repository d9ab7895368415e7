"""`lmkernels-bench COMMAND ...` (or `python -m lmkernels_bench COMMAND ...`): the maintainers'
suite. Each command is one module's `main(argv)`; `lmkernels-bench COMMAND --help` has its
options."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

PROG = "lmkernels-bench"
DESCRIPTION = "lmkernels' benchmark suite, run from a checkout; COMMAND --help has its options."

# command -> (module, what it does). Each module has parser() and main(argv).
COMMANDS: dict[str, tuple[str, str]] = {
    "suite": ("suite", "run parts of a suite: the rows behind the documents' tables (--list)"),
    "report": ("tables", "plots, validation reports and the documents' marked tables from the data"),
    "frontier": ("frontier", "FLCE against every peer: lm_head shapes x logit regimes, budgets"),
    "e2e": ("e2e", "end-to-end training: tokens/s and peak memory per configuration"),
    "dist-scale": ("scale", "distributed training on 1-4 GPUs: FSDP2, TP, 2-D, ZeRO, pipeline"),
    "compare-trees": ("compare_trees", "two source trees in turns on one GPU: before / after a change"),
    "generic": (
        "generic",
        "other GPUs' generic launch tables forced on this GPU against its own and compile",
    ),
    "trl-head": ("trl_head", "one TRL SFT step through TRL's fused head and through lmkernels'"),
    "posttrain": (
        "posttrain",
        "GRPO / DPO / JSD losses through the head: lmkernels, plain, TRL, Liger, verl",
    ),
    "posttrain-steps": ("posttrain_steps", "GRPO, DPO and GKD trainer steps: lmkernels, TRL, TRL with Liger"),
    "families": ("families", "bf16 training of the patched families against plain (--stepcheck)"),
    "families-scan": ("families_scan", "every transformers causal LM patched, one step compared"),
    "families-table": ("families_table", "the families table of docs/integration.md (--check)"),
    "gpu-tests": ("gpu_tests", "the test suite on a GPU, in groups; under compute-sanitizer"),
    "dispatch-overhead": ("dispatch_overhead", "the dispatch's host cost per call on the CPU"),
}


def module(command: str):
    """The module behind `command` (imported on demand: most need torch)."""
    return importlib.import_module(f"lmkernels_bench.{COMMANDS[command][0]}")


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} COMMAND [ARGS ...]", "", DESCRIPTION, ""]
    lines += ["commands:"] + [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"{PROG}: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    code = module(command).main(rest)
    return int(code or 0)
