"""Trainers and PEFT around a patched model: TRL's fused LM head run on lmkernels' fused loss (or
kept, logged with the reason), LmkernelsCallback (the one switch for the Trainer and TRL's
trainers), PEFT wrapping before or after the patch, LoRA on lm_head.

Tiny Llama-family models, fp32 on the CPU, eager backend; a few steps each. Per-token outputs and
gradients: 1e-5 relative (the fused loss sums in another order); trainer runs: the logged losses
to their 4-decimal resolution and the final weights to 1e-4 relative (trainer_common).
"""

from __future__ import annotations

import copy
import logging
import types

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers integration needs the hf extra")

import trainer_common as tc  # noqa: E402
from lmkernels.integrations import transformers as lk_hf  # noqa: E402
from lmkernels.integrations.transformers import patching  # noqa: E402
from lmkernels.registry import LMKernelsError  # noqa: E402

RTOL = 1e-5
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: torch's intra-op threads only add synchronization; restored after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _decision(model):
    return vars(model)[patching.RECORD].trl_decision


def _lmk_messages(caplog):
    return [r for r in caplog.records if r.name == "lmkernels"]


# --- TRL's fused head: the outputs, against TRL's own ---------------------------------------------


def _trl_batch(model, seed=0):
    """Input ids, and labels that are the model's own top-1 next token at every other position
    (so is_top1 has both values), with ignored tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, tc.V, (2, 12), generator=g)
    with torch.no_grad():
        top = model.eval()(input_ids=ids).logits.argmax(-1)
    model.train()
    labels = ids.clone()
    labels[:, 2::2] = top[:, 1:-1:2]
    labels[0, :3] = labels[1, -2:] = -100
    return ids, labels


def _with_trl_head(model, **kwargs):
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, **kwargs)
    return model


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


DPO_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")
WPO_OUTPUTS = (*DPO_OUTPUTS, "log_sum_sq_probs")
GRPO_OUTPUTS = ("log_probs", "entropy")


@pytest.mark.parametrize(
    "model_type, head_kwargs, call, backend",
    [
        ("llama", {}, "num_items", "eager"),
        ("llama", {}, "num_items", "triton"),  # (the Triton interpreter on the CPU)
        ("llama", {}, "shift_labels", "eager"),
        ("gemma2", {"temperature": 0.7}, "", "eager"),  # final softcap, then the temperature
        ("cohere", {"temperature": 1.3, "cast_lm_head_to_fp32": True}, "", "eager"),  # logit_scale
        ("llama", {"outputs": DPO_OUTPUTS}, "", "eager"),  # DPO / KTO: mean_logits
        ("gemma2", {"outputs": WPO_OUTPUTS, "temperature": 0.7}, "num_items", "eager"),  # WPO, softcap
        ("llama", {"outputs": DPO_OUTPUTS}, "", "triton"),
        ("llama", {"outputs": GRPO_OUTPUTS, "temperature": 0.7}, "entropy_bonus", "eager"),  # entropy_coef
    ],
)
def test_trl_head_outputs_equal_trl(model_type, head_kwargs, call, backend, caplog):
    """model(..., fused_lm_head=True) on a patched model runs lmkernels' fused loss (routed at its
    first call, logged once) and returns what TRL's head returns: log-probs with their gradient,
    entropy (with its gradient, for an entropy bonus, where the backend has it), top-1, mean
    logits, log sum p^2, label mask, loss; over calls after the first too."""
    pytest.importorskip("trl", reason="TRL is in the hf extra")
    head_kwargs = {"outputs": SFT_OUTPUTS, **head_kwargs}
    outputs = head_kwargs["outputs"]
    plain = tc.tiny(model_type)
    ids, labels = _trl_batch(plain)
    kwargs = dict(input_ids=ids, labels=labels, fused_lm_head=True)
    if call == "num_items":
        kwargs["num_items_in_batch"] = torch.tensor(13)
    if call == "shift_labels":
        kwargs["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    ref_model = _with_trl_head(copy.deepcopy(plain), **head_kwargs)
    model = lk_hf.apply(copy.deepcopy(plain), backend=backend)
    model = _with_trl_head(model, **head_kwargs)

    def objective(out):
        total = out.loss + out.log_probs[0].sum()
        return total - 0.1 * out.entropy.sum() if call == "entropy_bonus" else total

    ref = ref_model(**kwargs)
    objective(ref).backward()
    with caplog.at_level(logging.INFO, logger="lmkernels"), tc.flce_calls() as calls:
        outs = [model(**kwargs) for _ in range(2)]
    per_call = ["none", "none"] if "log_sum_sq_probs" in outputs else ["none"]
    assert calls == per_call * 2
    assert _decision(model).ours
    [record] = _lmk_messages(caplog)
    assert record.levelno == logging.INFO and "runs on lmkernels.fused_linear_cross_entropy" in record.message
    objective(outs[0]).backward()
    for out in outs:
        assert out.log_probs.shape == ref.log_probs.shape
        assert _rel(out.log_probs, ref.log_probs) <= RTOL
        assert _rel(out.entropy, ref.entropy) <= RTOL
        if "is_top1" in outputs:
            assert (
                torch.equal(out.is_top1.bool(), ref.is_top1.bool())
                and out.is_top1.any()
                and not out.is_top1.all()
            )
        for name in ("mean_logits", "log_sum_sq_probs", "is_top1"):
            assert (getattr(out, name) is None) == (name not in outputs), name
        for name in ("mean_logits", "log_sum_sq_probs"):
            if name in outputs:
                assert _rel(getattr(out, name), getattr(ref, name)) <= RTOL, name
                assert not getattr(out, name).requires_grad
        assert torch.equal(out.label_mask, ref.label_mask)
        assert _rel(out.loss, ref.loss) <= RTOL
    ref_grads, grads = _grads(ref_model), _grads(model)
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in ref_grads.items():
        assert _rel(grads[name], g) <= 1e-4, name


def test_trl_head_wrapped_before_apply():
    """TRL's head added before apply() (a trainer built first): apply() keeps it routable, the plain
    path (labels, no fused_lm_head) runs lmkernels' loss, and revert() restores TRL's forward."""
    pytest.importorskip("trl", reason="TRL is in the hf extra")
    plain = tc.tiny()
    ids, labels = _trl_batch(plain)
    ref = _with_trl_head(copy.deepcopy(plain), outputs=SFT_OUTPUTS)(
        input_ids=ids, labels=labels, fused_lm_head=True
    )
    model = _with_trl_head(copy.deepcopy(plain), outputs=SFT_OUTPUTS)
    trl_forward = vars(model)["forward"]
    lk_hf.apply(model, backend="eager")
    assert _decision(model).ours
    with tc.flce_calls() as calls:
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        plain_out = model(input_ids=ids, labels=labels)
    assert calls == ["none", "mean"] and plain_out.logits is None
    assert _rel(out.log_probs, ref.log_probs) <= RTOL
    torch.testing.assert_close(
        plain_out.loss, plain.train()(input_ids=ids, labels=labels).loss, rtol=RTOL, atol=0
    )
    lk_hf.revert(model)
    assert vars(model)["forward"] == trl_forward


def _accelerate_wrapped(model):
    """The model's forward wrapped as accelerate's prepare_model wraps it under mixed precision
    (autocast, outputs to fp32; autocast off here so the values compare exactly)."""
    from accelerate.utils import convert_outputs_to_fp32

    autocast = torch.autocast("cpu", enabled=False)
    model.forward = types.MethodType(convert_outputs_to_fp32(autocast(model.forward.__func__)), model)
    return model


def test_trl_head_inside_accelerate_wrapper_before_apply():
    """TRL's head inside accelerate's wrapper before apply() (a trainer's reference model, which
    LmkernelsCallback patches at on_train_begin): the wrapper stays, the forward TRL's head wraps
    becomes the patched one, the head runs on lmkernels; revert() restores TRL's."""
    pytest.importorskip("trl", reason="TRL is in the hf extra")
    pytest.importorskip("accelerate")
    plain = tc.tiny()
    ids, labels = _trl_batch(plain)
    ref = _accelerate_wrapped(_with_trl_head(copy.deepcopy(plain), outputs=DPO_OUTPUTS))
    model = _accelerate_wrapped(_with_trl_head(copy.deepcopy(plain), outputs=DPO_OUTPUTS))
    wrapper = vars(model)["forward"]
    lk_hf.apply(model, backend="eager")
    assert vars(model)["forward"] is wrapper and _decision(model).ours
    with tc.flce_calls() as calls, torch.no_grad():
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        want = ref(input_ids=ids, labels=labels, fused_lm_head=True)
    assert calls == ["none"]
    for name in DPO_OUTPUTS:
        assert _rel(getattr(out, name).float(), getattr(want, name).float()) <= RTOL, name
    lk_hf.revert(model)
    with tc.flce_calls() as calls, torch.no_grad():
        model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert calls == [] and vars(model)["forward"] is wrapper


