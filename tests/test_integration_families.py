"""Every tested transformers family, patched by structure, trains the same as plain transformers.

Tiny random models (lmkernels.integrations.transformers.tiny_model: hidden 64, 2 layers, vocab
128, MoE 4 experts top 2), fp32 on the CPU, 3 AdamW steps on one batch of random tokens: the patched run is
compared with plain transformers by the convergence policy (loss curve, eval loss, top-k
log-probs, final parameters; lmkernels.convergence.compare.TOLERANCES_FP32). The apply-time
report must list exactly the ops expected for the family (EXPECTED: the source of the family
table of docs/integration.md, `lmkernels-bench families-table`).

Backends: eager for the training matrix (fast; the compile backend and Triton on Llama / Gemma2
run in test_integration_transformers.py). The Triton interpreter is slow, so it runs one
training step (loss and every gradient) of the families whose op variants those do not cover.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers integration needs the hf extra")

from lmkernels.convergence.compare import TOLERANCES_FP32, compare  # noqa: E402
from lmkernels.convergence.data import Batches  # noqa: E402
from lmkernels.convergence.train import Patch, TrainConfig, train_run  # noqa: E402
from lmkernels.integrations import transformers as lk_hf  # noqa: E402
from lmkernels.registry import LMKernelsError  # noqa: E402

RMS = ("rms_norm", "rope", "mlp", "flce", "causal_mask")
LN_NO_GLU = ("layer_norm", "rope", "flce", "causal_mask")
# model type -> (ops the report must list as patched, kinds it must keep with a reason)
EXPECTED = {
    "llama": (RMS, ()),
    "mistral": (RMS, ()),
    "mixtral": (RMS, ()),
    "qwen2": (RMS, ()),
    "qwen2_moe": (RMS, ()),
    "qwen3": (RMS, ()),
    "qwen3_moe": (RMS, ()),
    "qwen3_next": (RMS, ()),
    "phi3": (RMS, ()),
    "gemma": (RMS, ()),
    "gemma2": (RMS, ()),
    "gemma3_text": (RMS[:-1], ("causal_mask",)),  # its forward copies the mask kwargs: kept
    "olmo": (("layer_norm", "rope", "mlp", "flce", "causal_mask"), ()),
    "olmo2": (RMS, ()),
    "granite": (RMS, ()),
    "cohere": (("layer_norm", "rope", "mlp", "flce", "causal_mask"), ()),
    "glm": (RMS, ()),
    "smollm3": (RMS, ()),
    "gpt_neox": (LN_NO_GLU, ("mlp",)),
    "starcoder2": (LN_NO_GLU, ("mlp",)),
}
BACKENDS: dict[str, str] = {}  # all eager here; Triton below, compile in test_integration_transformers.py
TRITON_FAMILIES = ("cohere", "gpt_neox")  # LayerNorm (weight only / with bias), interleaved and partial rope
STEPS, B, T, V = 3, 2, 16, 128


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: torch's intra-op threads only add synchronization (10x slower on a busy
    2-core machine); restored after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _backend(model_type: str) -> str:
    backend = BACKENDS.get(model_type, "eager")
    if backend == "triton":
        _require_triton()
    return backend


def _require_triton():
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("triton runs on the CPU only under TRITON_INTERPRET=1 (tests/conftest.py sets it)")


def _batches() -> Batches:
    # one batch, seen every step: the tiny model memorizes it, so the loss really falls
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    return Batches(train=[ids] * STEPS, eval=[ids], vocab_size=V)


def test_expected_covers_the_tested_families():
    assert tuple(EXPECTED) == lk_hf.TESTED


@pytest.mark.parametrize("model_type", list(EXPECTED))
def test_family_patched_trains_like_plain(model_type):
    backend = _backend(model_type)
    base = lk_hf.tiny_model(model_type, seed=0)
    report = lk_hf.patch_report(base, backend=backend)
    patched_ops, kept_ops = EXPECTED[model_type]
    assert not report.failed, report.format()
    assert sorted(report.patched_ops()) == sorted(patched_ops), report.format()
    assert sorted({f.op for f in report.kept}) == sorted(kept_ops), report.format()
    assert all(f.detail for f in report.kept), "every kept module needs a reason"

    batches = _batches()
    cfg = TrainConfig(family=model_type, steps=STEPS, batch_size=B, seq_len=T, topk=4, vocab_size=V)
    init = {n: p.detach().float().clone() for n, p in base.named_parameters()}
    plain = train_run(base, batches, cfg, label=f"{model_type} plain")
    run = train_run(base, batches, cfg, patch=Patch(backend, lk_hf.SUPPORTED_OPS), label=model_type)
    checks = compare(run, plain, init, cfg.topk)
    failed = [f"{c.metric} {c.value:.2e} > {c.limit:.0e} ({c.detail})" for c in checks if not c.passed]
    assert not failed, f"{model_type} ({backend}): " + "; ".join(failed)
    assert {c.limit for c in checks} <= set(TOLERANCES_FP32.values())
    assert plain.losses[-1] < plain.losses[0], "the runs must really train"


@pytest.mark.parametrize("model_type", TRITON_FAMILIES)
def test_family_triton_step_matches_plain(model_type, triton_device):
    _require_triton()
    device = triton_device
    plain = lk_hf.tiny_model(model_type, seed=0).to(device)
    patched = lk_hf.apply(lk_hf.tiny_model(model_type, seed=0).to(device), backend="triton")
    assert set(lk_hf.report(patched).patched_ops()) == set(EXPECTED[model_type][0])
    ids = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(0)).to(device)
    losses, grads = [], []
    for model in (plain, patched):
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for name, g in grads[0].items():
        err = ((grads[1][name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"


def test_class_level_patch_of_a_new_family():
    """apply("qwen3") verifies on a tiny Qwen3 and patches the classes for every later model."""
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    ref = lk_hf.tiny_model("qwen3", seed=3)
    ref.train()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    try:
        lk_hf.apply("qwen3", backend="eager")
        assert lk_hf.is_patched("qwen3") and lk_hf.family_patches("qwen3")
        model = lk_hf.tiny_model("qwen3", seed=3)
        model.train()
        out = model(input_ids=ids, labels=ids)
    finally:
        lk_hf.revert("qwen3")
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=0)
    assert not lk_hf.family_patches("qwen3")


def test_strict_fails_loudly_on_a_wrong_module_and_non_strict_reports_it():
    """A module that looks like an RMSNorm but computes something else is never patched: strict
    apply raises naming it, non-strict keeps it and patches the rest."""
    model = lk_hf.tiny_model("llama")

    class OddRMSNorm(torch.nn.Module):  # RMSNorm by name, but x * w: no normalization
        def __init__(self, n):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(n))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return x * self.weight

    model.model.norm = OddRMSNorm(model.config.hidden_size)
    with pytest.raises(LMKernelsError, match=r"rms_norm OddRMSNorm: no RMSNorm .* matches"):
        lk_hf.apply(model, backend="eager")
    assert not lk_hf.is_patched(model)
    lk_hf.apply(model, backend="eager", strict=False)
    report = lk_hf.report(model)
    assert [f.what for f in report.failed] == ["OddRMSNorm"]
    assert "rms_norm: LlamaRMSNorm x4" in report.summary()["patched"]
    assert "forward" not in vars(model.model.norm)
    lk_hf.revert(model)


def test_report_fits_80_columns():
    text = lk_hf.patch_report("gemma2", backend="eager").format()
    assert "final softcap" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_patch_report_cli(capsys):
    from lmkernels.cli import main

    assert main(["patch-report", "--model-type", "gpt_neox", "--backend", "eager"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^mlp +GPTNeoXMLP x2 +not a gated MLP", out, re.M) and "rotary dim 4 of 16" in out
    assert max(len(line) for line in out.splitlines()) <= 80


# --- tiny configs are tiny, whatever the config's attribute names -----------------------------

# Families whose configs store the sizes under other names (attribute_map: gpt2's n_embd,
# n_layer; bloom's n_layer) or have size fields of their own (gptj's rotary_dim, falcon's
# ffn_hidden_size, opt's ffn_dim), beside the tested ones.
OTHER_TYPES = (
    "gptj",
    "gpt2",
    "gpt_neox",
    "bloom",
    "falcon",
    "opt",
    "codegen",
    "gpt_bigcode",
    "mpt",
    "gpt_neo",
)
TINY_BOUND = 2_000_000  # parameters: hidden 64, 2 layers, vocab 128 and MoE experts stay far below


@pytest.mark.parametrize("model_type", sorted(set(lk_hf.TESTED) | set(OTHER_TYPES)))
def test_tiny_config_is_tiny(model_type):
    from lmkernels.integrations.transformers.families import TINY, causal_lm_types, parameter_count

    if model_type not in causal_lm_types():
        pytest.skip(f"transformers has no {model_type}")
    config = lk_hf.tiny_config(model_type)
    assert config.hidden_size == TINY["hidden_size"]
    assert config.num_hidden_layers == TINY["num_hidden_layers"]
    assert config.num_attention_heads == TINY["num_attention_heads"]
    assert parameter_count(config) < TINY_BOUND


def test_tiny_config_overrides_take_either_name():
    """An override by its canonical name (hidden_size) or its stored name (n_embd) replaces the
    tiny value, not the other way round."""
    assert lk_hf.tiny_config("gpt2", hidden_size=32).n_embd == 32
    assert lk_hf.tiny_config("gpt2", n_layer=3).num_hidden_layers == 3
    assert lk_hf.tiny_config("llama", num_hidden_layers=3).num_hidden_layers == 3


def test_patch_report_of_gptj_is_fast():
    """gptj's default config is 6B parameters (hidden 4096 x 28 layers as n_embd, n_layer)."""
    import time

    start = time.perf_counter()
    report = lk_hf.patch_report("gptj", backend="eager")
    assert time.perf_counter() - start < 30
    assert "layer_norm" in report.patched_ops()
    model = lk_hf.tiny_model("gptj")
    assert sum(p.numel() for p in model.parameters()) < TINY_BOUND


