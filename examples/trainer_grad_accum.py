"""HF Trainer with gradient accumulation, lmkernels switched on by one callback.

    python examples/trainer_grad_accum.py                       # tiny random Llama, CPU, 2 steps
    python examples/trainer_grad_accum.py --model Qwen/Qwen3-0.6B --steps 50 --bf16

LmkernelsCallback patches the plain model when the Trainer is built (before the optimizer) and
logs what it patched and which loss runs. Padded rows of uneven length: the Trainer passes
num_items_in_batch and the fused loss divides by it as transformers does, so the losses equal
plain transformers' (tests/test_integration_trainers.py).
"""

from __future__ import annotations

import argparse
import logging

import torch
from transformers import Trainer, TrainingArguments

from lmkernels.integrations import transformers as lk_hf


def collate(rows, vocab_size):
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r) % vocab_size
        labels[i, : len(r)] = ids[i, : len(r)]
    return {"input_ids": ids, "labels": labels, "attention_mask": (labels != -100).long()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="hub name or path (default: a tiny random Llama)")
    p.add_argument("--backend", default=None, help="lmkernels backend spec (default: auto)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--out", default="/tmp/lmkernels-example-trainer")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # shows the callback's summary
    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model)
        backend = args.backend
    else:
        model, backend = lk_hf.tiny_model("llama"), args.backend or "eager"
    g = torch.Generator().manual_seed(0)
    rows = [
        torch.randint(0, 10**6, (int(n),), generator=g).tolist()
        for n in torch.randint(8, 33, (16,), generator=g)
    ]
    training = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        max_steps=args.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=args.bf16,
        remove_unused_columns=False,  # the collator reads the raw "row" field
        use_cpu=not torch.cuda.is_available(),
    )
    vocab = model.config.vocab_size
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=[{"row": r} for r in rows],
        data_collator=lambda batch: collate([x["row"] for x in batch], vocab),
        callbacks=[lk_hf.LmkernelsCallback(backend=backend)],
    )
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


if __name__ == "__main__":
    print(main())