@pytest.mark.parametrize(
    "outputs, hints, backend, expect",
    [
        # DPO / KTO (mean_logits) and WPO (log_sum_sq_probs): lmkernels computes them.
        (DPO_OUTPUTS, {}, "eager", None),
        (WPO_OUTPUTS, {}, "eager", None),
        # GRPO / RLOO: the entropy carries its gradient on every backend of ours (routed).
        (GRPO_OUTPUTS, {}, "triton", None),
        (GRPO_OUTPUTS, {}, "eager", None),
        (SFT_OUTPUTS, {"prefer": "trl"}, "eager", "trl_head='trl'"),
    ],
)
def test_trl_head_kept_with_reason(outputs, hints, backend, expect, caplog):
    """Where lmkernels' fused loss cannot give the trainer what it reads, TRL's head is kept, logged
    once with the reason (WARNING; INFO for trl_head='trl'), and TRL's outputs come back unchanged;
    elsewhere lmkernels runs it."""
    pytest.importorskip("trl", reason="TRL is in the hf extra")
    plain = tc.tiny()
    ids, labels = _trl_batch(plain)
    ref = _with_trl_head(copy.deepcopy(plain), outputs=outputs)(
        input_ids=ids, labels=labels, fused_lm_head=True
    )
    model = lk_hf.apply(copy.deepcopy(plain), backend=backend)
    vars(model)[patching.RECORD].hints.update(hints)
    _with_trl_head(model, outputs=outputs)
    with caplog.at_level(logging.INFO, logger="lmkernels"), tc.flce_calls() as calls:
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        model(input_ids=ids, labels=labels, fused_lm_head=True)
    [record] = _lmk_messages(caplog)
    if expect is None:
        assert _decision(model).ours and calls and set(calls) == {"none"}
    else:
        assert not _decision(model).ours and calls == []
        assert "TRL's fused LM head kept" in record.message and expect in record.message
        assert record.levelno == (logging.INFO if hints.get("prefer") == "trl" else logging.WARNING)
    for name in outputs:  # TRL's values (the patched body differs by rounding)
        assert _rel(getattr(out, name).float(), getattr(ref, name).float()) <= RTOL, name


