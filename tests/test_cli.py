"""The CLI reads well at 80 columns: `list` is a short yes/no table (reasons on request) and
`validate` names the backends it runs and sums up the ones it cannot run in one line."""

import io

import pytest
from rich.console import Console

from lmkernels import cli
from lmkernels.harness.listing import render_list
from lmkernels.registry import backend_names, register, unregister


@pytest.fixture
def missing_peer():
    """A backend whose package is 'not installed', like an absent peer library."""
    reason = "toypkg is not installed (pip install toypkg)"
    register("swiglu", "toypeer", lambda **kw: None, external=True, available=lambda: reason)
    register("geglu", "toypeer", lambda **kw: None, external=True, available=lambda: reason)
    yield reason
    unregister("swiglu", "toypeer")
    unregister("geglu", "toypeer")


@pytest.mark.parametrize("reasons", [False, True])
def test_list_fits_80_columns(missing_peer, reasons):
    text = render_list(width=80, reasons=reasons)
    print(text)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    names = set(backend_names())
    rows = {
        ln.split()[0]: ln.split()[2:]
        for ln in lines
        if ln[:1] != " " and ln.split()[:1] and ln.split()[0] in names
    }
    assert set(rows) == set(backend_names())
    assert rows["eager"] == ["yes"] * len(rows["eager"])
    assert "yes" not in rows["toypeer"] and rows["toypeer"].count("no") == 2
    assert (missing_peer in text.replace("\n      ", " ")) == reasons


def _run_cli(argv, width=80):
    out = io.StringIO()
    saved = cli.console
    cli.console = Console(file=out, width=width, force_terminal=False)
    try:
        code = cli.main(argv)
    finally:
        cli.console = saved
    return code, out.getvalue()


def test_validate_sums_up_backends_it_cannot_run(missing_peer, tmp_path):
    argv = ["validate", "--op", "swiglu", "--op", "geglu", "--backend", "eager", "--backend", "toypeer"]
    argv += ["--dtype", "fp32", "--compile", "none", "--no-progress", "--out", str(tmp_path)]
    code, text = _run_cli(argv)
    print(text)
    assert code == 0
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "not run here: toypeer (not installed)" in text
    assert "unsupported" not in text.replace("0 unsupported", "")  # no rows for the absent peer
    # Cells never wrap: the table has as many lines at 80 columns as at 200.
    wide = _run_cli(argv, width=200)[1].splitlines()
    assert sum("│" in ln for ln in lines) == sum("│" in ln for ln in wide) == 2
    assert '"toypeer": "toypkg is not installed' in (tmp_path / "validation.json").read_text()
