"""Scaling benchmark: every distributed wrapping on 1, 2 and 4 GPUs, plain vs lmkernels vs Liger.

    python benchmarks/dist_scale.py --out DIR [--gpus 1,2,4] [--modes ...] [--configs plain,lmk,liger]
    python benchmarks/dist_scale.py --out DIR --dry-run        # the runs and their commands, nothing run
    python benchmarks/dist_scale.py --out DIR --tiny --gpus 2  # a tiny model on the CPU (gloo): checks the script

(not under torchrun: it launches `torchrun --nproc-per-node N` once per (GPU count, mode,
config), since patches are process-wide). Model: transformers LlamaForCausalLM at the
Llama-3.2-1B shape (hidden 2048, intermediate 8192, 32/8 heads, vocab 128256) with --layers
layers (8) and untied embeddings, random init, same seed everywhere; AdamW (lr 3e-4) over
lmkernels.distributed.foreach_safe_param_groups; random token batches (labels = inputs), the same
batches for every config of a (GPU count, mode). bf16 compute everywhere on CUDA: FSDP2's
MixedPrecisionPolicy(param bf16, reduce fp32) over fp32 parameters; DeepSpeed's bf16 mode; bf16
weights under tensor parallel alone (as `from_pretrained(dtype=bfloat16)`); autocast under
pipeline parallel.

Modes (N = GPUs of the run; --batch B sequences of --seq S tokens per data-parallel replica):
  fsdp           fully_shard per decoder layer + root; each rank B sequences           N >= 1
  fsdp_lm_head   the same plus embeddings and lm_head sharded on their own              N >= 1
  tp             tensor parallel over the N GPUs: transformers' tp plan
                 (DistributedConfig(tp_size=N)); the N GPUs share B sequences            N >= 2
  fsdp_tp_hf     2-D, tp 2 x dp N/2: transformers' DistributedConfig(tp_size=2,
                 fsdp_size=N/2) (its tp plan, its fully_shard plan); B per tp group      N >= 4, even
  fsdp_tp_torch  2-D, tp 2 x dp N/2: torch's parallel styles with sequence parallel
                 (lmkernels.distributed.plans.sequence_parallel_plan) + fully_shard on
                 dp per layer, lm_head alone, root; B per tp group                      N >= 4, even
  zero2, zero3   DeepSpeed ZeRO-2 / ZeRO-3 (deepspeed.initialize, bf16); B per rank     N >= 1
  pp             pipeline parallel (torch.distributed.pipelining, 1F1B), N stages of
                 layers/N decoder layers, B sequences in 2N microbatches per step;
                 the last stage's loss: plain lm_head + cross entropy, lmkernels'
                 fused op (lmkernels.integrations.lm_head_loss.causal_lm_loss), Liger's
                 LigerFusedLinearCrossEntropyLoss                                        N >= 2
Configs (--configs): plain (transformers), lmk[:BACKEND] (lmkernels.integrations.transformers,
backend auto or a spec with '/' for its commas: lmk:triton/flce=eager), liger
(apply_liger_kernel_to_llama). Where transformers applies the parallelism while loading (tp,
fsdp_tp_hf) the patch is the class patch (lk_hf.apply("llama") / apply_liger_kernel_to_llama())
applied before loading; elsewhere the model is patched before it is wrapped. A run that fails
records its error (Liger under DTensor layouts, say).

Per run (rank 0 writes it): the loss of every step (mean over data-parallel ranks), tokens/s/GPU
(tokens of all replicas per step / median step time after the first 2 steps / N), peak
torch.cuda.max_memory_allocated (max over ranks, GiB). The driver adds, per (N, mode): each
config's largest loss difference to plain's (relative), its tokens/s and peak ratios to plain and
to Liger, and for the 2-D modes the ratio to the same config's fsdp run at the same N. Outputs
in --out: dist_scale.json (environment: device, GPU count, versions, lmkernels commit, command;
then one row per run) and dist_scale.md (the table). --budget (s) skips runs past it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The distributed benchmark's model (Llama-3.2-1B's shape, untied embeddings, --layers layers),
# its tiny CPU variant and the NCCL settings of the lent machines.
from lmkernels.harness.bench.dist import MODEL as LLAMA_1B
from lmkernels.harness.bench.dist import NCCL_ENV, TINY

CONFIGS = ("plain", "lmk", "liger")
# mode: (minimum GPUs, the GPU count must be even, one-line description)
MODES = {
    "fsdp": (1, False, "FSDP2, fully_shard per decoder layer + root"),
    "fsdp_lm_head": (1, False, "FSDP2, + embeddings and lm_head alone"),
    "tp": (2, False, "tensor parallel over all GPUs, transformers' tp plan"),
    "fsdp_tp_hf": (4, True, "FSDP2 x TP (tp 2), transformers' DistributedConfig"),
    "fsdp_tp_torch": (4, True, "FSDP2 x TP (tp 2), torch styles + sequence parallel"),
    "zero2": (1, False, "DeepSpeed ZeRO-2"),
    "zero3": (1, False, "DeepSpeed ZeRO-3"),
    "pp": (2, False, "pipeline parallel (1F1B), one stage per GPU"),
}
TP_2D = 2
LR = 3e-4


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_config(name: str) -> tuple[str, str | None]:
    """Configuration name -> (kind, backend spec): "lmk:triton/flce=eager" -> ("lmk",
    "triton,flce=eager"); ValueError for an unknown name."""
    kind, _, backend = name.partition(":")
    if kind not in CONFIGS or (kind != "lmk" and backend):
        raise ValueError(f"unknown configuration {name!r}: plain, lmk[:BACKEND] or liger")
    return kind, backend.replace("/", ",") or None


def check_config(name: str) -> str | None:
    """Why configuration `name` cannot run (None: it can), before any torchrun starts."""
    try:
        kind, backend = parse_config(name)
    except ValueError as e:
        return str(e)
    if kind == "lmk" and backend:
        from lmkernels.registry import LMKernelsError, parse_backend_spec

        try:
            parse_backend_spec(backend, where=f"configuration {name!r}")
        except LMKernelsError as e:
            return str(e)
    return None


def missing_package(mode: str, config: str) -> str | None:
    """The package a run needs that is not installed here, if any."""
    from importlib.util import find_spec

    if mode.startswith("zero") and find_spec("deepspeed") is None:
        return "deepspeed is not installed"
    if config.startswith("liger") and find_spec("liger_kernel") is None:
        return "liger-kernel is not installed"
    return None


def mode_problem(mode: str, n: int, layers: int) -> str | None:
    """Why `mode` cannot run on n GPUs (None: it can)."""
    least, even, _ = MODES[mode]
    if n < least:
        return f"needs >= {least} GPUs"
    if even and n % TP_2D:
        return f"needs a multiple of {TP_2D} GPUs"
    if mode == "pp" and layers < n:
        return f"needs >= {n} layers for {n} stages"
    return None


def replicas(mode: str, n: int) -> int:
    """Data-parallel replicas of a mode on n GPUs (each takes --batch sequences per step)."""
    return {"tp": 1, "pp": 1, "fsdp_tp_hf": n // TP_2D, "fsdp_tp_torch": n // TP_2D}.get(mode, n)


def loss_collectives(args, n: int, mode: str, config: str) -> dict:
    """The vocab-parallel loss's collectives per step under tensor parallel (the model of
    lmkernels.distributed.vocab_parallel.communication, checked on the CPU by the distributed
    checks): their count and payload bytes per rank; {} for other runs."""
    tp = {"tp": n, "fsdp_tp_hf": TP_2D, "fsdp_tp_torch": TP_2D}.get(mode)
    if tp is None or not config.startswith("lmk"):
        return {}
    from lmkernels.distributed.vocab_parallel import communication

    cfg = TINY if args.tiny else LLAMA_1B
    ops = communication(args.batch * args.seq, cfg["hidden_size"], cfg["vocab_size"], tp)
    return {"loss_collectives": len(ops), "loss_collective_bytes": sum(b for _, _, b in ops)}


def slug(config: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in config)


# --- the worker: one (N, mode, config) under torchrun ---------------------------------------------


def model_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(**(TINY if args.tiny else LLAMA_1B), num_hidden_layers=args.layers)


def patch_instance(model, config: str):
    kind, backend = parse_config(config)
    if kind == "lmk":
        from lmkernels.integrations import transformers as lk_hf

        lk_hf.apply(model, backend=backend)
    elif kind == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model, cross_entropy=False, fused_linear_cross_entropy=True)
    return model


def patch_classes(config: str) -> None:
    """The class patch, for models that transformers parallelizes while loading them."""
    kind, backend = parse_config(config)
    if kind == "lmk":
        from lmkernels.integrations import transformers as lk_hf

        lk_hf.apply("llama", backend=backend)
    elif kind == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(cross_entropy=False, fused_linear_cross_entropy=True)


def new_model(args, device):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(model_config(args))


def checkpoint(args, device, rank: int, dtype) -> Path:
    """A saved random-init checkpoint (the same weights as new_model) for from_pretrained."""
    import torch
    import torch.distributed as dist

    path = Path(args.ckpt_dir) / f"{'tiny' if args.tiny else 'llama'}-{args.layers}l-{str(dtype)[6:]}"
    if rank == 0 and not (path / "config.json").exists():
        new_model(args, device).to(dtype).save_pretrained(path)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    return path


def mp_policy(device):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = torch.bfloat16 if device.type == "cuda" else torch.float32  # gloo on the CPU: fp32
    return MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)


def build_fsdp(args, device, lm_head_alone: bool):
    from torch.distributed.fsdp import fully_shard

    model = patch_instance(new_model(args, device), args.config)
    policy = mp_policy(device)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    if lm_head_alone:
        fully_shard(model.model.embed_tokens, mp_policy=policy)
        fully_shard(model.lm_head, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def build_hf_distributed(args, device, rank: int, tp: int, fsdp: int):
    import torch
    from transformers import AutoModelForCausalLM

    cuda = device.type == "cuda"
    # tp alone: bf16 weights; with FSDP2: fp32 weights, transformers' bf16 MixedPrecisionPolicy
    dtype = torch.bfloat16 if cuda and fsdp == 1 else torch.float32
    path = checkpoint(args, device, rank, dtype)
    patch_classes(args.config)
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers before DistributedConfig: TP alone through tp_plan
        if fsdp > 1:
            raise
        return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype)
    dc = DistributedConfig(tp_size=tp, fsdp_size=fsdp, fsdp_mixed_precision=cuda and fsdp > 1)
    return AutoModelForCausalLM.from_pretrained(path, distributed_config=dc, dtype=dtype)


def build_fsdp_tp_torch(args, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from lmkernels.distributed.plans import sequence_parallel_plan

    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh(device.type, (world // TP_2D, TP_2D), mesh_dim_names=("dp", "tp"))
    model = patch_instance(new_model(args, device), args.config)
    parallelize_module(model, mesh["tp"], sequence_parallel_plan(model))
    policy = mp_policy(device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model.lm_head, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    return model


def ds_config(args, stage: int, cuda: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": cuda},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def build_zero(args, device, stage: int):
    import deepspeed
    import torch

    if device.type == "cpu":  # the CPU run: skip DeepSpeed's shared-memory op build (~70 s of g++)
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    model = patch_instance(new_model(args, device), args.config)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, opt, *_ = deepspeed.initialize(
        model=model, optimizer=opt, config=ds_config(args, stage, device.type == "cuda")
    )
    return engine, opt


def _run_layers(layers, rotary_emb, h):
    import torch

    b, t = h.shape[:2]
    positions = torch.arange(t, device=h.device).unsqueeze(0).expand(b, -1)
    cos_sin = rotary_emb(h, position_ids=positions)
    for layer in layers:
        out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        h = out[0] if isinstance(out, tuple) else out
    return h


def build_pp(args, device, rank: int, world: int):
    """(schedule, this stage's module): stage k holds layers [k L/N, (k+1) L/N) (the last stage
    the rest too), stage 0 the embeddings, the last stage the final norm and lm_head."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    model = patch_instance(new_model(args, device), args.config)
    layers = model.model.layers
    per = len(layers) // world
    mine = nn.ModuleList(layers[rank * per : (rank + 1) * per if rank < world - 1 else len(layers)])
    first, last = rank == 0, rank == world - 1

    base, lm_head = model.model, model.lm_head

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers, self.rotary_emb = mine, base.rotary_emb
            self.embed_tokens = base.embed_tokens if first else None
            self.norm, self.lm_head = (base.norm, lm_head) if last else (None, None)

        def forward(self, x):
            h = self.embed_tokens(x) if first else x
            h = _run_layers(self.layers, self.rotary_emb, h)
            return self.norm(h) if last else h

    stage_mod = Stage()
    kind, backend = parse_config(args.config)

    def loss_fn(hidden, labels):  # every rank passes it: without one a schedule runs no backward
        w = stage_mod.lm_head.weight
        target = F.pad(labels, (0, 1), value=-100)[..., 1:]
        if kind == "lmk":
            from lmkernels.integrations.lm_head_loss import causal_lm_loss

            return causal_lm_loss(hidden, w, None, shift_labels=target, backend=backend)
        if kind == "liger":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            low = torch.bfloat16 if device.type == "cuda" else w.dtype  # what autocast gives a linear
            h = hidden.reshape(-1, w.shape[1]).to(low)
            return LigerFusedLinearCrossEntropyLoss()(w.to(low), h, target.reshape(-1))
        logits = stage_mod.lm_head(hidden).float()  # transformers' ForCausalLMLoss upcasts too
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    n_mb = 2 * world if args.batch % (2 * world) == 0 else world
    if args.batch % n_mb:
        raise ValueError(f"pp: --batch {args.batch} is not a multiple of {world} microbatches")
    stage = PipelineStage(stage_mod, stage_index=rank, num_stages=world, device=device)
    return Schedule1F1B(stage, n_microbatches=n_mb, loss_fn=loss_fn), stage_mod


