"""The Triton kernels' launch configurations, as data: records with named fields (records.py);
Hopper's tuned tables (hopper.py); the rule that fits Hopper's entries to any other GPU's
limits (generic.py, from the GPU's Target record: targets.py); tables `lmkernels tune
--install` tunes on one GPU, loaded from a file (files.py); the CPU interpreter's (default.py);
and the text of a new entry for a tuning run's winner (entry_text.py).

`tables_for(device)` picks a device's tables; the op bodies resolve an entry for their inputs
and pass the launch configuration to the launchers as an argument. Nothing here is changed at
run time: a tuner or a test that wants another configuration passes it to a launcher, builds a
table of its own, or launches as another GPU would (targets.simulate).
"""

from __future__ import annotations

import logging

import torch

from lmkernels.backends.triton.configs import default, files, generic, hopper, targets
from lmkernels.backends.triton.configs.records import Tables
from lmkernels.backends.triton.configs.targets import Target

_BY_DEVICE: dict[torch.device, Tables] = {}
logger = logging.getLogger("lmkernels")


def tables_for(device: torch.device) -> Tables:
    """The tables for `device`, decided once per device:

    1. the tables `lmkernels tune --install` tuned on this GPU model, where its file is there
       and valid for this Triton version (configs.files);
    2. Hopper's (hopper.py) on NVIDIA GPUs of compute capability 9.x;
    3. the generic rule's for any other GPU (generic.py: Hopper's entries within its limits);
    4. the CPU interpreter and the CPU: default.py's.

    Inside targets.simulate(target): that simulation's tables (the target's built-in ones)."""
    simulation = targets.ACTIVE
    if simulation is not None:
        return simulation.tables or target_tables(simulation.target)
    try:
        return _BY_DEVICE[device]
    except KeyError:
        pass
    if device.type == "cuda" and device.index is None:
        return tables_for(torch.device("cuda", torch.cuda.current_device()))
    tables = _BY_DEVICE[device] = _select(device)
    return tables


def target_tables(target: Target) -> Tables:
    """The built-in tables of `target` (no tuned file): Hopper's tuned ones on NVIDIA 9.x, the
    generic rule's on every other GPU."""
    if target.capability is not None and target.capability[0] == 9:  # (None: not NVIDIA)
        return hopper.TABLES
    return generic.tables_for_target(target)


def is_tuned(tables: Tables) -> bool:
    """Whether `tables` are tuned for the GPU they run on: Hopper's on Hopper, or a tuned file."""
    return not tables.name.startswith("generic ")


def _select(device: torch.device) -> Tables:
    from lmkernels.backends.triton import interpreting

    if device.type != "cuda" or interpreting():
        return default.TABLES
    target = targets.device_target(device.index)
    tables = files.load_tuned(files.identity_of(device.index))
    if tables is None:
        tables = target_tables(target)
    logger.info("lmkernels: %s (%s) launches from the %s tables", torch.cuda.get_device_name(device.index),
                target.name, tables.name)  # fmt: skip
    return tables
