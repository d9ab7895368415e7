"""The benchmark data files: one JSON object per measured row, one file per GPU kind
(<out>/<gpu>.jsonl, e.g. h200.jsonl), appended by `lmkernels-bench suite` and read by
`lmkernels-bench report` (tables.py). Validation evidence goes to <out>/<gpu>-validation.jsonl the same way.

Every row names what was measured and how it can be measured again:

- part: "ops", "flce", "e2e", "dist" or "trl" (TRL's fused head against lmkernels'; validation rows: "grid", "converge", "families",
  "stepcheck", "dist-checks", "tests");
- what: op / shape / dims / dtype / regime (FLCE) or model / config / batch / seq (end to end)
  or mode / config (distributed), the implementation (`impl`) and `peer`, the configuration it
  ran in, in words ("cut-cross-entropy 25.1.1 default call (filter_eps='high')");
- measurements: gpu_ms, wall_ms, peak_mib, and the rates where defined (gbps and pct_copy
  against the copy bandwidth of the same run, tflops and pct_matmul against its bf16 matmul
  rate; tokens_per_s, step_ms and the rounds' step times end to end);
- provenance: device, gpu (the kind), gpus, versions (torch, cuda, triton, transformers, the
  peers), commit (the lmkernels tree measured, "+dirty" when src/ had uncommitted changes),
  date, command, run (the invocation: rows of one run are compared with each other), and for
  rows converted from an earlier results folder, source (its path at the commit that held it).

A dry run (`--dry-run`) writes rows with made-up timings and `"dry_run": true`; such rows belong
in a scratch folder, never in the repository's data files (a test checks).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("triton", "transformers", "liger-kernel", "cut-cross-entropy")
# The order of a row's keys in the file (the rest follow, then the provenance).
FIRST = ("part", "op", "model", "mode", "config", "impl", "shape", "regime", "sweep", "batch", "seq")
PROVENANCE = ("device", "gpu", "gpus", "versions", "commit", "date", "command", "run", "source", "dry_run")


def gpu_kind(device_name: str) -> str:
    """ "h200" for "NVIDIA H200", "h100" for "NVIDIA H100 80GB HBM3": the first model number in
    the name, lower case (else the whole name as a slug)."""
    m = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", device_name)
    if m:
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "unknown"


def repo_root() -> Path | None:
    """The checkout this suite runs from (benchmarks/lmkernels_bench/../..), if it is one."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / ".git").exists() and (root / "src" / "lmkernels").is_dir() else None


def checkout() -> Path:
    """The checkout a command that runs the repository's tests, scripts or documents needs: this
    suite's own (repo_root), else the current directory when it is one."""
    root = repo_root()
    cwd = Path.cwd()
    if root is None and (cwd / "tests").is_dir() and (cwd / "src" / "lmkernels").is_dir():
        root = cwd
    if root is None:
        raise SystemExit(
            "this command runs the repository's tests or edits its documents: run it from a checkout"
        )
    return root


def command_line(command: str, argv: list[str] | None = None) -> str:
    """How a run of `lmkernels-bench COMMAND` is written in its rows and reports: the arguments
    given (argv, or this process's own)."""
    return shlex.join(["lmkernels-bench", command, *(sys.argv[1:] if argv is None else argv)])


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def commit(root: Path | None = None) -> str | None:
    """The lmkernels commit measured: $LMKERNELS_COMMIT if set (a copy of the tree without its
    git history), else the checkout's short HEAD, "+dirty" when src/ differs from it."""
    if os.environ.get("LMKERNELS_COMMIT"):
        return os.environ["LMKERNELS_COMMIT"]
    root = root or repo_root()
    if root is None:
        return None
    # A copy of the tree inside another repository (an exported tree): git would answer with the
    # enclosing repository's commit, not the tree's.
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != Path(root).resolve():
        return None
    head = _git(root, "rev-parse", "--short", "HEAD")
    if head is None:
        return None
    dirty = _git(root, "status", "--porcelain", "--untracked-files=no", "--", "src")
    return head + ("+dirty" if dirty else "")


