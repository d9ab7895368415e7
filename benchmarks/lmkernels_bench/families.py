"""bf16 training of the structurally patched families against plain transformers, two ways.

    lmkernels-bench families --out DIR                    # trajectories
    lmkernels-bench families --out DIR --stepcheck --repeat 2

For each family: a small random model (tiny_model with SIZE, the vocabulary of the shipped Tiny
Shakespeare BPE), the same init and batches for every run.

- Trajectories: trained plain in fp32 (the reference), plain in bf16 NOISE_RUNS times (the rows
  of each batch in another order: the same loss and gradients in exact arithmetic, another
  bf16 rounding) and patched in bf16 with --backend. Each bf16 run's distance from fp32: the
  mean |loss - fp32 loss| over the second half of the steps (where rounding has had time to
  move a trajectory). Verdict: the patched run's distance is within NOISE_FACTOR x the largest
  of the plain runs', i.e. inside the spread that rounding alone gives plain transformers.
- Step check (--stepcheck): along the patched run, before every update, plain bf16 and plain
  fp32 copies loaded with the patched model's current weights run the same batch. Per step the
  loss, every parameter gradient (RMS over steps, against fp32: pass when patched <= 2 x plain
  bf16's + floor) and the worst patched module's output against its own class forward.
  --repeat N trains the patched model N times: are its losses bit-identical?

Writes results.json / stepcheck.json and summary.md / stepcheck.md (device, versions, command)
under --out. `lmkernels-bench suite validation --part families` / `--part stepcheck` run these
and keep one record per family.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lmkernels_bench.data import command_line

DEFAULT = (
    "llama",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "phi3",
    "gemma3_text",
    "olmo2",
    "cohere",
    "glm",
    "gpt_neox",
)
SIZE = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "head_dim": 64,
    "moe_intermediate_size": 256,
}
# The step check's rule: lmkernels.convergence.compare's bf16 rule per step on shared weights;
# the floors are bf16's own resolution (a relative error below 2^-8 is not a bf16 difference).
FACTOR = 2.0
LOSS_FLOOR = 1e-5
GRAD_FLOOR = 2.0**-8


def make_batches(steps: int, batch_size: int, seq_len: int):
    from lmkernels.convergence import data

    return data.make_batches(steps, batch_size, seq_len, 2, seed=0)


def family_model(model_type: str, batches, seq_len: int):
    """The family's small random model (SIZE, the batches' vocabulary), on the CPU in fp32."""
    from lmkernels.integrations import transformers as lk_hf

    overrides = dict(SIZE, vocab_size=batches.vocab_size, max_position_embeddings=seq_len)
    return lk_hf.tiny_model(model_type, seed=0, **overrides)


# --- trajectories ---------------------------------------------------------------------------------


# The trajectory check's noise: plain bf16 runs on the batches' rows in other orders.
NOISE_RUNS = 3
NOISE_FACTOR = 1.5


def permuted(batches, seed: int):
    """The same batches with the rows of each in another (seeded) order; seed 0: as they are."""
    if seed == 0:
        return batches
    g = torch.Generator().manual_seed(seed)
    train = [b[torch.randperm(b.shape[0], generator=g)] for b in batches.train]
    return dataclasses.replace(batches, train=train)


def distance(losses: list[float], reference: list[float]) -> float:
    """Mean |loss - reference loss| over the second half of the steps."""
    half = len(losses) // 2
    pairs = list(zip(losses[half:], reference[half:]))
    return sum(abs(a - b) for a, b in pairs) / max(1, len(pairs))


def trajectory(model_type: str, backend: str, batches, steps: int, batch_size: int, seq_len: int, device):
    """fp32 plain, bf16 plain NOISE_RUNS times (rows reordered) and bf16 patched, from one init."""
    from lmkernels.convergence.train import Patch, TrainConfig, train_run
    from lmkernels.integrations import transformers as lk_hf

    start = time.perf_counter()
    base = family_model(model_type, batches, seq_len)
    report = lk_hf.patch_report(base.to(device), backend=backend)
    base = base.cpu()
    cfg = TrainConfig(
        family=model_type,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        dtype="bf16",
        device=device,
        vocab_size=batches.vocab_size,
    )
    reference = train_run(base, batches, cfg, dtype="fp32", label=f"{model_type} fp32", progress=True)
    plain = [
        train_run(base, permuted(batches, seed), cfg, label=f"{model_type} bf16 #{seed}", progress=True)
        for seed in range(NOISE_RUNS)
    ]
    patch = Patch(backend, lk_hf.SUPPORTED_OPS)
    patched = train_run(base, batches, cfg, patch=patch, label=f"{model_type} lmk", progress=True)
    noise = [distance(r.losses, reference.losses) for r in plain]
    ours = distance(patched.losses, reference.losses)
    limit = NOISE_FACTOR * max(noise)
    eval_noise = [abs(r.eval_loss - reference.eval_loss) for r in plain]
    eval_ours = abs(patched.eval_loss - reference.eval_loss)
    summary = report.summary()
    return {
        "family": model_type,
        "ops": report.patched_ops(),
        "patched": summary["patched"],
        "kept": summary["kept"],
        "failed": summary["failed"],
        "passed": ours <= limit,
        "distance": {"patched": ours, "plain_bf16": noise, "limit": limit},
        "eval_loss_diff": {"patched": eval_ours, "plain_bf16": eval_noise},
        "losses": {
            "fp32": reference.losses,
            "patched": patched.losses,
            **{f"bf16_{i}": r.losses for i, r in enumerate(plain)},
        },
        "seconds": time.perf_counter() - start,
    }


# --- the step check -------------------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _first(out):
    """A module output's main tensor: the tensor itself, a tuple's first item, or a transformers
    ModelOutput's first field (a patched model forward returns one: BaseModelOutputWithPast)."""
    return out if isinstance(out, torch.Tensor) else out[0]


