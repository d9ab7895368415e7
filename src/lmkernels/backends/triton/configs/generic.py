"""Every GPU without tuned tables of its own (Ampere, Ada, Blackwell, ROCm, and any GPU not
known by name): Hopper's tuned entries, fitted by one rule to the target's limits. Nothing
here is tuned on those GPUs; `lmkernels tune --install` tunes a GPU's own (a file the
package then loads on it, configs.files), and `lmkernels compile-check --target NAME` compiles
every launch of these tables for a target offline and checks it against the target's limits.

The rule (`tables_for_target`), a pure function of the Target record (configs.targets):

- threads: each launch keeps the threads of Hopper's (warps x 32): on 64-wide wavefronts that
  is half the warps, and never past the block's limit (max_threads_per_block / warp_size: 16 on
  AMD, where Hopper's 32-warp launches would be 2048 threads). Each thread then holds as many
  elements as on Hopper: the register use Hopper's entries are tuned for.
- shared memory: the norm backward's software-pipeline stages (its loads in flight through
  shared memory) are lowered until the buffers of bf16 rows fit the target's shared memory per
  block (`fit_stages`, the launchers' own rule, which lowers them again for fp32 at launch).
- residency: the backward's persistent programs per SM are lowered to those that can be resident
  on one SM together (threads per SM, shared memory per SM): a second wave of programs would run
  after the first, the tail the persistent grid exists to avoid.
- sm_90 instructions: the L2 prefetch is dropped below sm_90 (the launchers drop it there too).

Block sizes stay Hopper's: every target has Hopper's 64K registers per SM (AMD twice that) and 255
(512) per thread, and the offline check compiles each for register spills. The `why` of each entry
says what the rule changed and what the entry measured on Hopper.

PREFER_COMPILE is the hook for `auto` on untuned GPUs (see there).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TypeVar

from lmkernels.backends.triton.configs import hopper
from lmkernels.backends.triton.configs.records import (
    ColumnConfig,
    FlceRowsEntry,
    FlceTable,
    NormEntry,
    NormTable,
    Record,
    RopePosConfig,
    RopeTable,
    RopeTileConfig,
    SumConfig,
    Tables,
    WidePath,
    _pow2_ceil,
)
from lmkernels.backends.triton.configs.targets import Target

# Shared memory a norm backward needs besides its pipeline buffers (cross-warp reductions): a
# small fraction of this in the norm backwards' sm_90 cubins, so it leaves room to spare
# (docs/performance.md, "Design decisions and their measurements").
SHARED_MARGIN = 4096
# The same, per resident program, where programs share an SM's shared memory (the reductions'
# scratch of the cubins, a few hundred bytes at most).
RESIDENT_MARGIN = 1024
HOPPER_WARP = 32  # the warp size Hopper's entries are tuned for

# `auto` on a GPU running the generic tables (no tuned file loaded): per target name, the ops
# whose generic launches are slower than torch.compile there (the maintainers' suite,
# `lmkernels-bench generic`, which times a target's generic tables on a Hopper GPU against the
# Hopper tables and torch.compile). For those ops `auto` passes over the Triton backend and picks
# the next one (compile); an explicit backend="triton" still runs it. An op enters only where
# the suite shows it slower; none does.
PREFER_COMPILE: dict[str, frozenset[str]] = {}


def prefers_compile(target: Target, op: str) -> bool:
    """Whether `auto` should pass over Triton's `op` on `target`'s generic tables."""
    return op in PREFER_COMPILE.get(target.name, ())


# --- the rule's pieces (the launchers use them too) ---------------------------------------------


def warps_for(warps: int, target: Target) -> int:
    """Hopper's `warps` for `target`: the same threads, within the block's limit."""
    return max(1, min(warps * HOPPER_WARP // target.warp_size, target.max_warps))


def norm_stage_bytes(rows: int, cols: int, x_bytes: int, w_bytes: int, reload_x: bool) -> int:
    """Shared memory one pipeline stage of the norm backward holds: Triton keeps stages - 1
    copies of a loop iteration's pipelined loads, x and dy (read twice where reload_x), and the
    weight where it is reloaded per tile (w_bytes 0 otherwise)."""
    return rows * cols * ((4 if reload_x else 2) * x_bytes + w_bytes)


def fit_stages(stages: int, stage_bytes: int, shared_per_block: int) -> int:
    """`stages`, lowered until stages - 1 buffers of stage_bytes fit shared_per_block less
    SHARED_MARGIN."""
    limit = shared_per_block - SHARED_MARGIN
    while stages > 1 and (stages - 1) * stage_bytes > limit:
        stages -= 1
    return stages


def resident_programs(programs: int, warps: int, shared_bytes: int, target: Target) -> int:
    """`programs` per SM, lowered to what one SM holds at once (threads, shared memory)."""
    fit = target.max_threads_per_sm // (warps * target.warp_size)
    if shared_bytes:
        fit = min(fit, target.shared_per_sm // (shared_bytes + RESIDENT_MARGIN))
    return max(1, min(programs, fit))


def _changed(before: Record, after: Record, names: tuple[str, ...]) -> str:
    parts = [
        f"{n} {getattr(before, n)} -> {getattr(after, n)}"
        for n in names
        if getattr(before, n) != getattr(after, n)
    ]
    return ", ".join(parts) if parts else "unchanged"


def _why(target: Target, before: Record, after: Record, names: tuple[str, ...]) -> str:
    return (
        f"generic {target.name}: Hopper's entry ({_changed(before, after, names)}); on Hopper: {before.why}"
    )


# --- the rule, per record --------------------------------------------------------------------------


def _bwd_cols(e: NormEntry) -> int:
    """Columns the backward holds per row at the entry's widest row (two blocks with `tail`)."""
    n = e.cols[1]
    block = _pow2_ceil(n)
    if e.tail:
        block //= 2
        return block + _pow2_ceil(n - block)
    return block


