"""Pipeline parallel (torch.distributed.pipelining, used directly): a patched tiny Llama split in
2 stages, the last stage's loss through `lmkernels.fused_linear_cross_entropy` (no logits);
see distributed_checks.py. torchtitan's own pipeline integration lives elsewhere
(lmkernels.integrations.torchtitan); this checks the pattern it relies on.

Stage 0 (rank 0): embeddings + the first half of the decoder layers; stage 1 (rank 1): the other
layers, the final norm, and the loss of lm_head's weight on the hidden states. Each step takes
the whole global batch in 2 microbatches; the schedule averages the microbatches' gradients
(`scale_grads`), and every microbatch has the same number of labelled tokens, so a step equals
one process's step on the whole batch (the reference: plain transformers, fp32).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import distributed_common as common
from distributed_common import compare, global_batches, optimizer, params, patched, reference, registry, tiny
from lmkernels.distributed.pipeline import DecoderStage, schedule_step

CHECKS, check = registry()
MICROBATCHES = 2


def fused_causal_lm_loss(stage: DecoderStage, backend: str):
    """loss_fn(hidden, labels) of the last stage: transformers' causal-LM loss (labels shifted
    left, mean over labelled tokens) through the fused op."""
    import lmkernels

    def loss_fn(hidden, labels):
        target = F.pad(labels, (0, 1), value=-100)[..., 1:]
        w = stage.lm_head.weight
        return lmkernels.fused_linear_cross_entropy(
            hidden.reshape(-1, w.shape[1]), w, target.reshape(-1), backend=backend
        )

    return loss_fn


def pp_run(ctx, schedule_name: str):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, world = ctx["rank"], ctx["world"]
    assert world == 2, "the pipeline checks split the model in 2 stages"
    model = patched(tiny())
    stage_mod = DecoderStage(model, rank, world)
    stage = PipelineStage(stage_mod, stage_index=rank, num_stages=world, device=common.DEVICE)
    # Every rank passes loss_fn: a schedule without one runs no backward (stage 0 never calls it).
    loss_fn = fused_causal_lm_loss(stage_mod, common.BACKEND)
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    sched = schedule(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    opt = optimizer(stage_mod)
    losses = []
    for ids in global_batches(world):  # every step the whole global batch, in microbatches
        mb_losses = schedule_step(sched, ids, first=rank == 0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(torch.stack(mb_losses).mean().item() if mb_losses else None)
    box = [losses]
    dist.broadcast_object_list(box, src=world - 1)
    losses = box[0]
    mine = {id(p) for p in stage_mod.parameters()}
    names = {n for n, p in model.named_parameters() if id(p) in mine}
    final = {n: p for n, p in params(model).items() if n in names}
    ref_losses, ref_final, ref_init = reference(world)
    sub = (ref_losses, {n: ref_final[n] for n in names}, {n: ref_init[n] for n in names})
    return {"stage": rank, "n_params": len(names), **compare(losses, final, sub)}


@check
def check_pp_gpipe_fused_loss_last_stage(ctx):
    return pp_run(ctx, "gpipe")


@check
def check_pp_1f1b_fused_loss_last_stage(ctx):
    return pp_run(ctx, "1f1b")
