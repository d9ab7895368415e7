"""TRL's post-training trainers through LmkernelsCallback: DPO (loss types, WPO), KTO, GRPO with a
reference model and an entropy bonus, RLOO with a reference model, GKD and DistillationTrainer.

Each trainer runs twice from the same tiny fp32 model on the CPU, with TRL as is and with the
callback (eager backend): the per-step losses and every metric TRL logs (rewards, log-probs,
mean logits, entropy, KL, clip ratios, ...) agree to the logged resolution, the final weights
to 1e-4 relative (trainer_common), and lmkernels' fused ops ran (counted): the policy's and the
reference's TRL heads on lmkernels.fused_linear_cross_entropy, the distillation losses on
lmkernels.fused_linear_distillation.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math

import pytest
import torch

pytest.importorskip("trl", reason="TRL is in the hf extra")

import lmkernels  # noqa: E402
import trainer_common as tc  # noqa: E402
from lmkernels.integrations import transformers as lk_hf  # noqa: E402
from lmkernels.integrations.transformers import patching  # noqa: E402

METRIC_ATOL = 2e-4  # metrics are averaged and logged as floats; losses at the Trainer's 4 decimals


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def distill_calls():
    calls = []
    real = lmkernels.fused_linear_distillation

    def counting(*args, **kwargs):
        calls.append(kwargs.get("reduction", "mean"))
        return real(*args, **kwargs)

    lmkernels.fused_linear_distillation = counting
    try:
        yield calls
    finally:
        lmkernels.fused_linear_distillation = real


def _history(trainer):
    """Every logged step's numbers (the final summary excluded)."""
    return [
        {k: v for k, v in h.items() if isinstance(v, float | int) and k not in ("epoch", "step")}
        for h in trainer.state.log_history
        if "loss" in h
    ]


def _assert_logs_equal(got, want):
    assert len(got) == len(want) and want
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), (sorted(g), sorted(w))
        for k, v in w.items():
            if k in ("learning_rate", "num_tokens", "step_time") or "time" in k:
                continue
            atol = tc.LOGGED_ATOL if k == "loss" else METRIC_ATOL
            if isinstance(v, float) and math.isnan(v):
                assert math.isnan(g[k]), k
            else:
                assert abs(g[k] - v) <= atol + 1e-4 * abs(v), (k, g[k], v)


def _run(make_trainer, model, tmp_path, callbacks=None):
    trainer = make_trainer(model, tmp_path, callbacks)
    with tc.flce_calls() as calls, distill_calls() as distill:
        trainer.train()
    return trainer, _history(trainer), tc.params(trainer.model), calls, distill


def _compare(make_trainer, tmp_path, plain=None, by_path=False, **cb_kwargs):
    """by_path: the trainers load the model from a local checkpoint (GRPO / RLOO build their
    reference model from the policy's path)."""
    plain = tc.tiny() if plain is None else plain
    if by_path:
        plain = tc.save_tiny_checkpoint(tmp_path / "ckpt")

    def model():
        return str(tmp_path / "ckpt") if by_path else copy.deepcopy(plain)

    ref_trainer, ref_logs, ref_params, _, _ = _run(make_trainer, model(), tmp_path / "plain")
    cb = lk_hf.LmkernelsCallback(backend="eager", **cb_kwargs)
    trainer, logs, params, calls, distill = _run(make_trainer, model(), tmp_path / "lmk", [cb])
    _assert_logs_equal(logs, ref_logs)
    tc.assert_params_close(ref_params, params)
    assert any(
        ((p - plain.state_dict()[n]).norm() / plain.state_dict()[n].norm().clamp_min(1e-30)) > 1e-4
        for n, p in params.items()
    )  # it trained
    return trainer, cb, calls, distill


def _tok():
    tok = tc.tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
        "{% if add_generation_prompt %} {% endif %}"
    )
    return tok


def _words(seed, n, lo=2, hi=6):
    g = torch.Generator().manual_seed(seed)
    return [
        " ".join(
            f"w{int(t)}"
            for t in torch.randint(3, tc.V, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g)
        )
        for _ in range(n)
    ]


def _ref_model():
    return tc.tiny(seed=1)  # a reference that differs from the policy: nonzero rewards from step 1


# --- DPO --------------------------------------------------------------------------------------------


def _dpo(loss_type, use_weighting=False, **config):
    def make(model, tmp_path, callbacks):
        from datasets import Dataset
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(
            **tc.run_args(tmp_path),
            loss_type=loss_type,
            use_weighting=use_weighting,
            beta=0.5,
            max_length=24,
            bf16=False,
            **config,
        )
        data = Dataset.from_dict({"prompt": _words(0, 8), "chosen": _words(1, 8), "rejected": _words(2, 8)})
        return DPOTrainer(
            model=model,
            ref_model=_ref_model(),
            args=args,
            train_dataset=data,
            processing_class=tc.tokenizer(),
            callbacks=callbacks,
        )

    return make


