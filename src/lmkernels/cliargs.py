"""What every `lmkernels` subcommand shares: the argument parser (errors wrapped to the terminal,
exit status 2), argument types that name the argument and the accepted values, and the hint
for Triton backends skipped on a machine without a GPU.

A typo is an argparse error, raised while the command line is parsed: `lmkernels validate:
error: argument --backend: unknown backend 'eagr'; known: ...`, never a traceback.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmkernels.registry.core import OpSpec

WIDTH = 80  # the widest line the CLI prints (tables may use a wider terminal's width with --wide)

TRITON_HINT = "hint: set TRITON_INTERPRET=1 to run the Triton kernels on the CPU interpreter"


def width() -> int:
    """The terminal's width, at most WIDTH."""
    return min(WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns)


def table(
    header: Sequence[str], rows: Iterable[Sequence[str]], columns: int | None = None, wrap_last: bool = True
) -> str:
    """A plain-text table (rich, no borders, no colour, two spaces between columns) that fits `columns` (default: the
    terminal's, at most WIDTH): every column but the last keeps its cells on one line, the last
    wraps (wrap_last) or is cut. Lines carry no trailing spaces."""
    import io

    from rich.console import Console
    from rich.table import Table

    t = Table(box=None, padding=(0, 2, 0, 0), pad_edge=False, header_style="", expand=False)
    for i, name in enumerate(header):
        last = i == len(header) - 1
        t.add_column(name, no_wrap=not (last and wrap_last), overflow="fold" if last else "ellipsis")
    for row in rows:
        t.add_row(*row)
    out = io.StringIO()
    Console(
        file=out, width=columns or width(), color_system=None, force_terminal=False, soft_wrap=False
    ).print(t)
    return "\n".join(line.rstrip() for line in out.getvalue().rstrip("\n").splitlines())


def wrap(text: str, indent: str = "", subsequent: str | None = None, columns: int | None = None) -> str:
    """`text` wrapped to the terminal (at most WIDTH columns), each paragraph line on its own."""
    cols = columns or width()
    sub = indent if subsequent is None else subsequent
    out = []
    for line in text.splitlines() or [""]:
        out += textwrap.wrap(
            line, cols, initial_indent=indent, subsequent_indent=sub, break_on_hyphens=False
        ) or [indent.rstrip()]
    return "\n".join(out)


