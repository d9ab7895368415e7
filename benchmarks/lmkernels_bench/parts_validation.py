"""The parts of the validation suite (`lmkernels-bench suite validation`): the full validation
grid, convergence, the patched families (trajectories and per step), the distributed checks on
2 GPUs and the GPU test groups; each runs the repository's own command and turns its report into
data rows. With --dry-run they make up passing records instead (no GPU)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from lmkernels_bench.data import checkout
from lmkernels_bench.parts import SUITE, Context, run_command


def grid_records(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (op, backend, dtype) of a validation report: cases by status, the worst error against
    what the policy allows, and the failing cases."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["op"], r["backend"], r["dtype"]), []).append(r)
    out = []
    for (op, backend, dtype), cases in groups.items():
        ratios = [e["impl"] / e["allowed"] for c in cases for e in c.get("errors") or () if e.get("allowed")]
        failed = [c for c in cases if c["status"] not in ("pass", "unsupported")]
        out.append(
            {"op": op, "impl": backend, "dtype": dtype, "cases": len(cases)}
            | {"passed": sum(c["status"] == "pass" for c in cases), "failed": len(failed)}
            | {"unsupported": sum(c["status"] == "unsupported" for c in cases)}
            | {"worst_ratio": max(ratios, default=None), "failures": [c.get("test_id") for c in failed][:20]}
            | {"grid": "full"}
        )
    return out


def grid_part(ctx: Context, ops: str, dtypes: str | None):
    if ctx.done(("grid",)):
        return
    if ctx.dry_run:
        cases = [(op, d) for op in ops.split(",") for d in (dtypes or "fp32,bf16,fp16").split(",")]
        errors = [{"impl": 1.0, "allowed": 2.0}]
        results = [dict(op=op, backend="triton", dtype=d, status="pass", errors=errors) for op, d in cases]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, *"-m lmkernels validate --device cuda --full --backend triton".split()]
            cmd += ["--op", ops, *(["--dtype", dtypes] if dtypes else []), "--out", tmp, "--no-progress"]
            run_command(cmd, ctx.time_left(), ctx.log)
            report = Path(tmp) / "validation.json"
            results = json.loads(report.read_text())["results"] if report.exists() else []
    ctx.emit(grid_records(results), ("grid",))


def converge_records(report: dict[str, Any], dtype: str) -> list[dict[str, Any]]:
    out = []
    for fam in report["families"]:
        for case in fam["cases"]:
            checks = [{k: c[k] for k in ("metric", "value", "limit", "passed")} for c in case["checks"]]
            row = dict(family=fam["family"], dtype=dtype, impl=report["backend"], variant=case["variant"])
            out.append(row | dict(ops=case["ops"], passed=case["passed"], checks=checks))
    return out


def converge_part(ctx: Context):
    for dtype in ("bf16", "fp32"):
        if ctx.done((dtype,)):
            continue
        if ctx.dry_run:
            check = dict(metric="loss curve", value=1e-3, limit=2e-3, passed=True)
            case = dict(variant="all", ops=["rms_norm"], passed=True, checks=[check])
            report = {"backend": "triton", "families": [{"family": "llama", "cases": [case]}]}
        else:
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, *"-m lmkernels converge --family all --backend triton".split()]
                cmd += ["--dtype", dtype, "--device", "cuda", "--out", tmp, "--no-progress"]
                run_command(cmd, ctx.time_left(), ctx.log)
                found = list(Path(tmp).glob("converge-*.json"))
                if not found:
                    continue
                report = json.loads(found[0].read_text())
        ctx.emit(converge_records(report, dtype), (dtype,))


def families_part(ctx: Context, stepcheck: bool):
    import torch

    from lmkernels_bench import families as fam

    steps = 20 if stepcheck else 150
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = None
    for family in fam.DEFAULT:
        if ctx.done((family,)):
            continue
        if ctx.time_left() <= 0:
            ctx.skipped.append((family,))
            continue
        if ctx.dry_run:
            record = {"family": family, "passed": True, "ops": ["rms_norm"]}
            record["distance"] = {"patched": 0.01, "plain_bf16": [0.01, 0.012, 0.009], "limit": 0.018}
            if stepcheck:
                record = dict(family=family, passed=True, loss=[1e-5, 2e-5], grad=["w", 0.1, 0.2])
                record |= dict(module=[0.003, "mlp"], repeatable=True)
        else:
            batches = batches or fam.make_batches(steps, 8, 256)
            if stepcheck:
                runs = fam.stepcheck_runs(family, "triton", batches, 256, 2, device)
                record = {"family": family} | fam.stepcheck_verdict(runs)
            else:
                r = fam.trajectory(family, "triton", batches, steps, 8, 256, device)
                record = {k: r[k] for k in ("family", "passed", "ops", "distance", "eval_loss_diff")}
        ctx.emit([record | {"impl": "triton", "steps": steps}], (family,))


def dist_checks_part(ctx: Context):
    root = None if ctx.dry_run else checkout()
    for backend in ("triton", "eager"):
        if ctx.done((backend,)):
            continue
        if ctx.dry_run:
            checks = {"fsdp_layers_root": [{"ok": True, "loss_rel_err": 1e-7}] * 2}
        else:
            from lmkernels_bench.scale_worker import NCCL_ENV

            with tempfile.TemporaryDirectory() as tmp:
                out = str(Path(tmp) / f"checks_{backend}.json")
                assert root is not None  # (a checkout unless dry_run)
                script = str(root / "tests" / "distributed_checks.py")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
                cmd += [script, "--device", "cuda", "--backend", backend, "--timeout", "150", "--out", out]
                run_command(cmd, ctx.time_left() / 2, ctx.log, cwd=root, env=NCCL_ENV)
                run_command([sys.executable, script, "--merge", "--out", out], 120, ctx.log, cwd=root)
                if not Path(out).exists():
                    continue
                checks = json.loads(Path(out).read_text())["checks"]
        records = []
        for name, ranks in checks.items():
            worst = lambda key, ranks=ranks: max(
                (r[key] for r in ranks if r.get(key) is not None), default=None
            )  # noqa: E731
            records.append(
                {"check": name, "impl": backend, "ok": all(r.get("ok") for r in ranks), "ranks": len(ranks)}
                | {
                    k: worst(k)
                    for k in ("loss_rel_err", "param_rel_err", "param_update_rel_err", "other_err")
                }
            )
        ctx.emit(records, (backend,))


def tests_part(ctx: Context, args: list[str]):
    if ctx.done(("tests",)):
        return
    if ctx.dry_run:
        select = args[args.index("-k") + 1] if "-k" in args else None
        record: dict[str, Any] = {"group": args[1], "select": select, "tool": "none", "exit": 0}
        record |= {"pytest": "1 passed", "seconds": 1.0}
    else:
        root = checkout()
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, *SUITE, "gpu-tests", *args, "--out", tmp]
            run_command(
                [*cmd, "--timeout", f"{max(ctx.time_left() - 20, 60):.0f}"],
                ctx.time_left() + 60,
                ctx.log,
                cwd=root,
            )
            lines = (Path(tmp) / "gpu_tests.jsonl").read_text().splitlines()
            got = json.loads(lines[-1])
            if got.get("exit") != 0:  # the rows keep the summary; the failures go to the log
                for log in Path(tmp).glob("*.log"):
                    ctx.log("\n".join(log.read_text().splitlines()[-80:]))
        keys = ("group", "select", "tool", "pytest", "exit", "seconds", "sanitizer_errors")
        record = {k: got.get(k) for k in keys}
    ctx.emit([record], ("tests",))
