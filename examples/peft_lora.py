"""PEFT LoRA on a causal LM patched by lmkernels, in either order.

    python examples/peft_lora.py                                # tiny random Qwen3, CPU, 3 steps
    python examples/peft_lora.py --order wrap-first --lora-lm-head
    python examples/peft_lora.py --model Qwen/Qwen3-0.6B

--order patch-first: lk_hf.apply(model), then get_peft_model; wrap-first: the other way round;
the same modules are patched either way (lk_hf.report shows them). Without --lora-lm-head,
lm_head stays frozen (requires_grad False) and the fused loss skips its weight gradient; with
it, the fused loss computes LoRA's [x, s * A(dropout(x))] @ [W, B].T and trains the adapter.
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
    p.add_argument("--order", default="patch-first", choices=("patch-first", "wrap-first"))
    p.add_argument("--lora-lm-head", action="store_true", help="LoRA on lm_head too")
    args = p.parse_args(argv)
    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model)
        backend = args.backend
    else:
        model, backend = lk_hf.tiny_model("qwen3"), args.backend or "eager"
    targets = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"] + (
        ["lm_head"] if args.lora_lm_head else []
    )
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=targets)
    if args.order == "patch-first":
        model = get_peft_model(lk_hf.apply(model, backend=backend), config)
    else:
        model = lk_hf.apply(get_peft_model(model, config), backend=backend)
    print(lk_hf.report(model))
    model.print_trainable_parameters()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), device=device)
    losses = []
    for _ in range(args.steps):
        out = model(input_ids=ids, labels=ids)
        assert out.logits is None  # the fused loss ran
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    head = model.get_output_embeddings()
    assert (head.base_layer if args.lora_lm_head else head).weight.grad is None
    return losses


if __name__ == "__main__":
    print(main())
