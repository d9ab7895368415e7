"""The candidates `lmkernels tune` times: entries of the device's tables
(configs.tables_for) with some fields replaced (dataclasses.replace), a norm's NormEntry (forward
fields, backward fields, const_n), the wide path's WidePath and ColumnConfig, RoPE's
RopeTileConfig and RopePosConfig; their names in the report, their JSON form in tune.json, and
the table that holds one in the place of the entry it replaces."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from lmkernels.backends.triton.configs import records, tables_for
from lmkernels.backends.triton.configs.records import (
    ColumnConfig,
    NormEntry,
    RopeTileConfig,
    WidePath,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: the interpreter, for the tests


# --- the candidates: table entries with fields replaced -------------------------------------------


# The records and tables are the Triton backend's (backends/triton/configs): typed Any here.


def tables() -> Any:
    return tables_for(torch.device(DEVICE))


def _block(N: int) -> int:
    return 1 << (N - 1).bit_length()


FWD_FIELDS = ("fwd_rows", "fwd_warps", "fwd_chunk", "hints")  # the rest of NormEntry's: the backward's


def base_entry(table: Any, op: str, N: int) -> Any:
    """What the table runs for rows of N columns, as the record a candidate replaces fields of:
    the entry serving N; rows wider than max_fused_n, the wide path; narrower than every entry,
    an entry of the default forward and backward (whose several backward rows per program no
    entry can hold)."""
    from lmkernels.backends.triton import norms

    if N > table.max_fused_n:
        return table.wide
    entry = table.entry(op, N)
    if entry is None:
        f, b, block = norms.fwd_config(table, op, N), norms.bwd_config(table, op, N), _block(N)
        entry = NormEntry(op=op, cols=(block // 2 + 1, block), fwd_rows=f.rows, fwd_warps=f.num_warps,
                          bwd_warps=b.num_warps, programs_per_sm=b.programs_per_sm, why="")  # fmt: skip
    return entry


def _fresh(base: Any, candidates: list[Any]) -> list[Any]:
    """The candidates once each, without the base's own, and without its `why` (unmeasured)."""
    return [replace(c, why="") for c in dict.fromkeys(candidates) if c != base]