def test_trl_head_kept_without_flce():
    """ops without "flce": TRL's head is not routed (no pre-hook), and the callback says so."""
    pytest.importorskip("trl", reason="TRL is in the hf extra")
    model = _with_trl_head(lk_hf.apply(tc.tiny(), backend="eager", ops=("rms_norm", "mlp")))
    ids, labels = _trl_batch(model)
    with tc.flce_calls() as calls:
        model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert calls == [] and _decision(model) is None
    cb = lk_hf.LmkernelsCallback()
    cb.on_train_begin(types.SimpleNamespace(), None, None, model=model)
    assert not _decision(model).ours and "flce is not patched" in cb.summary


@pytest.mark.parametrize("backend", ["eager", "triton"])  # (the Triton interpreter on the CPU)
def test_entropy_gradient_equals_trls(backend):
    """A loss that differentiates the routed head's entropy (an entropy bonus) gets the gradient
    TRL's own head gives (the term is computed, never silently missing), temperature and final
    softcap included; detached, as TRL's SFT metrics use it, it adds nothing."""
    pytest.importorskip("trl", reason="TRL is in the hf extra")
    plain = tc.tiny("gemma2")
    ids, labels = _trl_batch(plain)
    kwargs = dict(input_ids=ids, labels=labels, fused_lm_head=True)
    ref_model = _with_trl_head(copy.deepcopy(plain), outputs=SFT_OUTPUTS, temperature=0.7)
    model = _with_trl_head(
        lk_hf.apply(copy.deepcopy(plain), backend=backend), outputs=SFT_OUTPUTS, temperature=0.7
    )
    ref = ref_model(**kwargs)
    (ref.loss - 0.3 * ref.entropy.sum()).backward()
    out = model(**kwargs)
    assert _decision(model).ours
    (out.loss - 0.3 * out.entropy.sum()).backward()
    ref_grads, grads = _grads(ref_model), _grads(model)
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in ref_grads.items():
        assert _rel(grads[name], g) <= 1e-4, name
    detached = _with_trl_head(
        lk_hf.apply(copy.deepcopy(plain), backend=backend), outputs=SFT_OUTPUTS, temperature=0.7
    )
    out = detached(**kwargs)
    (out.loss + 0 * out.entropy.detach().sum()).backward()
    model.zero_grad()
    model(**kwargs).loss.backward()
    for name, g in _grads(model).items():
        assert _rel(_grads(detached)[name], g) <= 1e-6, name


