"""Tensor / sequence parallel checks and the vocab-parallel FLCE; see distributed_checks.py."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

import distributed_common as common
from distributed_common import (
    RTOL,
    compare,
    device_mesh,
    full,
    global_batches,
    params,
    patched,
    reference,
    registry,
    rel,
    tiny,
    train,
)

CHECKS, check = registry()


@check
def check_tp_transformers_auto(ctx):
    """from_pretrained(tp_plan="auto"): q/k/v/gate/up colwise, o/down rowwise, lm_head vocab-
    sharded (a DTensor Shard(0) weight: the vocab-parallel loss)."""
    from transformers import AutoModelForCausalLM

    box = [tempfile.mkdtemp(prefix="lmk-tp-") if ctx["rank"] == 0 else None]
    dist.broadcast_object_list(box)
    path = os.path.join(box[0], "tiny-llama")
    if ctx["rank"] == 0:
        tiny().save_pretrained(path)
    dist.barrier()
    try:
        # The mesh on DEVICE: transformers' default mesh is on the GPU whenever torch sees one,
        # so CPU ranks on a one-GPU machine would each claim cuda:rank.
        mesh = device_mesh((ctx["world"],))
        model = AutoModelForCausalLM.from_pretrained(
            path, tp_plan="auto", device_mesh=mesh, dtype=torch.float32
        )
    finally:
        dist.barrier()
        if ctx["rank"] == 0:
            shutil.rmtree(box[0], ignore_errors=True)
    w = model.lm_head.weight
    assert type(w).__name__ == "DTensor" and w.placements[0].is_shard(0), f"lm_head weight: {type(w)}"
    patched(model)
    losses = train(model, global_batches(ctx["world"]))
    return compare(losses, params(model), reference(ctx["world"]))


def torchtitan_plan(model) -> dict:
    """torchtitan's tensor parallel plan for a Llama `model` (the styles
    check_tp_torch_parallel_styles names), shared by the checks that shard with it."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.model.layers)):
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return plan


@check
def check_tp_torch_parallel_styles(ctx):
    """torch.distributed.tensor.parallel styles as torchtitan uses them: q/k/v/gate/up
    ColwiseParallel, o/down RowwiseParallel, lm_head ColwiseParallel with a vocab-sharded output
    (what loss_parallel takes; the patched model reads its Shard(0) weight instead)."""
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = device_mesh((ctx["world"],))
    model = patched(tiny())
    parallelize_module(model, mesh, torchtitan_plan(model))
    losses = train(model, global_batches(ctx["world"]))
    return compare(losses, params(model), reference(ctx["world"]))


