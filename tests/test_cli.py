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


def test_quick_grid_covers_every_option_dtype_and_shape_once_per_backend():
    """--quick: per op and backend every option set, dtype and quick shape at least once, with
    as few cases as the longest of those lists (each costs the compile backend a compilation),
    and the fullgraph compile check once per backend."""
    from lmkernels.harness import runner
    from lmkernels.harness.checks import case_id
    from lmkernels.registry import ops

    plans = list(runner.plan_cases(grid="quick", compile_backend="aot_eager", device="cpu"))
    for spec in ops():
        mine = [p for p in plans if p.spec.name == spec.name]
        backends = {p.impl.backend for p in mine}
        assert "eager" in backends
        for backend in backends:
            ps = [p for p in mine if p.impl.backend == backend]
            assert len(ps) == max(len(spec.cases), len(spec.dtypes), len(spec.shapes["quick"]))
            assert {case_id(p.case) for p in ps} == {case_id(c) for c in spec.cases}
            assert {p.dtype for p in ps} == set(spec.dtypes)
            assert {spec.shape_id(p.shape) for p in ps} == {spec.shape_id(s) for s in spec.shapes["quick"]}
            assert [p.compile_backend for p in ps].count("aot_eager") == 1
    lines = runner.coverage_lines(plans)
    assert len(lines) == len(ops()) and all(len(line) <= 80 for line in lines)


def test_validation_in_worker_processes_matches_in_process():
    """The worker processes run the same checks (plans travel by name) and return the results
    in plan order; a backend registered only in this process is an error that says so."""
    from lmkernels.harness import runner

    plans = list(runner.plan_cases(["swiglu"], ["eager"], ["fp32", "bf16"], "quick", device="cpu"))
    register("swiglu", "local_only", lambda **kw: None)
    try:
        local = next(runner.plan_cases(["swiglu"], ["local_only"], ["fp32"], "quick", device="cpu"))
        workers = runner.start_workers(1)
        try:
            remote = runner.run_validation([*plans, local], "cpu", progress=False, workers=workers)
        finally:
            workers.shutdown()
    finally:
        unregister("swiglu", "local_only")
    here = runner.run_validation(plans, "cpu", progress=False)
    assert [r.test_id for r in remote[:-1]] == [r.test_id for r in here]
    assert [r.status for r in remote[:-1]] == [r.status for r in here] == ["pass"] * len(plans)
    assert [[e.impl for e in r.errors] for r in remote[:-1]] == [[e.impl for e in r.errors] for r in here]
    assert remote[-1].status == "error" and "use --jobs 1" in remote[-1].reason
