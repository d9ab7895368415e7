"""A whole patched training step (forward, backward, optimizer step) captured in one CUDA graph
and replayed: the host-bound regime of small batches then costs one graph launch per step.
Capture fails on any host sync or host-side decision in the step (a .item(), a Python branch
on a value), so this also proves the patched step has none with value checks off.

GPU only: CUDA graphs need a CUDA device."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers integration needs the hf extra")

from lmkernels.convergence.models import build_model  # noqa: E402
from lmkernels.integrations import transformers as lk_hf  # noqa: E402

V, B, T = 512, 4, 64


def _step(model, opt, ids, labels):
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    opt.step()
    return loss


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_patched_llama_training_step_replays_from_a_cuda_graph(monkeypatch):
    # The FLCE target range check syncs with the host; a captured step cannot, so it is off.
    monkeypatch.setenv("LMKERNELS_CHECK_VALUES", "0")
    base = build_model("llama", V, T, use_cache=False).cuda().train()
    eager_model, graph_model = base, copy.deepcopy(base)
    for m in (eager_model, graph_model):
        lk_hf.apply(m, backend="triton")
    # capturable=True: the optimizer keeps its step count on the GPU, as a graph needs; the same
    # setting on both sides makes their updates identical.
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3, capturable=True)
    graph_opt = torch.optim.AdamW(graph_model.parameters(), lr=1e-3, capturable=True)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, V, (B, T), generator=g).cuda() for _ in range(6)]
    static_ids = batches[0].clone()

    # Warm-up on a side stream (Triton compiles, autograd and the optimizer allocate their state).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for ids in batches[:3]:
            graph_opt.zero_grad(set_to_none=True)
            static_ids.copy_(ids)
            _step(graph_model, graph_opt, static_ids, static_ids)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    graph_opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = _step(graph_model, graph_opt, static_ids, static_ids)

    eager_losses = []
    for ids in batches[:3]:
        eager_opt.zero_grad(set_to_none=True)
        _step(eager_model, eager_opt, ids, ids)
    for ids in batches[3:]:
        eager_opt.zero_grad(set_to_none=True)
        eager_losses.append(_step(eager_model, eager_opt, ids, ids).detach().clone())
        # The gradients were None at capture, so the captured backward writes them afresh (it
        # does not accumulate): a replay needs only the new batch in the static input.
        static_ids.copy_(ids)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_loss, eager_losses[-1], rtol=1e-5, atol=1e-6)
    for p_graph, p_eager in zip(graph_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p_graph, p_eager, rtol=1e-4, atol=1e-6)
    assert len({round(loss.item(), 6) for loss in eager_losses}) == 3, "the batches should differ"