@check
def check_fsdp_plus_tp_2d_mesh(ctx):
    """FSDP2 over a data-parallel mesh dim (size 1 here: 2 processes) on top of tensor parallel
    (size 2), lm_head sharded on its own: inside lm_head's FSDP forward the weight is the TP
    DTensor, which goes to the vocab-parallel loss."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = device_mesh((1, ctx["world"]), ("dp", "tp"))
    model = patched(tiny())
    parallelize_module(model, mesh["tp"], torchtitan_plan(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model.lm_head, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    losses = train(model, global_batches(ctx["world"]))
    return compare(losses, params(model), reference(ctx["world"]))


@check
def check_vocab_parallel_flce(ctx):
    """The vocab-parallel loss against the one-device reference: uneven split (V=131), bias,
    ignored tokens, label smoothing + softcap + z-loss, temperature, all reductions, fast and
    lean modes, an upstream gradient other than 1; loss and all gradients. Then bf16 under the op's policy, in
    several chunks (grad_weight summed in bf16), and a second backward of a fast graph raises."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from lmkernels.distributed import dtensor_linear_cross_entropy
    from lmkernels.ops.flce import fused_linear_cross_entropy_reference as ref_fn

    mesh = device_mesh((ctx["world"],))
    g = torch.Generator().manual_seed(3)
    n, h, v = 37, 24, 131
    hidden = torch.randn(n, h, generator=g).to(common.DEVICE)
    weight = (torch.randn(v, h, generator=g) * 0.5).to(common.DEVICE)
    bias = torch.randn(v, generator=g).to(common.DEVICE)
    target = torch.randint(0, v, (n,), generator=g)
    target[::5] = -100
    target = target.to(common.DEVICE)
    worst = 0.0
    cases = [
        {},
        {"reduction": "sum"},
        {"reduction": "none", "label_smoothing": 0.1, "temperature": 2.0},
        {"label_smoothing": 0.2, "softcap": 3.0, "z_loss_scale": 1e-2},
        {"label_smoothing": 0.2, "softcap": 3.0, "z_loss_scale": 1e-2, "temperature": 0.7},
    ]
    import lmkernels.distributed.vocab_parallel as vp
    from lmkernels.backends.triton import triton_unavailable_reason

    # The elementwise passes in torch ops, and in the FLCE's Triton row kernel (CUDA's default;
    # here on the CPU interpreter).
    no_triton = triton_unavailable_reason()
    paths = (False,) if no_triton else (False, True)
    grid = itertools.product(cases, (False, True), (False, True), ("", "16"), paths)
    for opts, use_bias, lean, chunk, triton_rows in grid:
        if triton_rows and (use_bias or not chunk):
            continue  # the kernel path in several chunks is enough (the interpreter is slow)
        os.environ[vp.ROWS_ENV] = "triton" if triton_rows else "torch"
        os.environ["LMKERNELS_FLCE_CHUNK_TOKENS"] = chunk  # empty: the default, all 37 tokens at once
        h0, w0 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        b0 = bias.clone().requires_grad_() if use_bias else None
        expected = ref_fn(h0, w0, target, bias=b0, **opts)
        up = torch.randn(expected.shape, generator=g).to(common.DEVICE)
        (expected * up).sum().backward()
        h1 = hidden.clone().requires_grad_()
        w1 = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
        b1 = distribute_tensor(bias, mesh, [Shard(0)]).requires_grad_() if use_bias else None
        backend = "triton_lean" if lean else None
        got = dtensor_linear_cross_entropy(h1, w1, target, bias=b1, backend=backend, **opts)
        (got * up).sum().backward()
        del os.environ["LMKERNELS_FLCE_CHUNK_TOKENS"]
        del os.environ[vp.ROWS_ENV]
        pairs = [(got.detach(), expected.detach()), (h1.grad, h0.grad), (full(w1.grad), w0.grad)]
        if use_bias:
            pairs.append((full(b1.grad), b0.grad))
        for a, b in pairs:
            err = rel(a, b)
            worst = max(worst, err)
            assert err < RTOL, (
                f"{opts} bias={use_bias} lean={lean} chunk={chunk} triton={triton_rows}: relative error {err:.2e}"
            )
    # The modes differ where they should: fast computes each chunk's logits once, lean twice.
    for backend, passes in ((None, 1), ("triton_lean", 2)):
        calls = []
        original = vp._raw_logits
        vp._raw_logits = lambda *a, calls=calls, original=original, **k: calls.append(1) or original(*a, **k)
        try:
            w1 = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
            dtensor_linear_cross_entropy(
                hidden.clone().requires_grad_(), w1, target, backend=backend
            ).backward()
        finally:
            vp._raw_logits = original
        assert len(calls) == passes, f"backend={backend}: {len(calls)} logits passes, expected {passes}"
    # bf16 under the op's own policy: error against fp64 on the same bf16 values <= factor x
    # eager bf16's + floor; without options (the folded dlogits path) and with label smoothing.
    from lmkernels.ops.flce import SPEC

    tol = SPEC.tolerances[torch.bfloat16]
    bf16 = {}
    for opts, triton_rows in itertools.product(({}, {"label_smoothing": 0.1}), paths):
        os.environ[vp.ROWS_ENV] = "triton" if triton_rows else "torch"
        h32 = hidden.bfloat16().double().requires_grad_()
        w32 = weight.bfloat16().double().requires_grad_()
        ref_fn(h32, w32, target, **opts).backward()
        hb, wb = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
        ref_fn(hb, wb, target, **opts).backward()
        h2 = hidden.bfloat16().requires_grad_()
        w2 = distribute_tensor(weight.bfloat16(), mesh, [Shard(0)]).requires_grad_()
        # 5 chunks of 8 tokens: grad_weight is summed in bf16 (at most 8 roundings, the policy's)
        os.environ["LMKERNELS_FLCE_CHUNK_TOKENS"] = "8"
        try:
            loss = dtensor_linear_cross_entropy(h2, w2, target, **opts)
        finally:
            del os.environ["LMKERNELS_FLCE_CHUNK_TOKENS"]
            del os.environ[vp.ROWS_ENV]
        loss.backward(retain_graph=True)
        try:
            loss.backward()
        except RuntimeError as e:
            assert "inplace" in str(e), e
        else:
            raise AssertionError("a second backward of a fast vocab-parallel loss did not raise")
        for what, ours, eager, exact in (
            ("grad_hidden", h2.grad, hb.grad, h32.grad),
            ("grad_weight", full(w2.grad), wb.grad, w32.grad),
        ):
            key = f"{what} {opts} triton={triton_rows}"
            bf16[key] = (rel(ours, exact), rel(eager, exact))
            bound = tol.factor * bf16[key][1] + tol.floor
            assert bf16[key][0] <= bound, (
                f"bf16 {key}: error {bf16[key][0]:.2e} > {bound:.2e} (eager bf16 {bf16[key][1]:.2e})"
            )
    return {"worst_rel_err": worst, "bf16_err_vs_eager_bf16": bf16, "triton_rows_not_run": no_triton}


