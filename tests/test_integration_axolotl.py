"""The Axolotl plugin through Axolotl itself: config validation (the plugin's keys merged into
Axolotl's schema by its plugin manager), model loading with the plugin's hooks, and Axolotl's
training entry (load_datasets + train, what `axolotl train` runs), on a tiny local Llama.

Needs axolotl, which pins its own transformers / TRL / PEFT: CI runs this file in a venv of
its own (.venv-axolotl, built by .ci/run). Without axolotl only the import-error test runs.
"""

from __future__ import annotations

import importlib.util
import json
import random

import pytest

from lmkernels.registry import LMKernelsError

HAS_AXOLOTL = importlib.util.find_spec("axolotl") is not None
needs_axolotl = pytest.mark.skipif(
    not HAS_AXOLOTL, reason="axolotl is not installed (CI runs this file in .venv-axolotl, see .ci/run)"
)

PLUGIN = "lmkernels.integrations.axolotl.LmkernelsPlugin"


def test_import_without_axolotl_names_the_package():
    if HAS_AXOLOTL:
        pytest.skip("axolotl is installed")
    with pytest.raises(LMKernelsError, match="needs axolotl installed"):
        import lmkernels.integrations.axolotl  # noqa: F401


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny Llama checkpoint with a word-level tokenizer (nothing from the hub) and a jsonl
    completion dataset of rows with uneven lengths (padding: uneven ignored-token counts)."""
    import trainer_common

    root = tmp_path_factory.mktemp("axolotl")
    V = trainer_common.save_tiny_checkpoint(root / "model").config.vocab_size
    rng = random.Random(0)
    with open(root / "data.jsonl", "w") as f:
        for _ in range(32):
            words = [f"w{rng.randrange(3, V)}" for _ in range(rng.randrange(6, 24))]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    return root


def _config(workdir, name: str, **extra) -> dict:
    """3 optimizer steps of 2 accumulated micro-batches of 2 rows, fp32 on the CPU, a loss per
    step, nothing saved but what Axolotl always writes."""
    return {
        "base_model": str(workdir / "model"),
        "datasets": [{"path": str(workdir / "data.jsonl"), "ds_type": "json", "type": "completion"}],
        "dataset_prepared_path": str(workdir / "prepared"),
        "output_dir": str(workdir / name),
        "sequence_len": 32,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 3,
        "num_epochs": 1,
        "learning_rate": 1e-3,
        "optimizer": "adamw_torch",
        "lr_scheduler": "constant",
        "val_set_size": 0,
        "dataset_processes": 1,
        "dataset_num_proc": 1,
        "bf16": False,
        "fp32": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "seed": 42,
        **extra,
    }


@pytest.fixture
def axolotl_env(monkeypatch):
    """No telemetry and no hub (the model and tokenizer are local); a clean plugin manager (a
    singleton that keeps every plugin registered in the process)."""
    monkeypatch.setenv("AXOLOTL_DO_NOT_TRACK", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    from axolotl.integrations.base import PluginManager

    manager = PluginManager.get_instance()
    manager.plugins.clear()
    yield manager
    manager.plugins.clear()


def _train(workdir, name, **extra):
    """Axolotl's training entry on the config: what `axolotl train config.yml` runs."""
    from axolotl.cli.args import TrainerCliArgs
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.train import train
    from axolotl.utils.dict import DictDefault

    cfg = load_cfg(DictDefault(_config(workdir, name, **extra)))
    dataset_meta = load_datasets(cfg=cfg, cli_args=TrainerCliArgs())
    model, _, trainer = train(cfg=cfg, dataset_meta=dataset_meta)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return cfg, model, losses, params


