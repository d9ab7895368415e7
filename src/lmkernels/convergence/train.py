"""One short training run of a tiny model, plain or patched, recording what the comparison needs."""

from __future__ import annotations

import copy
import dataclasses
import gc
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lmkernels.convergence.data import Batches
from lmkernels.registry import LMKernelsError

if TYPE_CHECKING:
    from rich.progress import Progress

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass
class TrainConfig:
    """AdamW with a constant learning rate and gradient clipping, as a short fine-tune would run.

    lr 2e-3 is high enough that the tiny model's loss falls by ~1.5 nats in 30 steps (so the runs
    really learn) and low enough that training stays smooth; clipping at 1.0 is the Trainer's
    default.
    """

    family: str = "llama"
    steps: int = 30
    batch_size: int = 8
    seq_len: int = 64
    dtype: str = "fp32"
    device: str = "cpu"
    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    seed: int = 0
    eval_batches: int = 2
    topk: int = 8
    vocab_size: int = 512

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise LMKernelsError(f"dtype: expected one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise LMKernelsError(f"device: expected 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise LMKernelsError("device: 'cuda' requested but torch.cuda.is_available() is False")
        for name in ("steps", "batch_size", "seq_len", "eval_batches", "topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LMKernelsError(f"{name}: expected a positive int, got {value!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclasses.dataclass
class Patch:
    """Run the model patched by lmkernels.integrations.transformers.apply(backend, ops)."""

    backend: str | None
    ops: tuple[str, ...]


@dataclasses.dataclass
class RunResult:
    """What train_run() measured: per-step losses and gradient norms, the eval loss and
    log-probs, the final parameters and the wall time."""

    label: str
    dtype: str
    losses: list[float]  # training loss of every step, before that step's update
    grad_norms: list[float]  # total gradient norm of every step, before clipping
    eval_loss: float  # mean loss over the eval batches after training
    eval_logprobs: torch.Tensor  # (B, T, V) fp32 log-softmax on the first eval batch, CPU
    params: dict[str, torch.Tensor]  # final parameters, fp32, CPU
    seconds: float


def train_run(
    base_model: torch.nn.Module,
    batches: Batches,
    cfg: TrainConfig,
    patch: Patch | None = None,
    dtype: str | None = None,
    label: str = "",
    progress: bool = False,
) -> RunResult:
    """Train a copy of `base_model` (left untouched) on `batches`; deterministic given its inputs."""
    from lmkernels.integrations import transformers as lk_hf

    dtype = dtype or cfg.dtype
    device = torch.device(cfg.device)
    require_plain_family(base_model)
    model = copy.deepcopy(base_model).to(device=device, dtype=DTYPES[dtype])
    if patch is not None:
        lk_hf.apply(model, backend=patch.backend, ops=patch.ops)
    try:
        losses, grad_norms, eval_loss, logprobs, seconds = _train(
            model, batches, cfg, device, label, progress
        )
    finally:
        if patch is not None:
            lk_hf.revert(model)
    params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    return RunResult(label, dtype, losses, grad_norms, eval_loss, logprobs, params, seconds)


def require_plain_family(model: torch.nn.Module) -> None:
    """Every run must start from plain transformers: a class-level patch, or the module-level
    rope patch a live patched model holds, would silently change the baseline too."""
    from lmkernels.integrations import transformers as lk_hf

    if lk_hf.family_patches(model):
        gc.collect()  # patched models that are only waiting for collection release rope
    found = lk_hf.family_patches(model)
    if found:
        raise LMKernelsError(
            f"model: the baseline must be plain transformers, but these are patched: {'; '.join(found)}. "
            f"Revert them (lmkernels.integrations.transformers.revert, patched_models()) first"
        )


def _progress_bar(shown: bool) -> Progress:
    """A progress bar of training steps on stderr: on a terminal, removed when done; elsewhere (a
    log) its last state, one line per run. Not shown: nothing printed."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    from lmkernels.cliargs import width

    columns: tuple[ProgressColumn, ...] = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    columns += (TextColumn("{task.fields[loss]}"),)
    console = Console(stderr=True, width=width())
    return Progress(*columns, console=console, transient=console.is_terminal, disable=not shown)


def _train(
    model: torch.nn.Module,
    batches: Batches,
    cfg: TrainConfig,
    device: torch.device,
    label: str,
    progress: bool,
) -> tuple[list[float], list[float], float, torch.Tensor, float]:
    # foreach=False: the same per-tensor update everywhere (multi-tensor kernels are equivalent,
    # but one code path on every device keeps the baseline and the candidates identical).
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, foreach=False
    )
    losses: list[float] = []
    grad_norms: list[float] = []
    start = time.perf_counter()
    model.train()
    with _progress_bar(progress) as bar:
        task = bar.add_task(label or "train", total=len(batches.train), loss="")
        for ids in batches.train:
            ids = ids.to(device)
            loss = model(input_ids=ids, labels=ids).loss
            if not torch.isfinite(loss):
                raise LMKernelsError(f"{label}: training loss became {loss.item()} at step {len(losses)}")
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            grad_norms.append(norm.item())
            bar.update(task, advance=1, loss=f"loss {losses[-1]:.4f}")
    eval_loss, logprobs = evaluate(model, batches, device)
    return losses, grad_norms, eval_loss, logprobs, time.perf_counter() - start


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Batches, device: torch.device) -> tuple[float, torch.Tensor]:
    """Mean eval loss and the log-probs of the first eval batch.

    The loss is computed in train mode, which for a patched model routes it through the fused
    lm_head + loss (its no-grad path); the configs have no dropout, so train mode computes the
    same function as eval mode. The log-probs come from the logits of the eval-mode forward.
    """
    model.train()
    losses = [model(input_ids=ids.to(device), labels=ids.to(device)).loss.float() for ids in batches.eval]
    eval_loss = torch.stack(losses).mean().item()
    model.eval()
    logits = model(input_ids=batches.eval[0].to(device)).logits
    logprobs = F.log_softmax(logits.float(), dim=-1).cpu()
    model.train()
    return eval_loss, logprobs
