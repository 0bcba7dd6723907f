"""The package's shape: the import graph of ``src/blockformer`` read with ``ast``.

Layers, lowest first; a module may import from its own layer and the ones below, never
above, and no two modules may import each other, directly or around a loop. Function-local
imports count: hiding an edge inside a function does not remove it. ``TYPE_CHECKING``
imports are for annotations only and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "blockformer"

# (layer, the top-level modules or packages in it). docs/ARCHITECTURE.md draws the same map.
LAYERS = [
    ("leaf", {"errors", "textformats", "paths", "hardware", "kernels", "native", "schema", "precision", "presets"}),
    ("model config", {"config"}),
    ("components", {"nn"}),
    ("models", {"models", "stats"}),
    ("run config", {"run_config", "tokenizers"}),
    ("data", {"data"}),
    ("generation", {"generate"}),
    ("processes", {"parallel"}),
    ("training", {"train"}),
    ("around a trained model", {"interop", "probes", "scaling", "serve"}),
    ("views", {"view"}),
    ("commands", {"cli", "__main__", "__init__"}),
]
LAYER_OF = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def _type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(name: str) -> set[str]:
    """The modules of the package that ``name`` imports, anywhere in its file."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # ``from . import x`` imports the submodule x when there is one, else a name of the package
            subs = [f"{origin}.{alias.name}" for alias in node.names if f"{origin}.{alias.name}" in MODULES]
            targets = subs if subs and len(subs) == len(node.names) else [origin, *subs]
        else:
            continue
        if _type_checking(node, parents):
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_top_level_module_has_a_layer():
    assert {top(m) for m in MODULES} - set(LAYER_OF) == set()


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if LAYER_OF[top(b)] > LAYER_OF[top(a)])


def test_no_import_reaches_up_a_layer():
    upward = _upward(GRAPH)
    assert not upward, "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_cycles():
    cycles = _cycles(GRAPH)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_no_package_cycles():
    packages: dict[str, set[str]] = {}
    for a, targets in GRAPH.items():
        packages.setdefault(top(a), set()).update(top(b) for b in targets if top(b) != top(a))
    cycles = _cycles(packages)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_a_cycle_and_an_upward_edge():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert LAYER_OF["train"] > LAYER_OF["parallel"] > LAYER_OF["generate"] > LAYER_OF["models"] > LAYER_OF["nn"]
    assert all(LAYER_OF[top(b)] <= LAYER_OF["nn"] for b in GRAPH["blockformer.nn.stack"])
    # the edges of the issue: the loop importing the CLI, a component importing the run config
    fake = {"blockformer.train.loop": {"blockformer.cli.train", "blockformer.models"},
            "blockformer.nn.lora": {"blockformer.run_config"}}
    assert _upward(fake) == ["blockformer.nn.lora -> blockformer.run_config", "blockformer.train.loop -> blockformer.cli.train"]
    # a function-local import is an edge like any other
    assert "blockformer.train.build" in imports_of("blockformer.cli.info")  # inside cli.info.run


FUNCTION_LIMIT = 60
LIMITED = ("train", "generate", "parallel")


def test_no_long_functions_in_the_loop_decoding_and_parallel_packages():
    long = []
    for name, path in MODULES.items():
        if top(name) not in LIMITED:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > FUNCTION_LIMIT:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, "\n".join(long)