# --- TRL's trainers --------------------------------------------------------------------------------


def _sft_run(model, tmp_path, callbacks=None, bf16=False):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(**tc.run_args(tmp_path), bf16=bf16, max_length=tc.T)
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"text": tc.texts()}),
        processing_class=tc.tokenizer(),
        callbacks=callbacks,
    )
    with tc.flce_calls() as calls:
        trainer.train()
    return tc.logged(trainer, "loss", "entropy", "mean_token_accuracy"), tc.params(model), calls


@pytest.mark.parametrize("how", ["apply", "callback"])
def test_sft_trainer_trains_through_lmkernels(how, tmp_path, caplog):
    """SFTTrainer (gradient accumulation over padded rows) on a model patched with apply(), or on a
    plain model with LmkernelsCallback: every micro-batch's loss is lmkernels' fused loss (4 calls,
    was 0), the logged loss, entropy and token accuracy and the final weights equal TRL's run
    without lmkernels, and the choice is logged once."""
    pytest.importorskip("trl", reason="TRL is in the hf extra")
    plain = tc.tiny()
    ref, ref_params, _ = _sft_run(copy.deepcopy(plain), tmp_path / "plain")
    if how == "apply":
        model, callbacks = lk_hf.apply(copy.deepcopy(plain), backend="eager"), None
    else:
        model, callbacks = copy.deepcopy(plain), [lk_hf.LmkernelsCallback(backend="eager")]
    with caplog.at_level(logging.INFO, logger="lmkernels"):
        logs, model_params, calls = _sft_run(model, tmp_path / how, callbacks)
    assert calls == ["none"] * 4
    assert len(logs) == 2
    torch.testing.assert_close(torch.tensor(logs), torch.tensor(ref), rtol=0, atol=tc.LOGGED_ATOL)
    tc.assert_params_close(ref_params, model_params)
    [record] = _lmk_messages(caplog)
    assert "TRL's fused LM head runs on lmkernels.fused_linear_cross_entropy" in record.message
    if how == "callback":
        assert record.message == callbacks[0].summary and "patched mlp x2, rms_norm x5" in record.message