def _count_calls(monkeypatch, names):
    import lmkernels

    calls = dict.fromkeys(names, 0)
    for name in names:
        original = getattr(lmkernels, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(lmkernels, name, counting)
    return calls


def _assert_same_training(workdir, losses, params, p_losses, p_params, trainable_only=False):
    """The convergence policy's fp32 limits (lmkernels.convergence.compare): every step's loss
    to 1e-5 relative, each parameter's training update to 3e-3 relative. With LoRA (frozen base
    weights) the adapters are compared relative to their norm: lora_B starts at zero, so its
    norm is its update."""
    from transformers import AutoModelForCausalLM

    from lmkernels.convergence.compare import TOLERANCES_FP32

    assert len(losses) == len(p_losses) == 3
    print("losses without / with lmkernels:", losses, p_losses)
    for plain, patched in zip(losses, p_losses):
        assert abs(patched - plain) <= TOLERANCES_FP32["loss curve"] * abs(plain), (losses, p_losses)
    assert params.keys() == p_params.keys()
    init = dict(AutoModelForCausalLM.from_pretrained(workdir / "model").named_parameters())
    for name, p in params.items():
        if trainable_only:
            if "lora_" not in name:
                continue
            update = p.norm().clamp_min(1e-30)
        else:
            update = (p - init[name].detach()).norm().clamp_min(1e-30)
        err = ((p_params[name] - p).norm() / update).item()
        assert err <= TOLERANCES_FP32["params"], f"{name}: update differs by {err:.2e}"


@needs_axolotl
def test_plugin_trains_like_axolotl_without_it(workdir, axolotl_env, monkeypatch):
    """`plugins: [lmkernels...LmkernelsPlugin]` + `lmkernels: true`: the norms, rope, SwiGLU
    and the fused loss run lmkernels ops, and every loss and the final weights equal the same
    config without the plugin (fp32, gradient accumulation over padded batches)."""
    from lmkernels.integrations import transformers as lk_hf

    _, plain_model, losses, params = _train(workdir, "plain")
    assert not lk_hf.is_patched(plain_model)

    calls = _count_calls(monkeypatch, ["rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"])
    import lmkernels.integrations.axolotl as lk_axolotl

    patch = lk_axolotl._patch

    def patch_then_count(cfg, model):  # count training calls, not the checks apply() runs
        patch(cfg, model)
        calls.update(dict.fromkeys(calls, 0))

    monkeypatch.setattr(lk_axolotl, "_patch", patch_then_count)
    cfg, model, p_losses, p_params = _train(
        workdir, "lmkernels", plugins=[PLUGIN], lmkernels=True, lmkernels_backend="eager"
    )
    assert PLUGIN in axolotl_env.plugins
    assert cfg.lmkernels is True and cfg.lmkernels_backend == "eager"
    patched = {f.op for f in lk_hf.report(model).patched}
    assert {"rms_norm", "rope", "mlp", "flce"} <= patched, lk_hf.report(model).format()
    # 3 steps x 2 micro-batches: one fused loss per forward; per layer 2 norms, rope and GLU.
    layers = model.config.num_hidden_layers
    assert calls["fused_linear_cross_entropy"] == 6, calls
    assert calls["rms_norm"] == 6 * (2 * layers + 1) and calls["rope"] == 6 * layers, calls
    assert calls["swiglu"] >= 6 * layers, calls
    _assert_same_training(workdir, losses, params, p_losses, p_params)


@needs_axolotl
def test_per_op_keys_choose_the_ops(workdir, axolotl_env):
    """`lmkernels: true` with `lmkernels_flce: false` patches everything but the loss; a single
    `lmkernels_rms_norm: true` (no `lmkernels`) patches only the norms."""
    from lmkernels.integrations.axolotl import selected_ops
    from lmkernels.integrations.transformers import SUPPORTED_OPS

    assert selected_ops({"lmkernels": True}) == SUPPORTED_OPS
    assert "flce" not in selected_ops({"lmkernels": True, "lmkernels_flce": False})
    assert selected_ops({"lmkernels_rms_norm": True}) == ("rms_norm",)
    assert selected_ops({"lmkernels": False, "lmkernels_glu": True}) == ("mlp",)
    assert selected_ops({}) == ()


@needs_axolotl
@pytest.mark.parametrize(
    "extra, message",
    [
        ({"lmkernels_backend": "tritonn"}, "tritonn"),
        ({"liger_rms_norm": True}, "lmkernels_rms_norm and liger_rms_norm"),
        ({"chunked_cross_entropy": True}, "lmkernels_flce and chunked_cross_entropy"),
    ],
)
def test_config_validation_refuses(workdir, axolotl_env, extra, message):
    """Axolotl's config validation runs the plugin's checks: a backend spec that does not parse
    and an op another option also replaces are refused before anything is loaded."""
    from axolotl.cli.config import load_cfg
    from axolotl.utils.dict import DictDefault

    plugins = [PLUGIN] + (["axolotl.integrations.liger.LigerPlugin"] if "liger_rms_norm" in extra else [])
    cfg = _config(workdir, "refused", plugins=plugins, lmkernels=True, **extra)
    with pytest.raises(Exception, match=message):
        load_cfg(DictDefault(cfg))


LORA = dict(
    adapter="lora",
    lora_r=4,
    lora_alpha=8,
    lora_dropout=0.0,
    lora_target_linear=True,
    # Axolotl's own fused LoRA kernels (on by default for LoRA) need CUDA.
    lora_mlp_kernel=False,
    lora_qkv_kernel=False,
    lora_o_kernel=False,
    lora_embedding_kernel=False,
)


@needs_axolotl
def test_lora_inside_the_fused_mlp(workdir, axolotl_env):
    """`adapter: lora` on every linear layer: the plugin patches before PEFT wraps the
    projections (post_model_build), so the gated MLP is fused with LoRA running inside it, and
    the run equals Axolotl's LoRA run without the plugin."""
    from lmkernels.integrations import transformers as lk_hf

    _, _, losses, params = _train(workdir, "lora-plain", **LORA)
    _, model, p_losses, p_params = _train(
        workdir, "lora", plugins=[PLUGIN], lmkernels=True, lmkernels_backend="eager", **LORA
    )
    base = model.get_base_model()
    assert {"rms_norm", "rope", "mlp", "flce"} <= {f.op for f in lk_hf.report(base).patched}
    assert type(base.model.layers[0].mlp.gate_proj).__module__.startswith("peft.")
    _assert_same_training(workdir, losses, params, p_losses, p_params, trainable_only=True)


@needs_axolotl
def test_axolotl_lora_mlp_kernel_keeps_the_mlp(workdir, axolotl_env):
    """With Axolotl's fused LoRA MLP kernel on (its default for LoRA), which sets the MLP's
    forward after the adapter is in, the plugin leaves the MLP to it and patches the rest."""
    from axolotl.utils.dict import DictDefault

    from lmkernels.integrations import transformers as lk_hf
    from lmkernels.integrations.axolotl import LmkernelsPlugin

    model = lk_hf.tiny_model("llama", seed=0)
    cfg = DictDefault(lmkernels=True, lmkernels_backend="eager", adapter="lora", lora_mlp_kernel=True)
    LmkernelsPlugin().post_model_build(cfg, model)
    patched = {f.op for f in lk_hf.report(model).patched}
    assert "mlp" not in patched and {"rms_norm", "rope", "flce"} <= patched
