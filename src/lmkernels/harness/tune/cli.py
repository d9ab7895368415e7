"""`lmkernels tune`: the tuner's arguments; the tuner (norms.py) loads only when it runs."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

DESCRIPTION = """\
Time candidate launch configurations of the RMSNorm, LayerNorm and RoPE Triton
kernels on this GPU (fwd+bwd, bf16, GPU time), each checked against an fp32
reference first, beside the committed table's entry, torch.compile and Liger.

Writes DIR/tune.json (every candidate's row, device, versions, command) and
DIR/tune.md: a table per point, then per table key the entry the timings
suggest, with its measured reason. Where entries beat the tables, also
DIR/tuned-tables.json: this GPU's tables with them in place; --install writes it
where lmkernels loads it on this GPU model from then on
(~/.cache/lmkernels/configs/, or $LMKERNELS_CONFIG_DIR).

  lmkernels tune --out DIR --install              norms and RoPE, ~8 minutes
  lmkernels tune --out DIR --ops rope --grid final --table-only
"""


def _run(args: argparse.Namespace) -> int:
    from lmkernels.harness.tune import norms

    return norms.run(args, shlex.join(["lmkernels", *sys.argv[1:]]))


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "tune",
        help="time launch configurations of the norm and RoPE kernels (CUDA)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from lmkernels.harness.tune.grids import add_arguments

    add_arguments(p)
    p.set_defaults(func=_run)
