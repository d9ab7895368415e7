"""A part of a suite (`lmkernels-bench suite`): what it is (Part, the suites table's entries in
suite.py), the context it runs in (Context: where its rows go, their provenance, its budget), and
what parts that run the repository's own commands share (run_command)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmkernels_bench import data


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


SUITE = ["-m", "lmkernels_bench"]  # `lmkernels-bench` in a subprocess: sys.executable, *SUITE, ...


def run_command(cmd: list[str], timeout: float, log, cwd: Path | None = None, env=None) -> int:
    """The repository's own command of a part, kernels compiled (not interpreted), within its
    budget; this suite importable in it (SUITE)."""
    log("  $ " + " ".join(cmd))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1", **(env or {}))
    here = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, timeout=max(timeout, 60)).returncode
    except subprocess.TimeoutExpired:
        log(f"  stopped at the time budget ({timeout:.0f} s)")
        return -1
