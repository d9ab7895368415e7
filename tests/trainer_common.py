"""Helpers of the trainer tests (test_integration_ecosystem.py, test_integration_trainers.py, the
Axolotl and LLaMA-Factory tests): tiny models, token rows, a word-level tokenizer and a local
checkpoint of both, the training arguments the Trainer and TRL runs share, and a counter of
lmkernels' fused-loss calls."""

from __future__ import annotations

import contextlib

import torch

import lmkernels
from lmkernels.integrations import transformers as lk_hf

V, T = 128, 16
# The Trainer logs losses rounded to 4 decimals: compared to that resolution; the final weights
# (compared to 1e-4 relative per tensor after two AdamW steps) are the sharp check.
LOGGED_ATOL = 1e-4


def tiny(model_type="llama", seed=0, **overrides):
    return lk_hf.tiny_model(model_type, seed=seed, **overrides)


def rows(n=8, seed=0):
    """Token rows of uneven lengths (the collator pads them: uneven ignored-token counts)."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, V, (int(torch.randint(6, T + 1, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_params_close(a, b, rtol=1e-4):
    assert a.keys() == b.keys()
    for name, p in a.items():
        err = ((b[name] - p).norm() / p.norm().clamp_min(1e-30)).item()
        assert err <= rtol, f"{name}: {err:.2e}"


def collate(batch_rows):
    width = max(len(r) for r in batch_rows)
    ids = torch.zeros(len(batch_rows), width, dtype=torch.long)
    labels = torch.full((len(batch_rows), width), -100)
    mask = torch.zeros(len(batch_rows), width, dtype=torch.long)
    for i, r in enumerate(batch_rows):
        ids[i, : len(r)] = torch.tensor(r)
        labels[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def run_args(tmp_path) -> dict:
    """The training arguments the Trainer and SFTTrainer runs share: 2 optimizer steps of 2
    accumulated batches of 2 rows on the CPU, a loss logged per step, nothing saved or reported."""
    return dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )


def tokenizer(vocab_size=V):
    """A word-level tokenizer: <pad> <s> </s>, then words w3 .. w{vocab_size - 1}."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def save_tiny_checkpoint(path, model_type="llama", seed=0):
    """A tiny model and the word-level tokenizer over its vocabulary saved as a local checkpoint
    (nothing from the hub), pad / bos / eos = 0 / 1 / 2: for trainers that load a model by path.
    Returns the model."""
    model = tiny(model_type, seed=seed)
    model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id = 0, 1, 2
    model.save_pretrained(path)
    tokenizer(model.config.vocab_size).save_pretrained(path)
    return model


def texts(n=8, seed=0):
    return [" ".join(f"w{t}" for t in row) for row in rows(n, seed)]


def logged(trainer, *keys):
    """The per-step logs of a trainer's run, the given keys of each."""
    return [[h[k] for k in keys] for h in trainer.state.log_history if "loss" in h]


@contextlib.contextmanager
def flce_calls():
    """Counts calls of lmkernels.fused_linear_cross_entropy (the op every lmkernels loss path
    calls) in the block: yields a list whose length is the count."""
    calls = []
    real = lmkernels.fused_linear_cross_entropy

    def counting(*args, **kwargs):
        calls.append(kwargs.get("reduction", "mean"))
        return real(*args, **kwargs)

    lmkernels.fused_linear_cross_entropy = counting
    try:
        yield calls
    finally:
        lmkernels.fused_linear_cross_entropy = real
