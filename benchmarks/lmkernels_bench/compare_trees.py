"""Same-run comparison of two lmkernels source trees on one GPU: is any op, FLCE mode or
end-to-end training step slower (or larger) after a change than before it?

    git archive OLD_REV src | tar -x -C /tmp/old      # the tree before, beside this one
    lmkernels-bench compare-trees --trees old=/tmp/old/src,new=src --rounds 3 --out DIR

Each (tree, round) runs in its own process, the trees taking turns in an order that alternates
per round, so drift cancels; a case's ratio new/old is the median over rounds of the per-round
ratios, and the spread of the old tree's own rounds is the noise it is read against. Per case:
fwd+bwd GPU time (median of 30 steps, each with the launch queue filled ahead and the L2 flushed;
an end-to-end case: the median wall time of 20 training steps) and peak memory above the inputs. Writes DIR/compare.json (one row per case) and prints a table.

A training step of a few thousand tokens is host-bound, and its time varies from one process to
the next by far more than a change's few percent. --same-process runs the end-to-end cases with
both trees in one process per round and case (a copy of the old tree renamed to `lmkold`), their steps
alternating on one model each (side_by_side keeps each tree's module-level patches its own);
the noise is then the spread of the per-round ratios.
"""

from __future__ import annotations

import argparse
import functools
import gc
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

# (case, kind, sizes): bf16, shapes of the README's benchmarks.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("rms_norm 16384x4096", "rms_norm", dict(M=16384, N=4096)),
    ("rms_norm 4096x8192", "rms_norm", dict(M=4096, N=8192)),
    ("rms_norm 1024x2048", "rms_norm", dict(M=1024, N=2048)),
    ("layer_norm 4096x16384", "layer_norm", dict(M=4096, N=16384)),
    ("layer_norm 8192x4096", "layer_norm", dict(M=8192, N=4096)),
    ("rope bhtd 1x32x8x8192x128", "rope", dict(B=1, Hq=32, Hkv=8, T=8192, D=128, bthd=False)),
    ("rope bthd 4x32x8x2048x128", "rope", dict(B=4, Hq=32, Hkv=8, T=2048, D=128, bthd=True)),
    (
        "rope bhtd 2x16x16x4096x64 partial",
        "rope",
        dict(B=2, Hq=16, Hkv=16, T=4096, D=64, bthd=False, partial=True),
    ),
    ("swiglu 8192x14336", "swiglu", dict(M=8192, N=14336)),
    ("geglu 8192x14336", "geglu", dict(M=8192, N=14336)),
    ("flce 8192x4096x128256", "flce", dict(BT=8192, H=4096, V=128256, backend="triton")),
    ("flce 16384x2560x151936", "flce", dict(BT=16384, H=2560, V=151936, backend="triton")),
    ("flce triton_lean 8192x4096x128256", "flce", dict(BT=8192, H=4096, V=128256, backend="triton_lean")),
    *((f"e2e llama-1b {b}x1024", "e2e", dict(batch=b, seq=1024)) for b in (1, 2, 4, 8, 16, 32)),
]

MODEL_ENV = "LMKERNELS_COMPARE_MODEL"  # the e2e model's config (JSON), from the driver to the workers
CASES_ENV = "LMKERNELS_COMPARE_CASES"  # --cases, from the driver to the workers
OLD_PACKAGE = "lmkold"  # --same-process: the old tree's package, renamed
_PACKAGES = ("lmkernels", OLD_PACKAGE)
PAIRED_STEPS = 10  # --same-process: 2 x this many timed steps per tree, the order flipping per pair
_MISSING = object()


def selected_cases() -> list[tuple[str, str, dict[str, Any]]]:
    """The CASES whose names contain one of --cases' comma-separated words (all without it)."""
    words = [w.strip() for w in os.environ.get(CASES_ENV, "").split(",") if w.strip()]
    return [c for c in CASES if not words or any(w in c[0] for w in words)]


