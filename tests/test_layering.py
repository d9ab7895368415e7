"""The package's import graph: no circle, and the lower layers (registry, ops) import nothing
above them. Built statically from the source (every import statement, function-level ones
included, and importlib.import_module calls with a literal name), so an import hidden inside a
function counts as much as one at the top of a file.

And the line between the package and the maintainers' suite (benchmarks/lmkernels_bench): the
suite uses lmkernels' public API only, and nothing in src/ imports the suite or reads the
repository's files."""

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import lmkernels

ROOT = Path(lmkernels.__file__).parent
UPPER = ("backends", "nn", "losses", "integrations", "harness", "convergence", "cli", "distributed")


def _module_name(path: Path) -> str:
    parts = ["lmkernels", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The module that `import name` executes last: name itself or its nearest known parent."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = mod if is_pkg else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                # `from pkg import sub` imports the submodule sub; `from mod import name`, mod.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                targets = [node.args[0].value]
            for t in targets:
                if t == "lmkernels" or t.startswith("lmkernels."):
                    target = _resolve(t, modules)
                    if target and target != mod:
                        graph[mod].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    # lmkernels/__init__.py imports the backends only inside its loader function.
    assert "lmkernels.backends" in graph["lmkernels"]
    assert "lmkernels.registry.core" in graph["lmkernels.ops.rms_norm"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_registry_and_ops_import_nothing_above_them():
    graph = import_graph()
    upper = tuple(f"lmkernels.{u}" for u in UPPER)
    bad = []
    for mod, targets in graph.items():
        if not mod.startswith(("lmkernels.registry", "lmkernels.ops")):
            continue
        for t in targets:
            above = t == "lmkernels" or t.startswith(tuple(f"{u}." for u in upper)) or t in upper
            if above or (mod.startswith("lmkernels.registry") and t.startswith("lmkernels.ops")):
                bad.append(f"{mod} -> {t}")
    assert not bad, "lower layers importing upper ones:\n" + "\n".join(sorted(bad))


def test_losses_build_on_the_ops_only():
    """lmkernels.losses (post-training losses for plain PyTorch) sits on the ops and the registry:
    never on the integrations, the nn modules, the backends or the harness."""
    graph = import_graph()
    allowed = ("lmkernels.ops", "lmkernels.registry", "lmkernels.utils", "lmkernels.losses")
    bad = [
        f"{mod} -> {t}"
        for mod, targets in graph.items()
        if mod.startswith("lmkernels.losses")
        for t in targets
        if t != "lmkernels" and not t.startswith(allowed)
    ]
    assert not bad, "lmkernels.losses importing above the ops:\n" + "\n".join(sorted(bad))
    assert not any(
        t.startswith("lmkernels.losses")
        for m, ts in graph.items()
        if m.startswith(("lmkernels.ops", "lmkernels.registry"))
        for t in ts
    )


IMPORT_TIMER = textwrap.dedent(
    """
    import sys, time
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    import lmkernels
    t2 = time.perf_counter()
    heavy = [m for m in ("torch._inductor", "torch._dynamo.convert_frame", "torch._dynamo.symbolic_convert",
                         "triton", "transformers", "sympy") if m in sys.modules]
    print(t1 - t0, t2 - t1, ",".join(heavy))
    """
)


def test_import_lmkernels_is_cheap_and_pulls_in_no_compiler():
    """`import lmkernels` within 0.5 s of `import torch` was the target (it took 4-5 s when the
    compile backend imported dynamo and inductor); the bound here is loose for a loaded CI box."""
    env = {k: v for k, v in os.environ.items() if k != "LMKERNELS_BACKEND"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT.parent), env.get("PYTHONPATH", "")])
    runs = []
    for _ in range(3):
        out = subprocess.run(
            [sys.executable, "-c", IMPORT_TIMER], capture_output=True, text=True, env=env, check=True
        ).stdout.split()
        runs.append((float(out[0]), float(out[1]), out[2] if len(out) > 2 else ""))
    torch_s, lmk_s, heavy = min(runs, key=lambda r: r[1])
    print(f"import torch {torch_s:.2f} s; import lmkernels after it: {lmk_s:.3f} s (best of 3)")
    assert heavy == "", f"import lmkernels pulled in {heavy}"
    assert lmk_s < 1.0


