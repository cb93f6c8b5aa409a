"""The project's import graph and its cycles: an AST pass over every ``vramlab.*`` import in core/ and app/.

Counted: every import statement, at module level or inside a function (a lazy import is still an arrow);
relative imports resolved; ``if TYPE_CHECKING:`` blocks left out (they run only under a type checker). A call
``piece(key, "<name>")`` of :mod:`vramlab.core.families` or :mod:`vramlab.core.objectives` imports a unit's
piece by name at run time, so it counts as an arrow to that piece of every unit folder of that loader that has it
(any piece when the name is not a constant).

Run: python tools/import_graph.py [ROOT]   prints each cycle (a strongly connected component of more than one
module) and, last, ``cycles=<n> modules_in_cycles=<m> modules=<k> arrows=<a>``. tests/test_architecture.py
holds the count at zero.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

PACKAGES = {"core": "vramlab.core", "app": "vramlab.app"}
# the loaders that import a unit's piece by name: families (one folder per model family), objectives
LOADERS = ("vramlab.core.families", "vramlab.core.objectives")


def modules(root: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for top, name in PACKAGES.items():
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root / top).with_suffix("").as_posix().replace("/", ".")
            found[name if rel == "__init__" else name + "." + rel.removesuffix(".__init__")] = path
    return found


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_pkg: bool, known: dict[str, Path]):
        self.module, self.is_pkg, self.known = module, is_pkg, known
        self.deps: set[str] = set()
        self.piece_names: dict[str, str] = {}  # local name of a loader's piece -> the loader package
        self.loader_modules: dict[str, str] = {}  # local name of a loader package -> the package

    def _add(self, name: str) -> None:
        while name and name not in self.known:
            name = name.rpartition(".")[0]
        if name and name != self.module:
            self.deps.add(name)

    def visit_If(self, node: ast.If) -> None:  # noqa: N802
        if "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:  # noqa: N802
        for alias in node.names:
            if alias.name.startswith("vramlab."):
                self._add(alias.name)
                if alias.name in LOADERS and alias.asname:
                    self.loader_modules[alias.asname] = alias.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:  # noqa: N802
        if node.level:
            parts = self.module.split(".") if self.is_pkg else self.module.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        elif node.module and node.module.startswith("vramlab."):
            base = node.module
        else:
            return
        for alias in node.names:
            full = f"{base}.{alias.name}"
            self._add(full if full in self.known else base)
            if base in LOADERS and alias.name == "piece":
                self.piece_names[alias.asname or alias.name] = base
            if full in LOADERS:
                self.loader_modules[alias.asname or alias.name] = full

    def visit_Call(self, node: ast.Call) -> None:  # noqa: N802
        func = node.func
        loader = None
        if isinstance(func, ast.Name):
            loader = self.piece_names.get(func.id)
        elif isinstance(func, ast.Attribute) and func.attr == "piece" and isinstance(func.value, ast.Name):
            loader = self.loader_modules.get(func.value.id)
        if loader and self.module != loader:
            wanted = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
            for mod in self.known:
                head, _, leaf = mod.rpartition(".")
                if head.startswith(loader + ".") and head.count(".") == loader.count(".") + 1 \
                        and (wanted is None or leaf == wanted):
                    self._add(mod)
        self.generic_visit(node)


def graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    out = {}
    for mod, path in known.items():
        v = _Imports(mod, path.name == "__init__.py", known)
        v.visit(ast.parse(path.read_text(encoding="utf-8")))
        out[mod] = v.deps
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start, first in g.items():
        if start in index:
            continue
        work = [(start, iter(sorted(first)))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else os.getcwd())
    g = graph(root)
    comps = cycles(g)
    for comp in comps:
        inside = set(comp)
        print(" <-> ".join(m.removeprefix("vramlab.") for m in comp))
        for m in comp:
            for d in sorted(g[m] & inside):
                print(f"    {m.removeprefix('vramlab.')} -> {d.removeprefix('vramlab.')}")
    print(f"cycles={len(comps)} modules_in_cycles={sum(map(len, comps))} modules={len(g)} "
          f"arrows={sum(map(len, g.values()))}")
    return 1 if comps else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