def _op_case(lk, kind: str, p: dict, dev: str):
    """(step function inputs, leaves) of one op case: fwd+bwd with a fixed upstream gradient."""
    import torch

    bf = torch.bfloat16
    if kind in ("rms_norm", "layer_norm"):
        x = torch.randn(p["M"], p["N"], device=dev, dtype=bf, requires_grad=True)
        w = (torch.rand(p["N"], device=dev) + 0.5).to(bf).requires_grad_()
        b = torch.randn(p["N"], device=dev, dtype=bf, requires_grad=True)
        if kind == "rms_norm":
            return (lambda: lk.rms_norm(x, w, backend="triton")), [x, w]
        return (lambda: lk.layer_norm(x, w, b, backend="triton")), [x, w, b]
    if kind == "rope":
        from lmkernels.ops.rope import rope_tables

        B, Hq, Hkv, T, D = p["B"], p["Hq"], p["Hkv"], p["T"], p["D"]
        R = D // 2 if p.get("partial") else D
        if p["bthd"]:
            q = torch.randn(B, T, Hq, D, device=dev, dtype=bf).transpose(1, 2).requires_grad_()
            k = torch.randn(B, T, Hkv, D, device=dev, dtype=bf).transpose(1, 2).requires_grad_()
        else:
            q = torch.randn(B, Hq, T, D, device=dev, dtype=bf, requires_grad=True)
            k = torch.randn(B, Hkv, T, D, device=dev, dtype=bf, requires_grad=True)
        cos, sin = (t.to(dev, bf) for t in rope_tables(torch.arange(T), R, "neox"))
        rotary_dim = R if p.get("partial") else None
        return (lambda: lk.rope(q, k, cos, sin, rotary_dim=rotary_dim, backend="triton")), [q, k]
    if kind in ("swiglu", "geglu"):
        g = torch.randn(p["M"], p["N"], device=dev, dtype=bf, requires_grad=True)
        u = torch.randn(p["M"], p["N"], device=dev, dtype=bf, requires_grad=True)
        f = lk.swiglu if kind == "swiglu" else lk.geglu
        return (lambda: f(g, u, backend="triton")), [g, u]
    BT, H, V = p["BT"], p["H"], p["V"]
    h = torch.randn(BT, H, device=dev, dtype=bf, requires_grad=True)
    w = (torch.randn(V, H, device=dev, dtype=bf) * (2.0 / H**0.5)).requires_grad_()
    t = torch.randint(0, V, (BT,), device=dev)
    return (lambda: lk.fused_linear_cross_entropy(h, w, t, backend=p["backend"])), [h, w]


def _gpu_time_ms(step, runs: int = 30) -> float:
    """Median device time of one step with the launch queue filled ahead: before each step the
    L2 is flushed and a sleep kernel holds the stream while the host queues the whole step, so
    the events time the GPU, not the host (a small op's step is host-bound otherwise)."""
    import torch

    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.zero_()
        torch.cuda._sleep(5_000_000)  # ~2.5 ms at 2 GHz: longer than the host needs to queue a step
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _time_op(fn, leaves) -> dict:
    import torch

    outs0 = fn()
    outs0 = outs0 if isinstance(outs0, tuple) else (outs0,)
    grads = [torch.randn_like(o) for o in outs0]

    def step():
        outs = fn()
        torch.autograd.backward(outs if isinstance(outs, tuple) else (outs,), grads)
        for leaf in leaves:
            leaf.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return {"ms": _gpu_time_ms(step), "peak_mib": peak}


