"""FSDP2 (every common wrapping) and DDP checks of a patched tiny Llama; see distributed_checks.py."""

from __future__ import annotations

import torch

import distributed_common as common
from distributed_common import (
    RTOL,
    UPDATE_RTOL,
    compare,
    device_mesh,
    errors,
    fsdp_run,
    global_batches,
    params,
    patched,
    reference,
    registry,
    tiny,
    train,
)

CHECKS, check = registry()


@check
def check_fsdp_layers_root(ctx):
    return fsdp_run(ctx)


@check
def check_fsdp_lm_head_alone(ctx):
    return fsdp_run(ctx, lm_head_alone=True)


@check
def check_fsdp_lm_head_alone_triton(ctx):
    from lmkernels.backends.triton import triton_unavailable_reason

    reason = triton_unavailable_reason()
    if reason:  # e.g. an interpreter too old for these kernels: test_distributed skips it
        return {"skipped": reason}
    return fsdp_run(ctx, lm_head_alone=True, backend="eager,flce=triton")


TRL_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")


def _trl_missing():
    try:
        import trl  # noqa: F401
    except ImportError:
        return {"skipped": "TRL is not installed"}
    return None


@check
def check_fsdp_trl_head_lm_head_alone(ctx):
    """TRL's fused LM head on lmkernels with lm_head sharded on its own (its FSDP forward method
    unshards it for the head's every output)."""
    return _trl_missing() or fsdp_run(ctx, lm_head_alone=True, trl_outputs=TRL_OUTPUTS)


@check
def check_fsdp_trl_head_layers_root(ctx):
    """The same with lm_head in the root unit (unsharded by the root's forward)."""
    return _trl_missing() or fsdp_run(ctx, trl_outputs=TRL_OUTPUTS)


@check
def check_fsdp_embed_and_lm_head_alone(ctx):
    return fsdp_run(ctx, lm_head_alone=True, embed_alone=True)


@check
def check_fsdp_tied_embeddings(ctx):
    return fsdp_run(ctx, model_kw={"tie_word_embeddings": True})


@check
def check_fsdp_checkpointing_non_reentrant(ctx):
    return fsdp_run(ctx, lm_head_alone=True, ckpt=False)


@check
def check_fsdp_checkpointing_reentrant(ctx):
    return fsdp_run(ctx, lm_head_alone=True, ckpt=True)


@check
def check_fsdp_cpu_offload(ctx):
    """FSDP2's CPUOffloadPolicy: sharded parameters and gradients on the CPU, copied to the device
    around each all-gather / reduce-scatter, the optimizer step on the CPU (pinned memory on
    CUDA, as users run it; the world has gloo beside NCCL for the CPU tensors)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    policy = CPUOffloadPolicy(pin_memory=common.DEVICE.type == "cuda")
    return fsdp_run(ctx, lm_head_alone=True, offload_policy=policy)


@check
def check_fsdp_no_reshard_after_forward(ctx):
    return fsdp_run(ctx, lm_head_alone=True, reshard_after_forward=False)


@check
def check_fsdp_mixed_precision(ctx):
    """bf16 params, fp32 gradient reduction: patched and plain under the same policy, each against
    the fp32 one-process run; each patched error must stay within 3x plain's + the fp32 limit
    (DESIGN.md's policy with the bf16 FLCE factor; measured on gloo: loss 4.2e-5 vs 2.2e-5,
    parameters 2.6e-3 for both). gloo runs the bf16 all-gathers and fp32 reduce-scatters FSDP2
    asks for."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref = reference(ctx["world"])
    errs = {}
    for name in ("plain", "patched"):
        model = tiny()
        if name == "patched":
            patched(model)
        mesh = device_mesh((ctx["world"],))  # on DEVICE, as in fsdp_run
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy, mesh=mesh)
        fully_shard(model.lm_head, mp_policy=policy, mesh=mesh)
        fully_shard(model, mp_policy=policy, mesh=mesh)
        losses = train(model, global_batches(ctx["world"]), ctx["rank"], ctx["world"])
        errs[name] = errors(losses, params(model), ref)
    floors = {"loss_rel_err": RTOL, "param_rel_err": RTOL, "param_update_rel_err": UPDATE_RTOL}
    for what, floor in floors.items():
        bound = 3 * errs["plain"][what] + floor
        assert errs["patched"][what] <= bound, (
            f"{what}: patched bf16 {errs['patched'][what]:.2e} > {bound:.2e} (plain bf16 "
            f"{errs['plain'][what]:.2e})"
        )
    return {**errs["patched"], **{f"plain_bf16_{k}": v for k, v in errs["plain"].items()}}


@check
def check_ddp(ctx):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(patched(tiny()))
    losses = train(model, global_batches(ctx["world"]), ctx["rank"], ctx["world"])
    final = {n.removeprefix("module."): p for n, p in params(model).items()}
    return compare(losses, final, reference(ctx["world"]))
