"""Multi-process checks: a patched tiny Llama trains under FSDP2 / DDP / tensor parallel /
pipeline parallel / DeepSpeed ZeRO / FSDP2 x TP the same as one process trains plain transformers
on the whole batch, and the vocab-parallel FLCE equals the one-device loss. Shared pieces and
tolerances in distributed_common.py; the checks, by suite (--suite, one world each):

- main (2 processes): distributed_checks_fsdp.py, distributed_checks_tp.py, distributed_checks_pp.py
- deepspeed (2 processes): distributed_checks_deepspeed.py (ZeRO-2 / ZeRO-3; skipped without deepspeed)
- 2d (4 processes, dp 2 x tp 2): distributed_checks_2d.py

Every check runs in each rank of the suite's world and returns its measured errors or raises.
--device cpu (the default, CI): gloo, eager backend; --device cuda: cuda:LOCAL_RANK, NCCL,
the Triton backend (--backend picks another, e.g. "triton,flce=eager"); --device auto: cuda when
torch sees a GPU. tests/test_distributed*.py run each suite in one world (start-up paid once).

    python tests/distributed_checks.py --out results.json            # spawns 2 processes
    python tests/distributed_checks.py --suite 2d --out r2d.json     # spawns 4 processes
    torchrun --standalone --nproc-per-node 2 tests/distributed_checks.py --device cuda --out r.json
    torchrun --standalone --nproc-per-node 4 tests/distributed_checks.py --suite 2d --device cuda --out r.json

Each rank appends its results to OUT.rankN.jsonl as it goes, so a world that dies (a hung
collective ends after --timeout) still leaves what ran; rank 0 merges them into OUT (JSON:
environment + per check, per rank) and OUT with .md (a table). `--merge` redoes that step alone.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import distributed_checks_2d
import distributed_checks_deepspeed
import distributed_checks_fsdp
import distributed_checks_pp
import distributed_checks_tp
import distributed_common as common

# suite: (world size, checks)
SUITES = {
    "main": (
        2,
        {**distributed_checks_fsdp.CHECKS, **distributed_checks_tp.CHECKS, **distributed_checks_pp.CHECKS},
    ),
    "deepspeed": (2, distributed_checks_deepspeed.CHECKS),
    "2d": (4, distributed_checks_2d.CHECKS),
}
CHECKS = SUITES["main"][1]
WORLD = 2  # this process's suite's world and checks: set by select()


def select(suite: str) -> None:
    global WORLD, CHECKS
    WORLD, CHECKS = SUITES[suite]


# --- in each rank --------------------------------------------------------------------------------


def rank_file(out: str, rank: int) -> Path:
    return Path(f"{out}.rank{rank}.jsonl")


def run_checks(rank: int, world: int, names: list[str], out: str) -> None:
    ctx = {"rank": rank, "world": world}
    path = rank_file(out, rank)
    path.unlink(missing_ok=True)
    for i, name in enumerate(names):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            result = {"ok": True, **(CHECKS[name](ctx) or {})}
        except Exception as exc:  # a failed check is reported, the others still run
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        result["cpu_s"] = round(time.process_time() - cpu, 2)
        result["wall_s"] = round(time.perf_counter() - start, 2)
        with path.open("a") as f:
            f.write(json.dumps({"check": name, **result}) + "\n")
        if rank == 0:
            status = "ok" if result["ok"] else "FAIL " + result["error"][:60]
            print(f"[{i + 1:2d}/{len(names)}] {name:38s} {result['wall_s']:6.1f} s  {status}", flush=True)
        dist.barrier()


def init_world(timeout_s: float) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    if common.DEVICE.type == "cpu":
        dist.init_process_group("gloo", timeout=timeout)
        return
    if not dist.is_nccl_available():
        raise RuntimeError("--device cuda: this torch build has no NCCL")
    # NCCL for CUDA tensors, gloo for CPU ones: FSDP2's CPUOffloadPolicy keeps the sharded
    # parameters on the CPU, and gathering them for the comparison is a CPU collective.
    dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)


def environment(args) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    launcher = f"torchrun --nproc-per-node {WORLD}" if under_torchrun else Path(sys.executable).name

    env = {
        "command": " ".join([launcher, *sys.argv]),
        "suite": args.suite,
        "device": torch.cuda.get_device_name(common.DEVICE) if common.DEVICE.type == "cuda" else "cpu",
        "world": WORLD,
        "process_group": "gloo" if common.DEVICE.type == "cpu" else "cpu:gloo,cuda:nccl",
        "backend": common.BACKEND,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if common.DEVICE.type == "cuda" else None,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    for pkg in ("transformers", "triton", "accelerate", "deepspeed"):
        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            env[pkg] = None
    try:  # the copy run may not be a git checkout
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
        env["lmkernels_commit"] = rev.stdout.strip() or None
    except OSError:
        env["lmkernels_commit"] = None
    for var in (
        "TRITON_INTERPRET",
        "NCCL_NVLS_ENABLE",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST",
        "NVSHMEM_DISABLE_NVLS",
    ):
        env[var] = os.environ.get(var)
    return env


def main_in_rank(args, names: list[str]) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != WORLD:
        raise SystemExit(f"the checks need a world of {WORLD} processes, got WORLD_SIZE={world}")
    # A rank that dies of a signal (one CI run lost rank 0 to a SIGSEGV that never came back)
    # prints its Python stack to stderr, which test_distributed shows.
    faulthandler.enable()
    common.configure(args.device, args.backend)
    if common.DEVICE.type == "cpu":
        # one core's worth of threads per rank: 4 ranks on 2 cores would otherwise fight
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_world(args.timeout)
    try:
        if rank == 0:
            Path(f"{args.out}.env.json").write_text(json.dumps(environment(args), indent=1))
        run_checks(rank, world, names, args.out)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        merge(args.out, names)


def _worker(rank: int, port: int, args, names: list[str]) -> None:
    select(args.suite)  # a spawned process imports this module afresh
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD),
    )
    main_in_rank(args, names)


# --- results -------------------------------------------------------------------------------------


def merge(out: str, names: list[str]) -> dict:
    """OUT (JSON) and its .md from the rank files; a check a rank has no line for is reported as
    not run (the world died before it: see the log)."""
    env_path = Path(f"{out}.env.json")
    env = json.loads(env_path.read_text()) if env_path.exists() else {}
    per_rank = []
    for r in range(WORLD):
        path = rank_file(out, r)
        lines = path.read_text().splitlines() if path.exists() else []
        per_rank.append({(d := json.loads(line)).pop("check"): d for line in lines if line.strip()})
    missing = {"ok": False, "error": "not run: the world ended before this check (see the log)"}
    checks = {n: [rank.get(n, missing) for rank in per_rank] for n in names}
    merged = {"environment": env, "checks": checks}
    Path(out).write_text(json.dumps(merged, indent=1))
    Path(out).with_suffix(".md").write_text(markdown(merged))
    return merged


def _fmt(x) -> str:
    return f"{x:.1e}" if isinstance(x, float) else "-"


def markdown(merged: dict) -> str:
    env, checks = merged["environment"], merged["checks"]
    passed = sum(all(r["ok"] for r in rs) for rs in checks.values())
    lines = [
        f"# Distributed checks: {passed} of {len(checks)} pass",
        "",
        f"{env.get('world', WORLD)} x {env.get('device', '?')}, process group {env.get('process_group')}, "
        f"backend `{env.get('backend')}`; torch {env.get('torch')}, triton {env.get('triton')}, "
        f"transformers {env.get('transformers')}, NCCL {env.get('nccl')}; lmkernels {env.get('lmkernels_commit')}",
        "",
        f"`{env.get('command')}`",
        "",
        "Errors relative to plain transformers, fp32, one process (worst rank): loss, parameters vs",
        "their norm, parameters vs their training update (limits in tests/distributed_common.py).",
        "",
        "Other: the largest other error a check returns (single ops, the vocab-parallel loss).",
        "",
        "| check | result | loss | params | params/update | other | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, ranks in checks.items():
        ok = all(r["ok"] for r in ranks)
        bad = next((r for r in ranks if not r["ok"]), {})
        result = "ok" if ok else "FAIL: " + bad.get("error", "").replace("|", "/").replace("\n", " ")[:120]
        worst = {
            k: max((r[k] for r in ranks if isinstance(r.get(k), float)), default=None)
            for k in ("loss_rel_err", "param_rel_err", "param_update_rel_err")
        }
        other = [
            v
            for r in ranks
            for k, v in r.items()
            if isinstance(v, float) and k not in (*worst, "cpu_s", "wall_s") and not k.startswith("plain")
        ]
        wall = max((r.get("wall_s", 0.0) for r in ranks), default=0.0)
        lines.append(
            f"| {name} | {result} | {_fmt(worst['loss_rel_err'])} | {_fmt(worst['param_rel_err'])} | "
            f"{_fmt(worst['param_update_rel_err'])} | {_fmt(max(other, default=None))} | {wall:.1f} |"
        )
    return "\n".join(lines) + "\n"


def run_world(suite: str, out: Path, timeout: float = 900) -> dict:
    """Run a suite's world in a fresh interpreter (the tests' entry point): {check: [per rank]}.
    Fails the calling test with the world's stderr if it dies."""
    import pytest

    env = dict(os.environ)
    src = str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a world of our own, even when pytest itself runs under torchrun
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--suite",
        suite,
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not Path(out).exists():
        pytest.fail(f"the {suite} world failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(Path(out).read_text())["checks"]


def assert_check(results: dict, name: str, world: int) -> None:
    """Fail (with the rank's error and trace) or skip (with the reason) one check's test."""
    import pytest

    per_rank = results[name]
    assert len(per_rank) == world
    for rank, result in enumerate(per_rank):
        assert result["ok"], f"rank {rank}: {result['error']}\n{result.get('trace', '')}"
    skipped = {result.get("skipped") for result in per_rank}
    if skipped != {None}:
        pytest.skip(f"not run here: {' / '.join(sorted(map(str, skipped)))}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file for the results (a .md beside it)")
    p.add_argument("--suite", choices=sorted(SUITES), default="main", help="which world of checks")
    p.add_argument("--checks", help="comma-separated subset of the suite's checks (default: all)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu")
    p.add_argument(
        "--backend", help="the patched models' backend spec (default: eager on cpu, triton on cuda)"
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before a hung collective ends the world"
    )
    p.add_argument(
        "--merge", action="store_true", help="only merge the rank files of an earlier run into OUT"
    )
    args = p.parse_args(argv)
    select(args.suite)
    names = args.checks.split(",") if args.checks else list(CHECKS)
    unknown = set(names) - set(CHECKS)
    if unknown:
        p.error(f"--checks: unknown {sorted(unknown)} in suite {args.suite}; known: {sorted(CHECKS)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not args.merge:
        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA device")
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            p.error("--device cuda runs the compiled Triton kernels: unset TRITON_INTERPRET")
    if args.merge:
        results = merge(args.out, names)
    elif "RANK" in os.environ:  # under torchrun
        main_in_rank(args, names)
        if os.environ["RANK"] != "0":
            return 0
        results = json.loads(Path(args.out).read_text())
    else:
        import torch.multiprocessing as mp

        if args.device == "cpu":
            # CPU ranks run Triton only on its interpreter, even where a GPU and an explicit
            # TRITON_INTERPRET=0 are: compiled kernels cannot take their CPU tensors (the
            # checks pick their Triton paths by triton_unavailable_reason). Inherited by the
            # spawned ranks.
            os.environ["TRITON_INTERPRET"] = "1"
        mp.spawn(_worker, args=(free_port(), args, names), nprocs=WORLD)
        results = json.loads(Path(args.out).read_text())
    failed = [n for n, rs in results["checks"].items() if not all(r["ok"] for r in rs)]
    print(
        f"{len(results['checks']) - len(failed)} of {len(results['checks'])} checks pass"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