class Parser(argparse.ArgumentParser):
    """argparse with its error message wrapped to the terminal; subparsers are of this class."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        text = wrap(f"{self.prog}: error: {message}", subsequent="  ")
        self.exit(2, text + "\n")


# The optional packages the commands import, and the extra that installs each.
EXTRAS = {
    "transformers": "hf",
    "tokenizers": "hf",
    "accelerate": "hf",
    "matplotlib": "hf",
    "datasets": "trl",
    "trl": "trl",
    "peft": "peft",
    "triton": "triton",
}


def missing_module(e: ModuleNotFoundError) -> str:
    """One line for a missing optional package: what is missing and the pip command for it."""
    package = (e.name or "").split(".")[0]
    return f"{package} is not installed (pip install 'lmkernels[{EXTRAS.get(package, package)}]')"


def invoke(args: argparse.Namespace, prog: str = "lmkernels") -> int:
    """Run the subcommand args.func: an LMKernelsError, or a missing optional package, is an
    error line in argparse's style ("lmkernels explain: error: ...", exit status 2), Ctrl-C exits
    130 and a closed pipe (`| head`) 141, with no traceback."""
    import os

    from lmkernels.registry import LMKernelsError

    command = getattr(args, "command", None)
    where = f"{prog} {command}" if command else prog
    try:
        return int(args.func(args) or 0)
    except LMKernelsError as e:
        return error(where, str(e))
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] not in EXTRAS:
            raise
        return error(where, missing_module(e))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left: no traceback, and none when Python flushes at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def error(where: str, message: str) -> int:
    """Print "<where>: error: <message>" to stderr, wrapped to the terminal; returns 2."""
    print(wrap(f"{where}: error: {message}", subsequent="  "), file=sys.stderr)
    return 2


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings off (its notes on the tiny models the CLI builds), then restored."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def known_list(names: Iterable[str]) -> str:
    return ", ".join(names)


def _suggest(value: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(value, known, n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def unknown(what: str, value: str, known: Sequence[str], list_known: bool = True) -> str:
    text = f"unknown {what} {value!r}{_suggest(value, known)}"
    return text + (f"; known: {known_list(known)}" if list_known else "")


def split_commas(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def op_names(text: str) -> list[str]:
    """Type of --op: one op or a comma-separated list (aliases accepted), canonical names."""
    from lmkernels.registry.dispatch import all_op_names, op_aliases

    known = all_op_names()
    known_aliases = op_aliases()
    out = []
    for name in split_commas(text) or [text]:
        name = known_aliases.get(name, name)
        if name not in known:
            aliases = ", ".join(f"{a}={o}" for a, o in known_aliases.items())
            raise argparse.ArgumentTypeError(f"{unknown('op', name, known)} (aliases: {aliases})")
        out.append(name)
    return out


def op_name(text: str) -> str:
    """Type of a single op argument."""
    names = op_names(text)
    if len(names) != 1:
        raise argparse.ArgumentTypeError(f"expected one op, got {text!r}")
    return names[0]


def backend_names_type(extra: Sequence[str] = (), auto: bool = False) -> Callable[[str], list[str]]:
    """Type of --backend: registered backend names (and `extra` ones), comma-separated."""

    def parse(text: str) -> list[str]:
        from lmkernels.registry import backend_names

        known = [*(["auto"] if auto else []), *backend_names(), *extra]
        out = []
        for name in split_commas(text) or [text]:
            if name not in known:
                raise argparse.ArgumentTypeError(unknown("backend", name, known))
            out.append(name)
        return out

    parse.__name__ = "backend"
    return parse


def backend_name(text: str) -> str:
    """Type of a single backend name ("auto" included), e.g. explain's --backend."""
    (name, *rest) = backend_names_type(auto=True)(text)
    if rest:
        raise argparse.ArgumentTypeError(f"expected one backend, got {text!r}")
    return name


def backend_spec(text: str) -> str:
    """Type of a backend spec like "triton" or "triton,flce=compile" (checked, returned as is)."""
    from lmkernels.registry import LMKernelsError, parse_backend_spec

    for item in split_commas(text):
        op, sep, name = item.rpartition("=")
        if sep:
            op_name(op.strip())
        backend_name(name.strip())
    try:
        parse_backend_spec(text, where="--backend")
    except LMKernelsError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--backend: ")) from None
    return text


def choice_list(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """Type of a repeatable, comma-separated option whose values come from `choices`."""

    def parse(text: str) -> list[str]:
        out = []
        for v in split_commas(text) or [text]:
            if v not in choices:
                raise argparse.ArgumentTypeError(unknown(what, v, choices))
            out.append(v)
        return out

    parse.__name__ = what
    return parse


# The dtype names the commands take: the short ones and torch's (float32, torch.float32, ...).
DTYPE_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp64": "fp64",
    "float64": "fp64",
    "double": "fp64",
}


def dtype_name(text: str, allowed: Sequence[str] = ("fp32", "bf16", "fp16")) -> str:
    """A dtype's short name (fp32, bf16, fp16) from it or torch's name for it."""
    short = DTYPE_ALIASES.get(text.strip().lower().removeprefix("torch."))
    if short is None or short not in allowed:
        known = [*allowed, *(k for k, v in DTYPE_ALIASES.items() if v in allowed and k not in allowed)]
        raise argparse.ArgumentTypeError(unknown("dtype", text, known))
    return short


def dtype_type(*allowed: str) -> Callable[[str], str]:
    """Type of a --dtype taking one of `allowed` (short names), by any of its names."""

    def parse(text: str) -> str:
        return dtype_name(text, allowed or ("fp32", "bf16", "fp16"))

    parse.__name__ = "dtype"
    return parse