def _hook_patched_modules(model, worst: dict):
    """Forward hooks on every instance-patched submodule: its output against the class forward."""
    handles = []
    for name, module in model.named_modules():
        fn = vars(module).get("forward")
        if (
            module is model
            or fn is None
            or not getattr(getattr(fn, "__func__", fn), "_lmkernels_patch", False)
        ):
            continue

        def hook(mod, args, kwargs, out, name=name):
            with torch.no_grad():
                ref = type(mod).forward(mod, *args, **kwargs)
            err = _rel(_first(out), _first(ref))
            if err > worst.get("err", -1.0):
                worst.update(err=err, module=name)

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    return handles


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    # No cache: a module hook re-runs attention on the same arguments, which would append to a
    # cache twice (sliding-window layers then see more keys than the mask has).
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def stepcheck_runs(model_type: str, backend: str, batches, seq_len: int, repeat: int, device) -> list:
    """Per step: loss and gradients of the patched bf16 model, of plain bf16 and of plain fp32,
    all three on the patched model's current weights and the same batch; `repeat` runs."""
    from lmkernels.integrations import transformers as lk_hf

    base = family_model(model_type, batches, seq_len)
    runs = []
    for r in range(repeat):
        plain = copy.deepcopy(base).to(device=device, dtype=torch.bfloat16)
        fp32 = copy.deepcopy(base).to(device=device)
        model = copy.deepcopy(base).to(device=device, dtype=torch.bfloat16)
        lk_hf.apply(model, backend=backend, ops=lk_hf.SUPPORTED_OPS)
        opt = torch.optim.AdamW(
            model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01, foreach=False
        )
        steps = []
        for step, ids in enumerate(batches.train):
            ids = ids.to(device)
            weights = model.state_dict()
            plain.load_state_dict(weights)
            fp32.load_state_dict(weights)  # upcast: the same values in fp32
            ref_loss, ref_grads = _loss_and_grads(fp32, ids)
            plain_loss, plain_grads = _loss_and_grads(plain, ids)
            worst_module: dict = {}
            handles = _hook_patched_modules(model, worst_module) if r == 0 else []
            try:
                loss, grads = _loss_and_grads(model, ids)
            finally:
                for h in handles:
                    h.remove()
            grad_errs = {
                n: (_rel(g, ref_grads[n]), _rel(plain_grads[n], ref_grads[n])) for n, g in grads.items()
            }
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps.append(
                {
                    "step": step,
                    "loss": {"patched": loss, "plain_bf16": plain_loss, "fp32": ref_loss},
                    "grad_err": grad_errs,  # name -> (patched vs fp32, plain bf16 vs fp32)
                    "module_err": worst_module.get("err"),
                    "module": worst_module.get("module"),
                }
            )
            print(f"{model_type} r{r} step {step:2d} loss {loss:.4f} plain {plain_loss:.4f}", flush=True)
        lk_hf.revert(model)
        runs.append(steps)
    return runs


def _rms(values) -> float:
    values = list(values)
    return (sum(v * v for v in values) / len(values)) ** 0.5


