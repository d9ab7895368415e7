"""`lmkernels converge`: train tiny models plain and patched, and compare.

    lmkernels converge --family llama --backend compile --steps 30 --device cpu
    lmkernels converge --family all --backend triton --dtype bf16 --ablation

Exit status: 0 when every comparison passes, 1 when one fails, 2 on bad
arguments or setup. Also runnable as `python -m lmkernels.convergence.cli`.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from lmkernels import cliargs
from lmkernels.convergence.models import FAMILIES


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "converge",
        help="train tiny models with and without a backend's kernels and compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--family", choices=[*FAMILIES, "all"], default="llama", help="model family (default llama)"
    )
    p.add_argument(
        "--backend",
        type=cliargs.backend_spec,
        default="compile",
        help="backend name or spec like 'triton,flce=compile' (default compile)",
    )
    p.add_argument(
        "--dtype",
        type=cliargs.dtype_type("fp32", "bf16"),
        default="fp32",
        help="training dtype: fp32 (default) or bf16",
    )
    p.add_argument("--steps", type=cliargs.positive_int, default=30, help="training steps (default 30)")
    p.add_argument(
        "--device", type=cliargs.device, default=None, help="cpu or cuda (default: cuda if available)"
    )
    p.add_argument("--ablation", action="store_true", help="also run all-but-FLCE and no kernels")
    p.add_argument("--out", default="lmkernels-results/convergence", help="folder for the JSON and PNG")
    p.add_argument(
        "--seq-len", type=cliargs.positive_int, default=64, help="tokens per sequence (default 64)"
    )
    p.add_argument(
        "--batch-size", type=cliargs.positive_int, default=8, help="sequences per step (default 8)"
    )
    p.add_argument("--seed", type=int, default=0, help="init and data seed (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--wide", action="store_true", help="the table with every error and limit and the ops (> 80 columns)"
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lmkernels.registry import LMKernelsError

    console = Console()
    families = FAMILIES if args.family == "all" else (args.family,)
    device = args.device or _default_device()
    try:
        from lmkernels.convergence import report as rep
        from lmkernels.convergence.compare import run_convergence

        if not args.no_progress:
            console.print(f"converge: {', '.join(families)} on {device}, {args.steps} steps per run")
        with cliargs.quiet_transformers():
            report = run_convergence(
                args.backend,
                families=families,
                ablation=args.ablation,
                progress=not args.no_progress,
                steps=args.steps,
                batch_size=args.batch_size,
                seq_len=args.seq_len,
                dtype=args.dtype,
                device=device,
                seed=args.seed,
            )
    except LMKernelsError as e:
        return cliargs.error("lmkernels converge", str(e))
    except ModuleNotFoundError as e:  # transformers, tokenizers, matplotlib come with the hf extra
        return cliargs.error("lmkernels converge", cliargs.missing_module(e))
    rep.print_report(report, console, wide=args.wide)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{args.family}-{args.backend}-{args.dtype}")
    json_path = rep.write_json(report, f"{args.out}/converge-{slug}.json")
    png_path = rep.plot(report, f"{args.out}/converge-{slug}.png")
    console.print(f"wrote {json_path.name} and {png_path.name} to {json_path.parent}")
    return 0 if report.passed else 1


def main(argv: list[str] | None = None) -> int:
    parser = cliargs.Parser(prog="lmkernels")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return cliargs.invoke(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
