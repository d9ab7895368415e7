"""Every launch of the Triton ops, compiled offline for a GPU target and checked against its
limits: `lmkernels compile-check --target sm_86`.

The CPU interpreter runs a kernel's Python, not Triton's compiler, so a kernel the compiler
rejects for sm_80, or a launch asking for more shared memory than a 99 KiB part has, passes
every interpreter test. Here:

1. record: each op's Triton impl runs forward and backward on CPU tensors, under
   configs.targets.simulate(target, compiled=True), so that the launchers choose what they
   would choose on that GPU (its tables, PDL and the L2 prefetch on sm_90+ NVIDIA, pipeline
   stages fitted to its shared memory, no software bf16 rounding), with Triton's
   `JITFunction.run` replaced by a recorder: no kernel runs (the host code makes no host syncs,
   so its control flow does not depend on kernel outputs). Each launch is specialized as
   Triton's own launch path would specialize it (its binder: argument types, 16-byte alignment,
   divisibility, constexprs) for the target's backend.
2. compile: each distinct specialization once, `triton.compile` for the target (ptxas or the
   AMD backend included), in worker processes.
3. check: the compiled kernel's shared memory (`metadata.shared`, what Triton checks at launch),
   registers per thread and spills (ptxas's report; the AMD backend's metadata), its threads,
   against the target's limits (configs.targets.Target): shared memory per block, threads per
   block, registers per thread, the register file of an SM. Spills are reported, not failures.

Scopes: "full", the cases that reach every entry of the target's tables, every backward path and
every option set of each op (OpSpec.cases), in every dtype the target has; "ci", the subset CI
compiles (see CI_SCOPE). Nothing here needs a GPU; it needs Triton's NVIDIA backend (ptxas) for
CUDA targets and its AMD backend for gfx targets.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import dataclasses
import importlib
import io
import json
import multiprocessing as mp
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from lmkernels.backends.triton.configs.records import Tables
from lmkernels.backends.triton.configs.targets import CHECKED, TARGETS, Target, target

OPS = (
    "rms_norm",
    "layer_norm",
    "rope",
    "swiglu",
    "geglu",
    "fused_linear_cross_entropy",
    "fused_linear_distillation",
)
SCOPES = ("ci", "full")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


# --- the cases: op calls whose launches reach every configuration --------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One forward + backward call of an op's Triton impl, on CPU tensors."""

    op: str
    backend: str
    dtype: torch.dtype
    shape: tuple
    options: tuple = ()  # (name, value) pairs: an OpSpec case
    layout: str = ""  # RoPE: "bhtd" or "bthd" (q, k as transformers passes them)

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        parts = [
            self.op if self.backend == "triton" else f"{self.op}[{self.backend}]",
            DTYPE_NAMES[self.dtype],
        ]
        parts.append("x".join(map(str, self.shape)) + (f" {self.layout}" if self.layout else ""))
        return " ".join(parts) + (f" {opts}" if opts else "")


def dtypes_of(t: Target) -> tuple[torch.dtype, ...]:
    return (torch.bfloat16, torch.float32, torch.float16) if t.bf16 else (torch.float32, torch.float16)


def _norm_widths(tables: Tables, op: str, full: bool) -> list[int]:
    """Every entry's widest row (its largest register block), rows below the table (the default
    launch, per power-of-two block: every one in the full scope) and one row of the wide path."""
    n = tables.norms
    widths = sorted({e.cols[1] for e in n.entries if e.op == op})
    narrow = [1, 2, 4, 8, 16, 32, 64, 96, 256, 512] if full else [96, 512]
    return narrow + widths + [n.max_fused_n + 3616]


# RoPE in the full scope: Llama's, Phi's, Gemma's, GPT-NeoX's heads: (head dim, rotary dim).
ROPE_DIMS = [(64, 64), (80, 80), (96, 96), (128, 128), (256, 256), (128, 64), (128, 32), (80, 32)]


