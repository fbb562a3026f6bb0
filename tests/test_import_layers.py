"""The import graph of persia_core, components and pipelines: no cycles, arrows only down the layers.

Every import counts: module-level, inside functions, and ``importlib.import_module`` / ``__import__`` of a
project module named by a string literal. Layers: ``pipelines -> components -> persia_core``; inside persia_core
the embedding package never imports ``ps``, ``train`` or ``evaluate``; ``config`` never imports the embedding
package; ``evaluate`` never imports ``train``; nothing under persia_core imports kfp. Function-level project
imports inside persia_core (the CLI and the benchmarks aside, where lazy imports keep start-up fast) are few,
each with a ``# lazy:`` reason on the line above.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("persia_core", "components", "pipelines")
MAX_FUNCTION_LEVEL = 15
LAZY_EXEMPT = ("persia_core.__main__", "persia_core.cli", "persia_core.bench")
"""Modules whose function-level imports keep the CLI's and the benchmarks' start-up fast (not counted)."""

# (importer prefix, imported prefix): an importer under the first may not import anything under the second
FORBIDDEN = [
    ("persia_core", "components"),
    ("persia_core", "pipelines"),
    ("persia_core", "kfp"),
    ("components", "pipelines"),
    ("persia_core.embedding", "persia_core.ps"),
    ("persia_core.embedding", "persia_core.train"),
    ("persia_core.embedding", "persia_core.evaluate"),
    ("persia_core.config", "persia_core.embedding"),
    ("persia_core.evaluate", "persia_core.train"),
    ("persia_core.evaluate", "persia_core.serve"),
    ("persia_core.train", "persia_core.serve"),
]


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    path: str
    line: int
    function_level: bool
    type_checking: bool
    """Under ``if TYPE_CHECKING:``: never executed, so no cycle; still subject to the layers."""


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_names(root: str, packages=PACKAGES) -> dict[str, str]:
    """Module name -> file path of every ``.py`` file under ``packages`` of ``root``."""
    out = {}
    for pkg in packages:
        for folder, _, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    parts = os.path.relpath(path, root)[: -len(".py")].split(os.sep)
                    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(name: str, modules: dict[str, str]) -> str:
    """The longest known module that ``name`` (a module or ``module.attribute``) starts with."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def import_edges(root: str, packages=PACKAGES) -> list[Edge]:
    """Every import of a project module (or of kfp) by a project module under ``root``."""
    modules = module_names(root, packages)
    edges = []
    for mod, path in sorted(modules.items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_pkg = path.endswith("__init__.py")
        stack: list[tuple[ast.AST, bool, bool]] = [(tree, False, False)]
        while stack:
            node, in_function, type_checking = stack.pop()
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [f"{stem}.{a.name}" for a in node.names]  # `from pkg import submodule` or attribute
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                fn = node.func
                called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
                if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                    targets = [node.args[0].value]
            for t in targets:
                top = t.split(".")[0]
                if top == "kfp":
                    edges.append(Edge(mod, "kfp", path, node.lineno, in_function, type_checking))
                elif top in packages:
                    target = _resolve(t, modules)
                    if target and target != mod:
                        edges.append(Edge(mod, target, path, node.lineno, in_function, type_checking))
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            guarded = node.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) else []
            stack.extend((c, inner, type_checking or c in guarded) for c in ast.iter_child_nodes(node))
    return sorted(set(edges), key=lambda e: (e.path, e.line, e.imported))