def test_verification_models_over_the_size_bound_are_refused(tmp_path, monkeypatch, capsys):
    """tiny_model (which patch_report and apply build for a model type) and `lmkernels
    patch-report --config` refuse, before allocating it, a model over MAX_VERIFY_PARAMS, naming
    its config and its parameter count."""
    from transformers import AutoConfig

    from lmkernels.cli import main
    from lmkernels.integrations.transformers.families import MAX_VERIFY_PARAMS, parameter_count

    big = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 4, "vocab_size": 32000}
    n = parameter_count(lk_hf.tiny_config("llama", **big))
    assert n > MAX_VERIFY_PARAMS
    message = rf"config: a verification model of LlamaConfig \(llama\) would have {n / 1e6:,.0f}M parameters"
    with pytest.raises(LMKernelsError, match=message):
        lk_hf.tiny_model("llama", **big)
    with pytest.raises(LMKernelsError, match=message):
        lk_hf.patch_report("llama", **big)
    with pytest.raises(LMKernelsError, match=r"would have 0\.\d+M parameters, over the 0\.01M limit"):
        lk_hf.families.check_verification_size(lk_hf.tiny_config("llama"), limit=10_000)
    # A checkpoint's config is shrunk to the tiny sizes (by its stored names too)...
    AutoConfig.for_model("gptj").save_pretrained(tmp_path / "gptj")
    assert main(["patch-report", "--config", str(tmp_path / "gptj"), "--backend", "eager"]) in (0, 1)
    # ... and one whose sizes sit where shrinking does not reach is refused.
    AutoConfig.for_model("llama", **big).save_pretrained(tmp_path / "big")
    monkeypatch.setattr(lk_hf.families, "TINY", {})  # as if the tiny fields named none of its sizes
    capsys.readouterr()
    assert main(["patch-report", "--config", str(tmp_path / "big")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert re.search(r"LlamaConfig \(llama\) would have \d+M parameters, over the 50M limit", err), err
