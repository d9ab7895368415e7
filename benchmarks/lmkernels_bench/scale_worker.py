"""One run of the distributed benchmark (scale.py) under torchrun: the model built under one
distributed wrapping (the modes of scale.py's docstring), patched by one configuration, trained
for --steps steps; rank 0 writes the row. The driver launches it (`-m
lmkernels_bench.scale --worker`); the wrappings, the configurations and the constants
both sides share live here.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from lmkernels_bench.e2e_setup import LLAMA_1B as E2E_LLAMA_1B
from lmkernels_bench.e2e_setup import TINY_SIZES

# The Llama-3.2-1B shape of the single-GPU benchmark, with untied embeddings (so lm_head can be
# sharded on its own) and the layer count from --layers; its tiny variant checks the code on the CPU.
LLAMA_1B: dict[str, Any] = {k: v for k, v in E2E_LLAMA_1B.items() if k != "num_hidden_layers"} | {
    "tie_word_embeddings": False
}
TINY: dict[str, Any] = LLAMA_1B | TINY_SIZES
# Multicast over NVLink is unavailable on the lent machines (see the device notes).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

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
    "titan_fsdp": (1, False, "torchtitan's trainer and Llama-3 1B, FSDP2"),
    "titan_tp": (2, True, "torchtitan, TP 2 (x FSDP2 over the rest)"),
    "titan_pp": (2, True, "torchtitan, PP 2 stages (x FSDP2 over the rest)"),
}
TP_2D = 2
LR = 3e-4
WARMUP_STEPS = 2  # not timed


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_config(name: str) -> tuple[str, str | None]:
    """Configuration name -> (kind, backend spec): "lmk:triton/flce=eager" -> ("lmk",
    "triton,flce=eager"); ValueError for an unknown name."""
    kind, _, backend = name.partition(":")
    if kind not in CONFIGS or (kind != "lmk" and backend):
        raise ValueError(f"unknown configuration {name!r}: plain, lmk[:BACKEND] or liger")
    return kind, backend.replace("/", ",") or None


def replicas(mode: str, n: int) -> int:
    """Data-parallel replicas of a mode on n GPUs (each takes --batch sequences per step)."""
    halves = {"fsdp_tp_hf", "fsdp_tp_torch", "titan_tp", "titan_pp"}
    return 1 if mode in ("tp", "pp") else n // TP_2D if mode in halves else n


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
        comm: Any = sys.modules["deepspeed.comm.torch"]
        comm.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    model = patch_instance(new_model(args, device), args.config)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, opt, *_ = deepspeed.initialize(
        model=model, optimizer=opt, config=ds_config(args, stage, device.type == "cuda")
    )
    return engine, opt


def build_pp(args, device, rank: int, world: int):
    """(schedule, this stage's module): lmkernels.distributed.pipeline.DecoderStage, the loss of
    the config on the last stage."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from lmkernels.distributed.pipeline import DecoderStage

    model = patch_instance(new_model(args, device), args.config)
    stage_mod = DecoderStage(model, rank, world)
    kind, backend = parse_config(args.config)

    def loss_fn(hidden, labels):  # every rank passes it: without one a schedule runs no backward
        head: Any = stage_mod.lm_head  # (the last stage's: only it calls the loss)
        w = head.weight
        target = F.pad(labels, (0, 1), value=-100)[..., 1:]
        if kind == "lmk":
            from lmkernels.integrations.lm_head_loss import causal_lm_loss

            return causal_lm_loss(hidden, w, None, shift_labels=target, backend=backend)
        if kind == "liger":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            low = torch.bfloat16 if device.type == "cuda" else w.dtype  # what autocast gives a linear
            h = hidden.reshape(-1, w.shape[1]).to(low)
            return LigerFusedLinearCrossEntropyLoss()(w.to(low), h, target.reshape(-1))
        logits = head(hidden).float()  # transformers' ForCausalLMLoss upcasts too
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    n_mb = 2 * world if args.batch % (2 * world) == 0 else world
    if args.batch % n_mb:
        raise ValueError(f"pp: --batch {args.batch} is not a multiple of {world} microbatches")
    # The other stages' layers are this rank's garbage. A patched model (lmkernels' or Liger's)
    # binds forward methods to its modules, reference cycles that only Python's cycle collector
    # frees: without this, each rank would hold the whole model's parameters (+3 GiB measured on
    # the middle stages of 4).
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    stage = PipelineStage(stage_mod, stage_index=rank, num_stages=world, device=device)
    return Schedule1F1B(stage, n_microbatches=n_mb, loss_fn=loss_fn), stage_mod


def train(args, result: dict, device, rank: int, world: int) -> None:
    """The transformers model under args.mode, trained args.steps steps; fills `result`."""
    import torch
    import torch.distributed as dist

    from lmkernels.distributed import foreach_safe_param_groups
    from lmkernels.distributed.pipeline import schedule_step

    cuda = device.type == "cuda"
    mode = args.mode
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
    times, warmup_peak = [], 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        # The same batches for every config: step s's global batch, this replica's rows.
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (args.batch * n_rep, args.seq), generator=g)
        ids = ids.chunk(n_rep)[replica].to(device)
        if cuda:
            torch.cuda.synchronize()
            if step == WARMUP_STEPS:  # the peak of the timed steps, as the one-GPU benchmark's
                warmup_peak = torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        if mode == "pp":
            with autocast:
                mb_losses = schedule_step(sched, ids, first=rank == 0)
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
    step_s = statistics.median(times[WARMUP_STEPS:] if len(times) > WARMUP_STEPS else times)
    result["step_ms"] = step_s * 1e3
    result["tokens_per_s_per_gpu"] = args.batch * n_rep * args.seq / step_s / world
    timed_peak = torch.cuda.max_memory_allocated() if cuda else 0
    record_peaks(result, timed_peak, max(timed_peak, warmup_peak), device)