def dtype_list(text: str) -> list[str]:
    """Type of a repeatable, comma-separated --dtype (validate)."""
    return [dtype_name(v) for v in split_commas(text) or [text]]


def device(text: str) -> str:
    """Type of --device: cpu or cuda, and cuda only where torch sees a CUDA device."""
    import torch

    if text not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(unknown("device", text, ["cpu", "cuda"]))
    if text == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise argparse.ArgumentTypeError(
            f"cuda: no CUDA device is available here (torch {torch.__version__}, {build}); use --device cpu"
        )
    return text


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def key_value(text: str) -> tuple[str, Any]:
    """Type of --set: key=value, the value a Python literal when it parses as one, else a string."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected key=value (e.g. casting_mode=gemma), got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return key, value


def option_names(spec: OpSpec) -> set[str]:
    """The option (keyword) names an op's inputs take: its reference's keyword arguments and the
    make_inputs options (e.g. FLCE's with_bias, regime)."""
    import inspect

    names = set()
    for fn in (spec.reference, spec.make_inputs):
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                names.add(p.name)
    return names - {"shape", "dtype", "device", "seed"}


def check_options(specs: Sequence[OpSpec], options: dict[str, Any], where: str = "--set") -> None:
    """Raise LMKernelsError naming an option key that one of the ops' inputs do not take."""
    from lmkernels.registry import LMKernelsError

    for spec in specs:
        known = sorted(option_names(spec))
        for key in options:
            if key not in known:
                more = " (--op chooses the ops)" if len(specs) > 1 else ""
                raise LMKernelsError(f"{where}: {spec.name} {unknown('option', key, known)}{more}")


def parse_shape(spec: OpSpec, text: str) -> dict[str, int]:
    """--shape "M=4096,N=8192" or "4096x8192" (dims in the order of the op's shape grid)."""
    from lmkernels.registry import LMKernelsError

    dims = list(spec.shapes["quick"][0])
    order = "x".join(dims)
    example = "x".join(str(v) for v in spec.shapes["quick"][0].values())
    usage = f'{spec.name} takes {len(dims)} dims {order}, e.g. "{example}" or "{dims[0]}=...,..."'

    def number(dim: str, value: str) -> int:
        try:
            n = int(value.strip())
        except ValueError:
            raise LMKernelsError(f"--shape: {dim}={value.strip()!r} is not an integer; {usage}") from None
        if n < 1:
            raise LMKernelsError(f"--shape: {dim}={n} must be positive; {usage}")
        return n

    if "=" in text:
        shape: dict[str, int] = {}
        for part in split_commas(text):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in dims:
                raise LMKernelsError(f"--shape: {part!r} is not one of the dims {order}; {usage}")
            shape[key] = number(key, value)
        missing = [d for d in dims if d not in shape]
        if missing:
            raise LMKernelsError(f"--shape: missing {', '.join(missing)}; {usage}")
        return {d: shape[d] for d in dims}
    values = text.lower().split("x")
    if len(values) != len(dims):
        raise LMKernelsError(f"--shape: got {text!r}; {usage}")
    return {d: number(d, v) for d, v in zip(dims, values)}


def summarize_skipped(skipped: dict[str, str]) -> str:
    """One line for the backends a run leaves out: "liger, cce (not installed); torch_native
    (cuda only)", reasons cut to their gist (the reports keep them whole)."""
    by_reason: dict[str, list[str]] = {}
    for backend, reason in skipped.items():
        short = reason.split(" (")[0]
        if short.endswith(" is not installed"):
            short = "not installed"
        elif short.startswith("runs on ") and short.endswith(" only"):
            short = short.removeprefix("runs on ")
        by_reason.setdefault(short, []).append(backend)
    return "; ".join(f"{', '.join(bs)} ({why})" for why, bs in by_reason.items())


def triton_hint(reasons: Iterable[str]) -> str | None:
    """TRITON_HINT when one of these reasons is the Triton backend's "no CUDA device (set
    TRITON_INTERPRET=1 ...)", else None."""
    return TRITON_HINT if any("TRITON_INTERPRET=1" in r for r in reasons) else None