@check
def check_vocab_parallel_sequence_sharded_hidden(ctx):
    """Sequence parallel into the loss: hidden a Shard(1) DTensor (gathered for the loss, its
    gradient sliced back), weight vocab-sharded."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from lmkernels.distributed import dtensor_linear_cross_entropy
    from lmkernels.ops.flce import fused_linear_cross_entropy_reference as ref_fn

    mesh = device_mesh((ctx["world"],))
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 10, 24, generator=g).to(common.DEVICE)
    weight = (torch.randn(130, 24, generator=g) * 0.5).to(common.DEVICE)
    target = torch.randint(0, 130, (2, 10), generator=g).to(common.DEVICE)
    h0, w0 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = ref_fn(h0, w0, target, softcap=5.0)
    expected.backward()
    h1 = hidden.chunk(ctx["world"], 1)[ctx["rank"]].clone().requires_grad_()
    hd = DTensor.from_local(h1, mesh, [Shard(1)])
    w1 = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    got = dtensor_linear_cross_entropy(hd, w1, target, softcap=5.0)
    got.backward()
    errs = {
        "loss": rel(got.detach(), expected.detach()),
        "grad_hidden": rel(h1.grad, h0.grad.chunk(ctx["world"], 1)[ctx["rank"]]),
        "grad_weight": rel(full(w1.grad), w0.grad),
    }
    for what, err in errs.items():
        assert err < RTOL, f"{what}: relative error {err:.2e}"
    return errs


@check
def check_sequence_parallel_rms_norm(ctx):
    """torch's SequenceParallel on the patched RMSNorm (sequence-sharded input, Replicate weight):
    output, input gradient and the reduced weight gradient equal one process, for the eager and
    the Triton backends (Triton custom ops have no DTensor rules: they run on the local rows)."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    mesh = device_mesh((ctx["world"],))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 8, 64, generator=g).to(common.DEVICE)
    up = torch.randn(2, 8, 64, generator=g).to(common.DEVICE)
    rank, world = ctx["rank"], ctx["world"]
    from lmkernels.backends.triton import triton_unavailable_reason

    no_triton = triton_unavailable_reason()  # e.g. an interpreter too old for the kernels
    errs = {"triton_not_run": no_triton}
    for backend in ("eager",) if no_triton else ("eager", "triton"):
        model = tiny()
        with torch.no_grad():  # drawn on the CPU: the same values on every device
            model.model.norm.weight.copy_(torch.randn(model.model.norm.weight.shape, generator=g))
        xr = x.clone().requires_grad_()
        yr = model.model.norm(xr)
        (yr * up).sum().backward()
        w_grad = model.model.norm.weight.grad.clone()
        model.model.norm.weight.grad = None
        norm = parallelize_module(patched(model, backend).model.norm, mesh, SequenceParallel())
        xl = x.chunk(world, 1)[rank].clone().requires_grad_()
        y = norm(xl)
        assert type(y).__name__ == "DTensor", f"SequenceParallel output: {type(y)}"
        (y.to_local() * up.chunk(world, 1)[rank]).sum().backward()
        errs[backend] = max(
            rel(y.to_local(), yr.detach().chunk(world, 1)[rank]),
            rel(xl.grad, xr.grad.chunk(world, 1)[rank]),
            rel(full(norm.weight.grad), w_grad),
        )
        assert errs[backend] < RTOL, f"{backend}: relative error {errs[backend]:.2e}"
    return errs


