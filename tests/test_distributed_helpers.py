"""Single-process tests of the distributed helpers: foreach_safe_param_groups, and the
configuration names of the distributed benchmark (checked before any torchrun starts)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lmkernels.distributed import foreach_safe_param_groups

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo world of one process (in-memory store), for DTensors on two different meshes."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_groups_split_plain_tensors_and_meshes(world_of_one):
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh

    mesh_1d = init_device_mesh("cpu", (1,))
    mesh_2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    plain = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    on_1d = [torch.nn.Parameter(distribute_tensor(torch.randn(4), mesh_1d, [Replicate()])) for _ in range(2)]
    on_2d = torch.nn.Parameter(distribute_tensor(torch.randn(5), mesh_2d, [Replicate(), Replicate()]))
    groups = foreach_safe_param_groups([plain[0], on_1d[0], on_2d, plain[1], on_1d[1]])
    assert [[id(p) for p in g["params"]] for g in groups] == [
        [id(plain[0]), id(plain[1])],
        [id(on_1d[0]), id(on_1d[1])],
        [id(on_2d)],
    ]
    # what CUDA runs by default, forced here: every group's foreach update goes through
    opt = torch.optim.SGD(groups, lr=0.5, foreach=True)
    before = [p.detach().clone() for g in groups for p in g["params"]]
    for g in groups:
        for p in g["params"]:
            p.grad = torch.ones_like(p)
    opt.step()
    for old, p in zip(before, [p for g in groups for p in g["params"]]):
        assert torch.equal(p.detach(), old - 0.5), "a parameter was not stepped"


def test_groups_keep_their_options():
    a, b, c = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    groups = foreach_safe_param_groups([{"params": [a, b], "lr": 0.1}, {"params": c, "weight_decay": 0.0}])
    assert groups == [{"params": [a, b], "lr": 0.1}, {"params": [c], "weight_decay": 0.0}]
    with pytest.raises(TypeError, match="params"):
        foreach_safe_param_groups([{"lr": 0.1}])


def test_distributed_benchmark_configurations():
    from lmkernels_bench import scale

    for ok in ("plain", "lmk", "lmk:triton", "lmk:eager/flce=triton", "liger"):
        assert scale.check_config(ok) is None, ok
    assert "unknown backend 'trition'" in scale.check_config("lmk:eager/flce=trition")
    assert "unknown configuration 'lmk+compile'" in scale.check_config("lmk+compile")
    assert "unknown configuration" in scale.check_config("lmkernels")
    assert scale.slug("lmk:triton/flce=eager") == "lmk_triton_flce_eager"


def _zero3_like_lm_head(partitioned: bool):
    """An nn.Linear whose weight carries the attributes DeepSpeed ZeRO-3 gives a parameter; its
    data is the full weight (gathered) or empty (a partition, as between ZeRO-3's hooks)."""
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(16, 40, bias=False)
    w = lm_head.weight
    w.ds_id, w.ds_numel, w.ds_shape = 7, w.numel(), w.shape
    if partitioned:
        w.data = torch.empty(0)
    return lm_head


def test_zero3_loss_runs_as_lm_heads_forward():
    """Under ZeRO-3 the fused loss is lm_head's forward for one call: its forward hooks (where
    ZeRO-3 gathers and releases the weight) fire around it, the loss and the gradients are those
    of the plain call, and lm_head's own forward is back afterwards."""
    from lmkernels.integrations.lm_head_loss import causal_lm_loss, lm_head_loss

    lm_head = _zero3_like_lm_head(partitioned=False)
    hidden = torch.randn(2, 5, 16, requires_grad=True)
    labels = torch.randint(0, 40, (2, 5))
    seen = []
    lm_head.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(("pre", args[0] is hidden)), with_kwargs=True
    )
    lm_head.register_forward_hook(lambda m, args, out: seen.append(("post", out.dim())))
    loss = lm_head_loss(lm_head, hidden, labels, backend="eager")
    loss.backward()
    assert seen == [("pre", True), ("post", 0)], seen  # hidden positional (ZeRO-3's backward hooks), loss out
    assert "forward" not in vars(lm_head)
    assert torch.equal(lm_head(hidden[0]), hidden[0] @ lm_head.weight.T)  # Linear's forward again
    h2 = hidden.detach().clone().requires_grad_()
    w2 = lm_head.weight.detach().clone().requires_grad_()
    expected = causal_lm_loss(h2, w2, labels, backend="eager")
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=0, atol=0)
    torch.testing.assert_close(lm_head.weight.grad, w2.grad, rtol=0, atol=0)


