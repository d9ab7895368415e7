"""The torchtitan runs of the distributed benchmark (scale.py's titan_* modes): torchtitan's own
trainer (its config system, dataloader, activation checkpointing, parallelisms, CUDA graphs)
on its Llama-3 1B model, without and with lmkernels (lmkernels.integrations.torchtitan), under
torchrun; rank 0 writes the row.

The model is torchtitan's `model_registry("1B")` (16 layers, hidden 2048, vocab 128256), untied,
in the training setup of torchtitan's llama3 debug config (AdamW, warmup, selective
activation checkpointing, no torch.compile: torchtitan's defaults), with the pipeline schedule
left at torchtitan's default (1F1B). The text is generated here: a word-level tokenizer of 2048
words and documents of random words (the runs measure speed and memory; the loss only has to
match between the two runs). With --tiny the debug model runs instead (the CPU check in
tests/test_integration_torchtitan.py, which adds its CPU shims). `llama3_1b` is a torchtitan
config function:

    torchrun ... -m torchtitan.train --module lmkernels_bench.scale_titan --config llama3_1b
"""

from __future__ import annotations

import functools
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

# mode: (tensor parallel degree, pipeline parallel degree); data parallel (FSDP2) takes the rest
TITAN_LAYOUT = {"titan_fsdp": (1, 1), "titan_tp": (2, 1), "titan_pp": (1, 2)}
WORDS = 2048


def llama3_1b():
    """torchtitan's llama3 debug training config with the Llama-3 1B model, untied."""
    import torch
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry

    config = llama3_debug()
    config.model_spec = model_registry("1B")
    config.loss.loss_fn.global_vocab_size = decoder_vocab_size(config.model_spec)
    # Untied, as torchtitan's 8B (its pipeline parallel refuses tied weights): the embeddings
    # get their own initialization, and lm_head can be the last stage's alone.
    model = config.model_spec.model
    model.enable_weight_tying = False
    model.tok_embeddings.param_init = {"weight": functools.partial(torch.nn.init.normal_, std=1.0)}
    return config


def llama3_debug():
    """torchtitan's llama3 debug config (6 layers, vocab 2048: the CPU check of --tiny) with
    torchtitan's default pipeline schedule."""
    from torchtitan.models.llama3 import config_registry

    config = config_registry.llama3_debugmodel()
    config.parallelism.pipeline_parallel_schedule = "1F1B"
    return config


def older_torch_shims() -> list[str]:
    """What torchtitan 0.3 calls that an older torch (2.11-2.13) lacks, done with that torch's
    own parts; nothing changes where torch has them.
    - torch.distributed.set_timeout -> the process group's _set_pg_timeout.
    - torch.distributed.fsdp.DataParallelMeshDims, which torchtitan imports for its full_dtensor
      SPMD backend (these runs take partial_dtensor) -> a placeholder class.
    - FlexAttention's create_block_mask(separate_full_blocks=True): what an older torch's
      create_block_mask always does -> the keyword dropped (False is refused).
    - Pipeline schedules handed micro-batches already split (`step(arg_mbs=, kwarg_mbs=,
      target_mbs=)`): an older step() takes the whole batch and would pass the lists to the model
      as keyword arguments -> what step() does around the schedule's own _step_microbatches.
    - PipelineStage(get_mesh=): the callback that re-wraps a stage's incoming activations as
      DTensors (full_dtensor backend) -> dropped.
    Returns the names of those it applied."""
    import inspect

    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.nn.attention import flex_attention

    applied = []
    dist_module: Any = dist  # (the attributes below are this torch's missing ones)
    fsdp_module: Any = fsdp
    if not hasattr(dist, "set_timeout"):
        dist_module.set_timeout = dist.distributed_c10d._set_pg_timeout
        applied.append("set_timeout")
    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp_module.DataParallelMeshDims = type("DataParallelMeshDims", (), {})
        applied.append("DataParallelMeshDims")
    create = flex_attention.create_block_mask
    if "separate_full_blocks" not in inspect.signature(create, follow_wrapped=False).parameters:

        @functools.wraps(create)
        def create_block_mask(*args, separate_full_blocks: bool = True, **kwargs):
            if not separate_full_blocks:
                raise NotImplementedError("this torch's create_block_mask always separates full blocks")
            return create(*args, **kwargs)

        flex_attention.create_block_mask = create_block_mask
        applied.append("create_block_mask")
    init = PipelineStage.__init__
    if "get_mesh" not in inspect.signature(init, follow_wrapped=False).parameters:

        @functools.wraps(init)
        def stage_init(self, *args, get_mesh=None, **kwargs):
            init(self, *args, **kwargs)

        PipelineStage.__init__ = stage_init  # type: ignore[method-assign]  # (a compatibility patch)
        applied.append("PipelineStage(get_mesh)")
    if "arg_mbs" in inspect.signature(schedules.PipelineScheduleSingle.step, follow_wrapped=False).parameters:
        return applied
    applied.append("step(arg_mbs)")

    def premade_microbatches(step):
        def step_mbs(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, **kwargs):
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return step(self, *args, **kwargs)
            assert not args and not kwargs.pop("return_outputs", False), kwargs
            losses, loss_kwargs = kwargs.pop("losses", None), kwargs.pop("loss_kwargs", None)
            assert not kwargs, kwargs
            for stage in getattr(self, "_stages", None) or [self._stage]:
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(
                arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs=False, loss_kwargs=loss_kwargs
            )

        return step_mbs

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        cls.step = premade_microbatches(cls.step)  # type: ignore[method-assign]  # (a compatibility patch)
    return applied