def _e2e_step(p: dict, dev: str, apply):
    """A Llama-3.2-1B-shaped training step (bf16 parameters, gradient checkpointing, AdamW),
    patched by `apply` (a tree's integrations.transformers.apply, default backends), warmed up.
    The config is the end-to-end benchmark's (e2e_setup.LLAMA_1B), passed in by the driver: a
    worker imports only the lmkernels trees it measures."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads(os.environ[MODEL_ENV])
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = LlamaForCausalLM(LlamaConfig(**config))
    torch.set_default_dtype(torch.float32)
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    apply(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    ids = torch.randint(0, config["vocab_size"], (p["batch"], p["seq"]), device=dev)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return step


def _timed_ms(step) -> float:
    import torch

    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _step_peak_mib(step) -> float:
    """Peak memory of one step above what was allocated before it."""
    import torch

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _time_e2e(p: dict, dev: str) -> dict:
    """The median wall time of 20 steps and the step's peak."""
    from lmkernels.integrations.transformers import apply

    step = _e2e_step(p, dev, apply)
    peak = _step_peak_mib(step)
    return {"ms": statistics.median(_timed_ms(step) for _ in range(20)), "peak_mib": peak}


def worker(src: str, out: str) -> None:
    """Every case with the lmkernels tree at `src`, results to the JSON file `out`."""
    sys.path.insert(0, src)
    import torch
    import triton

    import lmkernels as lk

    if not os.path.abspath(lk.__file__).startswith(os.path.abspath(src)):
        raise SystemExit(f"worker: imported lmkernels from {lk.__file__}, not from the tree {src}")
    torch.manual_seed(0)
    torch.cuda.set_device(0)
    results = {}
    for name, kind, p in selected_cases():
        torch.cuda.empty_cache()
        results[name] = _time_e2e(p, "cuda") if kind == "e2e" else _time_op(*_op_case(lk, kind, p, "cuda"))
    results["_env"] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name(),
    }
    with open(out, "w") as fh:
        json.dump(results, fh)


def renamed_tree(src: str, dest: str, name: str = OLD_PACKAGE) -> str:
    """A copy of the tree at `src` whose package is `name` (every "lmkernels" in its code
    renamed, torch.library namespace and environment variables included), so that it imports
    beside the other tree in one process. Returns the folder to put on sys.path."""
    target = os.path.join(dest, name)
    shutil.copytree(os.path.join(src, "lmkernels"), target, ignore=shutil.ignore_patterns("__pycache__"))
    for root, _, files in os.walk(target):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path) as fh:
                    text = fh.read().replace("lmkernels", name).replace("LMKERNELS", name.upper())
                with open(path, "w") as fh:
                    fh.write(text)
    return dest


def _transformers_globals() -> dict[str, dict]:
    """A copy of the globals of every loaded transformers module."""
    return {
        name: dict(vars(module))
        for name, module in list(sys.modules.items())
        if name.split(".")[0] == "transformers" and module is not None
    }


def side_by_side(builds: dict[str, Callable[[], Any]]) -> tuple[dict[str, Any], Callable[[str], None]]:
    """Run each build (one that patches a model) as if it were alone, and return what each
    made, with `use(name)`, which puts that build's changes to transformers' module globals
    back in place. A patch also replaces functions in the modeling module (rope's
    apply_rotary_pos_emb, causal_mask's mask functions) that both trees' models call: without
    this, the tree patched second wraps the first one's functions, and a model runs the other
    tree's code there. The model's transformers modules must be imported before the call.

    Once per process: a tree installs its module-level functions only where it has not already
    (while a model it patched lives), so after a first call a tree's new model can run another
    tree's functions, or transformers' own (which build the mask, a host sync per forward)."""
    gc.collect()
    stock = _transformers_globals()
    earlier = [
        f"{module}.{key}"
        for module, values in stock.items()
        for key, value in values.items()
        if inspect.isfunction(value) and any(getattr(value, f"_{p}_patch", False) for p in _PACKAGES)
    ]
    for package in _PACKAGES:
        patching = sys.modules.get(f"{package}.integrations.transformers.patching")
        if patching is not None and len(patching.PATCHED_MODELS):
            earlier.append(f"{len(patching.PATCHED_MODELS)} live model(s) patched by {package}")
    if earlier:
        raise RuntimeError(
            f"side_by_side: patches of an earlier call ({', '.join(earlier[:3])}): one call per process"
        )
    made, changes = {}, {}
    for name, build in builds.items():
        made[name] = build()
        changes[name] = {
            (module, key): value
            for module, values in stock.items()
            for key, value in vars(sys.modules[module]).items()
            if values.get(key, _MISSING) is not value
        }
        for module, key in changes[name]:  # back to stock for the next build
            if key in stock[module]:
                vars(sys.modules[module])[key] = stock[module][key]
            else:
                del vars(sys.modules[module])[key]
    changed = sorted(set().union(*changes.values()))
    own = {
        name: [
            (vars(sys.modules[module]), key, mine.get((module, key), stock[module].get(key, _MISSING)))
            for module, key in changed
        ]
        for name, mine in changes.items()
    }

    def use(name: str) -> None:
        for globals_, key, value in own[name]:
            if value is _MISSING:
                globals_.pop(key, None)
            else:
                globals_[key] = value

    return made, use


