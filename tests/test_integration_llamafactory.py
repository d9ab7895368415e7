"""LLaMA-Factory: the kernel "lmkernels" in LLaMA-Factory's kernel registry, applied by its own
model loader (`use_v1_kernels: lmkernels`), training a tiny local Llama through its `run_exp`
and through this package's launcher (`python -m lmkernels.integrations.llamafactory train`).

LLaMA-Factory pins its own transformers / PEFT / TRL: CI runs this file in a venv of its own
(.venv-llamafactory, built by .ci/run). Without llamafactory only the tests of the module's
own logic run (PEFT unwrapping, the launcher's keys), in the main venv.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("transformers", reason="the LLaMA-Factory integration patches transformers models")

from lmkernels.integrations import llamafactory as lk_lf  # noqa: E402
from lmkernels.integrations import transformers as lk_hf  # noqa: E402
from lmkernels.registry import LMKernelsError  # noqa: E402

HAS_LLAMAFACTORY = importlib.util.find_spec("llamafactory") is not None
needs_llamafactory = pytest.mark.skipif(
    not HAS_LLAMAFACTORY,
    reason="llamafactory is not installed (CI runs this file in .venv-llamafactory, see .ci/run)",
)

# ---- TEST-ONLY SHIM (CPU CI) -------------------------------------------------------------------
# LLaMA-Factory imports torchaudio at module level (llamafactory/data/mm_plugin.py, for audio
# inputs). PyPI has only CUDA builds of torchaudio, which cannot load beside the CPU torch CI
# installs, so .ci/run uninstalls it and the tests give LLaMA-Factory an empty stand-in module.
# Nothing here reads audio. On a GPU machine the real torchaudio imports and this does nothing.


def _torchaudio_stub(tmp_path_factory) -> str | None:
    if importlib.util.find_spec("torchaudio") is not None:
        return None
    stub_dir = tmp_path_factory.mktemp("stubs")
    (stub_dir / "torchaudio").mkdir()
    (stub_dir / "torchaudio" / "__init__.py").write_text(
        '"""Test-only stand-in: the CPU CI has no loadable torchaudio (see the test module)."""\n'
    )
    sys.modules.setdefault("torchaudio", types.ModuleType("torchaudio"))
    return str(stub_dir)


# ---- the module's own logic (no LLaMA-Factory needed) -----------------------------------------


def test_patch_after_the_adapter():
    """LLaMA-Factory applies kernels after the adapter: the model inside the PEFT model is
    patched, MLPs whose projections are LoRA layers included; a value-head wrapper is opened."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        lk_hf.tiny_model("llama", seed=0),
        peft.LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear", r=4, lora_alpha=8),
    )
    assert lk_lf.patch(model, backend="eager") is model
    assert {f.op for f in lk_hf.report(model).patched} >= {"rms_norm", "rope", "mlp", "flce"}

    class AutoModelForCausalLMWithValueHead(torch.nn.Module):  # trl's wrapper, as LLaMA-Factory uses it
        def __init__(self, pretrained_model):
            super().__init__()
            self.pretrained_model = pretrained_model

    inner = lk_hf.tiny_model("llama", seed=0)
    assert lk_lf.unwrap(AutoModelForCausalLMWithValueHead(inner)) is inner


