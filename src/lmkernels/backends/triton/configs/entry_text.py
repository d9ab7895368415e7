"""The text of a table entry for a tuning run's winner: what `lmkernels tune` writes into a GPU
generation's module (hopper.py) instead of numbers copied into it by hand."""

from __future__ import annotations

import dataclasses
from typing import Any

from lmkernels.backends.triton.configs import hopper
from lmkernels.backends.triton.configs.records import NORM_OPS, NormEntry, RopePosConfig, RopeTileConfig

LINE_LENGTH = 110  # the project's (pyproject.toml, ruff)
_RECORDS = {
    "rms_norm": NormEntry,
    "layer_norm": NormEntry,
    "rope_position": RopePosConfig,
    "rope_tile": RopeTileConfig,
}


def entry_text(
    op: str, width: int, fields: dict, why: str, *, cols: tuple[int, int] | None = None, indent: int = 8
) -> str:
    """The constructor call of the entry for `op` at `width` with the launch `fields` (named as
    the record's), one field per line as ruff formats it, ending in a comma, for a table at
    `indent` spaces in a generation's module.

    op and width: "rms_norm" / "layer_norm" and the row width tuned; "rope_position" and the
    rotary half width (the entry serves its power of two); "rope_tile" and the exact rotary half
    width. RoPE's fields may name `partial` (dims past the rotary part copied).
    why: one line, what the entry buys, with the number measured (against the entry it replaces).
    cols (norms): the row widths the entry serves. By default those of hopper's entry for
    `width` (a new measurement replaces it), or, where none serves it, the upper half of the
    width's power-of-two block.

    The record is built first: a field it does not have, a missing field or a rule it breaks
    (records' __post_init__) raises ValueError or TypeError here, not when the table loads."""
    record = _RECORDS.get(op)
    if record is None:
        raise ValueError(f"op {op!r}: one of {sorted(_RECORDS)}")
    if not why.strip() or "\n" in why:
        raise ValueError("why: one non-empty line")
    names = {f.name for f in dataclasses.fields(record)}
    keys = {"op", "cols", "why"} if op in NORM_OPS else {"block_half", "half", "why"}
    unknown = sorted(set(fields) - (names - keys))
    if unknown:
        raise ValueError(f"{record.__name__} has no field {', '.join(unknown)} (or it is the entry's key)")
    if op in NORM_OPS:
        if cols is None:
            served = hopper.TABLES.norms.entry(op, width)
            block = 1 << max(width - 1, 0).bit_length()
            cols = served.cols if served is not None else (block // 2 + 1, block)
        if not cols[0] <= width <= cols[1]:
            raise ValueError(f"cols {cols} do not hold the width measured, {width}")
        key: dict[str, Any] = {"op": op, "cols": tuple(cols)}
    elif op == "rope_position":
        key = {"block_half": 1 << max(width - 1, 0).bit_length()}
    else:
        key = {"half": width}
    entry = record(**key, **fields, why=why)
    lines = [f"{record.__name__}("]
    for f in dataclasses.fields(record):
        value = getattr(entry, f.name)
        if f.name == "why" or (f.name not in key and _is_default(f, value)):
            continue
        lines.append(f"    {f.name}={_quoted(value) if isinstance(value, str) else repr(value)},")
    lines.append(f"    why={_quoted(why)},")
    lines.append("),")
    text = "\n".join(" " * indent + line for line in lines)
    longest = max(len(line) for line in text.splitlines())
    if longest > LINE_LENGTH:
        raise ValueError(f"why: {longest - LINE_LENGTH} characters too long for one line of {LINE_LENGTH}")
    return text + "\n"


def _is_default(f: dataclasses.Field, value: object) -> bool:
    return f.default is not dataclasses.MISSING and value == f.default


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
