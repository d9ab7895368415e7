"""Distributed training benchmark on 2 GPUs: FSDP2 and tensor parallel, plain vs lmkernels vs Liger.

    python benchmarks/dist_train.py --out DIR [--steps 12] [--batch 8] [--seq 1024] [--tiny]

(not under torchrun: it launches `torchrun --nproc-per-node 2` once per (mode, config), since
patches are process-wide). Model: transformers LlamaForCausalLM, hidden 2048, intermediate 8192,
32/8 heads, vocab 128256, 8 layers (--layers), untied embeddings (so lm_head can be sharded on
its own), random init, same seed everywhere; AdamW; random token batches (labels = inputs),
the same batches for every config.

Modes:
  fsdp          fully_shard per decoder layer + root; fp32 params, MixedPrecisionPolicy(param bf16,
                reduce fp32); each rank its own batch
  fsdp_lm_head  the same plus fully_shard(model.lm_head) (and the embeddings) on their own
  tp            from_pretrained(tp_plan="auto") of a bf16 checkpoint (q/k/v/gate/up colwise, o/down
                rowwise, lm_head vocab-sharded); both ranks the same batch
Configs (--configs, comma-separated; the names of e2e_setup.py): plain (transformers),
lmk[:BACKEND] (lmkernels.integrations.transformers.apply, backend auto or BACKEND, a backend spec
with '/' for its commas: lmk:triton/flce=eager), liger (apply_liger_kernel_to_llama(model=...)),
then optionally -noflce (the patch without the fused loss); +compile is not supported here.
A config that fails records its error.

Per run: the loss of every step (mean over ranks), tokens/s/GPU over the steps after the first
2 (tokens per rank per step / median step time; under tp a batch is shared by 2 GPUs), peak
torch.cuda.max_memory_allocated (max over ranks). Outputs in --out: dist.json (with device,
versions, command), summary.md, dist_loss.png. --budget (s) stops launching runs past it.
`--tiny` runs a 2-layer, hidden-64 model on the CPU with gloo, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lmkernels.harness.bench import e2e_setup
from lmkernels.harness.bench.dist_report import MODES, plot, summary
from lmkernels.harness.bench.e2e_setup import LLAMA_1B, TINY_SIZES

CONFIGS = ("plain", "lmk", "liger")
# The Llama-3.2-1B shape of the single-GPU benchmark, with untied embeddings (so lm_head can be
# sharded on its own) and the layer count from --layers.
MODEL = {k: v for k, v in LLAMA_1B.items() if k != "num_hidden_layers"} | {"tie_word_embeddings": False}
TINY = MODEL | TINY_SIZES
# Multicast over NVLink is unavailable on the lent machines (see the device notes).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- the worker: one (mode, config) under torchrun ------------------------------------------------


def model_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(**(TINY if args.tiny else MODEL), num_hidden_layers=2 if args.tiny else args.layers)


def check_config(name: str) -> str | None:
    """Why configuration `name` cannot run here (None: it can): a typo in the name or in an lmk
    backend spec is caught before any torchrun starts."""
    try:
        kind, backend, _, compiled = e2e_setup.parse_config(name)
    except ValueError as e:
        return str(e)
    if compiled:
        return f"{name}: +compile is not supported by the distributed benchmark (compiling FSDP2 / TP models is its own study)"
    if kind == "lmk" and backend:
        from lmkernels.registry import LMKernelsError, parse_backend_spec

        try:
            parse_backend_spec(backend, where=f"configuration {name!r}")
        except LMKernelsError as e:
            return str(e)
    return None


def slug(config: str) -> str:
    """A file-name-safe form of a configuration name (they may hold ':', '/' and '=')."""
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in config)


def build_fsdp(args, device, lm_head_alone: bool):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(model_config(args))
    e2e_setup.patch(model, args.config)
    if args.ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    bf16 = torch.bfloat16 if device.type == "cuda" else torch.float32  # gloo on the CPU: fp32
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    if lm_head_alone:
        fully_shard(model.model.embed_tokens, mp_policy=policy)
        fully_shard(model.lm_head, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def build_tp(args, device, rank: int):
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    path = Path(args.ckpt_dir) / ("tiny" if args.tiny else f"llama-{args.layers}l")
    if rank == 0 and not (path / "config.json").exists():
        torch.manual_seed(0)
        with torch.device(device):  # random init of ~1B parameters: on the GPU, not the host
            LlamaForCausalLM(model_config(args)).to(torch.bfloat16).save_pretrained(path)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype)
    e2e_setup.patch(model, args.config)
    if args.ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def run_worker(args) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    result = {"mode": args.mode, "config": args.config, "status": "ok", "losses": []}
    try:
        if args.mode == "tp":
            model = build_tp(args, device, rank)
        else:
            model = build_fsdp(args, device, lm_head_alone=args.mode == "fsdp_lm_head")
        model.train()
        from lmkernels.distributed import foreach_safe_param_groups

        # torch's foreach path (CUDA's default) cannot mix DTensors and plain tensors in one
        # group, and tp leaves the norms and embeddings plain: one group per kind.
        opt = torch.optim.AdamW(foreach_safe_param_groups(model.parameters()), lr=3e-4)
        vocab = model.config.vocab_size
        times = []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for step in range(args.steps):
            # The same batches for every config; data parallel: each rank its own.
            seed = step * world + (0 if args.mode == "tp" else rank)
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            loss = loss.detach().float()
            dist.all_reduce(loss)
            result["losses"].append(loss.item() / world)
            if rank == 0:
                log(f"  step {step:2d} loss {result['losses'][-1]:.4f} {times[-1] * 1e3:7.1f} ms")
        step_s = statistics.median(times[2:] if len(times) > 2 else times)
        tokens = args.batch * args.seq / (world if args.mode == "tp" else 1)
        result["tokens_per_s_per_gpu"] = tokens / step_s
        result["step_ms"] = step_s * 1e3
        peak = torch.tensor(float(torch.cuda.max_memory_allocated() if cuda else 0), device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        result["peak_gib"] = peak.item() / 2**30
    except Exception as exc:  # recorded: a peer that cannot run this wrapping is a result too
        result.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:400]}")
        log(f"rank {rank}: {result['error']}")
    if rank == 0:
        Path(args.json).write_text(json.dumps(result))
    dist.destroy_process_group()


# --- the driver -----------------------------------------------------------------------------------


def environment(args, command: str) -> dict:
    import torch

    from lmkernels.harness.bench.data import commit

    env = {"command": command, "torch": torch.__version__}
    env["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu"
    env["gpus"] = args.nproc
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("transformers", "triton", "liger-kernel", "lmkernels"):
        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            env[pkg] = None
    env.update({k: os.environ.get(k) for k in NCCL_ENV})
    env["lmkernels_commit"] = commit()  # the lmkernels checkout measured
    return env


def launch(args, mode: str, config: str, part: Path, ckpt_dir: str, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
    cmd += [
        "-m",
        "lmkernels.harness.bench.dist",
        "--worker",
        "--mode",
        mode,
        "--config",
        config,
        "--json",
        str(part),
        "--ckpt-dir",
        ckpt_dir,
    ]
    cmd += [
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--layers",
        str(args.layers),
    ]
    cmd += ["--tiny"] * args.tiny + ["--ckpt"] * args.ckpt
    env = {**os.environ, **NCCL_ENV, "OMP_NUM_THREADS": "4"}
    if args.tiny:  # the CPU run: Triton kernels (lmk:triton...) on the interpreter
        env.setdefault("TRITON_INTERPRET", "1")
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "config": config, "status": "timeout", "error": f"over {timeout:.0f} s"}
    if part.exists():
        return json.loads(part.read_text())
    return {"mode": mode, "config": config, "status": "crashed", "error": proc.stderr[-600:]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="output folder (driver)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="plain, lmk[:BACKEND] (BACKEND a spec with '/' for ',': lmk:triton/flce=eager), liger; "
        "-noflce for the patch without the fused loss",
    )
    p.add_argument(
        "--nproc", type=int, default=2, help="processes (GPUs); 1 runs the FSDP2 wrappings on one GPU"
    )
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank (per TP group under tp)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ckpt", action="store_true", help="activation checkpointing (non-reentrant)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds; later runs are skipped")
    p.add_argument("--tiny", action="store_true", help="2-layer hidden-64 model on the CPU (gloo)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.worker and not args.out:
        p.error("--out is required")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for config in args.configs:
        problem = check_config(config)
        if problem:
            log(f"--configs: {problem}")
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", *sys.argv]) if argv is None else shlex.join(argv)
    env = environment(args, command)
    deadline = time.monotonic() + args.budget
    rows = []

    def save():  # after every run too: a driver stopped by a time limit keeps what it measured
        (out / "dist.json").write_text(json.dumps({"environment": env, "runs": rows}, indent=1))
        (out / "summary.md").write_text(summary(rows, env))

    with tempfile.TemporaryDirectory(prefix="lmk-dist-") as tmp:
        for mode in args.modes.split(","):
            for config in args.configs:
                left = deadline - time.monotonic()
                if left < 20:
                    rows.append({"mode": mode, "config": config, "status": "skipped", "error": "budget"})
                    continue
                log(f"{mode} / {config} ({left:.0f} s of budget left)")
                start = time.monotonic()
                row = launch(args, mode, config, Path(tmp) / f"{mode}-{slug(config)}.json", tmp, left + 30)
                row["wall_s"] = round(time.monotonic() - start, 1)
                log(f"  -> {row['status']} {row.get('error', '')[:100]}")
                rows.append(row)
                save()
    save()
    plot(rows, out / "dist_loss.png")
    print(summary(rows, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