def _rope_shapes(tables: Tables, full: bool) -> list[tuple[int, int, str]]:
    """(head dim, rotary dim, layout): the tile kernel for each tile entry of the table (q, k of
    (B, H, T, D) memory), the position kernel for each position entry (the (B, T, H, D) memory
    transformers passes); the full scope adds ROPE_DIMS in both layouts."""
    out = []
    for tile in tables.rope.tile:
        assert tile.half is not None  # (a table's tile entries name the width they serve)
        R = 2 * tile.half
        out.append((2 * R if tile.partial else R, R, "bhtd"))
    for pos in tables.rope.position:
        R = 128 if pos.block_half is None else 2 * pos.block_half
        R = R // 2 if pos.partial and pos.block_half is None else R
        out.append((2 * R if pos.partial else R, R, "bthd"))
    if full:
        out += [(d, r, layout) for d, r in ROPE_DIMS for layout in ("bhtd", "bthd")]
    return list(dict.fromkeys(out))


def cases(t: Target, tables: Tables, scope: str = "full", ops: Sequence[str] = OPS) -> list[Case]:
    """The calls whose launches reach every configuration `tables` hold for `t` (see the module
    docstring; CI_SCOPE for "ci")."""
    from lmkernels.registry import get_op

    out: list[Case] = []
    full = scope == "full"
    dtypes = dtypes_of(t) if full else tuple(d for d in (torch.bfloat16, torch.float32) if d in dtypes_of(t))
    low = dtypes[:1]  # bf16 (fp32 on a GPU without)
    for op in ops:
        spec = get_op(op)
        option_sets = [tuple(sorted(c.items())) for c in spec.cases] if full else [()]
        if op in ("rms_norm", "layer_norm"):
            for N in _norm_widths(tables, op, full):
                # M = 2: one row tile per program (no pipelining); 41: loops of several tiles.
                for M in (2, 41) if full else (41,):
                    for dt in dtypes:
                        for opts in option_sets:
                            out.append(Case(op, "triton", dt, (M, N), opts))
        elif op == "rope":
            heads = [(32, 8), (4, 2), (12, 12)] if full else [(32, 8)]
            modes = [(i, p) for i in (False, True) for p in (None, "ids")] if full else [(False, None)]
            for D, R, layout in _rope_shapes(tables, full):
                for hq, hkv in heads:
                    for dt in dtypes if full else low:
                        for interleaved, positions in modes:
                            opts = (("interleaved", interleaved), ("positions", positions), ("rotary_dim", R))
                            out.append(Case(op, "triton", dt, (1, hq, hkv, 64, D), opts, layout))
        elif op in ("swiglu", "geglu"):
            for dt in dtypes if full else low:
                for opts in option_sets:
                    out.append(Case(op, "triton", dt, (37, 1000), opts))
        elif op == "fused_linear_cross_entropy":
            # Vocabularies reaching each row entry's block (and the narrow blocks under it).
            vocab = [100, 1000, 2000, 5000, 70000] if full else [1000, 5000, 70000]
            for V in vocab:
                for dt in dtypes if full else low:
                    for backend in ("triton", "triton_lean"):
                        for opts in option_sets if full else [()]:
                            out.append(Case(op, backend, dt, (37, 64, V), opts))
        elif op == "fused_linear_distillation":
            for V in [131, 500, 5000] if full else [5000]:
                for dt in dtypes if full else low:
                    for opts in option_sets:
                        out.append(Case(op, "triton", dt, (37, 64, 48, V), opts))
        else:
            raise KeyError(f"unknown op {op!r}; known: {', '.join(OPS)}")
    return out


# The "ci" scope: the norms' every entry, narrow row and wide path in bf16 and fp32 (the dtypes
# whose pipeline stages, registers and spills differ), with several row tiles per program (the
# pipelined loops); RoPE's every tile and position entry, the GLUs, FLCE's row entries (both
# modes) and the distillation kernel in bf16; each op's default options. The "full" scope adds
# fp16, every option set of every op (OpSpec.cases), one row tile per program, every narrow norm
# block, more vocabularies, RoPE's common head dims, head counts, interleaved pairs and position
# ids.
CI_SCOPE = "every table entry and backward path, bf16 (norms: and fp32), default options"