@pytest.mark.parametrize(
    "loss_type, extra",
    [
        ("sigmoid", {}),
        (["sigmoid", "sft"], {"loss_weights": [1.0, 0.5]}),
        ("ipo", {}),
        ("robust", {"label_smoothing": 0.1}),
        ("apo_zero", {"use_weighting": True}),  # WPO: log sum p^2 per token
    ],
    ids=str,
)
def test_dpo_trainer(loss_type, extra, tmp_path):
    """DPOTrainer's policy and reference heads on lmkernels (mean logits and token accuracy for
    its metrics, log sum p^2 for WPO): losses, every metric and the final weights equal TRL's."""
    trainer, cb, calls, _ = _compare(_dpo(loss_type, **extra), tmp_path)
    assert "runs on lmkernels.fused_linear_cross_entropy" in cb.summary and "mean logits" in cb.summary
    assert "reference model:" in cb.summary and "kept" not in cb.summary
    # per micro-batch: the policy (with stats) and the reference; WPO one more forward (the other
    # calls: apply()'s check of the reference model's patched head, at on_train_begin)
    per_step = 3 if extra.get("use_weighting") else 2
    assert calls.count("none") == per_step * 4
    assert vars(trainer.ref_model)[patching.RECORD].trl_decision.ours


# --- KTO --------------------------------------------------------------------------------------------


def test_kto_trainer(tmp_path):
    """KTOTrainer (with its KL batch: reference point from mismatched pairs): heads on lmkernels."""

    def make(model, tmp_path, callbacks):
        from datasets import Dataset
        from trl import KTOConfig, KTOTrainer

        args = KTOConfig(**tc.run_args(tmp_path), beta=0.5, max_length=24, bf16=False)
        data = Dataset.from_dict(
            {
                "prompt": _words(0, 8),
                "completion": _words(1, 8),
                "label": [True, False, True, True, False, True, False, False],
            }
        )
        return KTOTrainer(
            model=model,
            ref_model=_ref_model(),
            args=args,
            train_dataset=data,
            processing_class=tc.tokenizer(),
            callbacks=callbacks,
        )

    trainer, cb, calls, _ = _compare(make, tmp_path)
    assert "runs on lmkernels.fused_linear_cross_entropy" in cb.summary and "kept" not in cb.summary
    assert calls.count("none") >= 8


# --- CPO (SimPO, AlphaPO), ORPO: trl.experimental, log-probs from the logits in TRL ------------------


def _reference_free(name, **config):
    def make(model, tmp_path, callbacks):
        from datasets import Dataset

        if name == "cpo":
            from trl.experimental.cpo import CPOConfig as Config
            from trl.experimental.cpo import CPOTrainer as Trainer
        else:
            from trl.experimental.orpo import ORPOConfig as Config
            from trl.experimental.orpo import ORPOTrainer as Trainer
        args = Config(**tc.run_args(tmp_path), max_length=24, bf16=False, **config)
        data = Dataset.from_dict({"prompt": _words(0, 8), "chosen": _words(1, 8), "rejected": _words(2, 8)})
        return Trainer(
            model=model, args=args, train_dataset=data, processing_class=tc.tokenizer(), callbacks=callbacks
        )

    return make


@pytest.mark.parametrize(
    "name, config",
    [
        ("cpo", {"beta": 0.5}),
        ("cpo", {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0, "simpo_gamma": 1.0}),  # SimPO
        ("cpo", {"loss_type": "ipo", "alpha": 0.2}),  # length-normalized, AlphaPO rewards
        ("orpo", {"beta": 0.3}),
    ],
    ids=str,
)
def test_reference_free_trainers(name, config, tmp_path):
    """CPOTrainer and ORPOTrainer (trl.experimental; TRL builds the full logits): their log-probs,
    cross entropy and logits metrics from lmkernels' fused head, equal to TRL's."""
    trainer, cb, calls, _ = _compare(_reference_free(name, **config), tmp_path)
    assert "log-probs from the logits: run on lmkernels.fused_linear_cross_entropy" in cb.summary
    per_step = 2 if name == "orpo" else 1  # ORPO: one more call for its prompt + completion NLL
    assert calls.count("none") == 4 and calls.count("mean") >= (4 if per_step == 2 else 0)


# --- GRPO, RLOO -------------------------------------------------------------------------------------


