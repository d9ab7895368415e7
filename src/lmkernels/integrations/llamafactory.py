"""LLaMA-Factory: lmkernels as a kernel of LLaMA-Factory's kernel registry.

LLaMA-Factory applies the kernels named by its `use_v1_kernels` option (a comma-separated list
of kernel ids, or "auto" for all) to the model it loads for training. This module registers the
kernel "lmkernels" there, and runs LLaMA-Factory's training with it registered:

    # train.yaml: LLaMA-Factory's own config, plus
    use_v1_kernels: lmkernels
    lmkernels_backend: triton          # optional; read by this launcher, not by LLaMA-Factory

    python -m lmkernels.integrations.llamafactory train train.yaml [key=value ...]
    torchrun --nproc-per-node 8 -m lmkernels.integrations.llamafactory train train.yaml

or from Python: `lmkernels.integrations.llamafactory.run_exp(args, callbacks, backend=...)`,
which is LLaMA-Factory's `run_exp` with the kernel registered. LLaMA-Factory has no plugin
entry point: its registry holds what the training process imported, so `llamafactory-cli
train` (and the torchrun it starts for several GPUs) never sees this kernel; launch through
this module (with torchrun yourself for several GPUs), or call `register()` before `run_exp`.

What the kernel does: `lmkernels.integrations.transformers.apply` on the loaded model (inside
a value-head wrapper; a PEFT model is seen through by apply itself), with this module's
settings (`configure()`, or the launcher's `lmkernels_backend`, `lmkernels_ops`,
`lmkernels_strict` keys). LLaMA-Factory applies registered kernels at the end of model
loading, after the adapter: LoRA layers on the MLP projections run inside lmkernels' GLU, and
a LoRA or modules_to_save lm_head inside the fused loss, as PEFT computes them. The patch
report is logged once (logger `lmkernels`; the launcher shows its INFO lines).

The fused loss ("flce") returns no logits for a training forward with labels. Every
LLaMA-Factory stage that reads logits calls the model without labels (DPO, KTO, PPO, reward
models) except `use_asft_loss`; the launcher and run_exp() leave "flce" out for it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from torch import nn

from lmkernels.registry import LMKernelsError, parse_backend_spec

_Model = TypeVar("_Model", bound=nn.Module)

logger = logging.getLogger("lmkernels")

KERNEL_ID = "lmkernels"
_OPTION_KEYS = ("lmkernels_backend", "lmkernels_ops", "lmkernels_strict")
_settings: dict[str, Any] = {"backend": None, "ops": None, "strict": True}


def configure(backend: str | None = None, ops: Iterable[str] | None = None, strict: bool = True) -> None:
    """What the registered kernel applies: the arguments of
    lmkernels.integrations.transformers.apply (ops None: all of them)."""
    from lmkernels.integrations.transformers import SUPPORTED_OPS

    if ops is not None:
        ops = (ops,) if isinstance(ops, str) else tuple(ops)
        unknown = [op for op in ops if op not in SUPPORTED_OPS]
        if unknown:
            raise LMKernelsError(f"ops: unknown {unknown}; expected a subset of {SUPPORTED_OPS}")
    if backend is not None:  # a bad spec fails here, not after the model is loaded
        parse_backend_spec(backend, where="backend")
    _settings.update(backend=backend, ops=ops, strict=bool(strict))


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside LLaMA-Factory's value-head wrapper (`pretrained_model`: PPO and reward
    stages), else `model` (a transformers model, or a PEFT model around one)."""
    inner = getattr(model, "pretrained_model", None)
    if isinstance(inner, nn.Module) and type(model).__name__.endswith("WithValueHead"):
        return inner
    return model


def patch(
    model: _Model, backend: str | None = None, ops: Iterable[str] | None = None, strict: bool = True
) -> _Model:
    """Patch the model LLaMA-Factory loaded (wrappers included: see unwrap()); returns `model`.
    backend, ops, strict: as lmkernels.integrations.transformers.apply."""
    from lmkernels.integrations import transformers as lk_hf

    inner = unwrap(model)
    lk_hf.apply(inner, backend=backend, ops=lk_hf.SUPPORTED_OPS if ops is None else ops, strict=strict)
    report = lk_hf.report(inner)
    if int(os.environ.get("RANK", "0")) == 0 and report is not None:
        logger.info("\n%s", report.format())
    return model


