"""The wheel as users get it: built from this tree, installed into a fresh virtual environment
that holds only torch, with no extra, and used there.

The venv gets the torch running these tests (with its requirements), linked rather than copied
(tests/linked_packages.py: a copy is 0.75 GB that CI disks do not spare); then the wheel, whose
torch requirement that torch must satisfy: pip's dry run must plan no other torch (a CUDA build of
several GB) before anything is installed. About half a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from linked_packages import link_into

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        torch.version.cuda is not None,
        reason="the check expects a CPU build's backends (auto picks torch.compile)",
    ),
]

CHECK = textwrap.dedent(
    """
    import torch
    import lmkernels
    from lmkernels.registry import resolve

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 96, generator=g), torch.randn(96, generator=g)
    ref = torch.nn.functional.rms_norm(x, (96,), w, eps=1e-6)
    torch.testing.assert_close(lmkernels.rms_norm(x, w, eps=1e-6, backend="eager"), ref)
    auto = resolve("rms_norm", {"x": x, "weight": w}).backend
    torch.testing.assert_close(lmkernels.rms_norm(x, w, eps=1e-6), ref)
    print("ok", auto, lmkernels.__file__, torch.__version__)
    """
)


def _run(*argv, cwd, env, timeout=240):
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, argv))}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _planned(pip, target, cwd, env, report: Path) -> dict[str, dict]:
    """What `pip install target` would install: name -> the report's entry (nothing installed)."""
    _run(*pip, "install", "-q", "--dry-run", "--report", str(report), target, cwd=cwd, env=env)
    return {i["metadata"]["name"].lower(): i for i in json.loads(report.read_text())["install"]}


def test_wheel_installs_into_a_fresh_venv_and_runs(tmp_path):
    start = time.perf_counter()
    # No PYTHONPATH (a source tree on it would shadow the installed wheel), no interpreter switch.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    dist = tmp_path / "dist"
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        str(ROOT),
        "--no-deps",
        "-q",
        "-w",
        str(dist),
        cwd=tmp_path,
        env=env,
    )
    (wheel,) = dist.glob("lmkernels-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lmkernels/convergence/data/tinyshakespeare.txt" in names
    assert "lmkernels/py.typed" in names  # type checkers read the package's annotations
    assert not any(n.startswith(("tests/", "benchmarks/", "scripts/")) for n in names)

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", str(venv), cwd=tmp_path, env=env)
    python = str(venv / "bin" / "python")
    pip = (python, "-m", "pip")

    linked = link_into(venv, ["torch"])
    assert f"torch {torch.__version__}" in linked, linked

    plan = _planned(pip, str(wheel), tmp_path, env, tmp_path / "wheel.json")
    assert "torch" not in plan and not any(n.startswith(("nvidia-", "triton")) for n in plan), sorted(plan)
    assert "lmkernels" in plan and "transformers" not in plan  # no extra
    _run(*pip, "install", "-q", str(wheel), cwd=tmp_path, env=env)

    out = _run(python, "-c", CHECK, cwd=tmp_path, env=env)
    assert out.startswith("ok compile ")  # auto on the CPU: torch.compile outranks eager
    assert str(venv) in out and torch.__version__ in out
    listed = _run(str(venv / "bin" / "lmkernels"), "list", cwd=tmp_path, env=env)
    assert "compile" in listed and "Traceback" not in listed
    seconds = time.perf_counter() - start
    print(f"wheel build, venv, installs and checks: {seconds:.0f} s")
    assert seconds < 300  # 30 s on 2 idle cores; a torch download would take far longer


def test_linked_packages_survive_the_venvs_pip(tmp_path):
    """pip replacing a linked distribution in the venv removes the links, not the source files."""
    from packaging import __file__ as source

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv), cwd=tmp_path, env=os.environ)
    assert link_into(venv, ["packaging"]) == [f"packaging {version('packaging')}"]
    python = str(venv / "bin" / "python")
    where = _run(python, "-c", "import packaging; print(packaging.__file__)", cwd=tmp_path, env=os.environ)
    assert where.strip().startswith(str(venv))
    before = Path(source).read_bytes()
    _run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "uninstall",
        "-q",
        "-y",
        "packaging",
        cwd=tmp_path,
        env=os.environ,
    )
    assert not (venv / Path(where.strip()).relative_to(venv)).exists()
    assert Path(source).read_bytes() == before