def find_cycles(edges: list[Edge]) -> list[list[str]]:
    """The import cycles: each strongly connected component of more than one module (Tarjan's algorithm),
    sorted; ``kfp`` edges and imports under ``if TYPE_CHECKING:`` are left out."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.imported != "kfp" and not e.type_checking:
            graph.setdefault(e.importer, set()).add(e.imported)
            graph.setdefault(e.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
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
    return sorted(out)


def layer_violations(edges: list[Edge]) -> list[str]:
    return sorted(
        f"{e.path}:{e.line}: {e.importer} imports {e.imported}"
        for e in edges
        for low, high in FORBIDDEN
        if _under(e.importer, low) and _under(e.imported, high)
    )


def counted_function_level(edges: list[Edge]) -> list[Edge]:
    """Function-level project imports inside persia_core that count against ``MAX_FUNCTION_LEVEL``."""
    return [
        e
        for e in edges
        if e.function_level
        and _under(e.importer, "persia_core")
        and e.imported != "kfp"
        and not any(_under(e.importer, x) for x in LAZY_EXEMPT)
    ]


def _lazy_reason(e: Edge) -> str:
    """The ``# lazy: <reason>`` comment on the line above the import at ``e``, else ''."""
    with open(e.path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    above = lines[e.line - 2].strip() if e.line >= 2 else ""
    return above[len("# lazy:") :].strip() if above.startswith("# lazy:") else ""


@pytest.fixture(scope="module")
def project_edges() -> list[Edge]:
    """``import_edges(ROOT)``: parsed when a test asks, not while the module is collected (by every xdist worker)."""
    return import_edges(ROOT)


def test_there_is_no_import_cycle_in_the_project(project_edges):
    assert find_cycles(project_edges) == []


def test_no_import_points_up_or_across_the_layers(project_edges):
    assert layer_violations(project_edges) == []


def test_few_function_level_project_imports_each_with_its_reason(project_edges):
    counted = counted_function_level(project_edges)
    assert len(counted) <= MAX_FUNCTION_LEVEL, [f"{e.path}:{e.line}" for e in counted]
    assert [f"{e.path}:{e.line}" for e in counted if not _lazy_reason(e)] == []


# ---- the checker itself, on small trees planted with the faults it must find ---------------------------------


def _tree(tmp_path, files: dict[str, str]) -> str:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize(
    "b_imports",
    [
        "from persia_core import a\n",  # module level
        "def f():\n    from persia_core.a import x\n    return x\n",  # hidden in a function
        "import importlib\n\ndef f():\n    return importlib.import_module('persia_core.a')\n",
        "def f():\n    return __import__('persia_core.a')\n",
    ],
)
def test_the_checker_finds_a_cycle_however_the_import_is_written(tmp_path, b_imports):
    root = _tree(
        tmp_path,
        {
            "persia_core/__init__.py": "",
            "persia_core/a.py": "from persia_core.b import y\nx = 1\n",
            "persia_core/b.py": b_imports + "y = 2\n",
        },
    )
    assert find_cycles(import_edges(root, ("persia_core",))) == [["persia_core.a", "persia_core.b"]]


def test_the_checker_leaves_type_checking_imports_out_of_cycles_not_out_of_layers(tmp_path):
    root = _tree(
        tmp_path,
        {
            "persia_core/__init__.py": "",
            "persia_core/a.py": "from persia_core import b\n",
            "persia_core/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from persia_core import a\n",
            "persia_core/embedding/__init__.py": "",
            "persia_core/embedding/table.py": "from persia_core.train import loop\n",
            "persia_core/embedding/backend.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from persia_core.ps.client import C\n",
            "persia_core/ps/__init__.py": "",
            "persia_core/ps/client.py": "C = 1\n",
            "persia_core/train/__init__.py": "",
            "persia_core/train/loop.py": "import kfp\n",
        },
    )
    edges = import_edges(root, ("persia_core",))
    assert find_cycles(edges) == []
    assert [v.split(": ", 1)[1] for v in layer_violations(edges)] == [
        "persia_core.embedding.backend imports persia_core.ps.client",
        "persia_core.embedding.table imports persia_core.train.loop",
        "persia_core.train.loop imports kfp",
    ]


def test_the_checker_counts_function_level_imports_and_reads_their_reasons(tmp_path):
    root = _tree(
        tmp_path,
        {
            "persia_core/__init__.py": "",
            "persia_core/a.py": "def f():\n    # lazy: torch is heavy\n    from persia_core import b\n\n"
            "def g():\n    from persia_core import b\n",
            "persia_core/b.py": "",
            "persia_core/__main__.py": "def main():\n    from persia_core import a\n",
        },
    )
    counted = counted_function_level(import_edges(root, ("persia_core",)))
    assert [(e.importer, e.line, _lazy_reason(e)) for e in counted] == [
        ("persia_core.a", 3, "torch is heavy"),
        ("persia_core.a", 6, ""),
    ]
