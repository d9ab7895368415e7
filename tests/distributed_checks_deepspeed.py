"""DeepSpeed ZeRO-2 and ZeRO-3 checks of a patched tiny Llama (suite "deepspeed" of
distributed_checks.py, 2 processes); every check returns {"skipped": reason} where deepspeed is
not installed (`pip install 'lmkernels[deepspeed]'`, or DS_BUILD_OPS=0 pip install deepspeed).

Three ways in, each against the same reference as every other check (plain transformers, one
process, whole batch, fp32, SGD; tolerances in distributed_common.py):
- deepspeed.initialize(model=..., optimizer=SGD) and the engine's forward / backward / step;
- transformers' Trainer with `deepspeed=` a config dict (optim "sgd", constant learning rate, no
  clipping, sequential sampling, so that it takes the reference's steps);
- Accelerate's Accelerator(deepspeed_plugin=...) and accelerator.prepare / backward.

ZeRO-3 runs with stage3_param_persistence_threshold 0, so every parameter is really partitioned
(the default keeps those under 1e5 elements whole, i.e. all of a tiny model's). Under ZeRO-3 the
checks also show how the loss got the weight: it ran as lm_head's forward (a forward pre-hook on
lm_head fires once per step), lm_head.weight was never registered as an external parameter of
another module, and it is partitioned again (shape (0,)) after the steps.

Test-only workarounds for the CPU (none applies on GPUs):
- DeepSpeed JIT-compiles a shared-memory all-reduce for CPU worlds when its comm layer starts
  (deepspeed_shm_comm, ~70 s of g++ on a fresh 2-core machine, cached afterwards); ZeRO's
  collectives go through torch.distributed (gloo here) and never use it, so the checks skip the
  build (`deepspeed.comm.torch.build_shm_op`).
- accelerate's PartialState picks no process-group backend on a machine without CUDA, so the
  Trainer / Accelerator see one process ("AssertionError: Check batch related parameters.
  train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 2 != 2 *
  1 * 2"); the checks create the state with backend gloo and DeepSpeed on first
  (ACCELERATE_USE_DEEPSPEED=true around PartialState(backend=...)), and the Trainer keeps it
  (accelerator_config use_configured_state).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import distributed_common as common
from distributed_common import (
    B_PER_RANK,
    LR,
    RTOL,
    STEPS,
    UPDATE_RTOL,
    compare,
    errors,
    global_batches,
    params,
    patched,
    reference,
    registry,
    saved_tiny,
    tiny,
)

CHECKS, check = registry()


def _deepspeed():
    """The deepspeed module with its comm layer started on this world, or None if not installed."""
    try:
        import deepspeed
        import deepspeed.comm.torch  # noqa: F401
    except ImportError:
        return None
    # See the module docstring. (deepspeed.comm re-exports the name `torch`, so the attribute
    # deepspeed.comm.torch is torch itself: the module is taken from sys.modules.)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    return deepspeed


NOT_INSTALLED = {"skipped": "deepspeed is not installed (pip install 'lmkernels[deepspeed]')"}


def ds_config(stage: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # partition every parameter
    return {
        "train_micro_batch_size_per_gpu": B_PER_RANK,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # SGD, as the reference
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


@contextlib.contextmanager
def _gathered(deepspeed, model, stage):
    """Full parameters of a ZeRO-3 model inside the block (every rank must enter it)."""
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            yield
    else:
        yield


class LmHeadWatch:
    """How a ZeRO-3 run fed lm_head's weight to the loss: lm_head's forward calls, whether any
    module registered the weight as an external parameter, its shape after training."""

    def __init__(self, model):
        self.lm_head = model.lm_head
        self.calls = 0
        self.handle = self.lm_head.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1

    def verdict(self, model, steps: int) -> dict:
        self.handle.remove()
        (w,) = (p for p in self.lm_head._parameters.values() if p is not None)  # not ZeRO's getter
        external = [name for name, m in model.named_modules() if id(w) in getattr(m, "_external_params", {})]
        assert self.calls == steps, f"lm_head's forward ran {self.calls} times in {steps} steps"
        assert not external, f"lm_head.weight became an external parameter of {external}"
        assert w.numel() == 0 and hasattr(w, "ds_tensor"), (
            f"lm_head.weight is not partitioned: {tuple(w.shape)}"
        )
        return {"lm_head_forward_calls": self.calls, "lm_head_partition": tuple(w.ds_tensor.shape)}


def _mean_over_ranks(losses: list[float]) -> list[float]:
    t = torch.tensor(losses, dtype=torch.float64, device=common.DEVICE)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def initialize_run(ctx, stage: int, model_kw=None, trl_outputs=None):
    """trl_outputs: TRL's fused LM head (add_fused_lm_head with these outputs) on the patched
    model, called with fused_lm_head=True: lmkernels runs it (every output computed, the
    entropy's gradient path taken), its loss (the mean token cross entropy) trained."""
    deepspeed = _deepspeed()
    if deepspeed is None:
        return NOT_INSTALLED
    model_kw = model_kw or {}
    model = patched(tiny(**model_kw))
    if trl_outputs is not None:
        from trl.trainer.utils import add_fused_lm_head

        from lmkernels.integrations.transformers import patching

        vars(model)[patching.RECORD].hints["entropy_grad"] = "entropy" in trl_outputs
        add_fused_lm_head(model, outputs=trl_outputs)
    watch = LmHeadWatch(model) if stage == 3 else None
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage))
    losses = []
    for ids in global_batches(ctx["world"]):
        ids = ids.chunk(ctx["world"])[ctx["rank"]]
        if trl_outputs is None:
            loss = engine(input_ids=ids, labels=ids).loss
        else:
            out = engine(input_ids=ids, labels=ids, fused_lm_head=True)
            for name in trl_outputs:
                assert torch.isfinite(getattr(out, name).float()).all(), name
            loss = out.loss + 0.0 * out.entropy.sum()  # the entropy's backward runs (zero gradient)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    losses = _mean_over_ranks(losses)
    extra = watch.verdict(model, STEPS) if watch else {}
    if trl_outputs is not None:
        from lmkernels.integrations.transformers import patching

        decision = vars(model)[patching.RECORD].trl_decision
        assert decision is not None and decision.ours, decision and decision.message
        extra["trl_head"] = decision.message
    with _gathered(deepspeed, model, stage):
        final = params(model)
    engine.destroy()
    return {**extra, **compare(losses, final, reference(ctx["world"], **model_kw))}