def paired_worker(old_root: str, new_src: str, out: str) -> None:
    """The end-to-end cases with both trees in one process (the old one renamed): per case one
    model patched by each (side_by_side), their steps alternating, so that the host's state,
    which varies from one process to the next by more than a host-bound step's difference, is
    shared. The old tree reads LMKOLD_* environment variables: each LMKERNELS_* one is copied."""
    prefix = OLD_PACKAGE.upper() + "_"
    for key, value in list(os.environ.items()):
        if key.startswith("LMKERNELS_"):
            os.environ.setdefault(prefix + key[len("LMKERNELS_") :], value)
    sys.path[:0] = [new_src, old_root]
    import importlib

    import torch
    import transformers.masking_utils  # noqa: F401  (side_by_side: imported before the patches)
    import transformers.models.llama.modeling_llama  # noqa: F401

    apply = {}
    for tree, package, root in (("old", OLD_PACKAGE, old_root), ("new", "lmkernels", new_src)):
        module = importlib.import_module(package)
        if not os.path.abspath(module.__file__ or "").startswith(os.path.abspath(root)):
            raise SystemExit(f"paired worker: imported {package} from {module.__file__}, not from {root}")
        apply[tree] = importlib.import_module(f"{package}.integrations.transformers").apply
    torch.cuda.set_device(0)
    results: dict[str, dict] = {"old": {}, "new": {}}
    for name, kind, p in selected_cases():
        if kind != "e2e":
            continue
        gc.collect()  # the previous case's models: patched forwards are reference cycles
        torch.cuda.empty_cache()
        builds: dict[str, Callable[[], Any]] = {
            tree: functools.partial(_e2e_step, p, "cuda", fn) for tree, fn in apply.items()
        }
        steps, use = side_by_side(builds)
        peaks = {}
        for tree, step in steps.items():
            use(tree)
            peaks[tree] = _step_peak_mib(step)
        times: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(2 * PAIRED_STEPS):
            for tree in ("old", "new") if i % 2 == 0 else ("new", "old"):
                use(tree)
                times[tree].append(_timed_ms(steps[tree]))
        for tree in steps:
            results[tree][name] = {"ms": statistics.median(times[tree]), "peak_mib": peaks[tree]}
        del steps, use
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "same_process": True}
    with open(out, "w") as fh:
        json.dump(results | {"_env": env}, fh)