def norm_fwd_candidates(N: int, op: str, table: Any = None) -> list[Any]:
    """The table's entry with its forward replaced: rows x warps of a register-held row; for
    wide rows the row in chunks read again from L2 (eviction hints); each also compiled for the
    width (const_n, which the entry's backward shares). Wider than max_fused_n: the wide path's
    forward warps."""
    table = table or tables().norms
    base, block = base_entry(table, op, N), _block(N)
    if N > table.max_fused_n:
        return _fresh(base, [replace(base, fwd_warps=w) for w in (4, 8, 16, 32)])
    out = [replace(base, const_n=not base.const_n)]
    for rows in (1, 2, 4, 8):
        for warps in (2, 4, 8, 16, 32):
            per_thread = rows * block // (32 * warps)
            if (2048 <= rows * block <= 16384 and 8 <= per_thread <= 32) or (
                block >= 16384 and warps == 32 and rows == 1
            ):
                out.append(replace(base, fwd_rows=rows, fwd_warps=warps, fwd_chunk=0,
                                               hints=False, const_n=True))  # fmt: skip
    for chunk, warps in ((1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (4096, 16)):
        if block >= 4096 and chunk < N:
            for hints, const_n in ((False, False), (True, False), (True, True)):
                out.append(replace(base, fwd_rows=1, fwd_chunk=chunk, fwd_warps=warps,
                                               hints=hints, const_n=const_n))  # fmt: skip
    return _fresh(base, out)


# Column-kernel launches tried on the wide path: (block_m, block_n, warps, programs per SM).
COL_GRID = [(32, 128, 4, 8), (16, 256, 4, 8), (64, 64, 8, 4)]


def norm_bwd_candidates(N: int, op: str, table: Any = None) -> list[Any]:
    """The table's entry with its backward replaced: pipeline stages; each switch flipped
    alone; warps x programs per SM; from 8192 columns the row as one or two register blocks
    (tail) read again after the row sums (reload_x). Wider than max_fused_n: the wide path's
    block, warps, programs and stages, and the column kernel's launch."""
    table = table or tables().norms
    base, block = base_entry(table, op, N), _block(N)
    if N > table.max_fused_n:
        wide = [replace(base, block=b, bwd_warps=w, programs_per_sm=p, stages=st)
                for b, w in ((2048, 8), (4096, 8), (4096, 16)) for p in (1, 2) for st in (1, 3)]  # fmt: skip
        col = [
            replace(table.column, block_m=m, block_n=n, num_warps=w, programs_per_sm=p)
            for m, n, w, p in COL_GRID
        ]
        return _fresh(base, wide) + _fresh(table.column, col)
    out = [replace(base, stages=st) for st in (1, 2, 3, 4, 5)]
    switches = ["reload_w", "reload_x", "prefetch"] + (["tail"] if block >= 4096 else [])
    switches += ["hold_x"] if op == "rms_norm" else ["fma"]
    out += [replace(base, **{s: not getattr(base, s)}) for s in switches]
    for warps in (4, 8, 16, 32):
        if 4 <= block // (32 * warps) <= 32:
            out += [
                replace(base, bwd_warps=warps, programs_per_sm=p)
                for p in sorted({max(1, 32 // warps), 64 // warps})
            ]
    if block >= 8192:
        for tail in (False, True):
            for warps in (8, 16, 32):
                for p, st in ((1, 1), (1, 3), (2, 3)):
                    out.append(replace(base, tail=tail, bwd_warps=warps, programs_per_sm=p, stages=st,
                                 reload_w=True, reload_x=True))  # fmt: skip
    return _fresh(base, out)


def merged_entry(base: Any, fwd: Any, bwd: Any) -> Any:
    """`base` with the forward fields that `fwd` changed and the backward fields that `bwd`
    changed (const_n: the backward's change where both made one)."""
    names = [f.name for f in dataclasses.fields(base) if f.name not in ("op", "cols", "why")]

    def changed(e: Any, fields: Sequence[str]) -> dict[str, Any]:
        return {n: getattr(e, n) for n in fields if getattr(e, n) != getattr(base, n)}

    bwd_fields = [n for n in names if n not in FWD_FIELDS]
    return replace(base, **{**changed(fwd, FWD_FIELDS + ("const_n",)), **changed(bwd, bwd_fields)})


# RoPE's tile kernel: (tile elements, warps, least programs, head-loop stages); 2**30: one
# program per tile of positions. Its position kernel: (tile elements, warps, least programs).
TILE_GRID = [
    (e, w, p, st)
    for e, w in ((1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 8))
    for p in (2048, 8192, 2**30)
    for st in (1, 2)
]
POS_GRID = [
    (t, w, p) for t in (1024, 2048, 4096) for w in (2, 4, 8) for p in (8192, 2**30) if (t, w) != (1024, 8)
]


# A RoPE point: (B, Hq, Hkv, T, D, rotary dim or None for D), as grids.ROPES holds them.
RopeShape = tuple[int, int, int, int, int, int | None]


def rope_key(shape: RopeShape) -> tuple[int, bool]:
    """(rotary half width, partial): what RoPE's table entries serve."""
    D, R = shape[4], shape[5] or shape[4]
    return R // 2, D > R


def rope_pos_entry(table: Any, shape: RopeShape) -> Any:
    """The table's position-kernel entry for the point, keyed by its rotary block width."""
    half, partial = rope_key(shape)
    block_half = _block(half)
    return replace(table.position_config(block_half, partial), block_half=block_half, why="")


def rope_candidates(shape: RopeShape, table: Any = None) -> list[Any]:
    """The table's tile entry for the rotary width (where it has none, one keyed for it) and its
    position entry, with their launch fields replaced."""
    table = table or tables().rope
    half, partial = rope_key(shape)
    pos = rope_pos_entry(table, shape)
    tile = table.tile_config(half, partial) or RopeTileConfig(
        half=half, partial=partial, tile_elements=pos.tile_elements, num_warps=pos.num_warps,
        min_programs=pos.min_programs,
    )  # fmt: skip
    out = [replace(tile, tile_elements=e, num_warps=w, min_programs=p, head_stages=st)
           for e, w, p, st in TILE_GRID]  # fmt: skip
    out += [replace(pos, tile_elements=e, num_warps=w, min_programs=p) for e, w, p in POS_GRID]
    return _fresh(None, out)


def fwd_name(r: Any) -> str:
    if isinstance(r, WidePath):
        return f"fwd wide b{r.block} w{r.fwd_warps}"
    tag = f"fwd chunk{r.fwd_chunk} w{r.fwd_warps}" if r.fwd_chunk else f"fwd r{r.fwd_rows} w{r.fwd_warps}"
    return tag + (" hints" if r.hints else "") + (" const" if r.const_n else "")


def bwd_name(r: Any) -> str:
    if isinstance(r, ColumnConfig):
        return f"bwd col {r.block_m}x{r.block_n} w{r.num_warps} p{r.programs_per_sm}"
    if isinstance(r, WidePath):
        return f"bwd wide b{r.block} w{r.bwd_warps} p{r.programs_per_sm} s{r.stages}"
    flags = ("tail", "reload_w", "const_n", "reload_x", "prefetch", "hold_x", "fma")
    tag = f"bwd w{r.bwd_warps} p{r.programs_per_sm} s{r.stages}"
    return tag + "".join(f" {f}" for f in flags if getattr(r, f))


def rope_name(r: Any) -> str:
    stages = f" st{r.head_stages}" if getattr(r, "head_stages", 1) > 1 else ""
    return f"{'tile' if isinstance(r, RopeTileConfig) else 'pos'} e{r.tile_elements} w{r.num_warps} p{r.min_programs}{stages}"


def as_json(record: Any) -> dict[str, Any] | None:
    """A record's launch fields (its `why` is the report's to write), named by its class."""
    if record is None:
        return None
    fields = {k: v for k, v in dataclasses.asdict(record).items() if k != "why"}
    return {"record": type(record).__name__, **fields}


def from_json(config: dict[str, Any]) -> Any:
    fields = dict(config)
    cls = getattr(records, fields.pop("record"))
    if "cols" in fields:
        fields["cols"] = tuple(fields["cols"])
    return cls(**fields, why="")


def norm_table_with(table: Any, record: Any) -> Any:
    """`table` with `record` in the place of the one it replaces."""
    if isinstance(record, NormEntry):
        entries = [e for e in table.entries if (e.op, e.cols) != (record.op, record.cols)]
        return replace(table, entries=(*entries, record))
    return replace(table, **{"wide" if isinstance(record, WidePath) else "column": record})


def variants(op: str, case: Any, table_only: bool) -> list[tuple[str, Any]]:
    """(name, record) of each variant of a point, the table's first (record None: the op as
    called, the device's tables choosing)."""
    out: list[tuple[str, Any]] = [("table", None)]
    if table_only:
        return out
    t = tables()
    if op == "rope":
        out.append(("pos table", rope_pos_entry(t.rope, case.shape)))
        out += [(rope_name(r), r) for r in rope_candidates(case.shape, t.rope)]
    else:
        out += [(fwd_name(r), r) for r in norm_fwd_candidates(case.N, op, t.norms)]
        out += [(bwd_name(r), r) for r in norm_bwd_candidates(case.N, op, t.norms)]
    out = [(name, r) for name, r in out if r is None or fits_device(r)]
    seen: set[Any] = set()
    unique = []
    for name, r in out:  # each record once
        if r is not None:
            if r in seen:
                continue
            seen.add(r)
        unique.append((name, r))
    return unique


def fits_device(record: Any) -> bool:
    """Whether a candidate's warps fit a block of this GPU (16 on AMD's 64-wide wavefronts)."""
    if DEVICE != "cuda":
        return True
    from lmkernels.backends.triton.configs.targets import device_target

    limit = device_target(torch.cuda.current_device()).max_warps
    return all(getattr(record, f, 0) <= limit for f in ("fwd_warps", "bwd_warps", "num_warps"))
