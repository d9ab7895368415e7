"""`lmkernels list`: which backend can run which op on this machine, as a table that fits 80
columns (backends as rows, ops as short columns), and on request the reasons behind each "no"."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

import torch

from lmkernels.cliargs import TRITON_HINT
from lmkernels.cliargs import table as render_table
from lmkernels.registry.core import Impl, get_op, impls, ops


def short_op(name: str) -> str:
    """The op's name in tables: its OpSpec.short_name, if it has one."""
    return get_op(name).short_name or name


def why_not_here(impl: Impl) -> str | None:
    """None if the impl can run on some device of this machine, else why not."""
    reason = impl.unavailable_reason()
    if reason:
        return reason
    here = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    if not any(d in here for d in impl.devices):
        return f"runs on {', '.join(impl.devices)} only; no such device here"
    return None


def _backend_order() -> list[str]:
    """Backends by their highest priority, ours before the external peers."""
    best: dict[str, tuple[bool, int]] = {}
    for impl in impls():
        key = (impl.external, -impl.priority)
        best[impl.backend] = min(best.get(impl.backend, key), key)
    return sorted(best, key=lambda b: best[b])


def render_list(width: int = 80, reasons: bool = False) -> str:
    """`lmkernels list`: every op x backend, whether it runs here, in `width` columns; with
    `reasons`, why each backend that cannot run here does not."""
    op_names = [s.name for s in ops()]
    backends = _backend_order()
    table = {(i.op, i.backend): i for i in impls()}
    lines = ["Which backend can run each op here (yes/no; - not registered).", ""]
    rows = []
    for b in backends:
        prios = {table[(op, b)].priority for op in op_names if (op, b) in table}
        prio = str(prios.pop()) if len(prios) == 1 else "var"
        cells = []
        for op in op_names:
            impl = table.get((op, b))
            cells.append("-" if impl is None else ("no" if why_not_here(impl) else "yes"))
        rows.append((b, prio, *cells))
    lines.append(render_table(("backend", "prio", *map(short_op, op_names)), rows, width, wrap_last=False))
    legend = [f"{short_op(op)} = {op}" for op in op_names if short_op(op) != op]
    if legend:
        lines += ["", *textwrap.wrap(", ".join(legend), width, break_on_hyphens=False)]
    noes = _reasons(backends, op_names, table)
    if not noes:
        return "\n".join(lines)
    if not reasons:
        text = f"Not here: {', '.join(noes)} (lmkernels list --reasons says why)."
        lines += ["", *textwrap.wrap(text, width, break_on_hyphens=False)]
        whys = [w for groups in noes.values() for w in groups]
        if any("TRITON_INTERPRET=1" in w for w in whys):
            lines += textwrap.wrap(TRITON_HINT + ".", width, break_on_hyphens=False)
    else:
        lines += ["", "Why not:"]
        for backend, groups in noes.items():
            for why, which in groups.items():
                registered = [o for o in op_names if (o, backend) in table]
                where = "all ops" if len(which) == len(registered) else ", ".join(map(short_op, which))
                text = f"{backend} ({where}): {why}"
                lines += textwrap.wrap(
                    text, width, initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False
                )
    return "\n".join(lines)


def _reasons(
    backends: Sequence[str], op_names: Sequence[str], table: dict[tuple[str, str], Impl]
) -> dict[str, dict[str, list[str]]]:
    """backend -> reason -> ops it keeps the backend from running."""
    out: dict[str, dict[str, list[str]]] = {}
    for b in backends:
        for op in op_names:
            impl = table.get((op, b))
            why = why_not_here(impl) if impl is not None else None
            if why:
                out.setdefault(b, {}).setdefault(why, []).append(op)
    return out