@check
def check_zero2_initialize(ctx):
    return initialize_run(ctx, 2)


@check
def check_zero3_initialize(ctx):
    return initialize_run(ctx, 3)


@check
def check_zero3_trl_head(ctx):
    """TRL's fused LM head under ZeRO-3 on lmkernels: the partitioned lm_head gathered by its own
    hooks (call_as_forward) for log-probs, entropy, mean logits, top-1 and log sum p^2."""
    try:
        import trl  # noqa: F401
    except ImportError:
        return {"skipped": "TRL is not installed"}
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")
    return initialize_run(ctx, 3, trl_outputs=outputs)


@check
def check_zero3_tied_embeddings(ctx):
    """lm_head.weight is embed_tokens.weight: gathered by the embedding's hooks, then by
    lm_head's, as in plain transformers."""
    deepspeed = _deepspeed()
    if deepspeed is None:
        return NOT_INSTALLED
    return initialize_run(ctx, 3, model_kw={"tie_word_embeddings": True})


@contextlib.contextmanager
def _accelerate_state():
    """accelerate's process state for DeepSpeed on this world (the CPU workaround of the module
    docstring), reset afterwards so the next check starts clean."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    if common.DEVICE.type == "cpu":
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        try:
            PartialState(backend="gloo")
        finally:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        try:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        except ImportError:
            pass
        gc.collect()


class _Rows(torch.utils.data.Dataset):
    """The global batches' rows in order: with sequential sampling and B_PER_RANK rows per rank,
    rank r's step-s batch is global_batches()[s].chunk(world)[r], as in the reference."""

    def __init__(self, batches):
        self.rows = torch.cat(batches).cpu()

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def trainer_run(ctx, stage: int, zero_init: bool = False):
    """zero_init: the usual transformers + ZeRO-3 order, TrainingArguments(deepspeed=...) first
    so that from_pretrained builds the model inside deepspeed.zero.Init (partitioned from the
    start). The patch is then the class patch, applied before TrainingArguments: apply("llama")
    verifies on a tiny model it builds, which must not be built under zero.Init (transformers
    fails to initialize it: "Cannot copy out of meta tensor"), and the instance patch of a model
    built under zero.Init fails its checks (check_zero3_instance_patch_after_zero_init)."""
    deepspeed = _deepspeed()
    if deepspeed is None:
        return NOT_INSTALLED
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from lmkernels.integrations import transformers as lk_hf

    world = ctx["world"]
    ref = reference(world)  # before any class patch
    losses = []

    class Recording(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            loss_only = loss[0] if isinstance(loss, tuple) else loss
            losses.append(loss_only.detach().item())
            return loss

    with contextlib.ExitStack() as stack:
        if zero_init:
            path = stack.enter_context(saved_tiny(ctx))
            lk_hf.apply("llama", backend=common.BACKEND)
            stack.callback(lk_hf.revert, "llama")
        else:
            # Built before TrainingArguments: while a ZeRO-3 config is active transformers builds
            # models inside deepspeed.zero.Init.
            model = patched(tiny())
        stack.enter_context(_accelerate_state())
        out = stack.enter_context(tempfile.TemporaryDirectory(prefix="lmk-ds-"))
        cpu = common.DEVICE.type == "cpu"
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=B_PER_RANK,
            max_steps=STEPS,
            learning_rate=LR,
            optim="sgd",
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=0.0,
            train_sampling_strategy="sequential",
            deepspeed={**ds_config(stage), "train_micro_batch_size_per_gpu": "auto"},
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            **({"accelerator_config": {"use_configured_state": True}} if cpu else {}),
        )
        if zero_init:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            (w,) = (p for p in model.lm_head._parameters.values() if p is not None)
            assert w.numel() == 0 and hasattr(w, "ds_id"), "from_pretrained did not build under zero.Init"
            model.to(common.DEVICE)
        watch = LmHeadWatch(model) if stage == 3 else None
        trainer = Recording(model=model, args=args, train_dataset=_Rows(global_batches(world)))
        trainer.train()
        engine = trainer.model_wrapped
        assert type(engine).__name__ == "DeepSpeedEngine", (
            f"the Trainer did not use DeepSpeed: {type(engine)}"
        )
        assert engine.zero_optimization_stage() == stage
        # The Trainer scales each rank's loss so that the ranks' mean is the global mean.
        losses = _mean_over_ranks(losses)
        extra = watch.verdict(model, STEPS) if watch else {}
        with _gathered(deepspeed, model, stage):
            final = params(model)
        engine.destroy()
        del trainer, engine
    return {**extra, **compare(losses, final, ref)}