def test_launcher_keys():
    """The launcher pops its own keys (LLaMA-Factory refuses unknown ones), defaults
    use_v1_kernels to "lmkernels", leaves the fused loss out for use_asft_loss (which reads
    the logits of a forward with labels), and refuses a kernel list without lmkernels."""
    saved = dict(lk_lf._settings)
    try:
        args = lk_lf._prepare(
            {"stage": "sft", "lmkernels_backend": "eager", "lmkernels_ops": "rms_norm, flce"},
            None,
            None,
            True,
        )
        assert args == {"stage": "sft", "use_v1_kernels": "lmkernels"}
        assert lk_lf._settings == {"backend": "eager", "ops": ("rms_norm", "flce"), "strict": True}
        lk_lf._prepare(
            {"use_asft_loss": True, "use_v1_kernels": "auto", "lmkernels_strict": False}, None, None, True
        )
        assert "flce" not in lk_lf._settings["ops"] and lk_lf._settings["strict"] is False
        with pytest.raises(LMKernelsError, match="add 'lmkernels'"):
            lk_lf._prepare({"use_v1_kernels": "npu_fused_moe"}, None, None, True)
        with pytest.raises(LMKernelsError, match="tritonn"):
            lk_lf._prepare({"lmkernels_backend": "tritonn"}, None, None, True)
        with pytest.raises(LMKernelsError, match="unknown"):
            lk_lf.configure(ops=["rms_nrom"])
    finally:
        lk_lf._settings.update(saved)


def test_register_without_llamafactory_names_it():
    if HAS_LLAMAFACTORY:
        pytest.skip("llamafactory is installed")
    with pytest.raises(LMKernelsError, match="needs LLaMA-Factory"):
        lk_lf.register()


def test_launcher_usage():
    assert lk_lf.main([]) == 2
    assert lk_lf.main(["train", "--help"]) == 0


# ---- through LLaMA-Factory ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny Llama with a word-level tokenizer (nothing from the hub), an alpaca-format dataset
    of uneven lengths, and the torchaudio stand-in where torchaudio cannot load."""
    import trainer_common

    root = tmp_path_factory.mktemp("llamafactory")
    V = trainer_common.save_tiny_checkpoint(root / "model").config.vocab_size
    rng = random.Random(0)

    def words(lo, hi):
        return " ".join(f"w{rng.randrange(3, V)}" for _ in range(rng.randrange(lo, hi)))

    rows = [{"instruction": words(3, 8), "input": "", "output": words(3, 12)} for _ in range(16)]
    (root / "data").mkdir()
    (root / "data" / "toy.json").write_text(json.dumps(rows))
    (root / "data" / "dataset_info.json").write_text(json.dumps({"toy": {"file_name": "toy.json"}}))
    return {"root": root, "stubs": _torchaudio_stub(tmp_path_factory)}


def _args(workdir, name, **extra) -> dict:
    """SFT, 3 optimizer steps of 2 accumulated batches of 2 rows, fp32 on the CPU."""
    root = workdir["root"]
    return {
        "model_name_or_path": str(root / "model"),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "full",
        "dataset": "toy",
        "dataset_dir": str(root / "data"),
        "template": "default",
        "cutoff_len": 32,
        "output_dir": str(root / name),
        "overwrite_output_dir": True,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 3,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "use_cpu": True,
        "seed": 0,
        "data_seed": 0,
        "preprocessing_num_workers": None,
        "dataloader_num_workers": 0,
        **extra,
    }


def _recorder():
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        """The logged losses and the trained model (run_exp returns nothing)."""

        def on_train_end(self, args, state, control, model=None, **kwargs):
            self.losses = [h["loss"] for h in state.log_history if "loss" in h]
            self.model = model
            self.params = {n: p.detach().clone() for n, p in model.named_parameters()}

    return Recorder()


def _assert_same_training(root, plain, patched):
    """The Trainer logs losses rounded to 4 decimals: compared to that resolution (as in
    test_integration_ecosystem.py); the weights are the sharp check, the convergence policy's
    fp32 limit on each parameter's training update (full fine-tuning) or on the adapters."""
    from transformers import AutoModelForCausalLM

    from lmkernels.convergence.compare import TOLERANCES_FP32

    print("losses without / with lmkernels:", plain.losses, patched.losses)
    assert len(plain.losses) == len(patched.losses) == 3
    torch.testing.assert_close(torch.tensor(patched.losses), torch.tensor(plain.losses), rtol=0, atol=1e-4)
    assert plain.params.keys() == patched.params.keys()
    init = dict(AutoModelForCausalLM.from_pretrained(root / "model").named_parameters())
    for name, p in plain.params.items():
        base = init.get(name.replace("base_model.model.", "").replace(".base_layer", ""))
        if "lora_" in name:
            update = p.norm()
        elif base is not None and not torch.equal(base.detach(), p):
            update = (p - base.detach()).norm()
        else:
            continue  # frozen
        err = ((patched.params[name] - p).norm() / update.clamp_min(1e-30)).item()
        assert err <= TOLERANCES_FP32["params"], f"{name}: update differs by {err:.2e}"


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


