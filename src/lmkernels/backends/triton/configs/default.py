"""Every GPU that is not a Hopper (Ampere, Ada, Blackwell, ROCm), the CPU interpreter and the
CPU: the Hopper entries, unmeasured on these devices. Nothing here was tuned for them. The one
exception, FLCE's row kernel, keeps one launch for every width: Hopper's 32 warps for wide rows
are 2048 threads on ROCm's 64-wide wavefronts, past a block's limit of 1024.

They run anywhere: what in them is specific to Hopper is adjusted at launch, not by the table
(the backward's pipeline stages are lowered to fit the device's shared memory; the L2 prefetch
and programmatic dependent launch run on sm_90+ NVIDIA GPUs only). A generation measured with
`lmkernels tune` gets a module of its own, selected in configs.tables_for."""

import dataclasses

from lmkernels.backends.triton.configs import hopper
from lmkernels.backends.triton.configs.records import FlceRowsEntry, FlceTable

FLCE = FlceTable(
    rows=(
        FlceRowsEntry(
            min_cols=1,
            block=4096,
            num_warps=8,
            why="Hopper's narrow entry for every width: 8 warps are 256 or 512 threads on any GPU",
        ),
    ),
)

TABLES = dataclasses.replace(hopper.TABLES, name="default", flce=FLCE)
