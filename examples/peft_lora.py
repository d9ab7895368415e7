"""PEFT LoRA on a patched causal LM: patch first, then wrap.

    python examples/peft_lora.py                                # tiny random Qwen3, CPU, 3 steps
    python examples/peft_lora.py --model Qwen/Qwen3-0.6B

lm_head stays frozen (requires_grad False), so the fused loss skips its weight gradient.
"""

from __future__ import annotations

import argparse

import torch
from peft import LoraConfig, get_peft_model

from lmkernels.integrations import transformers as lk_hf


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="hub name or path (default: a tiny random Qwen3)")
    p.add_argument("--backend", default=None)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    if args.model:
        model = lk_hf.from_pretrained(args.model, backend=args.backend)
    else:
        model = lk_hf.apply(lk_hf.tiny_model("qwen3"), backend=args.backend or "eager")
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    model.print_trainable_parameters()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), device=device)
    losses = []
    for _ in range(args.steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert model.get_output_embeddings().weight.grad is None
    return losses


if __name__ == "__main__":
    print(main())
