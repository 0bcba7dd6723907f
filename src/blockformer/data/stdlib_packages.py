"""A real classification task from data every machine has: which standard-library package
does a Python function come from?

Every top-level function and method of the running Python's standard-library packages is
an example; its label is the top-level package (``asyncio``, ``email``, ...). The ``top``
packages with the most functions are kept. A fixed ~20% of the functions (chosen by a hash
of file and qualified name, so the split is the same on every run) is held out.

``pretrain.txt`` is the whole standard library's source with the held-out functions cut
out, so masked-LM pre-training on it never reads a function it is later tested on.

    python -m blockformer.data.stdlib_packages --out data/stdlib-packages

writes ``train.jsonl``, ``val.jsonl`` (``{"text", "label"}`` lines) and ``pretrain.txt``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .sources import SKIP_DIRS, _walk, stdlib_dir

SKIP_PACKAGES = {"idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "venv", "pydoc_data"}  # tools, GUIs


@dataclass
class Function:
    package: str
    file: Path
    qualname: str
    first: int  # 1-based line range, decorators excluded
    last: int
    text: str

    @property
    def held_out(self) -> bool:
        return is_held_out(self.file, self.qualname)


def is_held_out(file: Path, qualname: str, val_fraction: float = 0.2) -> bool:
    key = f"{file.relative_to(stdlib_dir()).as_posix()}:{qualname}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little") / 2**32 < val_fraction


def _functions_of(path: Path, package: str) -> list[Function]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    found = []
    for node in tree.body:
        pairs = [(node, node.name)] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
        if isinstance(node, ast.ClassDef):
            pairs = [(m, f"{node.name}.{m.name}") for m in node.body
                     if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for fn, qualname in pairs:
            text = textwrap.dedent("\n".join(lines[fn.lineno - 1 : fn.end_lineno]))
            found.append(Function(package, path, qualname, fn.lineno, fn.end_lineno, text))
    return found


def package_functions(top: int = 10) -> list[Function]:
    """The functions of the ``top`` standard-library packages with the most functions."""
    root = stdlib_dir()
    by_package: dict[str, list[Function]] = {}
    for d in sorted(root.iterdir()):
        if d.is_dir() and (d / "__init__.py").is_file() and d.name not in SKIP_DIRS | SKIP_PACKAGES:
            by_package[d.name] = [f for p in _walk(d, ".py") for f in _functions_of(p, d.name)]
    counts = Counter({k: len(v) for k, v in by_package.items()})
    return [f for name, _ in counts.most_common(top) for f in by_package[name]]


def pretrain_text(functions: list[Function]) -> str:
    """The whole standard library's source, with the held-out functions' lines removed."""
    cut: dict[Path, list[tuple[int, int]]] = {}
    for f in functions:
        if f.held_out:
            cut.setdefault(f.file, []).append((f.first, f.last))
    parts = []
    for path in _walk(stdlib_dir(), ".py"):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            continue
        for first, last in sorted(cut.get(path, []), reverse=True):
            del lines[first - 1 : last]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def write(out: str | Path, top: int = 10) -> dict[str, int]:
    """Write ``train.jsonl``, ``val.jsonl`` and ``pretrain.txt`` under ``out``; return counts."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    functions = package_functions(top)
    with open(out / "train.jsonl", "w", encoding="utf-8") as tr, open(out / "val.jsonl", "w", encoding="utf-8") as va:
        for f in functions:
            (va if f.held_out else tr).write(json.dumps({"text": f.text, "label": f.package}) + "\n")
    (out / "pretrain.txt").write_text(pretrain_text(functions), encoding="utf-8")
    n_val = sum(f.held_out for f in functions)
    return {"train": len(functions) - n_val, "val": n_val, "labels": len({f.package for f in functions})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, metavar="DIR")
    parser.add_argument("--top", type=int, default=10, metavar="N", help="packages kept (most functions first)")
    args = parser.parse_args(argv)
    counts = write(args.out, args.top)
    print(f"{args.out}: {counts['train']} training and {counts['val']} held-out functions, {counts['labels']} packages")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