def _reward(completions, **kwargs):  # varied rewards: nonzero advantages
    return [float(sum(int(w[1:]) for w in c.split() if w[1:].isdigit()) % 7) for c in completions]


def _rl(trainer_name, **config):
    def make(model, tmp_path, callbacks, config=config):
        config = dict(config)
        import trl
        from datasets import Dataset

        Config, Trainer = getattr(trl, f"{trainer_name}Config"), getattr(trl, f"{trainer_name}Trainer")
        run = {**tc.run_args(tmp_path), "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1}
        run["max_steps"] = config.pop("max_steps", run["max_steps"])
        args = Config(
            **run,
            num_generations=2,
            max_completion_length=4,
            temperature=0.7,
            bf16=False,
            **config,
        )
        tok = tc.tokenizer()
        tok.padding_side = "left"
        return Trainer(
            model=model,
            reward_funcs=_reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(3, 11)]}),
            processing_class=tok,
            callbacks=callbacks,
        )

    return make


@pytest.mark.parametrize(
    "config",
    [
        {"beta": 0.04, "entropy_coef": 0.01, "loss_type": "dapo"},
        {"beta": 0.04, "loss_type": "grpo", "num_iterations": 2, "steps_per_generation": 1, "max_steps": 3},
    ],
    ids=str,
)
def test_grpo_trainer_reference_and_entropy(config, tmp_path):
    """GRPOTrainer with the KL to a reference model (its head on lmkernels under no_grad) and the
    entropy bonus (the entropy's gradient through lmkernels' head)."""
    trainer, cb, calls, _ = _compare(_rl("GRPO", **config), tmp_path, by_path=True)
    assert "kept" not in cb.summary and "reference model:" in cb.summary
    assert vars(trainer.ref_model)[patching.RECORD].trl_decision.ours
    assert calls.count("none") >= 4


def test_rloo_trainer_reference(tmp_path):
    trainer, cb, calls, _ = _compare(_rl("RLOO", beta=0.05), tmp_path, by_path=True)
    assert "kept" not in cb.summary and "reference model:" in cb.summary
    assert calls.count("none") >= 4


# --- distillation -----------------------------------------------------------------------------------


def _teacher():
    return tc.tiny(seed=2, hidden_size=48)  # wider than the student; same vocabulary


def test_gkd_trainer(tmp_path):
    """GKDTrainer (trl.experimental): its generalized JSD (from both models' full logits in TRL) on
    lmkernels.fused_linear_distillation; off-policy (lmbda=0) so both runs see the same batches."""

    def make(model, tmp_path, callbacks):
        from datasets import Dataset
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        args = GKDConfig(**tc.run_args(tmp_path), lmbda=0.0, beta=0.3, max_length=24, bf16=False)
        messages = [
            [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
            for p, c in zip(_words(0, 8), _words(1, 8))
        ]
        return GKDTrainer(
            model=model,
            teacher_model=_teacher(),
            args=args,
            train_dataset=Dataset.from_dict({"messages": messages}),
            processing_class=_tok(),
            callbacks=callbacks,
        )

    trainer, cb, calls, distill = _compare(make, tmp_path)
    assert "GKD's generalized JSD runs on lmkernels.fused_linear_distillation" in cb.summary
    assert len(distill) == 4 and "none" not in calls  # (apply()'s checks of the teacher: the others)


def test_distillation_trainer(tmp_path):
    """DistillationTrainer: its chunked divergence (and entropy metric) on lmkernels; on-policy
    generations from the same seeds in both runs."""

    def make(model, tmp_path, callbacks):
        from datasets import Dataset
        from trl import DistillationConfig, DistillationTrainer

        args = DistillationConfig(
            **{**tc.run_args(tmp_path), "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1},
            beta=0.5,
            temperature=0.9,
            max_completion_length=4,
            bf16=False,
        )
        tok = tc.tokenizer()
        tok.padding_side = "left"
        return DistillationTrainer(
            model=model,
            teacher_model=_teacher(),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(3, 11)]}),
            processing_class=tok,
            callbacks=callbacks,
        )

    trainer, cb, calls, distill = _compare(make, tmp_path)
    assert (
        "DistillationTrainer's chunked divergence runs on lmkernels.fused_linear_distillation" in cb.summary
    )
    assert distill and set(distill) == {"sum"} | set(distill)


def test_trainer_not_routed_is_untouched(tmp_path, caplog):
    """trl_head='trl': TRL's heads and losses everywhere, the summary says so at INFO."""
    with caplog.at_level(logging.INFO, logger="lmkernels"):
        trainer, cb, calls, _ = _compare(_dpo("sigmoid"), tmp_path, trl_head="trl")
    assert "none" not in calls and "kept (trl_head='trl')" in cb.summary
