"""One TRL SFT step through TRL's fused LM head and through lmkernels': step time, tokens/s, peak memory.

    lmkernels-bench trl-head                                  # Qwen2.5-0.5B shape, 8 x 1024, bf16
    lmkernels-bench trl-head --model llama-1b --batch 4 --seq 2048 --json out.json
    lmkernels-bench trl-head --heads trl,lmkernels,plain --no-checkpointing
    lmkernels-bench trl-head --device cpu --tiny --steps 1 --warmup 1 --in-process   # smoke check

What it measures: TRL 1.x's SFTTrainer computes the loss with a fused LM head wrapped around the
model's forward; LmkernelsCallback runs that head on lmkernels.fused_linear_cross_entropy unless
told otherwise (lmkernels.integrations.trl). The heads compared (--heads):

  trl        model body patched by lmkernels, TRL's own fused head  (LmkernelsCallback(trl_head="trl"))
  lmkernels  model body patched by lmkernels, lmkernels' fused head (LmkernelsCallback())
  plain      no lmkernels at all (TRL's head on transformers' modules)

Same model shape, random weights (seed 0; nothing downloaded), same random token batches (no
padding: every token is a label), same SFTConfig: --batch rows of --seq tokens per step, no
gradient accumulation, AdamW (fused on CUDA), bf16 weights and autocast (--dtype), gradient
checkpointing unless --no-checkpointing. Each head runs in a fresh subprocess (patches are
process-wide, peaks must not leak; --in-process runs them in this process, for the smoke test).

Per head: --warmup steps untimed (Triton compiles, allocator warms up), then --steps steps each
timed between the Trainer's on_step_begin and on_step_end with the device synchronized (the
whole step: forward, backward, optimizer). step_ms is the median, tokens_per_s = batch * seq /
median; peak_gib = torch.cuda.max_memory_allocated over the timed steps (CUDA only); loss = the
first timed step's (the heads must agree to bf16 rounding); head = what the callback logged.
Output: a table on stdout; --json PATH writes the rows with the environment. The result decides
lmkernels.integrations.trl.AUTO (which head trl_head="auto" picks).
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
from typing import Any

HEADS = ("trl", "lmkernels", "plain")
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-0.5b": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
        ),
    ),
    "llama-1b": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            rope_theta=500000.0,
        ),
    ),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmkernels-bench trl-head", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    p.add_argument(
        "--tiny", action="store_true", help="a tiny Qwen2 (hidden 32, 2 layers): a check of the script"
    )
    p.add_argument("--heads", default="trl,lmkernels", help=f"comma-separated, of {HEADS}")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10, help="timed steps per head")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--backend", default=None, help="lmkernels backend spec (default: auto, Triton on CUDA)")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--json", default=None, help="write the rows and the environment here")
    p.add_argument("--in-process", action="store_true", help="run the heads in this process")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a worker: one head, JSON on stdout
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    heads = [h for h in args.heads.split(",") if h]
    bad = [h for h in heads if h not in HEADS]
    if bad or not heads:
        p.error(f"--heads: unknown {bad or 'none given'}; expected a subset of {HEADS}")
    if min(args.batch, args.seq, args.steps) < 1 or args.warmup < 0:
        p.error("--batch, --seq and --steps must be >= 1, --warmup >= 0")
    args.heads = heads
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def build_model(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lmkernels.integrations.transformers import tiny_config

    torch.manual_seed(0)
    if args.tiny:
        config = tiny_config("qwen2")
    else:
        model_type, fields = MODELS[args.model]
        config = AutoConfig.for_model(model_type, **fields)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _tokenizer():
    """Pad and EOS only: the batches are token ids already (nothing is tokenized)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "</s>": 1}, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def step_timer(args, times: list[float], peaks: list[float]):
    """A Trainer callback appending each step's wall time (s) to `times` and, on CUDA, the peak
    memory (GiB) since the warm-up's end to `peaks`."""
    import torch
    from transformers import TrainerCallback

    cuda, warmup = args.device == "cuda", args.warmup

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
                if state.global_step == warmup:
                    torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)
            if cuda:
                peaks.append(torch.cuda.max_memory_allocated() / 2**30)

    return Timer()


def run_head(args, head: str) -> dict[str, Any]:
    """One head: build the model and trainer, train warmup + steps, return the row."""
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from lmkernels.integrations import transformers as lk_hf

    model = build_model(args)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    n_rows = args.batch * (args.warmup + args.steps)
    ids = torch.randint(2, vocab, (n_rows, args.seq), generator=g).tolist()
    cuda = args.device == "cuda"
    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(
            output_dir=out,
            per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=1,
            max_steps=args.warmup + args.steps,
            learning_rate=1e-5,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            bf16=args.dtype == "bf16" and cuda,
            use_cpu=not cuda,
            max_length=args.seq,
            gradient_checkpointing=args.checkpointing,
            optim="adamw_torch_fused" if cuda else "adamw_torch",
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=0,
        )
        times: list[float] = []
        peaks: list[float] = []
        callbacks = [step_timer(args, times, peaks)]
        lmk = None
        if head != "plain":
            lmk = lk_hf.LmkernelsCallback(backend=args.backend, trl_head="trl" if head == "trl" else "auto")
            callbacks.insert(0, lmk)
        trainer = SFTTrainer(
            model=model,
            args=config,
            train_dataset=Dataset.from_dict({"input_ids": ids}),
            processing_class=_tokenizer(),
            callbacks=callbacks,
        )
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    timed = times[args.warmup :]
    step_s = statistics.median(timed)
    path = "TRL's fused head on transformers' modules"
    if lmk is not None and lmk.summary:
        path = lmk.summary.splitlines()[-1].removeprefix("lmkernels: loss: ")
    row = {
        "head": head,
        "model": "tiny" if args.tiny else args.model,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "checkpointing": args.checkpointing,
        "step_ms": round(step_s * 1e3, 3),
        "step_ms_all": [round(t * 1e3, 3) for t in timed],
        "tokens_per_s": round(args.batch * args.seq / step_s, 1),
        "peak_gib": round(max(peaks[args.warmup :]), 3) if peaks[args.warmup :] else None,
        "loss": losses[args.warmup] if len(losses) > args.warmup else None,
        "path": path,
    }
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def _worker_argv(argv, head: str) -> list[str]:
    return [sys.executable, __file__, *(argv or []), "--one", head]


def environment(args) -> dict[str, Any]:
    import torch
    import transformers
    import trl

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__}
    if args.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| head | step ms | tokens/s | peak GiB | loss | loss path |", "|---|---|---|---|---|---|"]
    for r in rows:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
        lines.append(
            f"| {r['head']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {peak} | {loss} | {r['path']} |"
        )
    return "\n".join(lines)


def run(argv=None) -> list[dict[str, Any]]:
    """The heads' rows (a worker, --one: its head's row printed, none returned)."""
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_head(args, args.one)))
        return []
    rows = []
    for head in args.heads:
        if args.in_process:
            rows.append(run_head(args, head))
            continue
        done = subprocess.run(
            _worker_argv(argv if argv is not None else sys.argv[1:], head), capture_output=True, text=True
        )
        if done.returncode:
            sys.stderr.write(done.stderr)
            raise SystemExit(f"lmkernels-bench trl-head: the {head!r} worker failed (exit {done.returncode})")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(args), "rows": rows}, f, indent=1)
    return rows


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