@check
def check_tensor_parallel_dtensor_glu_and_rope(ctx):
    """Plans that hand the patched MLP and RoPE DTensors (ColwiseParallel(use_local_output=False)):
    the Triton GLU and RoPE run on the local shards; outputs and gradients equal one process."""
    from lmkernels.backends.triton import triton_unavailable_reason

    reason = triton_unavailable_reason()
    if reason:  # e.g. an interpreter too old for these kernels: test_distributed skips it
        return {"skipped": reason}
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers.models.llama import modeling_llama

    from lmkernels.integrations import transformers as lk_hf
    from lmkernels.integrations.transformers.replacements import rope_function
    from lmkernels.integrations.transformers.structure import unwrapped

    mesh = device_mesh((ctx["world"],))
    rank, world = ctx["rank"], ctx["world"]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 8, 64, generator=g).to(common.DEVICE)
    model = tiny()
    mlp = model.model.layers[0].mlp
    xr = x.clone().requires_grad_()
    yr = mlp(xr)
    yr.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in mlp.named_parameters()}
    mlp.zero_grad(set_to_none=True)
    q = torch.randn(2, 4, 8, 16, generator=g).to(common.DEVICE)  # (B, heads, T, D)
    k = torch.randn(2, 2, 8, 16, generator=g).to(common.DEVICE)
    cos, sin = (
        torch.randn(2, 8, 16, generator=g).to(common.DEVICE),
        torch.randn(2, 8, 16, generator=g).to(common.DEVICE),
    )
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    qo, ko = modeling_llama.apply_rotary_pos_emb(qr, kr, cos, sin)
    (qo.sum() + 2 * ko.sum()).backward()

    patched(model, "triton")
    plan = {
        "gate_proj": ColwiseParallel(use_local_output=False),
        "up_proj": ColwiseParallel(use_local_output=False),
        "down_proj": RowwiseParallel(),
    }
    parallelize_module(mlp, mesh, plan)
    xl = x.clone().requires_grad_()
    y = mlp(xl)
    y.sum().backward()
    errs = {"mlp_out": rel(y, yr.detach()), "mlp_grad_x": rel(xl.grad, xr.grad)}
    for n, p in mlp.named_parameters():
        errs[f"grad_{n}"] = rel(full(p.grad), ref_grads[n])
    ql = q.chunk(world, 1)[rank].clone().requires_grad_()
    kl = k.chunk(world, 1)[rank].clone().requires_grad_()
    qd, kd = DTensor.from_local(ql, mesh, [Shard(1)]), DTensor.from_local(kl, mesh, [Shard(1)])
    # the rope function the patched model's attention runs (its layout, the triton backend)
    finding = next(f for f in lk_hf.report(model).patched if f.op == "rope")
    original = unwrapped(modeling_llama.apply_rotary_pos_emb)
    qd_out, kd_out = rope_function(original, finding.spec, lambda: "triton")(qd, kd, cos, sin)
    (qd_out.to_local().sum() + 2 * kd_out.to_local().sum()).backward()
    errs["rope_q"] = rel(qd_out.to_local(), qo.detach().chunk(world, 1)[rank])
    errs["rope_grad_k"] = rel(kl.grad, kr.grad.chunk(world, 1)[rank])
    for what, err in errs.items():
        assert err < RTOL, f"{what}: relative error {err:.2e}"
    return errs