def record_peaks(result: dict, timed: float, every_step: float, device) -> None:
    """Every rank's peak allocated bytes over the timed steps (`rank_peaks_gib`, the largest:
    `peak_gib`) and over all steps, the warmup's first optimizer step included
    (`peak_all_steps_gib`). Under pipeline parallel the fused loss lowers only the last stage's
    peak, so which rank holds the largest decides the ratio."""
    import torch
    import torch.distributed as dist

    own = torch.tensor([float(timed), float(every_step)], device=device)
    peaks = [torch.zeros_like(own) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, own)
    result["rank_peaks_gib"] = [round(p[0].item() / 2**30, 3) for p in peaks]
    result["peak_gib"] = max(result["rank_peaks_gib"])
    result["peak_all_steps_gib"] = round(max(p[1].item() for p in peaks) / 2**30, 3)


def run_worker(args, train_fn) -> None:
    """Under torchrun: the process group, then train_fn(args, result, device, rank, world) (this
    module's train, or scale_titan's run_titan), its error recorded as the row; rank 0 writes
    the row, or a rank that failed, which then ends the job."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    result = {"gpus": world, "mode": args.mode, "config": args.config, "status": "ok", "losses": []}
    try:
        train_fn(args, result, device, rank, world)
    except Exception as exc:  # recorded: a peer that cannot run a wrapping is a result too
        import traceback

        result.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:400]}")
        log(f"rank {rank}: {result['error']}\n{traceback.format_exc()[-1500:]}")
        if world > 1:
            # The other ranks may wait for this one in a collective until the run's timeout:
            # write the row and end the job now (torchrun stops the other ranks).
            _write_row(args.json, result)
            os._exit(1)
    if rank == 0:
        _write_row(args.json, result)
    dist.destroy_process_group()


def _write_row(path: str, result: dict) -> None:
    """The run's row. An error row is written by the first rank that fails (the others may fail
    only because it ended: "connection closed by peer"); the driver reads it once all have exited."""
    try:
        with open(path, "x" if result["status"] == "error" else "w") as f:
            f.write(json.dumps(result))
    except FileExistsError:
        pass
