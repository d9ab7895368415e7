"""The gated MLP's down projection recomputes its input in the backward (lmkernels.nn.recompute):
same gradients as saving it, no copy of it kept by autograd, loud failure where the GLU's
inputs were overwritten, and no effect under activation checkpointing."""

import subprocess
import sys

import pytest
import torch
import torch.utils.checkpoint as ckpt

import lmkernels
from lmkernels.nn import SwiGLUMLP, recompute
from lmkernels.nn.recompute import ENV, project_recomputed


def _mlp(seed=0):
    torch.manual_seed(seed)
    return SwiGLUMLP(16, 48, backend="eager")


def _grads(mlp, x):
    x = x.clone().requires_grad_()
    mlp(x).square().sum().backward()
    return [x.grad] + [p.grad for p in mlp.parameters()]


def test_same_gradients_as_saving_the_input(monkeypatch):
    x = torch.randn(5, 7, 16)  # 3-D: F.linear saves a 2-D view of its input
    runs = []
    original = recompute._Recipe.run
    monkeypatch.setattr(recompute._Recipe, "run", lambda self: runs.append(1) or original(self))
    recomputed = _grads(_mlp(), x)
    assert runs == [1]
    monkeypatch.setenv(ENV, "0")
    saved = _grads(_mlp(), x)
    for a, b in zip(recomputed, saved, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_autograd_keeps_no_copy_of_the_input():
    down = torch.nn.Linear(48, 16)
    gate = torch.randn(2, 4, 48, requires_grad=True)
    up = torch.randn(2, 4, 48, requires_grad=True)
    calls = []

    def again():
        calls.append(1)
        return lmkernels.swiglu(gate, up, backend="eager")

    h = lmkernels.swiglu(gate, up, backend="eager")
    y = project_recomputed(down, h, again, (gate, up))
    alive = torch.utils.weak.WeakIdKeyDictionary({h: 1})  # h freed once nothing but autograd could hold it
    del h
    assert len(alive) == 0, "autograd kept down_proj's input alive"
    y.sum().backward()
    assert calls == [1]
    assert down.weight.grad is not None and gate.grad is not None


def test_overwritten_glu_inputs_raise():
    down = torch.nn.Linear(48, 16)
    gate = torch.randn(2, 4, 48, requires_grad=True)
    up = torch.randn(2, 4, 48, requires_grad=True)
    g, u = gate * 1, up * 1
    h = lmkernels.swiglu(g, u, backend="eager")
    y = project_recomputed(down, h, lambda: lmkernels.swiglu(g, u, backend="eager"), (g, u))
    with torch.no_grad():
        g.add_(1.0)  # what a consuming GLU backward does to its inputs before a second backward
    with pytest.raises(RuntimeError, match="cannot be recomputed"):
        y.sum().backward()


def test_not_applied_under_activation_checkpointing(monkeypatch):
    mlp, x = _mlp(), torch.randn(3, 16, requires_grad=True)
    calls = []
    original = recompute._Recipe.run

    def counting(self):
        calls.append(1)
        return original(self)

    monkeypatch.setattr(recompute._Recipe, "run", counting)
    ckpt.checkpoint(mlp, x, use_reentrant=False).sum().backward()
    assert calls == []  # checkpointing owns the saved tensors there
    mlp(x).sum().backward()
    assert calls == [1]


_FSDP_SCRIPT = """
import socket, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM
from lmkernels.nn import recompute
from lmkernels.integrations.transformers import apply

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
runs = []
original = recompute._Recipe.run
recompute._Recipe.run = lambda self: runs.append(1) or original(self)
torch.manual_seed(0)
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)
model = apply(LlamaForCausalLM(config), backend="eager")
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
ids = torch.randint(0, 64, (2, 8))
model(input_ids=ids, labels=ids).loss.backward()
dist.destroy_process_group()
print("RUNS", len(runs))
"""


def test_applied_under_fsdp2():
    """FSDP2 per-layer wrapping leaves the recompute on (no saved-tensor hooks of its own): the
    memory it saves is there in sharded training too."""
    done = subprocess.run([sys.executable, "-c", _FSDP_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RUNS 2" in done.stdout, done.stdout