def test_sft_trainer_label_smoothing_says_the_loss_is_not_fused(tmp_path, caplog):
    """SFTTrainer with label_smoothing_factor computes its loss from the logits (its label
    smoother; TRL's fused head only feeds the metrics): the summary says so, at WARNING, and
    never that the loss runs on lmkernels."""
    pytest.importorskip("trl", reason="TRL is in the hf extra")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    cb = lk_hf.LmkernelsCallback(backend="eager")
    args = SFTConfig(**{**tc.run_args(tmp_path), "max_steps": 1}, max_length=tc.T, label_smoothing_factor=0.1)
    trainer = SFTTrainer(
        model=tc.tiny(),
        args=args,
        train_dataset=Dataset.from_dict({"text": tc.texts()}),
        processing_class=tc.tokenizer(),
        callbacks=[cb],
    )
    with caplog.at_level(logging.INFO, logger="lmkernels"):
        trainer.train()
    [record] = [r for r in _lmk_messages(caplog) if r.message == cb.summary]
    assert record.levelno == logging.WARNING
    assert "label_smoothing_factor=0.1: the trainer computes its loss from the logits" in cb.summary
    assert "for its metrics only" in cb.summary


def test_sft_trainer_bf16_autocast(tmp_path):
    """Under bf16 autocast, accelerate wraps TRL's forward in its own (autocast, fp32 outputs):
    lmkernels' head still computes every micro-batch's loss (inside that wrapper), and the run is
    as close to the fp32 run as SFT without lmkernels in bf16 is (the correctness policy's rule:
    within 2x its error; losses to their logged resolution)."""
    pytest.importorskip("trl", reason="TRL is in the hf extra")
    plain = tc.tiny()
    ref, ref_params, _ = _sft_run(copy.deepcopy(plain), tmp_path / "fp32")
    bf16_logs, bf16_params, _ = _sft_run(copy.deepcopy(plain), tmp_path / "bf16", bf16=True)
    cb = lk_hf.LmkernelsCallback(backend="eager")
    logs, model_params, calls = _sft_run(copy.deepcopy(plain), tmp_path / "lmk", [cb], bf16=True)
    assert calls == ["none"] * 4 and "runs on lmkernels" in cb.summary

    def err(p):
        return max(_rel(p[n], v) for n, v in ref_params.items())

    assert err(model_params) <= 2 * err(bf16_params), (err(model_params), err(bf16_params))
    for got, bf16, fp32 in zip(logs, bf16_logs, ref):
        for a, b, r in zip(got, bf16, fp32):
            assert abs(a - r) <= 2 * abs(b - r) + tc.LOGGED_ATOL, (got, bf16, fp32)


