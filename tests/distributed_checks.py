"""Multi-process checks: a patched tiny Llama trains under FSDP2 / DDP / tensor parallel the same
as one process trains plain transformers on the whole batch, and the vocab-parallel FLCE equals
the one-device loss (checks in distributed_checks_fsdp.py and distributed_checks_tp.py, shared
pieces and tolerances in distributed_common.py).

Every check runs in each rank of one world (2 processes; gloo on the CPU, NCCL on GPUs) and
returns its measured errors or raises. tests/test_distributed.py runs them all in one world (the
process start-up is paid once); by hand:

    python tests/distributed_checks.py --out results.json              # spawns 2 processes (CPU)
    torchrun --standalone --nproc-per-node 2 tests/distributed_checks.py --out r.json   # any device
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import distributed_checks_fsdp
import distributed_checks_tp

CHECKS = {**distributed_checks_fsdp.CHECKS, **distributed_checks_tp.CHECKS}


# --- driver --------------------------------------------------------------------------------------


def run_checks(rank: int, world: int, names: list[str]) -> dict:
    ctx = {"rank": rank, "world": world}
    results = {}
    for name in names:
        start = time.process_time()
        try:
            results[name] = {"ok": True, **(CHECKS[name](ctx) or {})}
        except Exception as exc:  # a failed check is reported, the others still run
            results[name] = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc(),
            }
        results[name]["cpu_s"] = round(time.process_time() - start, 2)
        dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    return gathered


def _worker(rank: int, world: int, port: int, names: list[str], out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    _main_in_rank(names, out)


def _main_in_rank(names: list[str], out: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        gathered = run_checks(rank, world, names)
        if rank == 0:
            merged = {n: [r[n] for r in gathered] for n in names}
            with open(out, "w") as f:
                json.dump(merged, f, indent=1)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file for the results")
    p.add_argument("--checks", default=",".join(CHECKS), help="comma-separated subset")
    args = p.parse_args(argv)
    names = args.checks.split(",")
    unknown = set(names) - set(CHECKS)
    if unknown:
        p.error(f"--checks: unknown {sorted(unknown)}; known: {sorted(CHECKS)}")
    if "RANK" in os.environ:  # under torchrun
        _main_in_rank(names, args.out)
    else:
        import torch.multiprocessing as mp

        mp.spawn(_worker, args=(2, free_port(), names, args.out), nprocs=2)
    if "RANK" not in os.environ or os.environ["RANK"] == "0":
        with open(args.out) as f:
            results = json.load(f)
        for name, per_rank in results.items():
            status = "ok" if all(r["ok"] for r in per_rank) else "FAIL " + per_rank[0].get("error", "")[:60]
            cpu = sum(r["cpu_s"] for r in per_rank)
            print(f"{name:38s} {cpu:6.1f} s cpu  {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