# --- the package and the maintainers' suite -----------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks" / "lmkernels_bench"
# A string that names a file or folder of the repository, not of the package.
REPO_PATH = re.compile(
    r"^(?:\.\./)*(?:(?:benchmarks|tests|scripts|docs|examples)(?:/.*)?|README\.md|DESIGN\.md"
    r"|pyproject\.toml|tox\.ini|\.git|\.ci(?:/.*)?)$"
)
# What src/ may still read of a checkout, and why (a debt, each entry).
READS_THE_CHECKOUT = {
    # The run-time version check reads the supported ranges from the checkout's pyproject.toml
    # when lmkernels runs from one (else from the installed metadata).
    "lmkernels/_versions.py",
}


def _imported_modules(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) of every import in `tree`, and import_module("...")."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.append((node.module or "", [a.name for a in node.names]))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append((node.args[0].value, []))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_the_bench_package_uses_only_the_public_api():
    """benchmarks/lmkernels_bench imports no `_`-prefixed lmkernels module or name and reads no
    `_` attribute of what it imported from lmkernels."""
    files = sorted(BENCH.rglob("*.py"))
    assert len(files) > 10, BENCH
    bad = []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for module, names in _imported_modules(tree):
            if module != "lmkernels" and not module.startswith("lmkernels."):
                continue
            if any(_private(part) for part in module.split(".")) or any(_private(n) for n in names):
                bad.append(f"{path.name}: {module} {names}")
        bound = set()  # the names bound to what came from lmkernels
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bound |= {a.asname or "lmkernels" for a in node.names if a.name.split(".")[0] == "lmkernels"}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lmkernels":
                bound |= {a.asname or a.name for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in bound:
                    bad.append(f"{path.name}:{node.lineno}: {root.id}...{node.attr}")
    assert not bad, "private lmkernels names in the bench package:\n" + "\n".join(bad)


def _leaves_the_package(node: ast.AST, depth: int) -> bool:
    """Path(__file__)...parents[k] or .parent chains reaching above src/lmkernels (a module
    `depth` folders below it: lmkernels/x.py is 1)."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
        if node.value.attr == "parents" and isinstance(node.slice, ast.Constant):
            return "__file__" in ast.unparse(node.value) and node.slice.value >= depth
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        count, inner = 0, node
        while isinstance(inner, ast.Attribute) and inner.attr == "parent":
            count, inner = count + 1, inner.value
        return "__file__" in ast.unparse(inner) and count > depth
    return False


def test_src_neither_imports_the_bench_package_nor_reads_the_repository():
    """Nothing in src/ imports lmkernels_bench, names a file of the repository (benchmarks/,
    tests/, scripts/, docs/, the README, pyproject.toml, .git), writes the documents' table
    markers or climbs from __file__ out of the package, except READS_THE_CHECKOUT."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        bad += [
            f"{rel}: imports {m}" for m, _ in _imported_modules(tree) if m.split(".")[0] == "lmkernels_bench"
        ]
        if rel in READS_THE_CHECKOUT:
            continue
        depth = len(path.relative_to(ROOT).parts)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if REPO_PATH.match(node.value) or "<!-- bench:" in node.value:
                    bad.append(f"{rel}:{node.lineno}: {node.value!r}")
            elif _leaves_the_package(node, depth):
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "src/ reaching into the repository:\n" + "\n".join(bad)


def test_the_repository_checks_see_what_they_look_for():
    assert REPO_PATH.match("benchmarks") and REPO_PATH.match("tests/distributed_checks.py")
    assert REPO_PATH.match("pyproject.toml") and not REPO_PATH.match("the tests and benchmarks")
    up = ast.parse("Path(__file__).resolve().parents[2] / 'x'; Path(__file__).parent.parent").body
    assert _leaves_the_package(up[0].value.left, 2) and not _leaves_the_package(up[0].value.left, 3)
    assert _leaves_the_package(up[1].value, 1) and not _leaves_the_package(up[1].value, 2)
    tree = ast.parse("from lmkernels.backends.triton import _flce_plan\nimport lmkernels_bench.cli")
    assert _imported_modules(tree) == [
        ("lmkernels.backends.triton", ["_flce_plan"]),
        ("lmkernels_bench.cli", []),
    ]
