"""FSDP2 x tensor parallel on a 2-D mesh, dp 2 x tp 2 (suite "2d" of distributed_checks.py, 4
processes): ranks 2d and 2d+1 form a tp group and see the same rows, the dp groups split the
global batch. Reference and tolerances as every check (distributed_common.py).

- torch's parallel styles with sequence parallel (torchtitan's layout on a transformers Llama):
  the residual stream sharded on the sequence between blocks, the patched RMSNorms on the
  sequence-sharded activations (SequenceParallel), attention and MLP on the gathered sequence
  with q/k/v/gate/up colwise and o/down rowwise (reduce-scattered back to the sequence shard),
  lm_head colwise: the loss is the vocab-parallel FLCE on the tp group (the sequence-sharded final
  hidden gathered first); fully_shard on dp per layer, lm_head alone, root.
- transformers' own 2-D loading, `from_pretrained(distributed_config=DistributedConfig(tp_size=2,
  fsdp_size=2))` (transformers >= 5.2x): its tp_plan on tp, its fsdp_plan on dp (fully_shard per
  layer, embeddings, [final norm + lm_head] kept unsharded, root).
- what `from_pretrained(tp_plan="auto", device_mesh=<2-D mesh with a "tp" dim>)` does (the
  pre-DistributedConfig way), so a change in transformers shows up here.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import distributed_common as common
from distributed_common import (
    compare,
    device_mesh,
    global_batches,
    optimizer,
    params,
    patched,
    reference,
    registry,
    saved_tiny,
    tiny,
)

CHECKS, check = registry()
DP, TP = 2, 2


def _dp_rank(ctx) -> int:
    assert ctx["world"] == DP * TP, f"the 2-D checks need {DP * TP} processes, got {ctx['world']}"
    return ctx["rank"] // TP  # mesh (dp, tp) in row-major order


@contextlib.contextmanager
def _spy(module, name: str):
    """Count calls of module.name (a function the code under test looks up at call time)."""
    calls = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(module, name, spy)
    try:
        yield calls
    finally:
        setattr(module, name, original)


def train_2d(model, ctx, *, position_ids: bool = False):
    """SGD steps on this rank's dp slice; the loss of every step averaged over the world (the
    ranks of a tp group hold the same value)."""
    opt = optimizer(model)
    model.train()  # from_pretrained returns eval mode, where the patched forward runs the original
    dp = _dp_rank(ctx)
    losses = []
    for ids in global_batches(DP):
        ids = ids.chunk(DP)[dp]
        kw = {}
        if position_ids:  # the embedding output is sequence-sharded: give transformers full positions
            kw["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        loss = model(input_ids=ids, labels=ids, **kw).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().float().clone()
        dist.all_reduce(loss)
        losses.append((loss / ctx["world"]).item())
    return losses


def _sp_2d_model(patch: bool):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from lmkernels.distributed.plans import sequence_parallel_plan

    mesh = device_mesh((DP, TP), ("dp", "tp"))
    model = tiny()
    if patch:
        patched(model)
    parallelize_module(model, mesh["tp"], sequence_parallel_plan(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model.lm_head, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    w = model.lm_head.weight
    assert w.device_mesh.ndim == 2 and w.placements[1].is_shard(0), f"lm_head weight: {w.placements}"
    return model


@check
def check_2d_torch_styles_sequence_parallel(ctx):
    """lmkernels.distributed.plans.sequence_parallel_plan + fully_shard on dp; the plain model
    under the same plan (logits gathered over the vocabulary) is held to the same tolerances."""
    import lmkernels.distributed.dtensor_loss as dtensor_loss
    import lmkernels.distributed.local as local

    ref = reference(DP)
    plain = _sp_2d_model(patch=False)
    plain_err = compare(train_2d(plain, ctx, position_ids=True), params(plain), ref)
    model = _sp_2d_model(patch=True)
    with (
        _spy(dtensor_loss, "vocab_parallel_cross_entropy") as vp_calls,
        _spy(local, "local_call") as sp_calls,
    ):
        losses = train_2d(model, ctx, position_ids=True)
    steps = len(losses)
    assert len(vp_calls) == steps, f"the vocab-parallel loss ran {len(vp_calls)} times in {steps} steps"
    # 2 norms per layer + the final norm, each step, on sequence-sharded DTensors
    n_norms = 2 * len(model.model.layers) + 1
    assert len(sp_calls) >= n_norms * steps, f"{len(sp_calls)} local (sequence-sharded) op calls"
    return {
        "vocab_parallel_calls": len(vp_calls),
        "local_op_calls": len(sp_calls),
        **{f"plain_{k}": v for k, v in plain_err.items() if k.endswith("err")},
        **compare(losses, params(model), ref),
    }


@check
def check_2d_transformers_distributed_config(ctx):
    """transformers applies TP and FSDP2 while loading, so the patch must come first: the class
    patch (lk_hf.apply("llama")), reverted afterwards. (lk_hf.apply(model) on the loaded model
    fails its verification on FSDP2's swapped classes: see the report of this check.)"""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError as exc:
        return {"skipped": f"transformers has no DistributedConfig ({exc})"}
    from transformers import AutoModelForCausalLM

    import lmkernels.distributed.dtensor_loss as dtensor_loss
    from lmkernels.integrations import transformers as lk_hf

    ref = reference(DP)  # before the class patch, which would patch the reference model too
    with saved_tiny(ctx) as path:
        lk_hf.apply("llama", backend=common.BACKEND)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, distributed_config=DistributedConfig(tp_size=TP, fsdp_size=DP), dtype=torch.float32
            )
            w = model.lm_head.weight
            names = w.device_mesh.mesh_dim_names
            assert names == ("fsdp", "tp") and w.placements[-1].is_shard(0), (names, w.placements)
            with _spy(dtensor_loss, "vocab_parallel_cross_entropy") as vp_calls:
                losses = train_2d(model, ctx)
            assert len(vp_calls) == len(losses), f"the vocab-parallel loss ran {len(vp_calls)} times"
            final = params(model)
        finally:
            lk_hf.revert("llama")
    return {"vocab_parallel_calls": len(vp_calls), **compare(losses, final, ref)}


@check
def check_2d_transformers_tp_plan_ignores_device_mesh(ctx):
    """from_pretrained(tp_plan="auto", device_mesh=<(dp 2, tp 2) mesh>) in transformers 5.24: the
    tp_plan argument becomes DistributedConfig(tp_plan="auto"), whose tp_size is the whole world,
    and the mesh transformers builds for it replaces device_mesh. So TP spans all 4 ranks and
    fully_shard on "dp" cannot be added: 2-D goes through DistributedConfig (the check above).
    Fails, saying so, once transformers honours the mesh."""
    from transformers import AutoModelForCausalLM

    mesh = device_mesh((DP, TP), ("dp", "tp"))
    with saved_tiny(ctx) as path:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # tp_plan= is deprecated
            model = AutoModelForCausalLM.from_pretrained(
                path, tp_plan="auto", device_mesh=mesh, dtype=torch.float32
            )
    w_mesh = model.lm_head.weight.device_mesh
    if w_mesh.size() == TP:
        raise AssertionError(
            f"transformers now shards on the given mesh's tp dim ({w_mesh}): add a check of tp_plan + "
            f"fully_shard on dp"
        )
    assert w_mesh.size() == ctx["world"], w_mesh
    return {"tp_mesh_used": str(w_mesh)}