def test_zero3_partition_not_gathered_raises_and_restores_forward():
    from lmkernels.integrations.lm_head_loss import lm_head_loss
    from lmkernels.registry import LMKernelsError

    lm_head = _zero3_like_lm_head(partitioned=True)
    with pytest.raises(LMKernelsError, match="ZeRO-3 partition that was not gathered.*deepspeed.initialize"):
        lm_head_loss(lm_head, torch.randn(2, 5, 16), torch.randint(0, 40, (2, 5)))
    assert "forward" not in vars(lm_head)


@pytest.mark.parametrize("value", ["triton", "torch", " torch ", "cuda"])
def test_vocab_parallel_rows_variable(monkeypatch, value):
    """LMKERNELS_VOCAB_PARALLEL_ROWS picks the elementwise passes' implementation: torch always
    runs; triton runs where the row kernel can (the CPU interpreter here) and is refused, with
    the reason, where it cannot (a bias, fp16), never replaced by the torch ops; another value
    is refused with the variable named."""
    import lmkernels
    from lmkernels.backends.triton import triton_unavailable_reason
    from lmkernels.distributed import vocab_parallel as vp

    monkeypatch.setenv(vp.ROWS_ENV, value)
    weight = torch.zeros(4, 2)
    if value == "cuda":
        with pytest.raises(lmkernels.LMKernelsError, match=f"{vp.ROWS_ENV}: expected one of .*got 'cuda'"):
            vp._use_triton(weight, None)
        return
    if value.strip() == "torch":
        assert vp._use_triton(weight, None) is False
        assert vp._use_triton(weight.half(), torch.zeros(4)) is False
        return
    refused = f"{vp.ROWS_ENV}=triton: the row kernel cannot run here"
    with pytest.raises(lmkernels.LMKernelsError, match=f"{refused} .*a bias"):
        vp._use_triton(weight, torch.zeros(4))
    with pytest.raises(lmkernels.LMKernelsError, match=f"{refused} .*fp16"):
        vp._use_triton(weight.half(), None)
    if triton_unavailable_reason() is None:  # the interpreter (CI) runs the kernel on the CPU
        assert vp._use_triton(weight, None) is True
    else:
        with pytest.raises(lmkernels.LMKernelsError, match=refused):
            vp._use_triton(weight, None)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_vocab_parallel_empty_shard_stats(smoothing):
    """A rank whose vocabulary shard has no rows (more ranks than rows): the row kernel's path
    gives what the torch ops' does, a logsumexp of -inf, target logit 0 and no sum."""
    from lmkernels.backends.triton import triton_unavailable_reason
    from lmkernels.distributed import vocab_parallel as vp

    if triton_unavailable_reason() is not None:
        pytest.skip(triton_unavailable_reason())
    target = torch.tensor([3, 7, -100])
    tg = vp._Targets(target, -100, 8, 0, smoothing)  # this shard: columns 8 to 8, none
    rows = vp._TritonRows(target, tg, (-100, None, smoothing, None, 0.0), 8, 0, 3, torch.device("cpu"), 1.0)
    z = torch.empty(3, 0)
    lse, _, target_z, sum_z = rows.local_stats(z, 0, 3)
    want_lse, _, want_t, want_sum = vp._local_stats_torch_(z.clone(), tg, 0, 3, smoothing)
    assert torch.equal(lse, want_lse) and torch.equal(target_z, want_t)
    assert (sum_z is None) == (want_sum is None)
    if sum_z is not None:
        assert torch.equal(sum_z, want_sum)
