"""One training step of TRL's GRPO, DPO and GKD trainers: lmkernels against TRL as is and TRL with
Liger's kernels (tokens/s, peak memory).

    lmkernels-bench posttrain-steps --trainer grpo --json OUT.json        # Qwen2.5-0.5B shape, bf16
    lmkernels-bench posttrain-steps --trainer dpo --batch 4 --seq 1024 --budget 540
    lmkernels-bench posttrain-steps --trainer gkd --configs lmkernels,trl
    lmkernels-bench posttrain-steps --trainer grpo --device cpu --tiny --steps 1 --warmup 1 --in-process

Configurations (--configs), each in a fresh subprocess (patches are process-wide):

  lmkernels  LmkernelsCallback(): the model (and the reference / teacher) patched, TRL's heads and
             GKD's divergence on lmkernels' fused ops (docs/trainers.md)
  trl        TRL as is (its fused LM head, GKD's loss from the full logits)
  trl_liger  TRL with use_liger_kernel=True (Liger's layer kernels; TRL keeps its own head)

Model: the --model shape (trl_head.MODELS; default Qwen2.5-0.5B) with random weights (seed 0;
nothing downloaded); the reference model (GRPO, DPO) and GKD's teacher the same shape, seed 1.
A word-level tokenizer over the vocabulary (every id is a word). Per trainer, --batch rows of
--seq tokens per step, no gradient accumulation, AdamW (fused on CUDA), bf16 (--dtype), gradient
checkpointing unless --no-checkpointing:

  grpo  --batch completions per step in groups of 4 (num_generations), prompts of seq / 4 tokens,
        completions of 3 seq / 4: generation is replaced by random completions of that length
        (the step timed is the training's: the old / reference log-probs, the loss, backward and
        optimizer), dapo loss, temperature 0.7, beta 0.04 (reference model), entropy_coef 0.01
  dpo   --batch pairs, prompt seq / 4, chosen and rejected 3 seq / 4 tokens, sigmoid, reference model
  gkd   --batch conversations of seq tokens (prompt seq / 4), off-policy (lmbda 0), beta 0.5

Timing as trl-head: --warmup untimed steps, then --steps steps between on_step_begin and
on_step_end with the device synchronized; step_ms the median, tokens_per_s = tokens per step /
median (GRPO: prompt + completion tokens; DPO: both sequences of each pair), peak_gib the largest
torch.cuda.max_memory_allocated over the timed steps, loss the first timed step's. A
configuration that cannot run (Liger not installed, out of memory) is recorded with the reason.
--budget (s) skips configurations that would start past it. Output: a table; --json PATH the rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lmkernels_bench.trl_head import MODELS, step_timer

TRAINERS = ("grpo", "dpo", "gkd")
CONFIGS = ("lmkernels", "trl", "trl_liger")
NUM_GENERATIONS = 4


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmkernels-bench posttrain-steps", description=__doc__.splitlines()[0])
    p.add_argument("--trainer", required=True, choices=TRAINERS)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {CONFIGS}")
    p.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen2: a check of the script")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--backend", default=None, help="lmkernels backend spec (default: auto, Triton on CUDA)")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--budget", type=float, default=None, help="seconds; configurations past it are skipped")
    p.add_argument("--json", default=None, help="write the rows and the environment here")
    p.add_argument("--in-process", action="store_true", help="run the configurations in this process")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a worker: one configuration
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        p.error(f"--configs: unknown {bad or 'none given'}; expected a subset of {CONFIGS}")
    if min(args.batch, args.seq, args.steps) < 1 or args.warmup < 0 or args.seq < 8:
        p.error("--batch and --steps must be >= 1, --seq >= 8, --warmup >= 0")
    if args.trainer == "grpo" and args.batch % NUM_GENERATIONS:
        p.error(f"--batch: GRPO takes groups of {NUM_GENERATIONS} completions; give a multiple of it")
    args.configs = configs
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def build_model(args, seed: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lmkernels.integrations.transformers import tiny_config

    if args.tiny:
        config = tiny_config("qwen2")
    else:
        model_type, fields = MODELS[args.model]
        config = AutoConfig.for_model(model_type, **fields)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 1, 1
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def tokenizer(vocab: int):
    """Word-level: <pad>, </s>, then w2 .. w{vocab-1}; the ids are the words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="</s>")
    out.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return out


def _texts(rows: int, length: int, vocab: int, seed: int) -> list[str]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (rows, length), generator=g).tolist()
    return [" ".join(f"w{i}" for i in row) for row in ids]


def _common(args, out: str) -> dict[str, Any]:
    cuda = args.device == "cuda"
    return dict(
        output_dir=out,
        gradient_accumulation_steps=1,
        max_steps=args.warmup + args.steps,
        learning_rate=1e-6,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=args.dtype == "bf16" and cuda,
        use_cpu=not cuda,
        gradient_checkpointing=args.checkpointing,
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )


def make_trainer(args, config: str, out: str, callbacks: list):
    """The trainer of args.trainer in configuration `config`, and its tokens per step."""
    from datasets import Dataset

    model = build_model(args, seed=0)
    vocab = model.config.vocab_size
    tok = tokenizer(vocab)
    prompt, completion = max(1, args.seq // 4), args.seq - max(1, args.seq // 4)
    common = _common(args, out) | {"use_liger_kernel": config == "trl_liger"}
    rows = args.batch * (args.warmup + args.steps)
    if args.trainer == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        path = Path(out) / "policy"  # GRPO builds its reference model from the policy's path
        model.save_pretrained(path)
        tok.save_pretrained(path)
        tok.padding_side = "left"
        grpo_args = GRPOConfig(
            **common,
            per_device_train_batch_size=args.batch,
            num_generations=NUM_GENERATIONS,
            max_completion_length=completion,
            temperature=0.7,
            beta=0.04,
            entropy_coef=0.01,
            loss_type="dapo",
        )
        grpo = GRPOTrainer(
            model=str(path),
            reward_funcs=_reward,
            args=grpo_args,
            train_dataset=Dataset.from_dict({"prompt": _texts(rows, prompt, vocab, 1)}),
            processing_class=tok,
            callbacks=callbacks,
        )
        # GRPO's generation, replaced on this instance (vars(): mypy forbids assigning to a method)
        vars(grpo)["_generate_single_turn"] = _random_completions(completion, vocab)
        return grpo, args.batch * args.seq
    if args.trainer == "dpo":
        from trl import DPOConfig, DPOTrainer

        dpo_args = DPOConfig(**common, per_device_train_batch_size=args.batch, max_length=args.seq, beta=0.1)
        data = Dataset.from_dict(
            {
                "prompt": _texts(rows, prompt, vocab, 1),
                "chosen": _texts(rows, completion - 1, vocab, 2),
                "rejected": _texts(rows, completion - 1, vocab, 3),
            }
        )
        dpo = DPOTrainer(
            model=model,
            ref_model=build_model(args, seed=1),
            args=dpo_args,
            train_dataset=data,
            processing_class=tok,
            callbacks=callbacks,
        )
        return dpo, 2 * args.batch * args.seq
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    gkd_args = GKDConfig(
        **common, per_device_train_batch_size=args.batch, max_length=args.seq, lmbda=0.0, beta=0.5
    )
    messages = [
        [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
        for p, c in zip(_texts(rows, prompt - 1, vocab, 1), _texts(rows, completion - 1, vocab, 2))
    ]
    gkd = GKDTrainer(
        model=model,
        teacher_model=build_model(args, seed=1),
        args=gkd_args,
        train_dataset=Dataset.from_dict({"messages": messages}),
        processing_class=tok,
        callbacks=callbacks,
    )
    return gkd, args.batch * args.seq


def _reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
    """GRPO's reward: any cheap function of the completion."""
    return [float(len(c) % 7) for c in completions]


def _random_completions(length: int, vocab: int):
    """GRPO's generation, replaced: `length` random tokens per completion, no EOS (the step timed
    is the training's)."""
    import torch

    g = torch.Generator().manual_seed(0)

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        n = len(prompt_ids)
        return torch.randint(2, vocab, (n, length), generator=g).tolist(), None

    return generate


def run_config(args, config: str) -> dict[str, Any]:
    import torch

    row: dict[str, Any] = {
        "trainer": args.trainer,
        "config": config,
        "model": "tiny" if args.tiny else args.model,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "checkpointing": args.checkpointing,
        "status": "ok",
        "note": "",
    }
    if config == "trl_liger":
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            return row | {"status": "not installed", "note": "liger-kernel is not installed"}
    from lmkernels.integrations import transformers as lk_hf

    times: list[float] = []
    peaks: list[float] = []
    callbacks = [step_timer(args, times, peaks)]
    lmk = None
    if config == "lmkernels":
        lmk = lk_hf.LmkernelsCallback(backend=args.backend)
        callbacks.insert(0, lmk)
    try:
        with tempfile.TemporaryDirectory() as out:
            trainer, tokens = make_trainer(args, config, out, callbacks)
            trainer.train()
            losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            del trainer
    except Exception as e:  # recorded, never hidden
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        return row | {"status": "OOM" if oom else "error", "note": f"{type(e).__name__}: {e}"[:300]}
    finally:
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    timed = times[args.warmup :]
    step_s = statistics.median(timed)
    row.update(
        step_ms=round(step_s * 1e3, 3),
        step_ms_all=[round(t * 1e3, 3) for t in timed],
        tokens_per_step=tokens,
        tokens_per_s=round(tokens / step_s, 1),
        peak_gib=round(max(peaks[args.warmup :]), 3) if peaks[args.warmup :] else None,
        loss=losses[args.warmup] if len(losses) > args.warmup else None,
        path=lmk.summary.split("lmkernels: loss: ", 1)[-1]
        if lmk is not None and lmk.summary
        else "TRL as is",
    )
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| trainer | config | status | step ms | tokens/s | peak GiB | loss |",
        "|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in rows:
        lines.append(
            f"| {r['trainer']} | {r['config']} | {r['status']} | {f(r.get('step_ms'), '.1f')} | "
            f"{f(r.get('tokens_per_s'), '.0f')} | {f(r.get('peak_gib'), '.2f')} | {f(r.get('loss'), '.4f')} |"
        )
    return "\n".join(lines)


def run(argv=None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_config(args, args.one)))
        return []
    start, rows = time.monotonic(), []
    for config in args.configs:
        if args.budget is not None and time.monotonic() - start > args.budget:
            rows.append(
                {"trainer": args.trainer, "config": config, "status": "skipped", "note": "past --budget"}
            )
            continue
        if args.in_process:
            rows.append(run_config(args, config))
            continue
        argv_ = [
            sys.executable,
            "-m",
            "lmkernels_bench.posttrain_steps",
            *(argv or sys.argv[1:]),
            "--one",
            config,
        ]
        done = subprocess.run(argv_, capture_output=True, text=True)
        if done.returncode:
            rows.append(
                {"trainer": args.trainer, "config": config, "status": "error", "note": done.stderr[-300:]}
            )
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(table(rows))
    if args.json:
        import torch
        import transformers
        import trl

        env = {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__}
        if args.device == "cuda":
            env["gpu"] = torch.cuda.get_device_name()
        Path(args.json).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    return rows


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
