"""The CLI reads well at 80 columns: `list` is a short yes/no table (reasons on request) and
`validate` names the backends it runs and sums up the ones it cannot run in one line."""

import argparse
import importlib.util
import io
import os
import re
import subprocess
import sys

import pytest
import torch
from rich.console import Console

import lmkernels
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
    rows: dict[str, list[str]] = {}  # backend -> its cells, over every block of op columns
    for ln in lines:
        if ln[:1] != " " and ln.split()[:1] and ln.split()[0] in names:
            rows.setdefault(ln.split()[0], []).extend(ln.split()[2:])
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


# --- every argument checked, every line within 80 columns -------------------------------------

HAS_HF = importlib.util.find_spec("transformers") is not None
NO_CUDA = not torch.cuda.is_available()


def _cli(argv, monkeypatch, capsys):
    """Run `lmkernels argv` in this process as in an 80-column terminal: (exit status, output)."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(cli, "console", Console())  # created after COLUMNS, like at a real start
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse: usage, then the error
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _too_wide(text, columns=80):
    """The lines (progress bars' \\r-separated redraws included) longer than `columns`."""
    return [line for line in re.split("[\r\n]", text) if len(line.rstrip()) > columns]


BAD_ARGUMENTS = [
    (["validate", "--dtype", "bf32"], "argument --dtype: unknown dtype 'bf32'"),
    (["validate", "--backend", "eagr"], "argument --backend: unknown backend 'eagr' (did you mean eager?)"),
    (["validate", "--op", "nope"], "argument --op: unknown op 'nope'"),
    (["validate", "--op", "rope", "--backend", "cce"], "--backend: no impl of rope by cce"),
    (["validate", "--jobs", "0"], "argument --jobs: expected a positive integer"),
    (["validate", "--device", "tpu"], "argument --device: unknown device 'tpu'"),
    (["explain", "rmsnrom"], "argument op: unknown op 'rmsnrom' (did you mean rms_norm?)"),
    (["explain", "rms_norm", "--shape", "4096xabc"], "--shape: N='abc' is not an integer"),
    (["explain", "rms_norm", "--shape", "M=4,N=x"], "--shape: N='x' is not an integer"),
    (["explain", "rms_norm", "--shape", "M=4"], "--shape: missing N"),
    (["explain", "rms_norm", "--shape", "4096"], "--shape: got '4096'; rms_norm takes 2 dims MxN"),
    (["explain", "rms_norm", "--shape", "0x8"], "--shape: M=0 must be positive"),
    (["explain", "rms_norm", "--set", "foo"], "argument --set: expected key=value"),
    (["explain", "rms_norm", "--set", "foo=1"], "--set: rms_norm unknown option 'foo'"),
    (["explain", "rms_norm", "--set", "casting_mode=bogus"], "casting_mode: expected one of"),
    (["explain", "rms_norm", "--backend", "eagr"], "argument --backend: unknown backend 'eagr'"),
    (["explain", "rms_norm", "--dtype", "bf32"], "argument --dtype: unknown dtype 'bf32'"),
    (["explain", "rms_norm", "--device", "tpu"], "argument --device: unknown device 'tpu'"),
    (["converge", "--backend", "eagr"], "argument --backend: unknown backend 'eagr'"),
    (["converge", "--backend", "triton,flc=eager"], "argument --backend: unknown op 'flc'"),
    (["converge", "--family", "foo"], "argument --family: invalid choice: 'foo'"),
    (["converge", "--steps", "0"], "argument --steps: expected a positive integer"),
    (["bench", "--op", "nope"], "argument --op: unknown op 'nope'"),
    (["bench", "--backend", "eagr"], "argument --backend: unknown backend 'eagr'"),
    (["bench", "--set", "foo"], "argument --set: expected key=value"),
    (
        ["bench", "--op", "rms_norm", "--device", "cpu", "--set", "foo=1"],
        "--set: rms_norm unknown option 'foo'",
    ),
    (["bench", "--set", "regime=zipf"], "the following arguments are required: --op"),
    (["bench", "--op", "rms_norm", "--device", "cpu", "--shape", "4x4x4"], "--shape: got '4x4x4'"),
    (
        ["bench", "--op", "rope", "--device", "cpu", "--backend", "cce"],
        "nothing to time: no impl of rope by cce",
    ),
    (["bench", "--rep", "-1"], "argument --rep: expected a positive number"),
    (["patch-report"], "one of the arguments --model-type --config --all is required"),
    (["patch-report", "--model-type", "lama"], "argument --model-type: unknown model type 'lama' (did you"),
    (["patch-report", "--model-type", "llama", "--backend", "eagr"], "argument --backend: unknown backend"),
    (["patch-report", "--model-type", "llama", "--ops", "foo"], "argument --ops: unknown op 'foo'"),
    (["patch-report", "--config", "/nonexistent/dir"], "--config: cannot load a transformers config"),
    (["list", "--bogus"], "unrecognized arguments: --bogus"),
]
if NO_CUDA:
    BAD_ARGUMENTS += [
        ([cmd, "--device", "cuda"], "argument --device: cuda: no CUDA device is available here")
        for cmd in ("validate", "converge")
    ] + [
        (["explain", "rms_norm", "--device", "cuda"], "argument --device: cuda: no CUDA device"),
        (["bench", "--op", "rms_norm"], "times the kernels on a CUDA device; none is available here"),
    ]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_one_line_errors_with_exit_status_2(argv, message, monkeypatch, capsys):
    if argv[0] in ("converge", "patch-report") and not HAS_HF:
        pytest.skip("the subcommand needs the hf extra")
    code, text = _cli(argv, monkeypatch, capsys)
    print(text)
    assert code == 2
    assert "Traceback" not in text
    assert message in " ".join(text.split()), text  # the message, whatever the line breaks
    assert not _too_wide(text)


def _subcommands():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_every_backend_argument_refuses_an_unknown_backend(monkeypatch, capsys):
    """Every subcommand that takes --backend, present or future, names the known backends."""
    takes = [name for name, p in _subcommands().items() if any(a.dest == "backend" for a in p._actions)]
    assert {"explain", "validate", "bench"} <= set(takes)
    for name in takes:
        argv = [name, *(["rms_norm"] if name == "explain" else [])]
        argv += ["--model-type", "llama"] if name == "patch-report" else []
        code, text = _cli([*argv, "--backend", "eagr"], monkeypatch, capsys)
        assert code == 2 and "unknown backend 'eagr'" in text and "eager" in text, (name, text)


def test_help_fits_and_cites_no_repository_file(monkeypatch, capsys):
    """Help is for users of the installed package: no DESIGN.md, benchmarks/ or scripts/."""
    for argv in (["--help"], *([name, "--help"] for name in _subcommands())):
        code, text = _cli(argv, monkeypatch, capsys)
        assert code == 0, argv
        assert not _too_wide(text), (argv, _too_wide(text))
        for cited in ("DESIGN", "benchmarks/", "scripts/", "docs/"):
            assert cited not in text, (argv, cited)


def test_explain_says_why_auto_passes_over_triton_on_the_cpu(monkeypatch, capsys):
    """On the CPU under TRITON_INTERPRET=1 (conftest) Triton can run but is never chosen by
    auto: explain says so for every backend above the chosen one, within 80 columns."""
    from lmkernels.backends.triton import interpreting
    from lmkernels.registry import explain, get_op, impls

    if not interpreting() or not NO_CUDA:
        pytest.skip("needs the Triton interpreter on a machine without CUDA")
    for op in ("rms_norm", "flce"):
        code, text = _cli(["explain", op], monkeypatch, capsys)
        print(text)
        assert code == 0 and not _too_wide(text)
        assert re.search(
            r"^ +triton +100 +not chosen automatically on cpu \(request it explicitly\)$", text, re.M
        )
        assert re.search(r"^-> +compile +50 +ok$", text, re.M)
    spec = get_op("rms_norm")
    e = explain("rms_norm", spec.make_inputs(spec.shapes["quick"][0], torch.float32, "cpu"))
    chosen = next(r for r in e.rows if r[0] == e.chosen)
    above = [r for r in e.rows if r[1] > chosen[1]]
    assert above and all(reasons for _, _, reasons in above)
    assert {i.backend for i in impls("rms_norm") if i.priority > chosen[1]} == {r[0] for r in above}
    # Asked for explicitly, it runs: no auto reason then.
    e = explain("rms_norm", spec.make_inputs(spec.shapes["quick"][0], torch.float32, "cpu"), "triton")
    assert e.chosen == "triton" and ("triton", 100, []) in e.rows


def test_explain_wraps_long_reasons():
    from lmkernels.registry.dispatch import Choice, Explanation

    long = "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on the CPU interpreter)"
    e = Explanation(
        "rms_norm", Choice("rms_norm", "auto", "auto"), "compile", None, [("triton", 100, [long])]
    )
    text = cli.render_explanation(e, columns=80)
    assert not _too_wide(text) and " ".join(text.split()).count(long) == 1


def _without_interpreter(*argv):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"COLUMNS": "80"}
    return subprocess.run(
        [sys.executable, "-m", "lmkernels", *argv], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.skipif(not NO_CUDA, reason="Triton runs on the GPU here")
def test_triton_skipped_on_the_cpu_gives_the_interpreter_hint(tmp_path):
    """list (without --reasons) and validate say how to run the Triton kernels on the CPU."""
    from lmkernels.backends.triton import triton_importable

    if not triton_importable():
        pytest.skip("triton is not installed")
    hint = "set TRITON_INTERPRET=1 to run the Triton kernels on the CPU interpreter"
    listed = _without_interpreter("list")
    assert listed.returncode == 0 and hint in listed.stdout, listed.stdout + listed.stderr
    argv = ["validate", "--op", "swiglu", "--backend", "eager,triton", "--dtype", "fp32"]
    validated = _without_interpreter(*argv, "--compile", "none", "--no-progress", "--out", str(tmp_path))
    text = validated.stdout + validated.stderr
    assert validated.returncode == 0, text
    assert "not run here: triton (no CUDA device)" in text and hint in text
    assert not _too_wide(listed.stdout) and not _too_wide(text)


@pytest.mark.skipif(not HAS_HF, reason="converge and patch-report need the hf extra")
def test_every_subcommand_fits_80_columns(tmp_path, monkeypatch, capsys):
    """The quick form of each subcommand on tiny inputs, progress bars included: no line is
    wider than an 80-column terminal. converge reads its shipped text without the datasets
    library's chatter or a cache in the home folder."""
    from lmkernels.convergence import data

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    data.load_text.cache_clear()
    data.tokenizer.cache_clear()
    data.token_ids.cache_clear()
    runs = [
        ["list"],
        ["list", "--reasons"],
        *(["explain", op.name, "--grad"] for op in lmkernels.ops()),
        ["explain", "flce", "--backend", "cce", "--set", "with_bias=True"],
        ["validate", "--op", "swiglu", "--backend", "eager", "--dtype", "fp32", "--compile", "none"],
        ["converge", "--backend", "eager", "--steps", "2", "--seq-len", "16", "--batch-size", "2"],
        [
            "converge",
            "--backend",
            "eager",
            "--steps",
            "2",
            "--seq-len",
            "16",
            "--dtype",
            "bf16",
            "--ablation",
        ],
        ["bench", "--op", "rms_norm", "--device", "cpu", "--shape", "8x64", "--shape", "M=5,N=100"]
        + ["--quick", "--mode", "all", "--backend", "eager,compile"],
        ["patch-report", "--model-type", "gpt2"],
    ]
    for argv in runs:
        out = ["--out", str(tmp_path / argv[0])] if argv[0] in ("validate", "converge", "bench") else []
        code, text = _cli([*argv, *out], monkeypatch, capsys)
        print(text)
        assert code in (0, 1), (argv, code, text)
        assert not _too_wide(text), (argv, _too_wide(text))
        assert "Traceback" not in text
        if argv[0] == "converge":
            assert "Generating" not in text and "PASS" in text
            assert " 2/2 " in text  # its progress bars (off a terminal: their last state)
    assert not (tmp_path / "home" / ".cache" / "huggingface").exists()


def test_bench_tables_fit_80_columns():
    from lmkernels.harness import bench
    from lmkernels.harness.bench.cli import print_tables

    rows = []
    for size in (1024, 4096):
        for backend, ms in (("compile", 1.0), ("triton", 0.5), ("liger", 0.8), ("compile_naive", 2.0)):
            rows.append(
                {
                    "op": "fused_linear_cross_entropy",
                    "shape": f"BT={size},H=4096,V=128256",
                    "dims": {"BT": size, "H": 4096, "V": 128256},
                    "options": "grad_accum_dtype=bf16",
                    "dtype": "bf16",
                    "backend": backend,
                    "mode": "full",
                    "status": "ok",
                    "ms": ms,
                    "gpu_ms": ms * 0.9,
                    "ms_p20": ms,
                    "ms_p80": ms,
                    "peak_mib": 1000.0 / ms,
                    "note": "",
                }
            )
    rows.append(dict(rows[-1], backend="cce", status="OOM", ms=None, gpu_ms=None, note="CUDA out of memory"))
    bench.add_rooflines(rows, torch.bfloat16, copy_gbps=3000.0, mm_tflops=900.0)
    bench.add_ratios(rows)
    out = io.StringIO()
    print_tables(rows, Console(file=out, width=80))
    text = out.getvalue()
    print(text)
    assert not _too_wide(text)
    assert "1.6x liger" in text and "3188% mm" in text  # speedups and rates, not cut
    assert "cce: OOM: CUDA out of memory" in text
    wide = io.StringIO()
    print_tables(rows, Console(file=wide, width=80), wide=True)
    assert max(len(line) for line in wide.getvalue().splitlines()) > 80  # --wide: every column


def test_bench_command_wiring_within_80_columns(tmp_path, monkeypatch, capsys):
    """`lmkernels bench` on a CUDA device (faked here): the backends not run are named, run_bench
    gets the parsed arguments (the op's design shape by default, else the shapes given), the
    narrow tables print."""
    from lmkernels.harness.bench import cli as bench_cli

    seen = {}

    def fake_run_bench(op, shapes, backends, dtype, modes, quick, options, **kw):
        seen.update(op=op, shapes=shapes, backends=backends, dtype=dtype, modes=modes, options=options)
        seen.update(device=kw["device"])
        row = {"op": op, "shape": "M=16384,N=4096", "dims": {"M": 16384, "N": 4096}}
        row |= {"options": "default", "dtype": "bf16", "mode": "full", "note": ""}
        rows = [
            row
            | {
                "backend": b,
                "status": "ok",
                "ms": ms,
                "ms_p20": ms,
                "ms_p80": ms,
                "gpu_ms": ms,
                "peak_mib": 64.0,
            }
            for b, ms in (("compile", 0.2), ("eager", 0.5))
        ]
        from lmkernels.harness import bench

        bench.add_rooflines(rows, torch.bfloat16, copy_gbps=3000.0, mm_tflops=None)
        bench.add_ratios(rows)
        return rows, {"device": "fake"}

    monkeypatch.setattr(bench_cli.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_cli, "run_bench", fake_run_bench)
    argv = ["bench", "--op", "rmsnorm", "--backend", "compile,eager", "--backend", "liger"]
    code, text = _cli([*argv, "--set", "eps=1e-5", "--out", str(tmp_path)], monkeypatch, capsys)
    print(text)
    assert code == 0 and not _too_wide(text)
    assert seen["op"] == "rms_norm" and seen["backends"] == ["compile", "eager", "liger"]
    assert seen["shapes"] == [{"M": 16384, "N": 4096}] and seen["device"] == "cuda"  # the design shape
    assert seen["options"] == {"eps": 1e-5} and seen["modes"] == ["full"]
    assert "not run here: liger (not installed)" in text or "liger" not in backend_names()
    assert "0.4x compile" in text and (tmp_path / "results.json").exists()
    shapes = ["--shape", "4096x8192", "--shape", "N=1000,M=3", "--out", str(tmp_path / "shapes")]
    code, text = _cli([*argv, *shapes], monkeypatch, capsys)
    assert code == 0 and seen["shapes"] == [{"M": 4096, "N": 8192}, {"M": 3, "N": 1000}]


def test_list_warns_about_a_dependency_outside_its_supported_range(monkeypatch, capsys):
    from lmkernels import _versions

    monkeypatch.setattr(
        _versions, "installed_version", lambda dist: "9.0.0" if dist == "transformers" else None
    )
    code, text = _cli(["list"], monkeypatch, capsys)
    assert code == 0 and not _too_wide(text)
    assert "warning: transformers 9.0.0 is not supported: lmkernels supports transformers>=" in " ".join(
        text.split()
    )


@pytest.mark.parametrize(
    "argv", [["patch-report", "--model-type", "llama"], ["converge", "--steps", "2", "--device", "cpu"]]
)
def test_a_missing_extra_is_named_with_its_pip_command(argv):
    """Without transformers (and tokenizers): one line naming the package and the extra that
    installs it, brackets and all; no traceback."""
    code = (
        "import sys; sys.modules['transformers'] = None; sys.modules['tokenizers'] = None\n"
        "from lmkernels.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    run = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 2, out
    assert "Traceback" not in out
    assert "is not installed (pip install 'lmkernels[hf]')" in " ".join(out.split())


def test_version_and_torch_dtype_names(capsys):
    """`lmkernels --version` names lmkernels, torch and triton; every --dtype takes torch's dtype
    names beside the short ones."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith(
        f"lmkernels {lmkernels.__version__}, torch "
    )
    from lmkernels import cliargs

    for name in ("bf16", "bfloat16", "torch.bfloat16", "BFloat16"):
        assert cliargs.dtype_name(name) == "bf16"
    assert cliargs.dtype_list("float32,torch.float16") == ["fp32", "fp16"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown dtype 'float64'"):
        cliargs.dtype_type("fp32", "bf16")("float64")


def test_command_errors_read_like_argparse_errors(capsys):
    """An error found after parsing (a bad --shape) is one line in argparse's style, with the
    program and command named, and exit status 2."""
    assert cli.main(["explain", "rms_norm", "--device", "cpu", "--shape", "3xq"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("lmkernels explain: error: --shape: N='q' is not an integer")
