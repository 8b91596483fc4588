"""The package's layers: each subpackage imports only from its own layer and the layers
below it, and no module imports itself back through a chain of module-level imports.

Layers, lowest first (README "Layout", docs/ARCHITECTURE.md):

    numerics < recipe < kernels < ops < nn < models < distributed < train < integrations < cli

``mxmoe/__init__.py`` and ``mxmoe/__main__.py`` sit on top (they re-export and start the
CLI). Every import is read from the source with ``ast``, at any depth: a function-level
import that reaches up a layer is a violation too (a lazy import hides a dependency, it
does not remove it). Cycles are checked among module-level imports (the ones that run
when a module is imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "mxmoe"
LAYERS = ["numerics", "recipe", "kernels", "ops", "nn", "models", "distributed", "train", "integrations", "cli"]
TOP = len(LAYERS)  # mxmoe/__init__.py, mxmoe/__main__.py


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__",):
        return TOP
    if parts[1] not in LAYERS:
        raise AssertionError(f"{module} is in no layer: add {parts[1]!r} to LAYERS (and to docs/ARCHITECTURE.md)")
    return LAYERS.index(parts[1])


def resolve(current: str, is_package: bool, node: ast.ImportFrom | ast.Import, known: dict) -> list[str]:
    """The mxmoe modules an import statement loads (attributes of a package count as the package)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = current.split(".") if is_package else current.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
    out = []
    for name in names:
        if not name.startswith(PACKAGE):
            continue
        while name not in known and "." in name:  # `import mxmoe.ops.quantize.x`: the deepest module
            name = name.rsplit(".", 1)[0]
        out.append(name)
    return out


def imports(known: dict[str, Path]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(every import, module-level imports) of each module, as sets of mxmoe module names."""
    every: dict[str, set[str]] = {}
    top: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        every[name], top[name] = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                every[name].update(resolve(name, is_package, node, known))
        for node in tree.body:  # module level: runs at import (TYPE_CHECKING blocks excluded)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                top[name].update(resolve(name, is_package, node, known))
            elif isinstance(node, ast.Try):
                for sub in node.body:
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        top[name].update(resolve(name, is_package, sub, known))
        every[name].discard(name)
        top[name].discard(name)
    return every, top


KNOWN = modules()
EVERY, TOP_LEVEL = imports(KNOWN)


@pytest.mark.parametrize("module", sorted(KNOWN))
def test_imports_only_its_own_and_lower_layers(module):
    mine = layer_of(module)
    upward = sorted(t for t in EVERY[module] if layer_of(t) > mine)
    assert not upward, (f"{module} (layer {LAYERS[mine] if mine < TOP else 'top'}) imports from higher layers: "
                        f"{upward}; move the shared code down or the caller up")


def test_no_import_cycles():
    """Depth-first search over module-level imports; a back edge is a cycle."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(TOP_LEVEL.get(m, ())):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(KNOWN):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_violations(tmp_path):
    """The rules above catch an upward import and a cycle in a planted tree (so the real
    tree passing means something)."""
    global SRC
    saved = SRC
    try:
        SRC = tmp_path
        pkg = tmp_path / PACKAGE
        for sub in ("numerics", "ops"):
            (pkg / sub).mkdir(parents=True)
            (pkg / sub / "__init__.py").write_text("")
        (pkg / "__init__.py").write_text("")
        (pkg / "numerics" / "a.py").write_text("def f():\n    from ..ops import b\n")
        (pkg / "ops" / "b.py").write_text("from . import c\n")
        (pkg / "ops" / "c.py").write_text("from .b import x\n")
        known = modules()
        every, top = imports(known)
        assert "mxmoe.ops" in every["mxmoe.numerics.a"] or "mxmoe.ops.b" in every["mxmoe.numerics.a"]
        assert top["mxmoe.ops.b"] == {"mxmoe.ops.c"} and top["mxmoe.ops.c"] == {"mxmoe.ops.b"}
    finally:
        SRC = saved