def _grpo_run(model, tmp_path, callbacks=None, **config):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def reward(completions, **kwargs):  # varied rewards: nonzero advantages
        return [float(sum(int(w[1:]) for w in c.split() if w[1:].isdigit()) % 7) for c in completions]

    args = GRPOConfig(
        **{**tc.run_args(tmp_path), "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1},
        num_generations=2,
        max_completion_length=4,
        temperature=0.7,
        bf16=False,
        **config,
    )
    tok = tc.tokenizer()
    tok.padding_side = "left"
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(3, 11)]}),
        processing_class=tok,
        callbacks=callbacks,
    )
    with tc.flce_calls() as calls:
        trainer.train()
    return tc.logged(trainer, "loss", "entropy"), tc.params(model), calls


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_grpo_trainer_callback(entropy_coef, tmp_path):
    """GRPOTrainer with LmkernelsCallback: the policy's log-probs run on lmkernels (temperature
    0.7), with entropy_coef the entropy's gradient too (backends that have it: eager; the others
    keep TRL's head, test_trl_head_kept_with_reason). Losses, entropy and weights equal GRPO
    without lmkernels."""
    pytest.importorskip("trl", reason="TRL is in the hf extra")
    plain = tc.tiny()
    ref, ref_params, _ = _grpo_run(copy.deepcopy(plain), tmp_path / "plain", entropy_coef=entropy_coef)
    cb = lk_hf.LmkernelsCallback(backend="eager")
    logs, model_params, calls = _grpo_run(
        copy.deepcopy(plain), tmp_path / "lmk", [cb], entropy_coef=entropy_coef
    )
    torch.testing.assert_close(torch.tensor(logs), torch.tensor(ref), rtol=0, atol=tc.LOGGED_ATOL)
    tc.assert_params_close(ref_params, model_params)
    assert any(_rel(p, plain.state_dict()[n]) > 1e-4 for n, p in model_params.items())  # it trained
    # with entropy_coef the entropy's gradient runs through lmkernels' fused head too (eager)
    assert calls and set(calls) == {"none"} and "temperature 0.7" in cb.summary


# --- the transformers Trainer -----------------------------------------------------------------------


def _trainer_run(model, tmp_path, callbacks=None, **extra):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(**tc.run_args(tmp_path), remove_unused_columns=False, **extra)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=[{"row": r} for r in tc.rows()],
        data_collator=lambda b: tc.collate([x["row"] for x in b]),
        callbacks=callbacks,
    )
    with tc.flce_calls() as calls:
        trainer.train()
    return tc.logged(trainer, "loss"), tc.params(model), calls


def test_trainer_callback_gradient_accumulation(tmp_path, caplog):
    """Trainer(..., callbacks=[LmkernelsCallback()]) on a plain model: patched before the optimizer
    exists, every micro-batch through lmkernels' fused loss (sum / num_items_in_batch), losses and
    weights equal to the same Trainer without lmkernels; one summary logged."""
    plain = tc.tiny("qwen3")
    ref, ref_params, _ = _trainer_run(copy.deepcopy(plain), tmp_path / "plain")
    model = copy.deepcopy(plain)
    cb = lk_hf.LmkernelsCallback(backend="eager")
    with caplog.at_level(logging.INFO, logger="lmkernels"):
        logs, model_params, calls = _trainer_run(model, tmp_path / "lmk", [cb])
    assert lk_hf.is_patched(model) and calls == ["sum"] * 4
    torch.testing.assert_close(torch.tensor(logs), torch.tensor(ref), rtol=0, atol=tc.LOGGED_ATOL)
    tc.assert_params_close(ref_params, model_params)
    [record] = _lmk_messages(caplog)
    assert record.message == cb.summary and record.levelno == logging.INFO
    assert "patched " in cb.summary and "flce" in cb.summary and "fused_linear_cross_entropy" in cb.summary


def test_callback_arguments_checked():
    with pytest.raises(LMKernelsError, match="trl_head"):
        lk_hf.LmkernelsCallback(trl_head="fast")
    with pytest.raises(LMKernelsError, match="ops"):
        lk_hf.LmkernelsCallback(ops=("flce", "attention"))
    cb = lk_hf.LmkernelsCallback()
    with pytest.raises(LMKernelsError, match="use_liger_kernel=False"):
        cb.on_init_end(types.SimpleNamespace(use_liger_kernel=True), None, None, model=tc.tiny())
    with pytest.raises(LMKernelsError, match="model_init"):  # a model built after __init__
        cb.on_train_begin(types.SimpleNamespace(), None, None, model=tc.tiny())


# --- PEFT -------------------------------------------------------------------------------------------


def _peft(model, **config):
    peft = pytest.importorskip("peft", reason="PEFT is in the hf extra")
    return peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, **config))