def _rope_inputs(case: Case) -> dict[str, Any]:
    from lmkernels.ops.rope import rope_tables

    B, Hq, Hkv, T, D = case.shape
    o = dict(case.options)
    R = o["rotary_dim"]
    layout = "interleaved" if o["interleaved"] else "neox"

    def heads(H: int) -> torch.Tensor:
        if case.layout == "bthd":
            return torch.randn(B, T, H, D, dtype=case.dtype).transpose(1, 2)
        return torch.randn(B, H, T, D, dtype=case.dtype)

    positions = torch.arange(T)
    cos, sin = (x.to(case.dtype) for x in rope_tables(torch.arange(2 * T), R, layout))
    inputs = dict(q=heads(Hq), k=heads(Hkv), cos=cos[:T], sin=sin[:T], layout=layout, rotary_dim=R)
    if o["positions"] == "ids":
        inputs.update(cos=cos, sin=sin, position_ids=positions[None].expand(B, T))
    return inputs


def _inputs(case: Case) -> dict[str, Any]:
    from lmkernels.registry import get_op

    spec = get_op(case.op)
    if case.op == "rope":
        inputs = _rope_inputs(case)
    else:
        names = list(spec.shapes["quick"][0])
        options = {k: v for k, v in case.options if k != "lean"}
        inputs = spec.make_inputs(dict(zip(names, case.shape)), case.dtype, "cpu", 0, **options)
    for name in spec.grad_inputs:
        x = inputs.get(name)
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            inputs[name] = x.detach().requires_grad_()
    return inputs