@check
def check_zero2_hf_trainer(ctx):
    return trainer_run(ctx, 2)


@check
def check_zero3_hf_trainer(ctx):
    return trainer_run(ctx, 3)


@check
def check_zero3_hf_trainer_zero_init(ctx):
    return trainer_run(ctx, 3, zero_init=True)


@check
def check_zero3_instance_patch_after_zero_init(ctx):
    """Reports (does not assert) whether lk_hf.apply(model) takes a model built under
    deepspeed.zero.Init: its replacement checks read the module's own (partitioned, empty)
    weights. Known in this version: "rms_norm LlamaRMSNorm: check raised RuntimeError: max():
    Expected reduction dim to be specified for input.numel() == 0" (the class patch is the way)."""
    deepspeed = _deepspeed()
    if deepspeed is None:
        return NOT_INSTALLED
    from transformers import AutoModelForCausalLM, TrainingArguments

    from lmkernels.integrations import transformers as lk_hf

    with saved_tiny(ctx) as path, _accelerate_state(), tempfile.TemporaryDirectory() as out:
        cpu = common.DEVICE.type == "cpu"
        args = TrainingArguments(  # noqa: F841 (holds the DeepSpeed config that zero.Init reads)
            output_dir=out,
            per_device_train_batch_size=B_PER_RANK,
            deepspeed={**ds_config(3), "train_micro_batch_size_per_gpu": "auto"},
            report_to=[],
            **({"accelerator_config": {"use_configured_state": True}} if cpu else {}),
        )
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        try:
            lk_hf.apply(model, backend=common.BACKEND)
        except Exception as exc:  # an lmkernels error naming the failed checks, not a crash
            from lmkernels.registry import LMKernelsError

            assert isinstance(exc, LMKernelsError), f"{type(exc).__name__}: {exc}"
            return {"instance_patch_after_zero_init": str(exc).splitlines()[1].strip()[:200]}
    return {"instance_patch_after_zero_init": "ok"}


