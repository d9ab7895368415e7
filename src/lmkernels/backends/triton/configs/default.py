"""Every GPU that is not a Hopper (Ampere, Ada, Blackwell, ROCm), the CPU interpreter and the
CPU: the Hopper entries, unmeasured on these devices. Nothing here was tuned for them.

They run anywhere: what in them is specific to Hopper is adjusted at launch, not by the table
(the backward's pipeline stages are lowered to fit the device's shared memory; the L2 prefetch
and programmatic dependent launch run on sm_90+ NVIDIA GPUs only). A generation measured with
`lmkernels tune` gets a module of its own, selected in configs.tables_for."""

import dataclasses

from lmkernels.backends.triton.configs import hopper

TABLES = dataclasses.replace(hopper.TABLES, name="default")