@check
def check_unsupported_layouts_raise(ctx):
    """Layouts the loss cannot compute exactly fail with errors that name them."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from lmkernels.distributed import dtensor_linear_cross_entropy
    from lmkernels.registry import LMKernelsError

    mesh = device_mesh((ctx["world"],))
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(6, 8, generator=g).to(common.DEVICE)
    weight = torch.randn(20, 8, generator=g).to(common.DEVICE)
    target = torch.randint(0, 20, (6,), generator=g).to(common.DEVICE)
    cases = [
        # the hidden dim sharded: each rank would see partial logits
        (distribute_tensor(weight, mesh, [Shard(1)]), target, "placements"),
        # different labels per rank: a data-parallel shard, not tensor parallel
        (distribute_tensor(weight, mesh, [Shard(0)]), (target + ctx["rank"]) % 20, "different labels"),
    ]
    for w, t, words in cases:
        try:
            dtensor_linear_cross_entropy(hidden, w, t)
        except LMKernelsError as exc:
            assert words in str(exc), f"error does not say {words!r}: {exc}"
        else:
            raise AssertionError(f"no error for {words}")


@check
def check_vocab_parallel_uneven_chunks_and_collectives(ctx):
    """Uneven vocabulary shards (V = 131: 66 and 65 rows) in several chunks: every rank chunks
    alike (sized for the largest shard; sized for its own, rank 0 ran 5 chunks and rank 1 4, and
    the collectives no longer matched). And the collectives the loss issues are those of
    `vocab_parallel.communication` (the communication model of docs/scaling.md): op and bytes,
    fast and lean, with and without label smoothing."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import lmkernels.distributed.vocab_parallel as vp
    from lmkernels.distributed import dtensor_linear_cross_entropy
    from lmkernels.ops.flce import fused_linear_cross_entropy_reference as ref_fn

    mesh = device_mesh((ctx["world"],))
    g = torch.Generator().manual_seed(8)
    n, h, v = 37, 8, 131
    hidden = torch.randn(n, h, generator=g).to(common.DEVICE)
    weight = torch.randn(v, h, generator=g).to(common.DEVICE)
    target = torch.randint(0, v, (n,), generator=g).to(common.DEVICE)
    seen = []
    original = dist.all_reduce

    def counting(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        seen.append(
            ("all_reduce " + ("MAX" if op == dist.ReduceOp.MAX else "SUM"), t.numel() * t.element_size())
        )
        return original(t, op=op, group=group, async_op=async_op)

    saved_bytes = vp.CHUNK_BYTES
    worst = 0.0
    try:
        vp.CHUNK_BYTES = 2600  # 9 tokens of 66 columns, 10 of 65: different counts if chunked per shard
        for lean, smoothing in itertools.product((False, True), (0.0, 0.1)):
            h0, w0 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            expected = ref_fn(h0, w0, target, label_smoothing=smoothing)
            expected.backward()
            h1 = hidden.clone().requires_grad_()
            w1 = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
            seen.clear()
            dist.all_reduce = counting
            try:
                got = vp.vocab_parallel_cross_entropy(
                    h1, w1.to_local(), target, vocab_size=v, label_smoothing=smoothing, lean=lean
                )
                got.backward()
            finally:
                dist.all_reduce = original
            model = vp.communication(n, h, v, ctx["world"], label_smoothing=bool(smoothing))
            assert seen == [(op, nbytes) for _, op, nbytes in model], (lean, smoothing, seen, model)
            for a, b in ((got.detach(), expected.detach()), (h1.grad, h0.grad), (full(w1.grad), w0.grad)):
                worst = max(worst, rel(a, b))
            assert worst < RTOL, f"lean={lean} smoothing={smoothing}: relative error {worst:.2e}"
        # dtensor_linear_cross_entropy adds one 32-byte all-reduce: the label check
        seen.clear()
        dist.all_reduce = counting
        try:
            w2 = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
            dtensor_linear_cross_entropy(hidden.clone().requires_grad_(), w2, target).backward()
        finally:
            dist.all_reduce = original
        model = vp.communication(n, h, v, ctx["world"])
        assert seen == [("all_reduce MAX", 32)] + [(op, b) for _, op, b in model], seen
    finally:
        vp.CHUNK_BYTES = saved_bytes
    return {"worst_rel_err": worst, "collectives": len(model)}