@check
def check_zero3_peft_lora_on_lm_head(ctx):
    """PEFT LoRA on q_proj and lm_head (lm_head a LoRA wrapper whose base layer holds the
    partitioned weight) under ZeRO-3: patched against plain, both through deepspeed.initialize
    (PEFT has no one-process reference here); losses and the trained LoRA weights."""
    deepspeed = _deepspeed()
    if deepspeed is None:
        return NOT_INSTALLED
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        return {"skipped": "peft is not installed"}
    world, rank = ctx["world"], ctx["rank"]
    runs = {}
    for name in ("plain", "patched"):
        model = tiny()
        if name == "patched":
            patched(model)
        cfg = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0, init_lora_weights=False
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)  # the same LoRA init in both runs
            model = get_peft_model(model, cfg)
        trainable = [p for p in model.parameters() if p.requires_grad]
        with _gathered(deepspeed, model, 0):
            init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(trainable, lr=LR), config=ds_config(3)
        )
        losses = []
        for ids in global_batches(world):
            ids = ids.chunk(world)[rank]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with _gathered(deepspeed, model, 3):
            final = {
                n: p.detach().to("cpu", torch.float32, copy=True)
                for n, p in model.named_parameters()
                if p.requires_grad
            }
        runs[name] = (_mean_over_ranks(losses), final, {n: t.cpu() for n, t in init.items()})
        engine.destroy()
    err = errors(runs["patched"][0], runs["patched"][1], runs["plain"])
    assert err["loss_rel_err"] <= RTOL, f"loss off by {err['loss_rel_err']:.2e}"
    assert err["param_update_rel_err"] <= UPDATE_RTOL, err
    assert any("lm_head" in n and "lora" in n for n in runs["plain"][1]), "no LoRA on lm_head"
    return err


@check
def check_zero3_accelerate(ctx):
    """Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...)), prepare(model, SGD),
    accelerator.backward, optimizer.step."""
    deepspeed = _deepspeed()
    if deepspeed is None:
        return NOT_INSTALLED
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    world, rank = ctx["world"], ctx["rank"]
    ref = reference(world)
    model = patched(tiny())
    watch = LmHeadWatch(model)
    with _accelerate_state():
        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(3)))
        assert acc.distributed_type.value == "DEEPSPEED", acc.distributed_type
        engine, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        losses = []
        for ids in global_batches(world):
            ids = ids.chunk(world)[rank].to(acc.device)
            loss = engine(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        losses = _mean_over_ranks(losses)
        extra = watch.verdict(model, STEPS)
        with _gathered(deepspeed, model, 3):
            final = params(model)
        engine.destroy()
        del acc, engine, opt
    return {**extra, **compare(losses, final, ref)}