def _peft_step(model, ids, seed=1):
    model.train()
    torch.manual_seed(seed)  # the same dropout masks in every run
    with tc.flce_calls() as calls:
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out, _grads(model), calls


def _orders(plain, **config):
    """Plain PEFT, patch-then-wrap and wrap-then-patch, the same LoRA weights in each."""
    torch.manual_seed(0)
    ref = _peft(copy.deepcopy(plain), **config)
    torch.manual_seed(0)
    patch_first = _peft(lk_hf.apply(copy.deepcopy(plain), backend="eager"), **config)
    torch.manual_seed(0)
    wrap_first = lk_hf.apply(_peft(copy.deepcopy(plain), **config), backend="eager")
    return ref, {"patch then wrap": patch_first, "wrap then patch": wrap_first}


@pytest.mark.parametrize(
    "config",
    [
        dict(target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], lora_dropout=0.1),
        dict(target_modules=["q_proj", "lm_head"], lora_dropout=0.1, init_lora_weights=False),
        dict(target_modules=["q_proj", "lm_head"], lora_dropout=0.0, init_lora_weights=False),
        dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
    ],
    ids=["lora-mlp", "lora-lm_head-dropout", "lora-lm_head", "modules_to_save-lm_head"],
)
def test_peft_either_order(config):
    """PEFT wrapping before or after apply(): the same modules are patched (the MLPs through PEFT's
    layers, the fused loss on lm_head as PEFT computes it: LoRA with dropout, modules_to_save), the
    loss runs fused (logits None), and loss and gradients equal plain PEFT's."""
    plain = tc.tiny()
    ids = torch.randint(3, tc.V, (2, tc.T), generator=torch.Generator().manual_seed(0))
    ref, models = _orders(plain, **config)
    ref_out, ref_grads, _ = _peft_step(ref, ids)
    for order, model in models.items():
        report = lk_hf.report(model)
        assert {"rms_norm", "rope", "mlp", "flce"} <= set(report.patched_ops()), (order, report.format())
        assert not report.failed and not report.kept, (order, report.format())
        out, grads, calls = _peft_step(model, ids)
        assert out.logits is None and calls == ["mean"], order
        torch.testing.assert_close(out.loss, ref_out.loss, rtol=RTOL, atol=0)
        assert grads.keys() == ref_grads.keys() and grads, order
        for name, g in ref_grads.items():
            assert _rel(grads[name], g) <= 1e-4, (order, name)
    if "lm_head" in config.get("target_modules", []):
        assert "PEFT LoRA" in str(lk_hf.report(models["wrap then patch"]))
        assert any("lm_head.lora_B" in n for n in ref_grads)


def test_peft_modules_to_save_disabled_adapter():
    """modules_to_save lm_head under disable_adapter() (DPO's reference model): the original head."""
    plain = tc.tiny()
    ids = torch.randint(3, tc.V, (2, tc.T), generator=torch.Generator().manual_seed(0))
    ref, models = _orders(plain, target_modules=["q_proj"], modules_to_save=["lm_head"])
    for module in (ref, *models.values()):  # a trained copy: differs from the original head
        with torch.no_grad():
            module.get_output_embeddings().modules_to_save["default"].weight.mul_(1.5)
    with ref.disable_adapter():
        expected = ref.train()(input_ids=ids, labels=ids).loss
    assert _rel(expected, ref(input_ids=ids, labels=ids).loss) > 1e-3
    for model in models.values():
        with model.disable_adapter():
            loss = model.train()(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=0)