def run_case(case: Case) -> None:
    """The op's Triton impl forward, then backward from ones (kernels recorded, not run)."""
    from lmkernels.registry import get_impl

    inputs = _inputs(case)
    backend = "triton_lean" if dict(case.options).get("lean") else case.backend
    out = get_impl(case.op, backend).fn(**inputs)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
    outs = [o for o in outs if o.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


# --- recording the launches ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Launch:
    """One specialization of a kernel, as Triton's launch path would compile it."""

    kernel: str  # "module:qualname" of the @triton.jit function
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict

    @property
    def name(self) -> str:
        return self.kernel.rsplit(":", 1)[-1]

    def constexpr(self, param: str) -> Any:
        """The value of constexpr parameter `param` (None where the kernel has none)."""
        names = list(self.signature)
        return self.constexprs.get((names.index(param),)) if param in names else None

    @property
    def key(self) -> str:
        return repr((self.kernel, sorted(self.signature.items()), sorted(self.constexprs.items(), key=repr),
                     sorted(self.attrs.items(), key=repr), sorted(self.options.items(), key=repr)))  # fmt: skip

    def describe(self) -> str:
        """The launch options and the constexprs (the upper-case ones: the configuration)."""
        values = [
            f"{name}={self.constexprs.get((i,))}"
            for i, (name, kind) in enumerate(self.signature.items())
            if kind == "constexpr" and name.isupper() and (i,) in self.constexprs
        ]
        options = f"warps={self.options.get('num_warps')} stages={self.options.get('num_stages')}"
        return " ".join([options, *values])


class _Recorder:
    """Replaces JITFunction.run: binds and specializes a launch as Triton's run would for the
    target's backend (its binder and _pack_args), records it, and launches nothing."""

    def __init__(self, t: Target) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.backend = make_backend(GPUTarget(t.backend, t.arch, t.warp_size))
        self.binders: dict[int, Any] = {}
        self.launches: list[Launch] = []

    def __call__(self, kernel: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        from triton import knobs
        from triton.runtime.jit import create_function_from_signature

        kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
        for name, knob in (("instrumentation_mode", "instrumentation_mode"),
                           ("fpsan_homomorphic_casts", "fpsan_homomorphic_casts")):  # fmt: skip
            if hasattr(knobs.compilation, knob):
                kwargs[name] = getattr(knobs.compilation, knob)
        binder = self.binders.get(id(kernel))
        if binder is None:
            binder = self.binders[id(kernel)] = create_function_from_signature(
                kernel.signature, kernel.params, self.backend
            )
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(
            self.backend, kwargs, bound_args, specialization, options
        )
        self.launches.append(
            Launch(
                f"{kernel.fn.__module__}:{kernel.fn.__qualname__}",
                dict(signature),
                dict(constexprs),
                {k: list(v) for k, v in attrs.items()},
                dict(options.__dict__),
            )  # fmt: skip
        )


@contextlib.contextmanager
def recording(t: Target, tables: Tables | None = None) -> Iterator[_Recorder]:
    """Launches of the Triton impls recorded for `t`, inside the block (see the module docstring)."""
    from triton.runtime.jit import JITFunction

    from lmkernels.backends.triton import common, interpreting
    from lmkernels.backends.triton.configs.targets import simulate

    if interpreting() or not isinstance(common.to_dtype, JITFunction):
        raise RuntimeError(
            "compile-check: the kernels were imported under TRITON_INTERPRET=1 (run it without)"
        )
    recorder = _Recorder(t)
    saved_run, saved_enabled = JITFunction.run, common._ENABLED

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        recorder(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = run
    common._ENABLED = False  # every launch through kernel[grid](...): the recorder
    try:
        with simulate(t, tables, compiled=True):
            yield recorder
    finally:
        JITFunction.run, common._ENABLED = saved_run, saved_enabled


def record(
    t: Target, case_list: Sequence[Case], tables: Tables | None = None
) -> tuple[dict[str, tuple[Launch, str]], list[str]]:
    """{key: (launch, the first case that made it)} of every launch of the cases, and the cases
    that failed to run (their errors)."""
    launches: dict[str, tuple[Launch, str]] = {}
    errors = []
    with recording(t, tables) as recorder:
        for case in case_list:
            recorder.launches.clear()
            torch.manual_seed(0)
            try:
                run_case(case)
            except Exception as e:  # noqa: BLE001  (reported: a case that cannot run is a finding)
                errors.append(f"{case.label}: {type(e).__name__}: {str(e)[:300]}")
                continue
            for launch in recorder.launches:
                launches.setdefault(launch.key, (launch, case.label))
    return launches, errors


# --- compiling -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    """A launch compiled for a target, with what it uses and what of it is past the limits."""

    target: str
    kernel: str
    config: str
    origin: str
    threads: int
    shared: int | None = None
    registers: int | None = None
    spills: int | None = None  # bytes of spill stores (NVIDIA), VGPRs spilled to scratch (AMD)
    pdl: bool | None = None  # launched with PDL: whether the kernel waits (griddepcontrol.wait)
    seconds: float = 0.0
    error: str | None = None
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.problems


def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    from triton import knobs

    import lmkernels  # noqa: F401  (the ops, then their backends: record_target)

    knobs.compilation.always_compile = True  # ptxas runs (and reports) every time
    knobs.nvidia.dump_ptxas_log = True


def _kernel(ref: str) -> Any:
    module, name = ref.split(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def compile_launch(target_name: str, launch: Launch) -> dict[str, Any]:
    """Compile `launch` for the target (a worker's job): shared memory, registers, spills, or the
    compiler's error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t = TARGETS[target_name]
    start = time.time()
    log = io.StringIO()
    try:
        src = ASTSource(_kernel(launch.kernel), launch.signature, launch.constexprs, launch.attrs)
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(
                src, target=GPUTarget(t.backend, t.arch, t.warp_size), options=launch.options
            )
    except Exception as e:  # noqa: BLE001  (the finding)
        text = f"{type(e).__name__}: {e}"
        return {"error": " ".join(text.split())[:600], "seconds": time.time() - start}
    out = {"shared": int(compiled.metadata.shared), "seconds": time.time() - start}
    if launch.constexpr("PDL"):  # programmatic dependent launch: the kernel must wait first
        out["pdl"] = "griddepcontrol.wait" in compiled.asm.get("ptx", "")
    if t.backend == "hip":
        out.update(_amd_usage(compiled.asm.get("amdgcn", "")))
    else:
        out.update(_ptxas_usage(log.getvalue()) or _cubin_usage(compiled.asm.get("cubin", b"")))
    return out


def _ptxas_usage(text: str) -> dict[str, int]:
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    if not regs:
        return {}
    return {"registers": int(regs.group(1)), "spills": int(spills.group(1)) if spills else 0}


def _cubin_usage(cubin: bytes) -> dict[str, int]:
    """Registers and local memory from cuobjdump -res-usage (when ptxas's report was not seen)."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not cubin or not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, local = re.search(r"REG:(\d+)", text), re.search(r"LOCAL:(\d+)", text)
    return (
        {"registers": int(regs.group(1))} | ({"spills": int(local.group(1))} if local else {}) if regs else {}
    )


def _amd_usage(asm: str) -> dict[str, int]:
    def value(pattern: str) -> int | None:
        m = re.search(pattern, asm)
        return int(m.group(1)) if m else None

    # Spills to scratch memory are VGPR spills; SGPRs spill into VGPR lanes (v_writelane), not to
    # memory, and are left out.
    vgprs = value(r"; TotalNumVgprs: (\d+)") or value(r"\.vgpr_count:\s+(\d+)")
    spills = value(r"\.vgpr_spill_count:\s+(\d+)") or 0
    return {"registers": vgprs, "spills": spills} if vgprs is not None else {}


def limit_problems(t: Target, r: Result) -> list[str]:
    """What of a compiled launch is past the target's limits."""
    problems = []
    if r.pdl is False:
        problems.append("launched with PDL but compiled without griddepcontrol.wait (pdl_enter first)")
    if r.shared is not None and r.shared > t.shared_per_block:
        problems.append(f"shared memory {r.shared} B > {t.shared_per_block} B per block")
    if r.threads > t.max_threads_per_block:
        problems.append(f"{r.threads} threads > {t.max_threads_per_block} per block")
    if r.registers is not None:
        if r.registers > t.max_registers_per_thread:
            problems.append(f"{r.registers} registers > {t.max_registers_per_thread} per thread")
        elif not t.registers_fit(r.threads, r.registers):
            problems.append(f"{r.threads} threads x {r.registers} registers > the SM's {t.registers_per_sm}")
    elif r.error is None:
        problems.append("the compiler reported no register count")
    return problems


# --- the check -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    target: str
    tables: str
    cases: int
    results: list[Result]
    case_errors: list[str]
    seconds: float = 0.0

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    @property
    def spilling(self) -> list[Result]:
        return [r for r in self.results if r.spills]

    def summary(self) -> str:
        n = len(self.results)
        shared = max((r.shared or 0 for r in self.results), default=0)
        regs = max((r.registers or 0 for r in self.results), default=0)
        return (f"{self.target}: {n} specializations ({self.tables} tables, {self.cases} calls), "
                f"{len(self.failures)} over the limits or not compiled, {len(self.spilling)} spilling, "
                f"{len(self.case_errors)} calls failed; largest shared memory {shared} B, registers {regs}")  # fmt: skip

    def lines(self, verbose: bool = False) -> list[str]:
        out = [self.summary()]
        for e in self.case_errors:
            out.append(f"  call failed: {e}")
        for r in self.failures:
            why = r.error or "; ".join(r.problems)
            out.append(f"  FAIL {r.kernel} [{r.config}] ({r.origin}): {why}")
        for r in self.spilling:
            out.append(f"  spills {r.spills}: {r.kernel} [{r.config}] ({r.origin}), {r.registers} registers")
        if verbose:
            for r in self.results:
                out.append(f"  {r.kernel} [{r.config}] shared {r.shared} regs {r.registers} spills {r.spills} "
                           f"threads {r.threads} {r.seconds:.1f}s ({r.origin})")  # fmt: skip
        return out

    def as_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "tables": self.tables,
            "cases": self.cases,
            "seconds": self.seconds,
            "case_errors": self.case_errors,
            "results": [dataclasses.asdict(r) | {"ok": r.ok} for r in self.results],
        }


def compiler_missing(t: Target) -> str | None:
    """Why the installed Triton cannot compile for `t`, or None."""
    try:
        importlib.import_module(f"triton.backends.{'nvidia' if t.backend == 'cuda' else 'amd'}.compiler")
    except Exception as e:  # noqa: BLE001
        return f"Triton's {'NVIDIA' if t.backend == 'cuda' else 'AMD'} backend is not installed ({e})"
    if t.backend == "cuda":
        from triton.backends.nvidia.compiler import get_ptxas

        try:
            get_ptxas(t.arch)
        except Exception as e:  # noqa: BLE001
            return f"no ptxas for {t.name} ({type(e).__name__}: {e})"
    return None


def compile_failures(t: Target) -> dict[str, str]:
    """The ops the installed Triton cannot compile for `t`, and why: on such a GPU the op refuses
    the Triton backend by name (its registration's availability), so nothing of it is checked."""
    import triton

    from lmkernels.backends.triton.rope import amd_compile_failure

    failures = {}
    if t.backend == "hip" and (reason := amd_compile_failure(triton.__version__)):
        failures["rope"] = reason
    return failures


def record_target(name: str, scope: str, ops: Sequence[str], tables: Tables | None = None) -> dict[str, Any]:
    """Record the launches of `ops` for target `name` (a worker's job): {"tables": name,
    "cases": count, "launches": {key: (Launch, origin)}, "errors": [...]}."""
    from lmkernels.backends import load_builtin
    from lmkernels.backends.triton.configs import target_tables

    load_builtin()
    t = target(name)
    tables = tables or target_tables(t)
    case_list = cases(t, tables, scope, ops)
    launches, errors = record(t, case_list, tables)
    return {"tables": tables.name, "cases": len(case_list), "launches": launches, "errors": errors}


def check(
    target_names: Sequence[str],
    scope: str = "ci",
    ops: Sequence[str] = OPS,
    jobs: int | None = None,
    tables_by_target: dict[str, Tables] | None = None,
    log: Callable[[str], None] = print,
) -> list[Report]:
    """Record, compile and check every launch of `ops` for each target (see the module
    docstring), in `jobs` worker processes (1: in this one). tables_by_target: tables to check
    instead of a target's built-in ones."""
    jobs = jobs or max(1, min(os.cpu_count() or 1, 16))
    start = time.time()
    names = []
    ops_of: dict[str, tuple[str, ...]] = {}  # per target: the ops its compiler can take
    for name in target_names:
        t = target(name)
        missing = compiler_missing(t)
        if missing:
            log(f"{t.name}: not checked: {missing}")
            continue
        names.append(t.name)
        failures = compile_failures(t)
        for op in ops:
            if op in failures:
                log(f"{t.name}: {op} not checked: {failures[op]}")
        ops_of[t.name] = tuple(op for op in ops if op not in failures)
    recorded: dict[str, dict[str, Any]] = {}
    compiled: dict[tuple[str, str], dict[str, Any]] = {}
    tables_by_target = tables_by_target or {}

    def recorded_one(name: str, result: dict[str, Any]) -> list[tuple[str, str, Launch]]:
        recorded[name] = result
        log(f"{name}: {result['cases']} calls, {len(result['launches'])} launch specializations "
            f"({time.time() - start:.0f}s)")  # fmt: skip
        return [(name, key, launch) for key, (launch, _) in result["launches"].items()]

    if jobs > 1:
        context = mp.get_context("spawn")
        with cf.ProcessPoolExecutor(jobs, mp_context=context, initializer=_worker_init) as pool:
            pending: dict[cf.Future[Any], tuple[str, Any]] = {
                pool.submit(record_target, n, scope, ops_of[n], tables_by_target.get(n)): ("record", n)
                for n in names
            }
            while pending:
                finished, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                for f in finished:
                    kind, what = pending.pop(f)
                    if kind == "record":
                        for name, key, launch in recorded_one(what, f.result()):
                            pending[pool.submit(compile_launch, name, launch)] = ("compile", (name, key))
                    else:
                        compiled[what] = f.result()
    else:
        _worker_init()
        for n in names:
            for name, key, launch in recorded_one(
                n, record_target(n, scope, ops_of[n], tables_by_target.get(n))
            ):
                compiled[(name, key)] = compile_launch(name, launch)
    reports = []
    for name in names:
        t, result = TARGETS[name], recorded[name]
        results = []
        for key, (launch, origin) in result["launches"].items():
            raw = compiled[(name, key)]
            r = Result(name, launch.name, launch.describe(), origin,
                       threads=int(launch.options.get("num_warps", 4)) * t.warp_size, **raw)  # fmt: skip
            r.problems = limit_problems(t, r) if r.error is None else []
            results.append(r)
        reports.append(
            Report(name, result["tables"], result["cases"], results, result["errors"], time.time() - start)
        )
    return reports


# --- the command ---------------------------------------------------------------------------------

DESCRIPTION = """\
Compile every launch of the Triton ops for GPU targets offline (no GPU
needed) and check each kernel's shared memory, registers and spills against
the target's limits. The launches are the ones the ops make on that GPU: its
launch tables (Hopper's on sm_90, the generic rule's elsewhere, or --config
FILE, a tuned file), every backward path, PDL and the L2 prefetch where the
target has them.

  lmkernels compile-check --target sm_86              RTX 3090 / A10, CI scope
  lmkernels compile-check --target all --scope full   every option and dtype
  lmkernels compile-check --config ~/.cache/lmkernels/configs/FILE.json
"""


def _run(args: argparse.Namespace) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels must be imported compiled: anew
        import subprocess

        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        argv = [
            "compile-check",
            "--target",
            ",".join(args.target),
            "--scope",
            args.scope,
            "--ops",
            ",".join(args.ops),
        ]
        argv += [
            f"--{k}={v}" for k, v in (("config", args.config), ("jobs", args.jobs), ("json", args.json)) if v
        ]
        argv += ["--verbose"] if args.verbose else []
        return subprocess.run([sys.executable, "-m", "lmkernels", *argv], env=env).returncode
    import lmkernels  # noqa: F401  (registers the ops)
    from lmkernels.backends import load_builtin

    load_builtin()
    tables_by_target = {}
    names = list(CHECKED) if "all" in args.target else args.target
    if args.config:
        from lmkernels.backends.triton.configs.files import ConfigFileError, read_tuned

        try:
            content = json.loads(open(args.config).read())
            tables = read_tuned(args.config)
        except (OSError, ValueError, ConfigFileError) as e:
            print(f"lmkernels compile-check: --config: {e}", file=sys.stderr)
            return 2
        arch = content["device"]["arch"]
        tables_by_target[target(arch).name] = tables
        names = [arch]
    reports = check(
        names, args.scope, args.ops, args.jobs, tables_by_target, log=lambda m: print(m, flush=True)
    )
    for report in reports:
        print("\n".join(report.lines(args.verbose)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_json() for r in reports], f, indent=1)
    failed = any(r.failures or r.case_errors for r in reports)
    return 1 if failed else 0


def _targets_arg(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n != "all":
            try:
                target(n)
            except KeyError as e:
                raise argparse.ArgumentTypeError(str(e.args[0])) from None
    return names


def _ops_arg(text: str) -> list[str]:
    from lmkernels.registry.dispatch import canonical_op

    names = []
    for n in text.split(","):
        if n.strip():
            try:
                name = canonical_op(n.strip())
            except Exception as e:  # noqa: BLE001
                raise argparse.ArgumentTypeError(str(e)) from None
            if name not in OPS:
                raise argparse.ArgumentTypeError(f"{n.strip()!r}: not a Triton op ({', '.join(OPS)})")
            names.append(name)
    return names


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "compile-check",
        help="compile every Triton launch for GPU targets offline; check shared memory, registers, spills",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", type=_targets_arg, default=["all"],
                   help=f"comma-separated, of {', '.join(TARGETS)}, or all (the checked ones: {', '.join(CHECKED)})")  # fmt: skip
    p.add_argument(
        "--scope", choices=SCOPES, default="ci", help=f"ci: {CI_SCOPE}; full: every option set and dtype"
    )
    p.add_argument(
        "--ops", type=_ops_arg, default=list(OPS), help="comma-separated (default: every Triton op)"
    )
    p.add_argument(
        "--config", help="a tuned tables file (lmkernels tune --install): check its tables for its GPU"
    )
    p.add_argument(
        "--jobs", type=int, default=None, help="compiling processes (default: the CPUs, at most 16)"
    )
    p.add_argument("--json", help="write every compiled launch's numbers to this file")
    p.add_argument("--verbose", action="store_true", help="print every compiled launch")
    p.set_defaults(func=_run)