@pytest.fixture
def lf_env(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DISABLE_VERSION_CHECK", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    saved = dict(lk_lf._settings)
    yield
    lk_lf._settings.update(saved)


@needs_llamafactory
@pytest.mark.parametrize("finetuning_type", ["full", "lora"])
def test_kernel_trains_like_llamafactory_without_it(workdir, lf_env, monkeypatch, finetuning_type):
    """`use_v1_kernels: lmkernels`: LLaMA-Factory's loader applies the kernel to the model it
    loads for training (after the adapter: with LoRA on every linear layer, the LoRA layers run
    inside the fused GLU); the fused loss and the other ops run in every step, and the losses
    and weights equal the same run without it."""
    from llamafactory.train.tuner import run_exp

    extra = {"finetuning_type": finetuning_type}
    if finetuning_type == "lora":
        extra |= {"lora_target": "all", "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0}
    plain = _recorder()
    run_exp(_args(workdir, f"plain-{finetuning_type}", **extra), callbacks=[plain])
    assert not lk_hf.is_patched(lk_lf.unwrap(plain.model))

    calls = _count_calls(monkeypatch, ["rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"])
    patch = lk_lf.patch

    def patch_then_count(model, **kwargs):  # count training calls, not the checks apply() runs
        out = patch(model, **kwargs)
        calls.update(dict.fromkeys(calls, 0))
        return out

    monkeypatch.setattr(lk_lf, "patch", patch_then_count)
    patched = _recorder()
    lk_lf.run_exp(
        _args(workdir, f"lmkernels-{finetuning_type}", lmkernels_backend="eager", **extra),
        callbacks=[patched],
    )
    model = lk_lf.unwrap(patched.model)
    assert {"rms_norm", "rope", "mlp", "flce"} <= {f.op for f in lk_hf.report(model).patched}
    # 3 steps x 2 micro-batches, one fused loss each; LLaMA-Factory turns on gradient
    # checkpointing by default, so the layers' norms, rope and GLU also run in the recompute.
    layers = model.config.num_hidden_layers
    assert calls["fused_linear_cross_entropy"] == 6, calls
    assert calls["rms_norm"] == 6 * (4 * layers + 1) and calls["rope"] == 6 * 2 * layers, calls
    assert calls["swiglu"] >= 6 * 2 * layers, calls
    _assert_same_training(workdir["root"], plain, patched)


@needs_llamafactory
def test_launcher_runs_llamafactory_training(workdir, tmp_path):
    """`python -m lmkernels.integrations.llamafactory train config.yaml key=value`: LLaMA-Factory's
    own config file and overrides, the kernel registered and applied in that process."""
    import yaml

    config = _args(workdir, "cli", max_steps=1, lmkernels_backend="eager")
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, HF_HUB_OFFLINE="1", DISABLE_VERSION_CHECK="1", WANDB_MODE="disabled")
    if workdir["stubs"]:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [workdir["stubs"], env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-m", "lmkernels.integrations.llamafactory", "train", str(path), "logging_steps=1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-2500:]
    assert "lmkernels patch report" in log and "flce" in log, log[-2500:]
    state = json.loads((workdir["root"] / "cli" / "trainer_state.json").read_text())
    assert [h for h in state["log_history"] if "loss" in h], state