def versions() -> dict[str, str | None]:
    import torch

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    out["cuda"] = torch.version.cuda
    for dist in PACKAGES:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def provenance(command: str, run: str, gpus: int = 1, device: str | None = None) -> dict[str, Any]:
    """The fields every row of one invocation shares."""
    import torch

    if device is None:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "device": device,
        "gpu": gpu_kind(device),
        "gpus": gpus,
        "versions": versions(),
        "commit": commit(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command,
        "run": run,
    }


def peer(impl: str, part: str, vers: dict[str, str | None]) -> str:
    """The configuration an implementation ran in, in words (a peer as its users call it)."""
    liger = f"liger-kernel {vers.get('liger-kernel')}"
    cce = f"cut-cross-entropy {vers.get('cut-cross-entropy')}"
    transformers = f"transformers {vers.get('transformers')}"
    base, _, suffix = impl.partition("+")
    kind = base.split(":")[0].split("-")[0]
    if part == "e2e" or part == "dist":
        words = {
            "plain": f"{transformers} LlamaForCausalLM as is (SDPA attention)",
            "lmk": "lmkernels integrations.transformers.apply(model), default backends",
            "liger": f"{liger} apply_liger_kernel_to_llama(model=...): rope, rms_norm, swiglu, "
            "fused_linear_cross_entropy",
        }.get(kind, impl)
        if ":" in base:
            words += f", backend {base.split(':', 1)[1].split('-')[0].replace('/', ',')}"
        if "-nocheck" in base:
            words += ", LMKERNELS_CHECK_VALUES=0"
        if "-noflce" in base:
            words += ", without the fused loss"
        if "-1thread" in base:
            words += ", backward on the calling thread"
        return words + (", then model.compile()" if suffix == "compile" else "")
    flce = part == "flce"
    table = {
        "triton": "lmkernels triton (default)",
        "triton_lean": "lmkernels triton_lean",
        "triton_accum_fp32": "lmkernels triton, grad_accum_dtype=fp32",
        "triton_accum_lean": "lmkernels triton, grad_accum_dtype=weight dtype",
        "compile": "lmkernels compile backend (chunked, compiled chunks)"
        if flce
        else "torch.compile of the eager reference",
        "compile_naive": "torch.compile of cross_entropy((x @ w.T).float(), y)",
        "eager": "the eager reference",
        "liger": f"{liger} default call"
        + (" (liger_fused_linear_cross_entropy)" if flce else " (functional API)"),
        "cce": f"{cce} default call (filter_eps='high')",
        "cce_exact": f"{cce} filter_eps=None (exact gradients)",
        "torch_native": f"torch {vers.get('torch')} F.linear_cross_entropy",
        "copy_floor": "plain copies moving the op's fwd+bwd bytes in 2 launches",
    }
    if impl.startswith("budget_"):
        return f"lmkernels triton, memory_budget={impl.removeprefix('budget_')}"
    return table.get(impl, impl)


def ordered(row: dict[str, Any]) -> dict[str, Any]:
    """The row with its keys in the file's order: what, measurements, provenance."""
    head = {k: row[k] for k in FIRST if k in row}
    tail = {k: row[k] for k in PROVENANCE if k in row}
    return head | {k: v for k, v in row.items() if k not in head and k not in tail} | tail


def data_path(out: Path, gpu: str, validation: bool = False) -> Path:
    return Path(out) / (f"{gpu}-validation.jsonl" if validation else f"{gpu}.jsonl")


def read_rows(path: Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append rows, one JSON object per line (the folder made where missing)."""
    if not rows:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(ordered(row), default=str) + "\n")


def data_files(folder: Path, validation: bool = False) -> dict[str, Path]:
    """gpu kind -> its data file in `folder`."""
    out = {}
    for path in sorted(Path(folder).glob("*.jsonl")):
        is_validation = path.stem.endswith("-validation")
        if is_validation == validation:
            out[path.stem.removesuffix("-validation")] = path
    return out