def run_worker(args) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    mode = args.mode
    result = {"gpus": world, "mode": mode, "config": args.config, "status": "ok", "losses": []}
    try:
        from lmkernels.distributed import foreach_safe_param_groups

        n_rep = replicas(mode, world)
        # which replica this rank is (ranks of a tp group / a pipeline share one)
        replica = {"tp": 0, "pp": 0}.get(mode, rank // TP_2D if mode.startswith("fsdp_tp") else rank)
        engine = opt = sched = None
        if mode in ("zero2", "zero3"):
            engine, opt = build_zero(args, device, int(mode[-1]))
            model = engine
        elif mode == "pp":
            sched, model = build_pp(args, device, rank, world)
        elif mode == "tp":
            model = build_hf_distributed(args, device, rank, tp=world, fsdp=1)
        elif mode == "fsdp_tp_hf":
            model = build_hf_distributed(args, device, rank, tp=TP_2D, fsdp=world // TP_2D)
        elif mode == "fsdp_tp_torch":
            model = build_fsdp_tp_torch(args, device)
        else:
            model = build_fsdp(args, device, lm_head_alone=mode == "fsdp_lm_head")
        model.train()
        if opt is None:
            opt = torch.optim.AdamW(foreach_safe_param_groups(model.parameters()), lr=LR)
        vocab = model_config(args).vocab_size
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda and mode == "pp")
        times = []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for step in range(args.steps):
            # The same batches for every config: step s's global batch, this replica's rows.
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, vocab, (args.batch * n_rep, args.seq), generator=g)
            ids = ids.chunk(n_rep)[replica].to(device)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            if mode == "pp":
                mb_losses = []
                with autocast:
                    if rank == 0:
                        sched.step(ids)
                    else:
                        sched.step(target=ids, losses=mb_losses)
                opt.step()
                opt.zero_grad(set_to_none=True)
                loss = torch.stack(mb_losses).mean().detach() if mb_losses else torch.zeros((), device=device)
            else:
                kw = {}
                if mode == "fsdp_tp_torch":  # the embedding output is sequence-sharded (see plans.py)
                    kw["position_ids"] = torch.arange(args.seq, device=device).expand(ids.shape[0], -1)
                loss = model(input_ids=ids, labels=ids, **kw).loss
                if engine is not None:
                    engine.backward(loss)
                    engine.step()
                else:
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            loss = loss.detach().float().clone()
            dist.all_reduce(loss)
            # pp: only the last stage holds the loss; elsewhere every rank holds its replica's
            result["losses"].append(loss.item() if mode == "pp" else loss.item() / world)
            if rank == 0:
                log(f"  step {step:2d} loss {result['losses'][-1]:.4f} {times[-1] * 1e3:8.1f} ms")
        step_s = statistics.median(times[2:] if len(times) > 2 else times)
        result["step_ms"] = step_s * 1e3
        result["tokens_per_s_per_gpu"] = args.batch * n_rep * args.seq / step_s / world
        # Every rank's peak (the table shows the largest): under pipeline parallel the fused loss
        # lowers only the last stage's, so which rank holds the largest decides the ratio.
        own = torch.tensor([float(torch.cuda.max_memory_allocated() if cuda else 0)], device=device)
        peaks = [torch.zeros_like(own) for _ in range(world)]
        dist.all_gather(peaks, own)
        result["rank_peaks_gib"] = [round(p.item() / 2**30, 3) for p in peaks]
        result["peak_gib"] = max(result["rank_peaks_gib"])
    except Exception as exc:  # recorded: a peer that cannot run a wrapping is a result too
        import traceback

        result.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:400]}")
        log(f"rank {rank}: {result['error']}\n{traceback.format_exc()[-1500:]}")
    if rank == 0:
        Path(args.json).write_text(json.dumps(result))
    dist.destroy_process_group()


