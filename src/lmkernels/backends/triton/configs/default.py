"""The CPU interpreter and the CPU: Hopper's entries, so that the interpreter's tests run the
launches the tuned GPUs run. The one exception, FLCE's row kernel, keeps one launch for every
width (Hopper's 32-warp launch for rows of 64k columns and more is never reached by those tests).

GPUs never get these: Hopper's own tables run on sm_90, the generic rule's (generic.py) or a
tuned file's (files.py) everywhere else (configs.tables_for)."""

import dataclasses

from lmkernels.backends.triton.configs import hopper
from lmkernels.backends.triton.configs.records import FlceRowsEntry, FlceTable

FLCE = FlceTable(
    rows=(
        FlceRowsEntry(
            min_cols=1,
            block=4096,
            num_warps=8,
            why="Hopper's narrow entry (8k-32k columns) for every width: the interpreter's tests run narrow rows",
        ),
    ),
)

TABLES = dataclasses.replace(hopper.TABLES, name="default", flce=FLCE)