def stepcheck_verdict(runs: list) -> dict[str, Any]:
    """RMS over the first run's steps of each error (patched vs fp32, plain bf16 vs fp32), loss and
    every gradient; pass when err(patched) <= FACTOR * err(plain bf16) + floor for all of them.
    Also the worst module output and whether the runs' losses are bit-identical."""
    steps = runs[0]
    loss_p = _rms(abs(s["loss"]["patched"] - s["loss"]["fp32"]) / s["loss"]["fp32"] for s in steps)
    loss_b = _rms(abs(s["loss"]["plain_bf16"] - s["loss"]["fp32"]) / s["loss"]["fp32"] for s in steps)
    loss_limit = FACTOR * loss_b + LOSS_FLOOR
    worst = (0.0, "", 0.0, 0.0)  # (ratio to the limit, name, patched, limit)
    for name in steps[0]["grad_err"]:
        g_p = _rms(s["grad_err"][name][0] for s in steps)
        limit = FACTOR * _rms(s["grad_err"][name][1] for s in steps) + GRAD_FLOOR
        if g_p / limit > worst[0]:
            worst = (g_p / limit, name, g_p, limit)
    module = max(steps, key=lambda s: s["module_err"] or 0.0)
    return {
        "passed": loss_p <= loss_limit and worst[0] <= 1.0,
        "loss": [loss_p, loss_limit],
        "grad": list(worst[1:]),
        "module": [module["module_err"], module["module"]],
        "repeatable": all([s["loss"] for s in r] == [s["loss"] for s in steps] for r in runs[1:]),
    }


# --- the command ------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmkernels-bench families",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True)
    p.add_argument("--families", nargs="+", default=list(DEFAULT))
    p.add_argument("--backend", default="triton")
    p.add_argument("--steps", type=int, help="training steps (default 150, step check 20)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--stepcheck", action="store_true", help="the step check on shared weights")
    p.add_argument("--repeat", type=int, default=1, help="step check: patched runs (default 1)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    args.steps = args.steps or (20 if args.stepcheck else 150)
    return args


def _fmt_trajectory(r: dict[str, Any]) -> str:
    d = r["distance"]
    noise = ", ".join(f"{v:.4f}" for v in d["plain_bf16"])
    return (
        f"| {r['family']} | {'pass' if r['passed'] else 'FAIL'} | {d['patched']:.4f} | {noise} | "
        f"{d['limit']:.4f} | {', '.join(r['ops'])} |"
    )


def _fmt_stepcheck(family: str, v: dict[str, Any]) -> str:
    name, g_p, g_lim = v["grad"]
    return (
        f"| {family} | {'pass' if v['passed'] else 'FAIL'} | {v['loss'][0]:.2g} / {v['loss'][1]:.2g} | "
        f"{g_p:.2g} / {g_lim:.2g} ({name}) | {v['module'][0] or 0:.2g} ({v['module'][1]}) | "
        f"{'yes' if v['repeatable'] else 'NO'} |"
    )


def main(argv=None) -> int:
    import transformers

    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = make_batches(args.steps, args.batch_size, args.seq_len)
    meta = {
        "command": command_line("families", argv),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "backend": args.backend,
        "steps": args.steps,
        "batch": [args.batch_size, args.seq_len],
    }
    head = [f"torch {meta['torch']}, transformers {meta['transformers']}, backend {args.backend}", ""]
    if args.stepcheck:
        checks: dict[str, dict[str, Any]] = {}
        lines: list[str] = []
        for family in args.families:
            runs = stepcheck_runs(family, args.backend, batches, args.seq_len, args.repeat, device)
            checks[family] = {"verdict": stepcheck_verdict(runs), "runs": runs}
            lines.append(_fmt_stepcheck(family, checks[family]["verdict"]))
            print(lines[-1], flush=True)
        (out / "stepcheck.json").write_text(json.dumps({"meta": meta, "results": checks}, indent=1))
        md = [f"# Patched vs plain on the same weights, per step ({meta['device']})", "", *head]
        md += [
            "Errors against plain fp32 on the same weights, RMS over steps: patched / limit",
            f"(limit = {FACTOR} x plain bf16's + floor {LOSS_FLOOR} loss, {GRAD_FLOOR} gradients).",
            "",
            "| family | verdict | loss | worst gradient | worst module output vs its class | repeatable |",
            "|---|---|---|---|---|---|",
            *lines,
        ]
        (out / "stepcheck.md").write_text("\n".join(md) + "\n")
        return 0 if all(r["verdict"]["passed"] for r in checks.values()) else 1
    results = []
    for family in args.families:
        results.append(
            trajectory(family, args.backend, batches, args.steps, args.batch_size, args.seq_len, device)
        )
        print(_fmt_trajectory(results[-1]), flush=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    md = [f"# Families, bf16 convergence on {meta['device']}", "", *head]
    md += [
        f"Mean |loss - fp32 loss| over the second half of {args.steps} steps: patched, plain bf16 with the",
        f"batch rows in {NOISE_RUNS} orders (the rounding noise), limit {NOISE_FACTOR} x the largest.",
        "",
        "| family | verdict | patched | plain bf16 runs | limit | patched ops |",
        "|---|---|---|---|---|---|",
    ]
    (out / "summary.md").write_text("\n".join(md + [_fmt_trajectory(r) for r in results]) + "\n")
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
