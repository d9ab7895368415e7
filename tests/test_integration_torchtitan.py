"""torchtitan: lmkernels' modules and fused loss in torchtitan's llama3 debug model, trained by
torchtitan's own trainer (torchrun, its config manager, dataloader, activation checkpointing,
FSDP2) with and without lmkernels, on the CPU.

Needs torchtitan (which imports triton): CI runs this file in a venv of its own
(.venv-torchtitan, built by .ci/run). Without torchtitan only the import-error test runs.

This file is also the launcher of the training runs (`python -m torch.distributed.run ...
tests/test_integration_torchtitan.py OUT -- ARGS`): see _launch() and _cpu_shims().
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

HAS_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
needs_torchtitan = pytest.mark.skipif(
    not HAS_TORCHTITAN,
    reason="torchtitan is not installed (CI runs this file in .venv-torchtitan, see .ci/run)",
)
COUNTED = ("rms_norm", "rope", "swiglu", "fused_linear_cross_entropy")
VOCAB_PARALLEL = "vocab_parallel_cross_entropy"  # the loss of a vocabulary-sharded (TP) lm_head


# ---- TEST-ONLY CPU SHIMS ------------------------------------------------------------------------
# torchtitan 0.3.0 trains on CUDA (and other accelerators) with a newer torch than the 2.13 CI
# installs. To run its real trainer on a CPU-only CI machine the launcher changes, in the
# training processes only (never in the library):
#  1. the device type: torchtitan takes "cuda" when torch finds no accelerator -> "cpu";
#  2. torch.cpu gets the memory-statistics functions torchtitan's memory monitor calls, and a
#     current_device() that returns an index (for barrier(device_ids=...));
#  3. torch.distributed.set_timeout (newer torch) -> torch 2.13's _set_pg_timeout (3 and 7:
#     lmkernels_bench.scale_titan.older_torch_shims, which the GPU benchmark uses too);
#  4. FlexAttention has no CPU backward -> SDPA with the same mask, made dense from the
#     BlockMask's own mask_mod (causal within each packed document, as FlexAttention computes);
#  5. gloo has no PREMUL_SUM, which FSDP2 uses for torchtitan's gradient divide factor -> plain
#     SUM reductions (FSDP then divides separately: the same gradients);
#  6. speed only: the BlockMask is made by torchtitan's torch.compile'd create_block_mask, which
#     on a CPU means an inductor C++ build in every fresh process -> the same function, eager;
#  7. torchtitan hands its pipeline schedule micro-batches it has already split
#     (`step(arg_mbs=, kwarg_mbs=, target_mbs=, ...)`, a newer torch's API); torch 2.13's step()
#     takes the whole batch and would pass them to the model as keyword arguments -> such a call
#     does what step() does around the schedule's own _step_microbatches (every schedule has one).
# Both runs of every comparison get the same shims.


def _cpu_shims() -> None:
    import types

    import torch
    import torch._utils
    import torch.nn.functional as F

    torch._utils._get_available_device_type = lambda: "cpu"  # 1 (before torchtitan is imported)
    stubs = {
        "get_device_name": lambda *a: "cpu",
        "get_device_properties": lambda *a: types.SimpleNamespace(total_memory=24 << 30, name="cpu"),
        "reset_peak_memory_stats": lambda *a: None,
        "empty_cache": lambda *a: None,
        "memory_stats": lambda *a: {},
    }
    for name, fn in stubs.items():  # 2
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
    torch.cpu.current_device = lambda: 0

    from torch.distributed.fsdp import FSDPModule
    from torch.nn.attention.flex_attention import create_block_mask, create_mask
    from torchtitan.models.common import attention
    from torchtitan.models.common.attention import FlexAttention

    attention._compiled_create_block_mask = create_block_mask  # 6

    def sdpa_forward(
        self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, enable_gqa=False, **kwargs
    ):  # 4
        assert kwargs.get("score_mod") is None and kwargs.get("out_transform") is None
        B, L = q_BLNH.shape[:2]
        mask = create_mask(attention_masks.mask_mod, B, None, L, L, device=q_BLNH.device)
        out = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)

    FlexAttention.forward = sdpa_forward
    set_factor = FSDPModule.set_gradient_divide_factor

    def set_factor_sum(self, factor):  # 5
        set_factor(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_factor_sum

    from lmkernels_bench.scale_titan import older_torch_shims

    older_torch_shims()  # 3, 7


# ---- the launcher (runs under torchrun) --------------------------------------------------------


def _launch(out_path: str, argv: list[str]) -> None:
    """torchtitan.train.main(), recording each step's loss, the calls of lmkernels ops during
    training, the loss and module classes, and (rank 0) the final parameters."""
    _cpu_shims()
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    import lmkernels
    import lmkernels.distributed.dtensor_loss

    init_logger()
    config = ConfigManager().parse_args(argv)
    trainer = config.build()
    losses = {}
    log = trainer.metrics_processor.log

    def record(step, global_avg_loss, *args, **kwargs):
        losses[step] = float(global_avg_loss)
        return log(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = record

    def full_params():  # this rank's pipeline stages (all of the model without PP)
        out = {}
        for model in trainer.model_parts:
            for name, p in model.named_parameters():
                full = p.full_tensor() if isinstance(p, DTensor) else p  # a collective: every rank
                out[name.replace("_checkpoint_wrapped_module.", "")] = full.detach().cpu().clone()
        return out

    init = full_params()
    calls = dict.fromkeys((*COUNTED, VOCAB_PARALLEL), 0)
    counted = [(lmkernels, name) for name in COUNTED]
    counted.append((lmkernels.distributed.dtensor_loss, VOCAB_PARALLEL))
    for module, name in counted:
        original = getattr(module, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(module, name, counting)
    trainer.train()
    lm_head = getattr(trainer.model_parts[-1], "lm_head", None)  # PP: the last stage's only
    result = {
        "losses": [losses[s] for s in sorted(losses)],
        "calls": calls,
        "loss_fn": type(trainer.loss_fn).__name__,
        "lm_head": None if lm_head is None else type(lm_head).__name__,
        "modules": sorted({type(m).__name__ for model in trainer.model_parts for m in model.modules()}),
        "init": init,
        "params": full_params(),
    }
    trainer.close()
    torch.save(result, f"{out_path}.rank{dist.get_rank()}")
    dist.destroy_process_group()


# ---- the tests ---------------------------------------------------------------------------------


def test_import_without_torchtitan_names_it():
    if HAS_TORCHTITAN:
        pytest.skip("torchtitan is installed")
    from lmkernels.registry import LMKernelsError

    with pytest.raises(LMKernelsError, match="needs torchtitan installed"):
        import lmkernels.integrations.torchtitan  # noqa: F401


STEPS, SEQ, BATCH = 4, 64, 2


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """(tokenizer, dataset) folders: the distributed benchmark's word-level tokenizer of the
    debug model's 2048 tokens and about 64 documents of 10-90 words (several per sequence)."""
    from lmkernels_bench.scale_titan import write_assets

    return write_assets(tmp_path_factory.mktemp("torchtitan"), tokens=64 * 50, max_words=90)