def write_assets(root: Path, tokens: int, max_words: int = 1000, seed: int = 0) -> tuple[Path, Path]:
    """(tokenizer folder, dataset folder) under root: a word-level tokenizer of WORDS words and
    a c4_test-style JSON-lines file of documents (10 to max_words words: several per sequence,
    packed by torchtitan's dataloader, so its block-causal masks matter) of >= `tokens` words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok_dir, data_dir = root / "tokenizer", root / "text"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    )
    rng = random.Random(seed)
    with open(data_dir / "data.json", "w") as f:
        written = 0
        while written < tokens:
            n = rng.randrange(10, max_words)
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(3, WORDS)}" for _ in range(n))}) + "\n")
            written += n
    return tok_dir, data_dir


def titan_argv(
    args, mode: str, world: int, kind: str, tok_dir: Path, data_dir: Path, dump: Path
) -> list[str]:
    """torchtitan's command line of one run: its defaults, CUDA graphs included except under
    pipeline parallel, which torchtitan's config check refuses them."""
    tp, pp = TITAN_LAYOUT[mode]
    here, fn = "lmkernels_bench.scale_titan", "llama3_debug" if args.tiny else "llama3_1b"
    if kind == "lmk":
        argv = ["--module=lmkernels.integrations.torchtitan", f"--config={here}.{fn}"]
    else:
        argv = [f"--module={here}", f"--config={fn}"]
    argv += [
        f"--hf_assets_path={tok_dir}",
        f"--dataloader.dataset_path={data_dir}",
        f"--dump_folder={dump}",
        f"--training.steps={args.steps}",
        f"--training.seq_len={args.seq}",
        f"--training.local_batch_size={args.batch}",
        "--metrics.log_freq=1",
        "--debug.seed=42",  # the same initial weights in every run
        f"--parallelism.data_parallel_shard_degree={world // (tp * pp)}",
        f"--parallelism.tensor_parallel_degree={tp}",
        f"--parallelism.pipeline_parallel_degree={pp}",
        # torchtitan's default SPMD backend (spmd_types) needs a newer torch than 2.13 for FSDP2
        # (its TP run fails without lmkernels too); partial_dtensor is DTensor on TP/PP only.
        "--parallelism.spmd_backend=partial_dtensor",
    ]
    if pp > 1:
        argv.append("--training.disable_cuda_graphs")
    return argv


def run_titan(args, result: dict, device, rank: int, world: int) -> None:
    """Train under torchtitan; fill `result` (every rank) with the last rank's losses (a
    pipeline's last stage computes the loss), tokens/s/GPU and every rank's peak."""
    import torch
    import torch.distributed as dist

    from lmkernels_bench.scale_worker import WARMUP_STEPS, parse_config, record_peaks

    shims = older_torch_shims()
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    kind, backend = parse_config(args.config)
    if backend:
        os.environ["LMKERNELS_BACKEND"] = backend
    tp, pp = TITAN_LAYOUT[args.mode]
    dp = world // (tp * pp)
    root = Path(args.ckpt_dir) / "titan"
    tokens = 2 * args.steps * args.batch * args.seq * dp
    if rank == 0:
        write_assets(root, tokens)
    dist.barrier()
    init_logger()
    dump = root / f"dump-{args.mode}-{world}-{kind}"
    argv = titan_argv(args, args.mode, world, kind, root / "tokenizer", root / "text", dump)
    graphs = "--training.disable_cuda_graphs" not in argv
    result.update(torch_shims=shims, cuda_graphs=graphs)
    config = ConfigManager().parse_args(argv)
    result["layers"] = len(config.model_spec.model.layers)
    trainer = config.build()
    times, losses, peaks = [], [], []
    log = trainer.metrics_processor.log

    def record(step, global_avg_loss, *a, **k):  # after each step (log_freq 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())  # torchtitan resets it in log()
        times.append(time.perf_counter())
        losses.append(float(global_avg_loss))
        return log(step, global_avg_loss, *a, **k)

    trainer.metrics_processor.log = record
    trainer.train()
    trainer.close()
    # log() follows each step: the gaps from the end of the warmup steps time the others
    gaps = [b - a for a, b in zip(times[WARMUP_STEPS - 1 :], times[WARMUP_STEPS:])]
    step_s = statistics.median(gaps) if gaps else float("nan")
    every = [None] * world
    dist.all_gather_object(every, losses)
    result["losses"] = every[-1]  # the last stage's under pipeline parallel
    result["step_ms"] = step_s * 1e3
    result["tokens_per_s_per_gpu"] = args.batch * dp * args.seq / step_s / world
    result["layout"] = {"dp_shard": dp, "tp": tp, "pp": pp}
    record_peaks(result, *step_peaks(peaks, graphs, WARMUP_STEPS), device)


def step_peaks(peaks: list[int], graphs: bool, warmup: int) -> tuple[int, int]:
    """(the timed steps' peak, every step's) from each step's peak allocated bytes. A replayed
    CUDA graph's memory is reserved in its pool, not allocated anew: with graphs the capture's
    step (every step's peak) is the one that counts for the timed steps too."""
    every = max(peaks, default=0)
    return (every if graphs else max(peaks[warmup:], default=0)), every