def register() -> Any:
    """Register the kernel "lmkernels" with LLaMA-Factory's kernel registry (once); returns its
    class. Its apply(model=...) runs patch() with the configure()d settings."""
    try:
        from llamafactory.v1.accelerator.helper import DeviceType
        from llamafactory.v1.plugins.model_plugins.kernels import interface
        from llamafactory.v1.plugins.model_plugins.kernels.base import BaseKernel
        from llamafactory.v1.plugins.model_plugins.kernels.registry import Registry
    except ImportError as exc:
        raise LMKernelsError(
            f"lmkernels.integrations.llamafactory needs LLaMA-Factory with its kernel registry "
            f"(llamafactory>=0.9.5): {exc}"
        ) from exc

    from lmkernels import _versions

    _versions.check("llamafactory")  # the range of pyproject.toml's llamafactory extra
    kernel = Registry.get(KERNEL_ID)
    if kernel is None:

        class LmkernelsKernel(BaseKernel):
            """lmkernels' norms, rotary embedding, gated MLP and fused linear cross entropy."""

            _kernel_id = KERNEL_ID
            _device = list(DeviceType)  # lmkernels' dispatch picks a backend for the device

            @classmethod
            def apply(cls, model: nn.Module | None = None, **kwargs: Any) -> nn.Module:
                if model is None:
                    raise LMKernelsError("the lmkernels kernel was applied without a model")
                return patch(model, **_settings)

        kernel = Registry.register(LmkernelsKernel)
        if kernel is None:  # the registry skips kernels whose _device lacks the accelerator
            raise LMKernelsError("LLaMA-Factory's kernel registry refused the lmkernels kernel")
    # interface.default_kernels is the registry's own dict in LLaMA-Factory 0.9.5; keep it so.
    if interface.default_kernels is not None and KERNEL_ID not in interface.default_kernels:
        interface.default_kernels[KERNEL_ID] = kernel
    return kernel


def _prepare(
    args: dict[str, Any], backend: str | None, ops: Iterable[str] | None, strict: bool
) -> dict[str, Any]:
    """Settings from the launcher keys (popped: LLaMA-Factory refuses keys it does not know)
    and the arguments; `use_v1_kernels` set to "lmkernels" when absent."""
    args = dict(args)
    options = {key: args.pop(key) for key in _OPTION_KEYS if key in args}
    if backend is None:
        backend = options.get("lmkernels_backend")
    if ops is None and options.get("lmkernels_ops") is not None:
        ops = options["lmkernels_ops"]
        ops = [op.strip() for op in ops.split(",") if op.strip()] if isinstance(ops, str) else list(ops)
    if "lmkernels_strict" in options:
        strict = options["lmkernels_strict"] not in (False, "false", "False", 0)
    if args.get("use_asft_loss"):  # reads the logits of a forward with labels
        from lmkernels.integrations import transformers as lk_hf

        ops = [op for op in (lk_hf.SUPPORTED_OPS if ops is None else ops) if op != "flce"]
    configure(backend=backend, ops=ops, strict=strict)
    kernels = args.get("use_v1_kernels")
    if kernels in (None, False):
        args["use_v1_kernels"] = KERNEL_ID
    elif kernels is True or kernels == "auto":
        pass  # "auto" applies every registered kernel, this one included
    elif KERNEL_ID not in str(kernels).split(","):
        raise LMKernelsError(
            f"use_v1_kernels is {kernels!r}: add {KERNEL_ID!r} to the list (or leave the key out)"
        )
    return args


def run_exp(
    args: dict[str, Any] | None = None,
    callbacks: list[Any] | None = None,
    *,
    backend: str | None = None,
    ops: Iterable[str] | None = None,
    strict: bool = True,
) -> None:
    """LLaMA-Factory's `llamafactory.train.tuner.run_exp` with the lmkernels kernel registered
    and applied (`use_v1_kernels` defaults to "lmkernels"). `args` None reads the config file and
    key=value overrides from the command line, as LLaMA-Factory does."""
    from llamafactory.hparams.parser import read_args
    from llamafactory.train.tuner import run_exp as lf_run_exp

    register()
    args = read_args(args)
    if not isinstance(args, dict):
        raise LMKernelsError(
            "arguments: expected a config file (.yaml / .json) or a dict of LLaMA-Factory's keys"
        )
    lf_run_exp(_prepare(args, backend, ops, strict), callbacks=callbacks)


USAGE = """usage: python -m lmkernels.integrations.llamafactory train CONFIG.yaml [key=value ...]

Runs LLaMA-Factory's training (as `llamafactory-cli train` does, in this process) with the
kernel "lmkernels" registered; `use_v1_kernels` defaults to "lmkernels". Extra config keys:
lmkernels_backend (e.g. triton, or triton,flce=compile), lmkernels_ops (comma-separated subset
of rms_norm,layer_norm,rope,mlp,flce,causal_mask), lmkernels_strict (default true).
For several GPUs: torchrun --nproc-per-node N -m lmkernels.integrations.llamafactory train ..."""


def main(argv: list[str] | None = None) -> int:
    """`python -m lmkernels.integrations.llamafactory train CONFIG.yaml [key=value ...]` (USAGE)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "train" or len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv and argv[-1] in ("-h", "--help") else 2
    sys.argv = [sys.argv[0], *argv[1:]]  # LLaMA-Factory's read_args reads the config from argv
    if not logger.handlers:  # this process is ours: show lmkernels' INFO lines (the patch report)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(levelname)s|%(name)s] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    run_exp()
    return 0


if __name__ == "__main__":
    sys.exit(main())
