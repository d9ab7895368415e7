"""Give a fresh venv some packages of the running interpreter by linking their files, not copying.

CI builds five environments (its own, one per trainer integration and the wheel test's); torch and
triton take 1.75 GB a copy, more than a CI disk holds five times over. Here each file a
distribution's RECORD lists is hard-linked into the target's site-packages (symlinked, file by
file, where the target lies on another filesystem). pip then sees the distribution installed; when
it replaces one (a trainer wanting another version) it removes the links, never the source files.
Console scripts are left out: their first line names the source interpreter.

    python tests/linked_packages.py VENV torch triton   # and their installed requirements
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def with_requirements(names: list[str]) -> list[metadata.Distribution]:
    """The installed distributions `names` and, recursively, those they require (no extras);
    a name not installed is left out: pip installs it in the target as usual."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def site_packages(venv: Path) -> Path:
    python = venv / "bin" / "python"
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(
        subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    )


def link_into(venv: Path, names: list[str]) -> list[str]:
    """Link `names` (and their requirements) into `venv`; returns 'name version' per distribution.
    One the venv has already (pip and setuptools, any version) is left to pip: files of two
    versions must not mix."""
    site = site_packages(venv)
    present = {canonicalize_name(p.name.split("-")[0]) for p in site.glob("*.dist-info")}
    linked = []
    for dist in with_requirements(names):
        if canonicalize_name(dist.metadata["Name"]) in present:
            continue
        source = Path(dist.locate_file(""))
        hard = os.stat(source).st_dev == os.stat(site).st_dev
        for file in dist.files or []:
            if file.parts[0] == "..":  # scripts and data outside site-packages
                continue
            src, dst = source / file, site / file
            if not src.is_file():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            if hard:
                os.link(src, dst)
            else:
                os.symlink(src, dst)
        linked.append(f"{dist.metadata['Name']} {dist.version}")
    return linked


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python tests/linked_packages.py VENV DISTRIBUTION...")
    done = link_into(Path(sys.argv[1]), sys.argv[2:])
    print(f"linked into {sys.argv[1]}: {', '.join(done) or 'nothing (none installed here)'}")
