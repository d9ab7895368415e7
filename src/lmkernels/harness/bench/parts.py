"""A part of a suite (`lmkernels bench --suite`): what it is (Part, the suites table's entries in
suite.py) and the context it runs in (Context: where its rows go, their provenance, its budget)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmkernels.harness.bench import data


@dataclasses.dataclass
class Part:
    what: str
    run: Callable[..., None]
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    gpus: int = 1
    budget_s: float = 540.0
    kind: str = ""  # the rows' "part" field (default: the part's name)


@dataclasses.dataclass
class Context:
    """What a part needs: where its rows go, the provenance they carry, its time budget, and
    which of its units (points) the data file already holds for this commit and GPU kind."""

    path: Path
    part: str
    prov: dict[str, Any]
    budget_s: float
    dry_run: bool = False
    again: bool = False
    log: Callable[[str], None] = print
    started: float = dataclasses.field(default_factory=time.time)
    have: set = dataclasses.field(default_factory=set)
    skipped: list = dataclasses.field(default_factory=list)
    written: int = 0

    def time_left(self) -> float:
        return self.started + self.budget_s - time.time()

    def done(self, unit: tuple) -> bool:
        return not self.again and unit in self.have

    def emit(self, rows: list[dict[str, Any]], unit: tuple | None = None) -> None:
        """Append rows (with the part, the peers' configurations and the provenance)."""
        vers = self.prov["versions"]
        out = []
        for row in rows:
            row = {"part": self.part} | row
            name = row.get("impl") or row.get("config")
            if name and "peer" not in row and self.part in ("ops", "flce", "e2e", "dist"):
                row["peer"] = data.peer(name, self.part, vers)
            if unit is not None:
                row["unit"] = list(unit)
            out.append(row | self.prov | ({"dry_run": True} if self.dry_run else {}))
        data.append_rows(self.path, out)
        self.written += len(out)