def test_peft_unsupported_head_never_dropped_silently(tmp_path):
    """DoRA on lm_head (a LoRA variant the fused loss does not compute): wrap then patch raises under
    strict naming lm_head, DoRA and the fix, and under strict=False keeps the head, listed with the
    reason; patch then wrap raises at the forward with the same fix, and LmkernelsCallback raises
    at on_init_end (strict) or patches again without the head (strict=False)."""
    config = dict(target_modules=["q_proj", "lm_head"], use_dora=True, init_lora_weights=False)
    plain = tc.tiny()
    ids = torch.randint(3, tc.V, (2, tc.T), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    ref = _peft(copy.deepcopy(plain), **config)
    fix = "remove 'lm_head' from the PEFT config's target_modules"
    torch.manual_seed(0)
    wrapped = _peft(copy.deepcopy(plain), **config)
    with pytest.raises(LMKernelsError, match=r"lm_head.*LoRA variant.*DoRA.*target_modules") as info:
        lk_hf.apply(wrapped, backend="eager")
    assert fix in str(info.value) and not lk_hf.is_patched(wrapped)
    lk_hf.apply(wrapped, backend="eager", strict=False)
    report = lk_hf.report(wrapped)
    assert [f.op for f in report.failed] == ["flce"] and "DoRA" in report.failed[0].detail
    assert "kept (could not be patched" in report.format() and "kept flce" in report.brief()
    out, ref_out = _peft_step(wrapped, ids)[0], _peft_step(ref, ids)[0]
    assert out.logits is not None
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=RTOL, atol=0)

    torch.manual_seed(0)
    late = _peft(lk_hf.apply(copy.deepcopy(plain), backend="eager"), **config)
    with pytest.raises(LMKernelsError, match="DoRA") as info:
        late.train()(input_ids=ids, labels=ids)
    assert fix in str(info.value)
    args = types.SimpleNamespace()
    with pytest.raises(LMKernelsError, match="the fused loss cannot run.*DoRA"):
        lk_hf.LmkernelsCallback().on_init_end(args, None, None, model=late)
    lk_hf.LmkernelsCallback(strict=False).on_init_end(args, None, None, model=late)
    assert [f.op for f in lk_hf.report(late).failed] == ["flce"]
    assert late(input_ids=ids, labels=ids).logits is not None


class _Int8Linear(torch.nn.Linear):
    """Stands in for a quantized projection: an nn.Linear subclass with a forward of its own."""

    def forward(self, x):
        return super().forward(x)


def test_foreign_mlp_projection_never_dropped_silently():
    """A gated MLP whose projection is neither nn.Linear nor a PEFT layer over one (a quantized
    layer): strict raises naming the projection and the fix; strict=False keeps it, reported."""
    model = tc.tiny()
    for layer in model.model.layers:
        old = layer.mlp.gate_proj
        layer.mlp.gate_proj = _Int8Linear(old.in_features, old.out_features, bias=False)
    with pytest.raises(LMKernelsError, match="gate_proj is a .*_Int8Linear.*ops excluding 'mlp'"):
        lk_hf.apply(model, backend="eager")
    lk_hf.apply(model, backend="eager", strict=False)
    report = lk_hf.report(model)
    assert [f.op for f in report.failed] == ["mlp"] and "flce" in report.patched_ops()


def test_peft_callback_lora_lm_head_trainer(tmp_path):
    """Trainer + LmkernelsCallback on a PEFT model with LoRA on lm_head (wrapped before the
    callback patches): the fused loss includes the adapter; losses and weights equal plain PEFT."""
    plain = tc.tiny()
    config = dict(target_modules=["q_proj", "lm_head"], lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(0)
    ref, ref_params, _ = _trainer_run(_peft(copy.deepcopy(plain), **config), tmp_path / "plain")
    torch.manual_seed(0)
    cb = lk_hf.LmkernelsCallback(backend="eager")
    logs, model_params, calls = _trainer_run(_peft(copy.deepcopy(plain), **config), tmp_path / "lmk", [cb])
    assert calls == ["sum"] * 4 and "PEFT LoRA" in cb.summary
    torch.testing.assert_close(torch.tensor(logs), torch.tensor(ref), rtol=0, atol=tc.LOGGED_ATOL)
    tc.assert_params_close(ref_params, model_params)