# --- the driver -----------------------------------------------------------------------------------


def environment(args) -> dict:
    import torch

    env = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "torch": torch.__version__}
    cuda = torch.cuda.is_available() and not args.tiny
    env["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    env["gpus_present"] = torch.cuda.device_count() if cuda else 0
    env["cuda"] = torch.version.cuda
    env["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("transformers", "accelerate", "deepspeed", "triton", "liger-kernel", "lmkernels"):
        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            env[pkg] = None
    env.update({k: os.environ.get(k) for k in NCCL_ENV})
    try:  # the lmkernels checkout measured
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        )
        commit = rev.stdout.strip()
        env["lmkernels_commit"] = commit + ("+dirty" if dirty.stdout.strip() else "") if commit else None
    except OSError:
        env["lmkernels_commit"] = None
    env["model"] = {"layers": args.layers, **(TINY if args.tiny else LLAMA_1B)}
    env["batch"], env["seq"], env["steps"] = args.batch, args.seq, args.steps
    return env


def command(args, n: int, mode: str, config: str, part: Path, ckpt_dir: str) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
    cmd += [str(Path(__file__).resolve()), "--worker", "--mode", mode, "--config", config]
    cmd += [
        "--json",
        str(part),
        "--ckpt-dir",
        ckpt_dir,
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
    ]
    cmd += ["--seq", str(args.seq), "--layers", str(args.layers)] + ["--tiny"] * args.tiny
    return cmd


def launch(cmd: list[str], args, n: int, mode: str, config: str, part: Path, timeout: float) -> dict:
    env = {**os.environ, **NCCL_ENV, "OMP_NUM_THREADS": "1" if args.tiny else "4"}
    if args.tiny:  # the CPU run: Triton kernels (lmk:triton...) on the interpreter
        env.setdefault("TRITON_INTERPRET", "1")
    row = {"gpus": n, "mode": mode, "config": config}
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {**row, "status": "timeout", "error": f"over {timeout:.0f} s"}
    if part.exists():
        return json.loads(part.read_text())
    return {**row, "status": "crashed", "error": proc.stderr[-600:]}


def compare_rows(rows: list[dict]) -> None:
    """Per (N, mode): each ok row's loss difference and ratios to plain / Liger; 2-D modes also
    against the same config's fsdp run at the same N."""
    ok = {(r["gpus"], r["mode"], r["config"]): r for r in rows if r.get("status") == "ok"}
    for (n, mode, config), r in ok.items():
        for peer in ("plain", "liger"):
            p = ok.get((n, mode, peer))
            if p is None or peer == config:
                continue
            r[f"tokens_vs_{peer}"] = r["tokens_per_s_per_gpu"] / p["tokens_per_s_per_gpu"]
            if p["peak_gib"]:
                r[f"peak_vs_{peer}"] = r["peak_gib"] / p["peak_gib"]
            if peer == "plain":
                r["max_loss_rel_diff_vs_plain"] = max(
                    abs(a - b) / abs(b) for a, b in zip(r["losses"], p["losses"])
                )
        f = ok.get((n, "fsdp", config))
        if mode.startswith("fsdp_tp") and f is not None:
            r["tokens_vs_fsdp"] = r["tokens_per_s_per_gpu"] / f["tokens_per_s_per_gpu"]
            if f["peak_gib"]:
                r["peak_vs_fsdp"] = r["peak_gib"] / f["peak_gib"]


def _x(v, fmt="{:.2f}x"):
    return fmt.format(v) if isinstance(v, float) else "-"


def summary(rows: list[dict], env: dict) -> str:
    lines = [
        f"# Scaling: {env.get('device')} ({env.get('gpus_present')} present), torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}, deepspeed {env.get('deepspeed')}, liger-kernel "
        f"{env.get('liger-kernel')}, lmkernels {env.get('lmkernels_commit')}",
        "",
        f"`{env.get('command')}`; {env.get('model', {}).get('layers')} layers, batch {env.get('batch')} x "
        f"seq {env.get('seq')} per replica, {env.get('steps')} steps",
        "",
        "| mode | GPUs | config | tokens/s/GPU | vs plain | vs Liger | vs FSDP2 | peak GiB | peak vs plain | "
        "max loss diff vs plain | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = r.get("status") == "ok"
        tok = f"{r['tokens_per_s_per_gpu']:,.0f}" if ok else "-"
        peak = f"{r['peak_gib']:.1f}" if ok else "-"
        status = r.get("status", "?") + (f": {r['error'][:90]}" if r.get("error") else "")
        lines.append(
            f"| {r['mode']} | {r['gpus']} | {r['config']} | {tok} | {_x(r.get('tokens_vs_plain'))} | "
            f"{_x(r.get('tokens_vs_liger'))} | {_x(r.get('tokens_vs_fsdp'))} | {peak} | "
            f"{_x(r.get('peak_vs_plain'))} | {_x(r.get('max_loss_rel_diff_vs_plain'), '{:.1e}')} | "
            f"{status.replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="output folder (driver)")
    p.add_argument("--gpus", default="1,2,4", help="GPU counts, comma-separated")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--configs", default=",".join(CONFIGS), help="plain, lmk[:BACKEND], liger")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8, help="sequences per data-parallel replica per step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--budget", type=float, default=3600.0, help="seconds; later runs are skipped")
    p.add_argument("--tiny", action="store_true", help="hidden-64 vocab-1000 model on the CPU (gloo)")
    p.add_argument("--dry-run", action="store_true", help="write the planned runs and commands, run nothing")
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
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    gpus = [int(n) for n in args.gpus.split(",")]
    for config in configs:
        problem = check_config(config)
        if problem:
            log(f"--configs: {problem}")
            return 2
    unknown = set(modes) - set(MODES)
    if unknown:
        log(f"--modes: unknown {sorted(unknown)}; known: {', '.join(MODES)}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args)
    deadline = time.monotonic() + args.budget
    rows: list[dict] = []

    def save():  # after every run too: a driver stopped by a time limit keeps what it measured
        compare_rows(rows)
        (out / "dist_scale.json").write_text(json.dumps({"environment": env, "runs": rows}, indent=1))
        (out / "dist_scale.md").write_text(summary(rows, env))

    with tempfile.TemporaryDirectory(prefix="lmk-scale-") as tmp:
        for n in gpus:
            for mode in modes:
                problem = mode_problem(mode, n, args.layers)
                for config in configs:
                    row = {"gpus": n, "mode": mode, "config": config}
                    why_not = problem or missing_package(mode, config)
                    if why_not:
                        rows.append({**row, "status": "n/a", "error": why_not})
                        continue
                    part = Path(tmp) / f"{n}-{mode}-{slug(config)}.json"
                    cmd = command(args, n, mode, config, part, tmp)
                    if args.dry_run:
                        rows.append({**row, "status": "planned", "command": " ".join(cmd)})
                        continue
                    left = deadline - time.monotonic()
                    if left < 20:
                        rows.append({**row, "status": "skipped", "error": "budget"})
                        continue
                    log(f"{n} GPUs / {mode} / {config} ({left:.0f} s of budget left)")
                    start = time.monotonic()
                    row = launch(cmd, args, n, mode, config, part, left + 30)
                    row["wall_s"] = round(time.monotonic() - start, 1)
                    row.update(loss_collectives(args, n, mode, config))
                    log(f"  -> {row['status']} {row.get('error', '')[:100]}")
                    rows.append(row)
                    save()
    save()
    print(summary(rows, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
