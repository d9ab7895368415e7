"""TRL's SFTTrainer with lmkernels: the body patched, TRL's fused LM head run on lmkernels' loss.

    python examples/trl_sft.py                                  # tiny random Llama, CPU, 2 steps
    python examples/trl_sft.py --model Qwen/Qwen3-0.6B --steps 50
    python examples/trl_sft.py --trl-head trl                   # keep TRL's own fused head

LmkernelsCallback logs once which head computes the loss (TRL's token accuracy and entropy are
logged either way). The tiny run uses a word-level tokenizer built in memory ("w3 w17 ..."), so
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import logging

import torch
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from lmkernels.integrations import transformers as lk_hf


def word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="hub name or path (default: a tiny random Llama)")
    p.add_argument("--backend", default=None)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="/tmp/lmkernels-example-sft")
    p.add_argument("--trl-head", default="auto", choices=("auto", "lmkernels", "trl"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # shows the callback's summary
    g = torch.Generator().manual_seed(0)
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        texts = ["The quick brown fox jumps over the lazy dog."] * 32
    else:
        model = lk_hf.tiny_model("llama")
        tokenizer = word_tokenizer(model.config.vocab_size)
        texts = [
            " ".join(f"w{t}" for t in torch.randint(3, 128, (12,), generator=g).tolist()) for _ in range(16)
        ]
    config = SFTConfig(
        output_dir=args.out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=args.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
    )
    backend = args.backend or (None if args.model else "eager")
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=tokenizer,
        callbacks=[lk_hf.LmkernelsCallback(backend=backend, trl_head=args.trl_head)],
    )
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


if __name__ == "__main__":
    print(main())
