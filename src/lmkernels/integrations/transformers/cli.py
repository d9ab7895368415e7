"""`lmkernels patch-report`: what apply() would patch on a model type or config, and why not the rest.

    lmkernels patch-report --model-type qwen3
    lmkernels patch-report --config path/to/config.json --backend triton
    lmkernels patch-report --all            # every family the tests train

The model is built from the config with its sizes shrunk to a tiny model (the structure, not the
size, decides what is patched), with random weights, on the CPU; nothing is downloaded.
"""

from __future__ import annotations

import argparse


def _shrunk(config):
    from lmkernels.integrations.transformers.families import TINY

    for key, value in TINY.items():
        if key in ("attn_implementation", "vocab_size", "pad_token_id", "bos_token_id", "eos_token_id"):
            continue
        if getattr(config, key, None) is not None:
            setattr(config, key, value)
    if hasattr(config, "layer_types") and config.layer_types is not None:
        config.layer_types = list(config.layer_types)[: config.num_hidden_layers]
    return config


def cmd_patch_report(args: argparse.Namespace) -> int:
    from lmkernels.integrations import transformers as lk_hf
    from lmkernels.registry import LMKernelsError

    ops = tuple(args.ops.split(",")) if args.ops else lk_hf.SUPPORTED_OPS
    if args.config:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = _shrunk(AutoConfig.from_pretrained(args.config))
        targets = [AutoModelForCausalLM.from_config(config)]
    elif args.all:
        targets = list(lk_hf.TESTED)
    elif args.model_type:
        targets = [args.model_type]
    else:
        raise LMKernelsError("patch-report: give --model-type TYPE, --config PATH or --all")
    failed = False
    for target in targets:
        report = lk_hf.patch_report(target, backend=args.backend, ops=ops)
        print(report.format())
        failed |= bool(report.failed)
    return 1 if failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "patch-report", help="what the transformers integration patches on a model, and why not the rest"
    )
    p.add_argument("--model-type", help="a transformers model type, e.g. qwen3, gemma3_text, gpt_neox")
    p.add_argument("--config", help="a config.json file or a directory / hub name holding one")
    p.add_argument("--all", action="store_true", help="every family the tests train")
    p.add_argument("--backend", help="backend spec the checks run with (default: dispatch decides)")
    p.add_argument("--ops", help="comma-separated subset of rms_norm,layer_norm,rope,mlp,flce,causal_mask")
    p.set_defaults(func=cmd_patch_report)
