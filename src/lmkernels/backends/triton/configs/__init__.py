"""The Triton kernels' tuned launch configurations, as data: one module per GPU generation
(hopper.py, measured on an H200; default.py, every other device), records with named fields
(records.py), and the text of a new entry for a measured winner (entry_text.py).

`tables_for(device)` picks a generation's tables by the device's compute capability; the op
bodies resolve an entry for their inputs and pass the launch configuration to the launchers as
an argument. Nothing here is changed at run time: a tuner or a test that wants another
configuration passes it to a launcher, or builds a table of its own.
"""

from __future__ import annotations

import torch

from lmkernels.backends.triton.configs import default, hopper
from lmkernels.backends.triton.configs.records import Tables

_BY_DEVICE: dict[torch.device, Tables] = {}


def tables_for(device: torch.device) -> Tables:
    """The tables for `device`: Hopper's on NVIDIA GPUs of compute capability 9.x with compiled
    kernels, the default ones elsewhere (other GPUs, ROCm, the CPU interpreter, the CPU).
    Decided once per device."""
    try:
        return _BY_DEVICE[device]
    except KeyError:
        pass
    if device.type == "cuda" and device.index is None:
        return tables_for(torch.device("cuda", torch.cuda.current_device()))
    tables = _BY_DEVICE[device] = _select(device)
    return tables


def _select(device: torch.device) -> Tables:
    from lmkernels.backends.triton import interpreting

    if device.type != "cuda" or interpreting() or torch.version.hip is not None:
        return default.TABLES  # ROCm reports gfx9xx as capability 9.x: not a Hopper
    major, _ = torch.cuda.get_device_capability(device.index)
    return hopper.TABLES if major == 9 else default.TABLES