def _run(assets, tmp_path, name: str, args: list[str], nproc: int = 1, env: dict | None = None) -> dict:
    import torch

    out = tmp_path / f"{name}.pt"
    common = [
        f"--hf_assets_path={assets[0]}",
        f"--dataloader.dataset_path={assets[1]}",
        f"--dump_folder={tmp_path / name}",
        f"--training.steps={STEPS}",
        f"--training.seq_len={SEQ}",
        f"--training.local_batch_size={BATCH}",
        "--training.mixed_precision_param=float32",  # fp32 compute: the convergence policy's sharp check
        "--debug.seed=42",
        "--metrics.log_freq=1",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [os.path.abspath(__file__), str(out), "--", *args, *common]
    run_env = dict(os.environ, OMP_NUM_THREADS="1", LMKERNELS_BACKEND="eager", **(env or {}))
    proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    ranks = [torch.load(f"{out}.rank{r}") for r in range(nproc)]
    # Rank 0's result, with the losses of the last rank (a pipeline's last stage: the loss is
    # computed there) and the parameters of all ranks (each pipeline stage's own).
    result = dict(ranks[0], losses=ranks[-1]["losses"], ranks=ranks)
    result["init"] = {k: v for r in ranks for k, v in r["init"].items()}
    result["params"] = {k: v for r in ranks for k, v in r["params"].items()}
    return result


def _assert_same_training(plain: dict, fused: dict) -> None:
    """The convergence policy's fp32 limits (lmkernels.convergence.compare): every step's loss to
    1e-5 relative; each parameter's training update (from torchtitan's seeded init, the same in
    both runs) to 3e-3 relative."""
    import torch

    from lmkernels.convergence.compare import TOLERANCES_FP32

    print("losses without / with lmkernels:", plain["losses"], fused["losses"])
    assert len(plain["losses"]) == len(fused["losses"]) == STEPS
    for a, b in zip(plain["losses"], fused["losses"]):
        assert abs(b - a) <= TOLERANCES_FP32["loss curve"] * abs(a), (plain["losses"], fused["losses"])
    assert plain["params"].keys() == fused["params"].keys() == plain["init"].keys()
    worst = 0.0
    for name, p in plain["params"].items():
        assert torch.equal(plain["init"][name], fused["init"][name]), name
        update = (p - plain["init"][name]).norm()
        assert update > 0, f"{name} did not train"
        err = ((fused["params"][name] - p).norm() / update).item()
        worst = max(worst, err)
        assert err <= TOLERANCES_FP32["params"], f"{name}: its update differs by {err:.2e}"
    print(f"worst relative difference of a parameter's update: {worst:.2e}")


def _assert_lmkernels_ran(result: dict, loss_op: str = "fused_linear_cross_entropy") -> None:
    assert result["loss_fn"] == "FusedLinearCrossEntropyLoss"
    assert {"LmkernelsRMSNorm", "LmkernelsComplexRoPE", "LmkernelsFeedForward"} <= set(result["modules"])
    assert not {"RMSNorm", "ComplexRoPE", "FeedForward"} & set(result["modules"])
    calls, layers = result["calls"], 6
    assert calls[loss_op] == STEPS, calls  # one fused call per step, no chunks
    # Per step and layer: 2 norms, 1 rope, 1 GLU (more with the recompute of activation checkpointing).
    assert calls["rms_norm"] >= STEPS * (2 * layers + 1), calls
    assert calls["swiglu"] >= STEPS * layers, calls
    if loss_op != VOCAB_PARALLEL:  # under TP RoPE meets DTensors: torchtitan's own code (modules.py)
        assert calls["rope"] >= STEPS * layers, calls


@pytest.fixture(scope="module")
def plain_run(assets, tmp_path_factory):
    return _run(
        assets, tmp_path_factory.mktemp("plain"), "plain", ["--module=llama3", "--config=llama3_debugmodel"]
    )


@needs_torchtitan
def test_config_module_trains_like_torchtitan(assets, plain_run, tmp_path):
    """`--module lmkernels.integrations.torchtitan --config llama3_debugmodel`: torchtitan's own
    debug config with lmkernels' RMSNorm, ComplexRoPE, SwiGLU and the fused lm_head + loss
    (backend from --loss.backend and LMKERNELS_BACKEND), equal to torchtitan without it."""
    fused = _run(
        assets,
        tmp_path,
        "lmkernels",
        ["--module=lmkernels.integrations.torchtitan", "--config=llama3_debugmodel", "--loss.backend=eager"],
    )
    assert plain_run["loss_fn"] == "ChunkedLossWrapper" and plain_run["calls"] == dict.fromkeys(
        (*COUNTED, VOCAB_PARALLEL), 0
    )
    _assert_lmkernels_ran(fused)
    _assert_same_training(plain_run, fused)


@needs_torchtitan
def test_overrides_train_like_torchtitan(assets, plain_run, tmp_path):
    """torchtitan's override mechanism: `--override.imports` of the four lmkernels overrides
    on the stock llama3 debug config gives the same model and training."""
    targets = ",".join(
        f"lmkernels.integrations.torchtitan.overrides.{name}"
        for name in ("rms_norm", "rope", "swiglu", "flce")
    )
    fused = _run(
        assets,
        tmp_path,
        "overrides",
        ["--module=llama3", "--config=llama3_debugmodel", "--override.imports", targets],
    )
    _assert_lmkernels_ran(fused)
    _assert_same_training(plain_run, fused)


def _run_both(assets, tmp_path, name: str, args: list[str]) -> tuple[dict, dict]:
    """torchtitan's llama3 and lmkernels' module on the debug model with the same arguments, 2
    processes each: (plain, fused). The plain run never calls lmkernels."""
    plain = _run(
        assets, tmp_path, f"{name}-plain", ["--module=llama3", "--config=llama3_debugmodel", *args], 2
    )
    module = "--module=lmkernels.integrations.torchtitan"
    fused = _run(assets, tmp_path, f"{name}-lmkernels", [module, "--config=llama3_debugmodel", *args], 2)
    assert not any(n for r in plain["ranks"] for n in r["calls"].values())  # torchtitan's own
    return plain, fused


@needs_torchtitan
def test_fsdp_two_processes(assets, tmp_path):
    """FSDP2 over 2 gloo processes (torchtitan shards lm_head with the final norm): the fused
    loss unshards lm_head through FSDP's hooks and its gradient is reduce-scattered as
    lm_head's own; equal to torchtitan's FSDP run without lmkernels."""
    fsdp = ["--parallelism.data_parallel_shard_degree=2", "--parallelism.spmd_backend=partial_dtensor"]
    plain, fused = _run_both(assets, tmp_path, "fsdp", fsdp)
    _assert_lmkernels_ran(fused)
    assert plain["lm_head"] == fused["lm_head"] == "FSDPLinear"
    _assert_same_training(plain, fused)


@needs_torchtitan
def test_tensor_parallel_two_processes(assets, tmp_path):
    """Tensor parallel over 2 gloo processes: lm_head is vocab-sharded (a DTensor weight, so
    the fused loss runs lmkernels' vocab-parallel loss), the norms and the GLU get DTensor
    inputs; equal to torchtitan's TP run without lmkernels."""
    # partial_dtensor: torchtitan's default spmd_types backend fails here without lmkernels too
    # (torch 2.13's fully_shard: "When dp_mesh_dims is provided, all parameters must be DTensors
    # on the full SPMD mesh ... Got plain tensor for parameter 'weight'").
    tp = ["--parallelism.tensor_parallel_degree=2", "--parallelism.spmd_backend=partial_dtensor"]
    plain, fused = _run_both(assets, tmp_path, "tp", tp)
    for r in fused["ranks"]:
        _assert_lmkernels_ran(r, loss_op=VOCAB_PARALLEL)
        assert r["calls"]["rope"] == 0, r["calls"]
    assert plain["lm_head"] == fused["lm_head"] == "FSDPLinear"
    _assert_same_training(plain, fused)


@needs_torchtitan
def test_pipeline_parallel_two_processes(assets, tmp_path):
    """Pipeline parallel over 2 gloo processes (torchtitan's schedule, 2 micro-batches): the
    loss runs on the last stage, which holds lm_head, as lmkernels' fused loss; the first
    stage never calls it. Equal to torchtitan's PP run without lmkernels."""
    pp = [
        "--parallelism.pipeline_parallel_degree=2",
        "--parallelism.pipeline_parallel_microbatch_size=1",
        "--training.disable_cuda_graphs",  # torchtitan's config check: its CUDA graphs refuse PP
    ]
    plain, fused = _run_both(assets, tmp_path, "pp", pp)
    first, last = fused["ranks"]
    layers = {k.split(".")[1] for k in fused["params"] if k.startswith("layers.")}
    assert layers == {str(i) for i in range(6)} and "lm_head.weight" in fused["params"]  # both stages
    assert first["lm_head"] is None and last["lm_head"] == plain["ranks"][-1]["lm_head"]
    assert last["loss_fn"] == "FusedLinearCrossEntropyLoss"
    assert first["calls"]["fused_linear_cross_entropy"] == 0, first["calls"]
    # One call per micro-batch (BATCH micro-batches of 1 sequence a step), and one more: on its
    # first step torch's schedule infers the stages' gradient metadata by running the last
    # stage's loss and backward once on empty tensors (torch.distributed.pipelining.stage,
    # _backward_metadata_inference), then discards it.
    assert last["calls"]["fused_linear_cross_entropy"] == STEPS * BATCH + 1, last["calls"]
    assert first["calls"]["rms_norm"] > 0 and first["calls"]["swiglu"] > 0, first["calls"]
    assert last["calls"]["rope"] > 0, last["calls"]
    _assert_same_training(plain, fused)


# ---- the pieces, without the trainer ----------------------------------------------------------


@pytest.fixture
def debug_model_config():
    pytest.importorskip("torchtitan")
    from torchtitan.models.llama3 import model_registry

    return model_registry("debugmodel").model


@needs_torchtitan
def test_converter_swaps_exact_types(debug_model_config):
    """LmkernelsConverter (a ModelConfigConverter, used like Float8LinearConverter) swaps the
    RMSNorm, ComplexRoPE and FeedForward configs; model_registry(converters=...) accepts it."""
    from torchtitan.models.llama3 import model_registry

    from lmkernels.integrations.torchtitan import LmkernelsConverter

    converter = LmkernelsConverter.Config(ops=["rms_norm", "mlp"], backend="eager").build()
    config = converter.convert(debug_model_config)
    assert (
        type(config.norm).__name__ == "Config" and type(config.norm).__qualname__ == "LmkernelsRMSNorm.Config"
    )
    assert type(config.layers[0].feed_forward).__qualname__ == "LmkernelsFeedForward.Config"
    assert type(config.layers[0].attention.rope).__qualname__ == "ComplexRoPE.Config"  # rope not asked for
    assert config.norm.backend == "eager"
    assert "norm" in converter.swapped and "layers.0.feed_forward" in converter.swapped
    spec = model_registry("debugmodel", converters=[LmkernelsConverter.Config()])
    assert type(spec.model.layers[0].attention.rope).__qualname__ == "LmkernelsComplexRoPE.Config"


@needs_torchtitan
@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm", "complex_rope", "cos_sin_rope", "feed_forward"])
def test_module_matches_torchtitan(kind, backend):
    """Each lmkernels module against the torchtitan module it replaces, same weights and inputs
    (fp32): outputs and gradients to 1e-5; RoPE (q and k in torchtitan's (batch, seq, heads,
    dim) layout, handed to lmkernels transposed) with per-sample and shared packed positions.
    Triton runs on the CPU interpreter here (tests/conftest.py)."""
    import torch
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, FeedForward, LayerNorm, Linear, RMSNorm

    from lmkernels.integrations.torchtitan.modules import replacement

    torch.manual_seed(0)
    if kind == "rms_norm":
        config = RMSNorm.Config(normalized_shape=32)
    elif kind == "layer_norm":
        config = LayerNorm.Config(normalized_shape=32)
    elif kind == "complex_rope":
        config = ComplexRoPE.Config(dim=16, max_seq_len=64, theta=500000, scaling="llama")
    elif kind == "cos_sin_rope":
        config = CosSinRoPE.Config(dim=16, max_seq_len=64)
    else:
        lin = Linear.Config
        config = FeedForward.Config(
            w1=lin(in_features=32, out_features=48),
            w2=lin(in_features=48, out_features=32),
            w3=lin(in_features=32, out_features=48),
        )
    ref = config.build()
    new = replacement(config, backend=backend).build()
    assert type(new).__mro__[1] is type(ref)
    new.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        new.load_state_dict(ref.state_dict())

    def run(module, inputs):
        inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = module(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs)
        loss.backward()
        grads = [t.grad for t in inputs if t.grad is not None] + [p.grad for p in module.parameters()]
        module.zero_grad()
        return outs, grads

    if "rope" in kind:
        q, k = torch.randn(2, 12, 4, 16), torch.randn(2, 12, 2, 16)
        cases = [
            [q, k],
            [q, k, torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]] * 2)],
            [q, k, torch.arange(12)[None] + 5],
        ]
    else:
        cases = [[torch.randn(3, 5, 32)]]
    for inputs in cases:
        ref_out, ref_grads = run(ref, inputs)
        new_out, new_grads = run(new, inputs)
        for a, b in zip(ref_out + tuple(ref_grads), new_out + tuple(new_grads)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@needs_torchtitan
def test_fused_loss_refuses_what_it_cannot_fuse():
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss, MSELoss

    from lmkernels.integrations.torchtitan.loss import FusedLinearCrossEntropyLoss, fused_loss_config
    from lmkernels.registry import LMKernelsError

    cfg = fused_loss_config(
        ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=8)), "eager"
    )
    assert type(cfg) is FusedLinearCrossEntropyLoss.Config and cfg.backend == "eager"
    assert cfg.loss_fn.global_vocab_size == 8
    assert type(fused_loss_config(CrossEntropyLoss.Config())) is FusedLinearCrossEntropyLoss.Config
    with pytest.raises(LMKernelsError, match="MSELoss"):
        fused_loss_config(MSELoss.Config())
    with pytest.raises(LMKernelsError, match="tritonn"):
        FusedLinearCrossEntropyLoss.Config(backend="tritonn").build()


