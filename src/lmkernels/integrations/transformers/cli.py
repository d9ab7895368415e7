"""`lmkernels patch-report`: what apply() would patch on a model type or config, and why not the rest.

    lmkernels patch-report --model-type qwen3
    lmkernels patch-report --config path/to/config.json --backend triton
    lmkernels patch-report --all            # every family the tests train

The model is built from the config with its sizes shrunk to a tiny model (the structure, not the
size, decides what is patched), with random weights, on the CPU; nothing is downloaded unless
--config names a hub model. A config that stays large after shrinking is refused.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from lmkernels import cliargs

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _model_type(text: str) -> str:
    try:
        from lmkernels.integrations.transformers.families import causal_lm_types

        known = sorted(causal_lm_types())
    except ModuleNotFoundError as e:
        raise argparse.ArgumentTypeError(cliargs.missing_module(e)) from None
    if text not in known:
        raise argparse.ArgumentTypeError(
            cliargs.unknown("model type", text, known, list_known=False)
            + f"; transformers knows {len(known)} causal-LM types, e.g. llama, qwen3, gemma3_text, gpt_neox"
        )
    return text


def _ops(text: str) -> tuple[str, ...]:
    from lmkernels.integrations.transformers import SUPPORTED_OPS

    return tuple(cliargs.choice_list(SUPPORTED_OPS, "op")(text))


def _load_config(path: str) -> PretrainedConfig:
    from transformers import AutoConfig

    from lmkernels.integrations.transformers.families import check_verification_size, shrink_config
    from lmkernels.registry import LMKernelsError

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LMKernelsError(f"--config: cannot load a transformers config from {path!r}: {first}") from None
    config = shrink_config(config)
    check_verification_size(config)
    return config


def cmd_patch_report(args: argparse.Namespace) -> int:
    from lmkernels.integrations import transformers as lk_hf

    ops = args.ops or lk_hf.SUPPORTED_OPS
    if args.config:
        from transformers import AutoModelForCausalLM

        with cliargs.quiet_transformers():
            targets = [AutoModelForCausalLM.from_config(_load_config(args.config))]
    elif args.all:
        targets = list(lk_hf.TESTED)
    else:
        targets = [args.model_type]
    failed = False
    for target in targets:
        with cliargs.quiet_transformers():
            report = lk_hf.patch_report(target, backend=args.backend, ops=ops)
        print(report.format(width=cliargs.width()))
        failed |= bool(report.failed)
    return 1 if failed else 0


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "patch-report", help="what the transformers integration patches on a model, and why not the rest"
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--model-type",
        type=_model_type,
        metavar="TYPE",
        help="a transformers model type, e.g. qwen3, gemma3_text, gpt_neox",
    )
    what.add_argument(
        "--config", metavar="PATH", help="a config.json file or a directory / hub name holding one"
    )
    what.add_argument("--all", action="store_true", help="every family the tests train")
    p.add_argument(
        "--backend",
        type=cliargs.backend_spec,
        help="backend spec the checks run with (default: dispatch decides)",
    )
    p.add_argument(
        "--ops",
        type=_ops,
        help="comma-separated subset of rms_norm,layer_norm,rope,mlp,flce,causal_mask",
    )
    p.set_defaults(func=cmd_patch_report)