def summarize(runs: dict[str, list[dict]], names: list[str], paired: bool = False) -> list[dict]:
    """Per case: the median over rounds of new/old, the noise, the peaks. The noise is the old
    tree's spread over rounds, or with both trees in each round's process (`paired`), the
    spread of the per-round ratios (the process-to-process spread cancels in each ratio)."""
    old, new = names
    rows = []
    for case, _, _ in selected_cases():
        if case not in runs[old][0]:
            continue
        o = [run[case]["ms"] for run in runs[old]]
        n = [run[case]["ms"] for run in runs[new]]
        ratios = [nn / oo for nn, oo in zip(n, o)]
        noise = max(ratios) - min(ratios) if paired else (max(o) - min(o)) / statistics.median(o)
        rows.append(
            dict(case=case, old_ms=statistics.median(o), new_ms=statistics.median(n), rounds=len(o))
            | dict(ratio=statistics.median(ratios))
            | dict(noise=noise, old_rounds_ms=o, new_rounds_ms=n)
            | dict(old_peak_mib=runs[old][0][case]["peak_mib"], new_peak_mib=runs[new][0][case]["peak_mib"])
        )
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lmkernels-bench compare-trees",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--trees", default="old=/tmp/old/src,new=src", help="NAME=PATH,NAME=PATH: before, after")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="", help="comma-separated words: only the cases whose names hold one")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--same-process",
        action="store_true",
        help="the end-to-end cases with both trees in one process per round (the old one renamed)",
    )
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--paired-worker", nargs=3, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.worker:
        worker(*a.worker)
        return 0
    if a.paired_worker:
        paired_worker(*a.paired_worker)
        return 0
    os.environ[CASES_ENV] = a.cases
    words = [w.strip() for w in a.cases.split(",") if w.strip()]
    unmatched = [w for w in words if not any(w in c[0] for c in CASES)]
    if unmatched:
        raise SystemExit(f"--cases: no case's name holds {unmatched}; cases: {[c[0] for c in CASES]}")
    trees = dict(item.split("=", 1) for item in a.trees.split(","))
    if len(trees) != 2:
        raise SystemExit("--trees: expected two NAME=PATH entries, before and after")
    if a.same_process and any(kind != "e2e" for _, kind, _ in selected_cases()):
        raise SystemExit("--same-process runs the end-to-end cases only: add --cases llama-1b")
    from lmkernels_bench.e2e_setup import LLAMA_1B

    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH="", **{MODEL_ENV: json.dumps(LLAMA_1B)})
    env.pop("TRITON_INTERPRET", None)
    # The workers run this file as a script (PYTHONPATH empty: each imports its tree's lmkernels).
    me = [sys.executable, os.path.abspath(__file__), "--out", a.out]
    names = list(trees)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    if a.same_process:
        renamed = tempfile.TemporaryDirectory()  # removed at exit
        old_root = renamed_tree(trees[names[0]], renamed.name)
    for r in range(a.rounds):
        if a.same_process:  # a process per case: side_by_side runs once per process
            both: dict[str, dict[str, Any]] = {"old": {}, "new": {}}
            for i, (case, _, _) in enumerate(selected_cases()):
                path = os.path.join(a.out, f"paired_{r}_{i}.json")
                one = dict(env, **{CASES_ENV: case})
                subprocess.run([*me, "--paired-worker", old_root, trees[names[1]], path], check=True, env=one)
                with open(path) as fh:
                    done = json.load(fh)
                for tree in both:
                    both[tree] |= done[tree]
            for name, tree in zip(names, ("old", "new")):
                runs[name].append(both[tree] | {"_env": done["_env"]})
            print(f"round {r + 1}/{a.rounds} done", flush=True)
        else:
            for name in names if r % 2 == 0 else names[::-1]:
                path = os.path.join(a.out, f"{name}_{r}.json")
                subprocess.run([*me, "--worker", trees[name], path], check=True, env=env)
                with open(path) as fh:
                    runs[name].append(json.load(fh))
                print(f"round {r + 1}/{a.rounds}: {name} done", flush=True)
        rows = summarize(runs, names, paired=a.same_process)  # every round: a cut-short run keeps its rounds
        with open(os.path.join(a.out, "compare.json"), "w") as fh:
            meta = {"env": runs[names[1]][0]["_env"], "trees": trees}
            json.dump(meta | {"same_process": a.same_process, "rows": rows}, fh, indent=1)
    print(f"{'case':<34} {'old ms':>8} {'new ms':>8} {'ratio':>6} {'noise':>6} {'old MiB':>8} {'new MiB':>8}")
    for row in rows:
        print(
            f"{row['case'][:34]:<34} {row['old_ms']:>8.3f} {row['new_ms']:>8.3f} {row['ratio']:>6.3f} "
            f"{row['noise']:>6.3f} {row['old_peak_mib']:>8.0f} {row['new_peak_mib']:>8.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