@needs_torchtitan
@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_fused_loss_matches_chunked_loss(backend):
    """The fused loss against torchtitan's ChunkedLossWrapper on the same hidden states, lm_head
    and labels (with ignored tokens): loss, hidden-state and weight gradients."""
    import torch
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.models.common import Linear

    from lmkernels.integrations.torchtitan.loss import FusedLinearCrossEntropyLoss

    torch.manual_seed(0)
    head = Linear.Config(in_features=32, out_features=96).build()
    torch.nn.init.normal_(head.weight, std=0.2)
    hidden = torch.randn(2, 16, 32)
    labels = torch.randint(0, 96, (2, 16))
    labels[0, :3] = -100
    gvt = torch.tensor(50)
    results = []
    for loss_cfg in (
        ChunkedLossWrapper.Config(num_chunks=4),
        FusedLinearCrossEntropyLoss.Config(backend="eager"),
    ):
        loss_fn = loss_cfg.build()
        loss_fn.set_lm_head(head)
        h = hidden.clone().requires_grad_()
        loss, _ = loss_fn(h, labels, gvt)
        loss.backward()
        results.append((loss.detach(), h.grad, head.weight.grad.clone()))
        head.weight.grad = None
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


@needs_torchtitan
def test_benchmark_worker_pipeline_parallel(tmp_path):
    """The torchtitan runs of the distributed benchmark (`lmkernels-bench dist-scale --modes
    titan_*`: lmkernels_bench.scale_titan) on the debug model, 2 CPU processes, pipeline
    parallel: torchtitan trains under the benchmark's own config function and measurements."""
    out = tmp_path / "row.json"
    worker = ["--worker", "--mode", "titan_pp", "--config", "lmk", "--json", str(out)]
    worker += ["--ckpt-dir", str(tmp_path), "--steps", "4", "--batch", "2", "--seq", "64", "--tiny"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [os.path.abspath(__file__), "--bench", *worker]
    env = dict(os.environ, OMP_NUM_THREADS="1", LMKERNELS_BACKEND="eager")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-5000:]
    row = json.loads(out.read_text())
    assert row["status"] == "ok", row
    assert row["layout"] == {"dp_shard": 1, "tp": 1, "pp": 2}
    assert len(row["losses"]) == 4 and all(0 < x < 20 for x in row["losses"]), row["losses"]
    assert row["tokens_per_s_per_gpu"] > 0 and len(row["rank_peaks_gib"]) == 2


if __name__ == "__main__":
    if sys.argv[1] == "--bench":  # the benchmark's worker (scale.py --worker ARGS) under torchrun
        _cpu_shims()
        from lmkernels_bench.scale import main

        sys.exit(main(sys.argv[2:]))
    # The launcher: tests/test_integration_torchtitan.py OUT -- TORCHTITAN_ARGS (under torchrun)
    sep = sys.argv.index("--")
    _launch(sys.argv[1], sys.argv[sep + 1 :])
