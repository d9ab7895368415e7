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
suggest, with its measured reason, in the form of the GPU generation's config
module (lmkernels/backends/triton/configs/). Entries go in by hand, after
`lmkernels bench --op ...` at the tuned shapes confirms them.

  lmkernels tune --out DIR                        norms and RoPE, the tune grid
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
