"""Step-by-step check of a patched bf16 training run against plain transformers on the same weights.

    python scripts/families_stepcheck.py --out /tmp/sc --families qwen3_moe gemma3_text --steps 20

The patched model trains as in scripts/families_gpu.py. Before every update, an unpatched copy
loaded with the patched model's current weights runs the same batch, so the two differ only by
the kernels: the script records per step the loss difference, the worst relative difference of
a parameter gradient, and the worst relative difference of a patched module's output against
its own class forward on the same input (forward hooks). A kernel that computes a wrong step
shows as an outlier there, while rounding drift stays at the bf16 level (~1e-2). --repeat N
trains the patched model N times to show whether its losses are deterministic.
Writes stepcheck.json and stepcheck.md (device, versions, command) under --out.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families_gpu import family_model, parser, prepare_run  # noqa: E402  (the validation run's options, data, models)

# The bf16 rule of lmkernels.convergence.compare, applied per step on shared weights; the floors
# are bf16's own resolution (a relative error below 2^-8 is not a bf16 difference).
FACTOR = 2.0
LOSS_FLOOR = 1e-5
GRAD_FLOOR = 2.0**-8


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
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def check_family(model_type, batches, args, device):
    """Per step: loss and gradients of the patched bf16 model, of plain bf16 and of plain fp32,
    all three on the patched model's current weights and the same batch."""
    from lmkernels.integrations import transformers as lk_hf

    base = family_model(model_type, batches, args.seq_len)
    runs = []
    for repeat in range(args.repeat):
        plain = copy.deepcopy(base).to(device=device, dtype=torch.bfloat16)
        fp32 = copy.deepcopy(base).to(device=device)
        model = copy.deepcopy(base).to(device=device, dtype=torch.bfloat16)
        lk_hf.apply(model, backend=args.backend, ops=lk_hf.SUPPORTED_OPS)
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
            handles = _hook_patched_modules(model, worst_module) if repeat == 0 else []
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
            print(
                f"{model_type} r{repeat} step {step:2d} loss {loss:.4f} plain {plain_loss:.4f} fp32 {ref_loss:.4f}"
                f" module {worst_module.get('err', float('nan')):.2g} ({worst_module.get('module')})",
                flush=True,
            )
        lk_hf.revert(model)
        runs.append(steps)
    return runs


def _rms(values) -> float:
    values = list(values)
    return (sum(v * v for v in values) / len(values)) ** 0.5


def verdict(steps) -> dict:
    """RMS over steps of each error (patched vs fp32, plain bf16 vs fp32), loss and every
    gradient; pass when err(patched) <= FACTOR * err(plain bf16) + floor for all of them."""
    loss_p = _rms(abs(s["loss"]["patched"] - s["loss"]["fp32"]) / s["loss"]["fp32"] for s in steps)
    loss_b = _rms(abs(s["loss"]["plain_bf16"] - s["loss"]["fp32"]) / s["loss"]["fp32"] for s in steps)
    loss_limit = FACTOR * loss_b + LOSS_FLOOR
    worst = (0.0, "", 0.0, 0.0)  # (ratio to the limit, name, patched, limit)
    for name in steps[0]["grad_err"]:
        g_p = _rms(s["grad_err"][name][0] for s in steps)
        g_b = _rms(s["grad_err"][name][1] for s in steps)
        limit = FACTOR * g_b + GRAD_FLOOR
        if g_p / limit > worst[0]:
            worst = (g_p / limit, name, g_p, limit)
    return {
        "loss": (loss_p, loss_limit),
        "grad": worst[1:],
        "passed": loss_p <= loss_limit and worst[0] <= 1.0,
    }


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0], steps=20)
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args(argv)

    import transformers

    device, out, batches = prepare_run(args)
    results = {}
    lines = []
    for model_type in args.families:
        runs = check_family(model_type, batches, args, device)
        first = runs[0]
        v = verdict(first)
        worst_mod = max(first, key=lambda s: s["module_err"] or 0.0)
        same = all([s["loss"] for s in r] == [s["loss"] for s in first] for r in runs[1:])
        results[model_type] = {"verdict": v, "runs": runs}
        name, g_p, g_lim = v["grad"]
        lines.append(
            f"| {model_type} | {'pass' if v['passed'] else 'FAIL'} | {v['loss'][0]:.2g} / {v['loss'][1]:.2g} | "
            f"{g_p:.2g} / {g_lim:.2g} ({name}) | {worst_mod['module_err']:.2g} ({worst_mod['module']}) | "
            f"{'yes' if same else 'NO'} |"
        )
        print(lines[-1], flush=True)
    meta = {
        "command": " ".join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "backend": args.backend,
    }
    (out / "stepcheck.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    md = [
        f"# Patched vs plain on the same weights, per step ({meta['device']})",
        "",
        f"`{meta['command']}`",
        "",
    ]
    md += [f"torch {meta['torch']}, transformers {meta['transformers']}, backend {args.backend}", ""]
    md += [
        "Errors against plain fp32 on the same weights, RMS over steps: patched / limit",
        f"(limit = {FACTOR} x plain bf16's + floor {LOSS_FLOOR} loss, {GRAD_FLOOR} gradients).",
        "",
        "| family | verdict | loss | worst gradient | worst module output vs its class | repeatable |",
        "|---|---|---|---|---|---|",
        *lines,
    ]
    (out / "stepcheck.md").write_text("\n".join(md) + "\n")
    return 0 if all(r["verdict"]["passed"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
