"""The records of the tuned tables and of the launches they resolve to.

A GPU generation's tables (`Tables`) hold, per op, entries measured on that generation: each
entry names the inputs it serves (a norm's row widths, RoPE's rotary width), its launch
parameters as named fields, and `why`, one line that says what it buys with the measured
number. The launchers never read a table: the op bodies pick a table with `tables_for(device)`,
resolve the entry for their inputs into a launch configuration (FwdConfig, BwdConfig,
RopePosConfig, RopeTileConfig) and pass that to the launcher as an argument.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

# Backward paths of the norm kernels (their PATH constexpr; 2 is the value WIDE always had, so
# that its compiled kernels keep their cache keys).
PATH_REGS = 0  # whole row in registers, weight-gradient partial sums in registers
PATH_WIDE = 2  # the row in blocks of the wide path's block, two passes, sums in the column kernel

NORM_OPS = ("rms_norm", "layer_norm")


def _pow2_ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# --- norms -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class NormEntry:
    """The forward's and the backward's launch for RMSNorm or LayerNorm rows of `cols`
    columns. The fields, once for all entries:

    op: "rms_norm" or "layer_norm".
    cols: (first, last) row width served, inclusive, within one power-of-two block (the
        block: the backward's register block, and the forward's unless fwd_chunk). An entry
        for part of a block (e.g. 4097-5120 of the 8192 block) may pad less or hold the row
        differently from the block's other widths.
    why: one line, what the entry buys, with the number measured.
    fwd_rows: forward rows per program (a rows x block tile in registers).
    fwd_warps, bwd_warps: warps per program of the forward and of the backward.
    fwd_chunk: > 0: the forward reads the row in chunks of this many columns, in passes
        (one row per program), instead of holding it in registers.
    hints: chunked forward: eviction hints that keep the row in L2 between the passes.
    programs_per_sm: backward programs per SM (a persistent grid, at most one per row tile),
        each looping over one-row tiles with the row in registers and its weight-gradient sums
        in registers.
    reload_w: the backward loads the weight per tile (an L1 hit) instead of holding it.
    tail: the backward holds the row as two register blocks, the largest power of two
        below the width and the rest (e.g. 4096 + 1024 for 5120 columns): fewer padded lanes.
    stages: software pipelining of the backward's loop over row tiles (the next tiles' loads
        in flight through shared memory); lowered at launch to fit the device (pipeline_stages).
    const_n: both kernels compiled for the row width (N a constexpr, one compile per width):
        the masks of a padded block are known at compile time and the lanes past N fold away.
    reload_x: the backward reads x and dy again after the row sums, one register block at a
        time (L1 / L2 hits), instead of holding them: registers for the gradient sums.
    prefetch: the backward asks L2 for its next row tile while the current one's loads are in
        flight (sm_90+ PTX: off elsewhere, at launch).
    hold_x: RMSNorm, bf16: the backward holds x and dy as loaded (half the registers of fp32)
        across the row sums and widens them again, instead of reload_x's second reads.
    fma: LayerNorm: the backward's x_hat and dx as fused multiply-adds with per-row products.
    """

    op: str
    cols: tuple[int, int]
    why: str
    fwd_rows: int = 1
    fwd_warps: int
    fwd_chunk: int = 0
    hints: bool = False
    bwd_warps: int
    programs_per_sm: int
    reload_w: bool = False
    tail: bool = False
    stages: int = 1
    const_n: bool = False
    reload_x: bool = False
    prefetch: bool = False
    hold_x: bool = False
    fma: bool = False

    def __post_init__(self) -> None:
        first, last = self.cols
        if self.op not in NORM_OPS:
            raise ValueError(f"NormEntry.op: {self.op!r}, not one of {NORM_OPS}")
        if not 0 < first <= last or _pow2_ceil(first) != _pow2_ceil(last):
            raise ValueError(f"NormEntry.cols: {self.cols} is not a range within one power-of-two block")
        if self.hold_x and self.op != "rms_norm":
            raise ValueError("NormEntry.hold_x: RMSNorm only")
        if self.fma and self.op != "layer_norm":
            raise ValueError("NormEntry.fma: LayerNorm only")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WidePath:
    """Rows wider than the table's max_fused_n: the forward in chunks of `block` columns with
    eviction hints (one row per program); the backward in blocks of `block` columns, two passes
    (the second from L2), its column loops pipelined (`stages`), writing dx only, and the column
    kernel summing the weight gradients."""

    block: int
    fwd_warps: int
    bwd_warps: int
    programs_per_sm: int
    stages: int
    why: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ColumnConfig:
    """The column kernel (the wide path's weight and bias gradients): programs of block_m rows x
    block_n columns, about programs_per_sm programs per SM in all (row ranges of at least
    block_m rows)."""

    block_m: int
    block_n: int
    num_warps: int
    programs_per_sm: int
    why: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SumConfig:
    """The kernel that sums the backward's fp32 weight-gradient partial rows: tiles of block_p
    partial rows x block_n columns."""

    block_p: int
    block_n: int
    num_warps: int
    why: str = ""


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class NormTable:
    """RMSNorm's and LayerNorm's entries and the settings they share. Rows of at most
    max_fused_n columns take the entry that serves their width (`entry`), or below the
    narrowest entry a default of several rows per program (_norms.fwd_config); wider rows the
    wide path. Compared and hashed by identity: a table is immutable, and the launch
    configurations resolved from it are cached per table."""

    entries: tuple[NormEntry, ...]
    max_fused_n: int
    wide: WidePath
    column: ColumnConfig
    sums: SumConfig

    if TYPE_CHECKING:  # built by __post_init__, not a field (a tuned file holds the fields)
        _index: dict[str, tuple[NormEntry, ...]] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        index: dict[str, list[NormEntry]] = {op: [] for op in NORM_OPS}
        for e in self.entries:
            index[e.op].append(e)
        for op, entries in index.items():
            entries.sort(key=lambda e: e.cols)
            for a, b in zip(entries, entries[1:]):
                if b.cols[0] <= a.cols[1]:
                    raise ValueError(f"{op}: entries for {a.cols} and {b.cols} overlap")
            if entries and entries[-1].cols[1] > self.max_fused_n:
                raise ValueError(f"{op}: an entry past max_fused_n = {self.max_fused_n}")
        object.__setattr__(self, "_index", {op: tuple(v) for op, v in index.items()})

    def entry(self, op: str, N: int) -> NormEntry | None:
        """The entry that serves rows of N columns, if any."""
        for e in self._index[op]:
            if e.cols[0] <= N <= e.cols[1]:
                return e
        return None


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """A norm forward's launch: what the launchers take."""

    rows: int  # rows per program (a rows x block tile)
    block: int  # columns a program handles at once
    single_block: bool  # the whole row fits in one block (kept in registers)
    num_warps: int
    hints: bool = False  # chunked rows: eviction hints that keep the row in L2 between passes
    const_n: bool = False  # compile for this row width (N a constexpr)


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """A norm backward's launch: what the launchers take. Fields as NormEntry's, resolved for
    one row width: `block` (and `tail`, the second register block's size) in columns. The wide
    path (PATH_WIDE) writes dx only and leaves every weight-gradient sum to the column kernel;
    PATH_REGS sums them in registers."""

    rows: int  # rows per loop iteration of a program
    block: int
    path: int  # PATH_REGS or PATH_WIDE
    num_warps: int
    programs_per_sm: int  # persistent grid: programs = SMs x this (at most one per row tile)
    reload_w: bool = False
    tail: int = 0  # PATH_REGS: a second register block of the row, columns block.. +tail
    stages: int = 1  # the loop over row tiles (wide path: over column blocks)
    const_n: bool = False
    reload_x: bool = False
    prefetch: bool = False
    hold_x: bool = False
    fma: bool = False
    column: ColumnConfig = dataclasses.field(kw_only=True)  # the column kernel's launch (wide path)
    sums: SumConfig = dataclasses.field(kw_only=True)  # the partial-sum kernel's launch

    @property
    def single_block(self) -> bool:
        return self.path != PATH_WIDE


# --- RoPE --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopePosConfig:
    """RoPE's position kernel: a program rotates BLOCK_H head rows of one position at a time,
    BLOCK_H = tile_elements // (2 * block_half) (at most the heads there are), with num_warps
    warps. Below min_programs positions, a position's head groups are spread over several
    programs so that every SM's memory pipe still gets work.

    In a table: block_half (the rotary half width rounded up to a power of two) and partial
    (dims past the rotary part are copied) name the inputs the entry serves; block_half None
    serves every width without an entry of its own."""

    block_half: int | None = None
    partial: bool = False
    tile_elements: int
    num_warps: int
    min_programs: int
    why: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeTileConfig:
    """RoPE's tile kernel, for q and k whose heads' positions are contiguous rows ((B, H, T, D)
    memory): a program rotates BLOCK_T = tile_elements // next_power_of_2(head_dim) positions x
    every splits-th head (q's, then k's), with num_warps warps; splits so that there are about
    min_programs programs. The cos / sin rows of its positions stay in registers over the loop
    over heads, which head_stages > 1 software-pipelines.

    In a table: half (the exact rotary half width) and partial (dims past the rotary part are
    copied) name the inputs the entry serves; other inputs take the position kernel."""

    half: int | None = None
    partial: bool = False
    tile_elements: int
    num_warps: int
    min_programs: int
    head_stages: int = 1
    why: str = ""


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class RopeTable:
    """RoPE's entries: the position kernel's per rotary block width (one with block_half None
    per `partial` value for the rest), the tile kernel's per exact rotary half. Compared and
    hashed by identity, as NormTable."""

    position: tuple[RopePosConfig, ...]
    tile: tuple[RopeTileConfig, ...]

    if TYPE_CHECKING:  # built by __post_init__, not fields (a tuned file holds the fields)
        _position: dict[tuple[int | None, bool], RopePosConfig] = dataclasses.field(init=False)
        _tile: dict[tuple[int | None, bool], RopeTileConfig] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        pos = {(e.block_half, e.partial): e for e in self.position}
        tile = {(e.half, e.partial): e for e in self.tile}
        if len(pos) != len(self.position) or len(tile) != len(self.tile):
            raise ValueError("RopeTable: two entries for the same inputs")
        if (None, False) not in pos or (None, True) not in pos:
            raise ValueError("RopeTable: a position-kernel entry with block_half None is needed per partial")
        object.__setattr__(self, "_position", pos)
        object.__setattr__(self, "_tile", tile)

    def position_config(self, block_half: int, partial: bool) -> RopePosConfig:
        return self._position.get((block_half, partial)) or self._position[(None, partial)]

    def tile_config(self, half: int, partial: bool) -> RopeTileConfig | None:
        return self._tile.get((half, partial))


# --- fused linear cross entropy -----------------------------------------------------------------


FLCE_NARROW_WARPS = 4  # the row kernel's warps where its block is under FLCE_NARROW_BLOCK columns
FLCE_NARROW_BLOCK = 2048


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlceRowsEntry:
    """_flce_rows_kernel's launch for rows (or vocabulary windows) of at least min_cols columns:
    block columns per loop step (a power of 2; at most the row's width rounded up to one),
    num_warps warps (FLCE_NARROW_WARPS where the block ends up under FLCE_NARROW_BLOCK)."""

    min_cols: int
    block: int
    num_warps: int
    why: str = ""

    def __post_init__(self) -> None:
        if self.min_cols < 1 or self.block < 1 or self.block & (self.block - 1):
            raise ValueError(f"FlceRowsEntry: min_cols >= 1 and a power-of-2 block, got {self}")


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class FlceTable:
    """The row kernel's entries; one with min_cols 1 serves every width."""

    rows: tuple[FlceRowsEntry, ...]

    if TYPE_CHECKING:  # built by __post_init__, not a field (a tuned file holds the fields)
        _by_width: tuple[FlceRowsEntry, ...] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        widths = [e.min_cols for e in self.rows]
        if len(set(widths)) != len(widths) or 1 not in widths:
            raise ValueError("FlceTable: one entry per min_cols, and one with min_cols 1")
        object.__setattr__(self, "_by_width", tuple(sorted(self.rows, key=lambda e: -e.min_cols)))

    def rows_launch(self, n_cols: int) -> tuple[int, int]:
        """(BLOCK_V, num_warps) for rows of n_cols columns (an empty row: the narrowest entry)."""
        entry = next((e for e in self._by_width if n_cols >= e.min_cols), self._by_width[-1])
        block = min(entry.block, _pow2_ceil(n_cols))
        return block, entry.num_warps if block >= FLCE_NARROW_BLOCK else FLCE_NARROW_WARPS


# --- a generation's tables ---------------------------------------------------------------------

# A record of a table, each with its `why`.
Record = NormEntry | WidePath | ColumnConfig | SumConfig | RopePosConfig | RopeTileConfig | FlceRowsEntry


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Tables:
    """Every op's table for one GPU generation."""

    name: str
    norms: NormTable
    rope: RopeTable
    flce: FlceTable

    def __post_init__(self) -> None:
        entries: tuple[Record, ...] = (
            *self.norms.entries,
            self.norms.wide,
            *self.rope.position,
            *self.rope.tile,
            *self.flce.rows,
        )
        missing = [e for e in entries if not e.why.strip()]
        if missing:
            raise ValueError(f"{self.name}: entries without a `why`: {missing}")