def norm_entry(e: NormEntry, target: Target) -> NormEntry:
    bwd_warps = warps_for(e.bwd_warps, target)
    stage = norm_stage_bytes(1, _bwd_cols(e), 2, 2 if e.reload_w else 0, e.reload_x and not e.hold_x)
    stages = fit_stages(e.stages, stage, target.shared_per_block)
    out = dataclasses.replace(
        e,
        fwd_warps=warps_for(e.fwd_warps, target),
        bwd_warps=bwd_warps,
        stages=stages,
        programs_per_sm=resident_programs(e.programs_per_sm, bwd_warps, (stages - 1) * stage, target),
        prefetch=e.prefetch and target.sm90_ptx,
    )
    names = ("fwd_warps", "bwd_warps", "stages", "programs_per_sm", "prefetch")
    return dataclasses.replace(out, why=_why(target, e, out, names))


def wide_path(w: WidePath, target: Target) -> WidePath:
    bwd_warps = warps_for(w.bwd_warps, target)
    stage = norm_stage_bytes(1, w.block, 2, 2, False)
    stages = fit_stages(w.stages, stage, target.shared_per_block)
    out = dataclasses.replace(
        w,
        fwd_warps=warps_for(w.fwd_warps, target),
        bwd_warps=bwd_warps,
        stages=stages,
        programs_per_sm=resident_programs(w.programs_per_sm, bwd_warps, (stages - 1) * stage, target),
    )
    return dataclasses.replace(
        out, why=_why(target, w, out, ("fwd_warps", "bwd_warps", "stages", "programs_per_sm"))
    )


def column_config(c: ColumnConfig, target: Target) -> ColumnConfig:
    warps = warps_for(c.num_warps, target)
    out = dataclasses.replace(
        c, num_warps=warps, programs_per_sm=resident_programs(c.programs_per_sm, warps, 0, target)
    )
    return dataclasses.replace(out, why=_why(target, c, out, ("num_warps", "programs_per_sm")))


def sum_config(s: SumConfig, target: Target) -> SumConfig:
    out = dataclasses.replace(s, num_warps=warps_for(s.num_warps, target))
    return dataclasses.replace(out, why=_why(target, s, out, ("num_warps",)))


_Launch = TypeVar("_Launch", RopePosConfig, RopeTileConfig, FlceRowsEntry)


def _warps_only(record: _Launch, target: Target) -> _Launch:
    out = dataclasses.replace(record, num_warps=warps_for(record.num_warps, target))
    return dataclasses.replace(out, why=_why(target, record, out, ("num_warps",)))


@functools.cache
def tables_for_target(target: Target, base: Tables = hopper.TABLES) -> Tables:
    """`base`'s entries (Hopper's tuned ones) fitted to `target` by the rule above."""
    n, r, f = base.norms, base.rope, base.flce
    norms = NormTable(
        entries=tuple(norm_entry(e, target) for e in n.entries),
        max_fused_n=n.max_fused_n,
        wide=wide_path(n.wide, target),
        column=column_config(n.column, target),
        sums=sum_config(n.sums, target),
    )
    rope = RopeTable(
        position=tuple(_warps_only(e, target) for e in r.position),
        tile=tuple(_warps_only(e, target) for e in r.tile),
    )
    flce = FlceTable(rows=tuple(_warps_only(e, target) for e in f.rows))
    return Tables(name=f"generic {target.name}", norms=norms, rope=rope, flce=flce)
