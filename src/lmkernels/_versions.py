"""The supported version ranges of lmkernels' dependencies, checked at run time.

The ranges are stated once, in pyproject.toml (the dependencies and the extras: torch, triton,
transformers, trl, peft, ...). pip enforces them when it installs lmkernels; this module reads
the same requirements back at run time for a package installed some other way (a transformers
upgraded after lmkernels, a source checkout), from

1. the pyproject.toml of the source tree this module is in, when there is one (a checkout, an
   editable install: always the current ranges, even before a reinstall), else
2. the installed distribution's metadata (a wheel: importlib.metadata.requires("lmkernels"),
   which pip wrote from the same pyproject.toml).

With neither (lmkernels copied without its metadata) nothing is checked.
"""

from __future__ import annotations

import functools
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from lmkernels.registry.core import LMKernelsError

DIST = "lmkernels"


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _read_toml(path: Path) -> dict[str, Any] | None:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads(path.read_text())
    return None  # Python 3.10: no TOML reader in the standard library


def _pyproject_requirements() -> list[str] | None:
    path = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not path.is_file():
        return None
    pyproject = _read_toml(path)
    if pyproject is None:
        return None
    project = pyproject.get("project", {})
    if project.get("name") != DIST:
        return None
    reqs = list(project.get("dependencies", []))
    for extra, items in project.get("optional-dependencies", {}).items():
        reqs += [f"{item}; extra == {extra!r}" for item in items]
    return reqs


@functools.lru_cache(maxsize=1)
def requirements() -> dict[str, tuple[SpecifierSet, tuple[str, ...]]]:
    """dependency name -> (its supported range, the extras that ask for it; () = always)."""
    reqs = _pyproject_requirements()
    if reqs is None:
        try:
            reqs = metadata.requires(DIST) or []
        except metadata.PackageNotFoundError:
            reqs = []
    out: dict[str, tuple[SpecifierSet, tuple[str, ...]]] = {}
    for text in reqs:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        name = _normalize(req.name)
        if name == DIST:  # an extra that pulls in other extras
            continue
        extras = tuple(e for e in _extras_of(req) if e)
        spec, seen = out.get(name, (SpecifierSet(), ()))
        out[name] = (spec & req.specifier, tuple(dict.fromkeys(seen + extras)))
    return out


def _extras_of(req: Requirement) -> list[str]:
    marker = str(req.marker) if req.marker else ""
    return [part.split("==")[1].strip().strip("'\"") for part in marker.split(" or ") if "extra ==" in part]


def supported(dist: str) -> SpecifierSet | None:
    """The supported range of `dist` (None: lmkernels states none)."""
    entry = requirements().get(_normalize(dist))
    return None if entry is None else entry[0]


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def problem(dist: str, version: str | None = None) -> str | None:
    """Why `version` (default: the installed one) of `dist` is outside the supported range, or
    None when it is inside, when `dist` is not installed or when no range is stated."""
    version = version or installed_version(dist)
    spec = supported(dist)
    if version is None or spec is None or not str(spec):
        return None
    try:
        ok = spec.contains(Version(version.split("+")[0]), prereleases=True)
    except InvalidVersion:
        return None
    if ok:
        return None
    extras = requirements()[_normalize(dist)][1]
    where = f" (lmkernels[{','.join(extras)}])" if extras else ""
    ranges = ",".join(sorted(map(str, spec), key=lambda s: (not s.startswith(">"), s)))
    return f"{dist} {version} is not supported: lmkernels supports {dist}{ranges}{where}"


def check(dist: str, version: str | None = None) -> None:
    """Raise LMKernelsError if `version` (default: the installed one) of `dist` is outside the
    range lmkernels supports."""
    text = problem(dist, version)
    if text:
        raise LMKernelsError(text)


def problems(dists: tuple[str, ...] = ("torch", "triton", "transformers", "trl", "peft")) -> list[str]:
    """What is outside its supported range among the installed `dists`."""
    return [p for p in map(problem, dists) if p]
