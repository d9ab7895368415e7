"""Every command the README and the docs cite exists in the tree: the files they name under
benchmarks/, scripts/, tests/, src/, docs/ and examples/, the `lmkernels` and `lmkernels-bench`
subcommands in their code, and the options given to them (each subcommand's parser knows them).
The README keeps the commands CI runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from lmkernels import cli
from lmkernels_bench import cli as bench_cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    "README.md",
    "benchmarks/README.md",
    *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))),
]

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # a code span, wrapped over two lines at most
# A path in the tree: after a space, a quote, a bracket or the line's start; not a git object
# (REV:path) nor a URL. Files (a suffix) and folders (a trailing slash).
PATH = re.compile(r"(?<![\w./:-])((?:benchmarks|scripts|tests|src|docs|examples)/[\w./-]*(?:\.\w+|/))")
PROGRAMS = {"lmkernels": "lmkernels", "lmkernels-bench": "lmkernels-bench"}
MODULES = {"lmkernels": "lmkernels", "lmkernels_bench": "lmkernels-bench"}


def _text(doc: str) -> str:
    return (ROOT / doc).read_text()


def code(text: str) -> list[str]:
    """The commands of a document: each line of its shell blocks, each inline code span (the
    JSON and Python blocks are data and code, not commands)."""
    out = []
    for lang, body in FENCE.findall(text):
        if lang in ("bash", "sh", "shell", ""):
            out += [line for line in body.splitlines() if line.strip()]
    out += [span.replace("\n", " ") for span in INLINE.findall(FENCE.sub("", text))]
    return out


def invocations(command: str) -> list[tuple[str, str, list[str]]]:
    """(program, subcommand, options) of each `lmkernels ...` / `lmkernels-bench ...` (or
    `python -m ...`) in a command line."""
    command = "" if command.lstrip().startswith("#") else command.split(" #")[0]
    try:
        tokens = shlex.split(command)
    except ValueError:  # an unbalanced quote: a span cut by the prose
        tokens = command.split()
    out = []
    for i, token in enumerate(tokens):
        program = PROGRAMS.get(token)
        if program is None and token in MODULES and i > 0 and tokens[i - 1] == "-m":
            program = MODULES[token]
        if program is None or i + 1 >= len(tokens) or tokens[i + 1].startswith(("-", "[")):
            continue
        rest = []
        for t in tokens[i + 2 :]:
            if t in ("&&", ";", "|", "||") or t.startswith("#"):
                break
            rest.append(t)
        options = [t.strip("[]").split("=")[0] for t in rest if t.strip("[").startswith("-")]
        out.append((program, tokens[i + 1].rstrip(";,."), [o for o in options if o.startswith("--")]))
    return out


def _lmkernels_parsers() -> dict:
    import argparse

    (sub,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def _option_strings(program: str, subcommand: str) -> set[str] | None:
    """The options of a subcommand, or None when there is no such subcommand."""
    if program == "lmkernels":
        parser = _lmkernels_parsers().get(subcommand)
    elif subcommand in bench_cli.COMMANDS:
        parser = bench_cli.module(subcommand).parser()
    else:
        parser = None
    return None if parser is None else set(parser._option_string_actions)


@pytest.mark.parametrize("doc", DOCS)
def test_the_files_a_document_cites_exist(doc):
    text = FENCE.sub(lambda m: "" if m.group(1) == "json" else m.group(0), _text(doc))
    missing = sorted({p for p in PATH.findall(text) if not (ROOT / p).exists()})
    assert not missing, f"{doc} cites files not in the tree: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_the_commands_a_document_cites_exist_with_their_options(doc):
    bad, seen = [], 0
    for command in code(_text(doc)):
        for program, subcommand, options in invocations(command):
            if subcommand.isupper():  # a placeholder: `lmkernels-bench COMMAND --help`
                continue
            seen += 1
            known = _option_strings(program, subcommand)
            if known is None:
                bad.append(f"{program} {subcommand}: no such command ({command})")
                continue
            unknown = [o for o in options if o not in known]
            if unknown:
                bad.append(f"{program} {subcommand}: unknown {', '.join(unknown)} ({command})")
    assert not bad, f"{doc}:\n" + "\n".join(bad)
    if doc in ("README.md", "benchmarks/README.md"):
        assert seen > 3  # the extraction sees the commands


def test_the_extraction_finds_commands_and_their_options():
    text = "Run `lmkernels-bench suite readme --part ops --out DIR` or\n```bash\nlmkernels bench --op X --shape S  # c\n```\n"
    found = [inv for c in code(text) for inv in invocations(c)]
    assert ("lmkernels-bench", "suite", ["--part", "--out"]) in found
    assert ("lmkernels", "bench", ["--op", "--shape"]) in found
    assert invocations("python3 -m lmkernels validate --full && lmkernels list") == [
        ("lmkernels", "validate", ["--full"]),
        ("lmkernels", "list", []),
    ]
    assert invocations("lmkernels-bench families-table [--check]") == [
        ("lmkernels-bench", "families-table", ["--check"])
    ]
    assert _option_strings("lmkernels", "bench") >= {"--op", "--shape", "--device"}
    assert _option_strings("lmkernels", "nope") is None
    assert _option_strings("lmkernels-bench", "dist-scale") >= {"--gpus", "--data"}
    assert "--suite" not in _option_strings("lmkernels", "bench")  # the suites left the package
    assert PATH.findall("see benchmarks/gpu_tests.py, `git show abc:benchmarks/results/` and tests/x.py") == [
        "benchmarks/gpu_tests.py",
        "tests/x.py",
    ]


def test_every_bench_command_has_help(capsys):
    for name in bench_cli.COMMANDS:
        with pytest.raises(SystemExit) as e:
            bench_cli.main([name, "--help"])
        assert e.value.code == 0, name
        assert f"usage: lmkernels-bench {name}" in capsys.readouterr().out
    assert bench_cli.main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert all(name in usage for name in bench_cli.COMMANDS)


def test_readme_keeps_the_commands_ci_runs():
    readme = _text("README.md")
    assert len(readme.splitlines()) <= 200
    setup = (
        'pip install "torch==2.13.0" -e ".[triton,hf,test]" -e ./benchmarks'
        " && lmkernels validate --device cpu --quick"
    )
    assert f"```bash\npython3 -m venv .venv && . .venv/bin/activate && {setup}\n```" in readme
    assert "```bash\npytest -q -n auto --dist loadfile\n```" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q "torch==2.13.0" -e ".[triton,hf,test]" -e ./benchmarks' in ci
    assert "\npytest -q -n auto --dist loadfile\n" in ci
