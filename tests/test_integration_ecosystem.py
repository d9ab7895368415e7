"""A patched model inside the ecosystem: HF Trainer with gradient accumulation, TRL's SFTTrainer,
PEFT LoRA (frozen lm_head), gradient checkpointing, generate(), save / load.

Tiny Llama / Qwen3 models, fp32 on the CPU, a few steps each. Equality tolerances as in
test_integration_transformers.py (1e-5 relative: the fused loss sums in another order).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers integration needs the hf extra")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import trainer_common as tc  # noqa: E402
from lmkernels.integrations import transformers as lk_hf  # noqa: E402
from trainer_common import LOGGED_ATOL, T, V, tiny  # noqa: E402

RTOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: torch's intra-op threads only add synchronization (10x slower on a busy
    2-core machine); restored after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trainer_run(model, tmp_path, **extra):
    from transformers import Trainer, TrainingArguments

    rows = tc.rows()
    args = TrainingArguments(
        **tc.run_args(tmp_path),
        data_seed=0,
        dataloader_num_workers=0,
        remove_unused_columns=False,  # the collator reads the raw "row" field
        **extra,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=[{"row": r} for r in rows],
        data_collator=lambda b: tc.collate([x["row"] for x in b]),
    )
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], tc.params(model)


def test_trainer_gradient_accumulation_and_checkpointing(tmp_path):
    """Trainer with gradient accumulation over padded batches (num_items_in_batch) gives the same
    losses and weights patched as plain, with gradient checkpointing on as well."""
    plain = tiny()
    losses, params = _trainer_run(copy.deepcopy(plain), tmp_path / "plain")
    patched = lk_hf.apply(copy.deepcopy(plain), backend="eager")
    p_losses, p_params = _trainer_run(patched, tmp_path / "patched")
    torch.testing.assert_close(torch.tensor(p_losses), torch.tensor(losses), rtol=0, atol=LOGGED_ATOL)
    tc.assert_params_close(params, p_params)
    patched_ckpt = lk_hf.apply(copy.deepcopy(plain), backend="eager")
    c_losses, c_params = _trainer_run(patched_ckpt, tmp_path / "ckpt", gradient_checkpointing=True)
    torch.testing.assert_close(torch.tensor(c_losses), torch.tensor(losses), rtol=0, atol=LOGGED_ATOL)
    tc.assert_params_close(params, c_params)


def _sft_run(model, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    texts = [" ".join(f"w{t}" for t in row) for row in tc.rows()]
    args = SFTConfig(
        **tc.run_args(tmp_path),
        bf16=False,  # fp32: under bf16 autocast the fused GLU / rope round once, transformers per op
        max_length=T,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=tc.tokenizer(),
    )
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], tc.params(model)


def test_trl_sft_trainer(tmp_path):
    """SFTTrainer trains a patched model like a plain one. (TRL 1.x computes the SFT loss with its
    own fused LM head, wrapped around the model's forward; a patched model runs it on lmkernels'
    fused loss: test_integration_trainers.py.)"""
    pytest.importorskip("trl", reason="TRL is in the hf extra")
    plain = tiny()
    losses, params = _sft_run(copy.deepcopy(plain), tmp_path / "plain")
    p_losses, p_params = _sft_run(lk_hf.apply(copy.deepcopy(plain), backend="eager"), tmp_path / "patched")
    assert len(losses) == 2
    torch.testing.assert_close(torch.tensor(p_losses), torch.tensor(losses), rtol=0, atol=LOGGED_ATOL)
    tc.assert_params_close(params, p_params)


class _WeightShapedOps(TorchDispatchMode):
    """Counts aten ops that produce a tensor shaped like lm_head.weight (a weight gradient)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # views (W.t() for the hidden gradient) cost nothing
            return out
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape:
                self.count += 1
        return out


@pytest.mark.parametrize("backend", ["eager", "compile"])
def test_peft_lora_frozen_lm_head_skips_weight_gradient(backend):
    """LoRA on the attention: lm_head is frozen, so the fused loss must not compute its weight
    gradient (no (V, H) tensor in the backward); the LoRA gradients equal plain PEFT's."""
    peft = pytest.importorskip("peft", reason="PEFT is in the hf extra")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))

    def step(model):
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        watch = _WeightShapedOps(model.get_output_embeddings().weight.shape)
        with watch:
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss, grads, watch.count

    torch.manual_seed(0)
    plain = peft.get_peft_model(tiny("qwen3"), config)
    torch.manual_seed(0)
    patched = peft.get_peft_model(lk_hf.apply(tiny("qwen3"), backend=backend), config)
    loss, grads, _ = step(plain)
    p_loss, p_grads, weight_ops = step(patched)
    assert not patched.get_output_embeddings().weight.requires_grad
    assert weight_ops == 0, f"{weight_ops} ops built a tensor of lm_head.weight's shape in the backward"
    torch.testing.assert_close(p_loss, loss, rtol=RTOL, atol=0)
    assert grads.keys() == p_grads.keys() and grads and all("lora_" in n for n in grads)
    for name, g in grads.items():
        # (LoRA's B starts at zero, so A's gradient is exactly zero in both runs)
        assert ((p_grads[name] - g).norm() / g.norm().clamp_min(1e-30)).item() <= RTOL, name


def test_generate_and_save_load(tmp_path):
    """generate() on a patched model equals plain (eval path: logits as before); the state dict
    is the plain one; a saved model loads patched in one line."""
    plain = tiny("qwen3")
    patched = lk_hf.apply(copy.deepcopy(plain), backend="eager")
    ids = torch.randint(3, V, (2, 5), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(patched.generate(ids, **kwargs), plain.generate(ids, **kwargs), rtol=0, atol=0)
    patched.train()  # generation in train mode too: no labels, so the original forward runs
    assert torch.equal(patched.generate(ids, **kwargs), plain.eval().generate(ids, **kwargs))

    state, plain_state = patched.state_dict(), plain.state_dict()
    assert state.keys() == plain_state.keys()
    assert all(torch.equal(state[k], plain_state[k]) for k in state)
    patched.save_pretrained(tmp_path)
    loaded = lk_hf.from_pretrained(str(tmp_path), backend="eager")
    assert lk_hf.is_patched(loaded)
    assert all(torch.equal(v, plain_state[k]) for k, v in loaded.state_dict().items())
    loaded.train()
    out = loaded(input_ids=ids, labels=ids)
    ref = plain.train()(input_ids=ids, labels=ids)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=RTOL, atol=0)
    from_cfg = lk_hf.from_config(plain.config, backend="eager")
    assert lk_hf.is_patched(from_cfg)


@pytest.mark.parametrize(
    "name, extra",
    [
        ("trainer_grad_accum", []),
        ("trl_sft", []),
        ("peft_lora", []),
        ("peft_lora", ["--order", "wrap-first", "--lora-lm-head"]),
    ],
)
def test_examples_run(name, extra, tmp_path):
    """The examples in examples/ run as shipped (tiny default model, one step)."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip({"trl_sft": "trl", "peft_lora": "peft"}.get(name, "transformers"))
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--steps", "1", *extra] + ([] if name == "peft_lora" else ["--out", str(tmp_path)])
    losses = module.main(argv)
    assert len(losses) == 1 and all(torch.isfinite(torch.tensor(losses)))
