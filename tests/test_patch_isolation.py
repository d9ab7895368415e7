"""Patching is per model: a model that was not patched computes, bit for bit, what it computes in a
process that never imported lmkernels, whatever other models of its family were built, patched
and deleted, in any order.

The baseline comes from a subprocess that imports transformers alone. Each family's patched
model runs on a probe backend (the eager references, counting their calls), so a replacement
that leaks into the unpatched model shows up twice: as calls made during its forward, and as
differences in its outputs (fp64 in the Llama case, which lmkernels' ops refuse).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers integration needs the hf extra")

from lmkernels.integrations import transformers as lk_hf  # noqa: E402
from lmkernels.integrations.transformers.families import TESTED, tiny_config  # noqa: E402
from lmkernels.registry import LMKernelsError, get_op, register, unregister  # noqa: E402

PROBE = "isolation_probe"
OPS = ("rms_norm", "layer_norm", "rope", "swiglu", "geglu", "fused_linear_cross_entropy")
CASES = [(family, "float32") for family in TESTED] + [("llama", "float64")]

# Runs in a fresh interpreter that never imports lmkernels: builds each model from its config
# (seeded), runs a forward with labels and a backward, saves logits, loss and gradients.
BASELINE = textwrap.dedent(
    """
    import json, sys, torch
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.set_num_threads(1)
    assert "lmkernels" not in sys.modules
    cases = json.loads(sys.argv[1])
    out = {}
    for key, (model_type, fields, dtype) in cases.items():
        config = AutoConfig.for_model(model_type, **fields)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
        ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
        result = model(ids, labels=ids)
        result.loss.backward()
        out[key] = {
            "logits": result.logits.detach(),
            "loss": result.loss.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        }
    assert "lmkernels" not in sys.modules
    torch.save(out, sys.argv[2])
    """
)


def _config_fields(model_type: str) -> dict:
    fields = tiny_config(model_type).to_dict()
    fields.pop("model_type")
    return fields


def _build(model_type: str, dtype: str):
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))


def _run(model) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    result = model(ids, labels=ids)
    result.loss.backward()
    return {
        "logits": None if result.logits is None else result.logits.detach(),  # a patched model's: None
        "loss": result.loss.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
    }


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert torch.equal(got["loss"], want["loss"]), f"{what}: loss {got['loss']} != {want['loss']}"
    assert torch.equal(got["logits"], want["logits"]), f"{what}: logits differ"
    assert got["grads"].keys() == want["grads"].keys(), f"{what}: other parameters got gradients"
    for name, grad in want["grads"].items():
        assert torch.equal(got["grads"][name], grad), f"{what}: gradient of {name} differs"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    cases = {f"{m}-{d}": (m, _config_fields(m), d) for m, d in CASES}
    path = tmp_path_factory.mktemp("isolation") / "baseline.pt"
    subprocess.run(
        [sys.executable, "-c", BASELINE, json.dumps(cases), str(path)],
        check=True,
        timeout=600,
        env={k: v for k, v in __import__("os").environ.items() if not k.startswith("LMKERNELS")},
    )
    return torch.load(path)


@pytest.fixture
def probe_calls():
    """A backend of every op that runs the eager reference and counts its calls."""
    calls: list[str] = []

    def counting(op):
        reference = get_op(op).reference

        def fn(*args, **kwargs):
            calls.append(op)
            return reference(*args, **kwargs)

        return fn

    for op in OPS:
        register(op, PROBE, counting(op), priority=-100)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield calls
    torch.set_num_threads(threads)
    for op in OPS:
        unregister(op, PROBE)


def _apply(model):
    # fp64 models are refused (lmkernels' ops take fp32, bf16, fp16): the patched one is fp32.
    return lk_hf.apply(model, backend=PROBE)


@pytest.mark.parametrize("model_type,dtype", CASES, ids=[f"{m}-{d}" for m, d in CASES])
def test_an_unpatched_model_computes_what_plain_transformers_computes(
    model_type, dtype, baseline, probe_calls
):
    want = baseline[f"{model_type}-{dtype}"]

    # built before another model of its family is patched
    plain = _build(model_type, dtype)
    patched = _apply(_build(model_type, "float32"))
    probe_calls.clear()
    _assert_same(_run(plain), want, "built before, run while the other is patched")
    assert probe_calls == [], f"lmkernels ops ran in the unpatched model: {sorted(set(probe_calls))}"

    # the patched model really runs the probe backend
    _run(patched)
    assert probe_calls, "the patched model ran none of lmkernels' ops"

    # built after; then with the patched model deleted; then with a second one patched
    probe_calls.clear()
    later = _build(model_type, dtype)
    _assert_same(_run(later), want, "built while the other is patched")
    del patched
    gc.collect()
    _assert_same(_run(plain), want, "after the patched model was deleted")
    assert probe_calls == [], f"lmkernels ops ran in the unpatched models: {sorted(set(probe_calls))}"
    other = _apply(_build(model_type, "float32"))
    probe_calls.clear()  # (apply verified each replacement on the probe backend)
    _assert_same(_run(later), want, "while a second model is patched")
    lk_hf.revert(other)
    _assert_same(_run(later), want, "after the second was reverted")
    assert probe_calls == []


def test_apply_refuses_an_fp64_model_by_name():
    model = _build("llama", "float64")
    with pytest.raises(LMKernelsError, match=r"LlamaForCausalLM: parameter .* is torch.float64"):
        lk_hf.apply(model)
    assert not lk_hf.is_patched(model)


def test_each_patched_model_keeps_its_own_rope_backend(probe_calls):
    """Two models of one family patched with different backends: each runs its own."""
    first = lk_hf.apply(_build("llama", "float32"), backend=PROBE)
    second = lk_hf.apply(_build("llama", "float32"), backend="eager")
    probe_calls.clear()
    _run(second)
    assert "rope" not in probe_calls
    _run(first)
    assert "rope" in probe_calls
