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
import sys
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


def _relative_base(current: str, is_package: bool, level: int) -> list[str]:
    """The package parts a relative import of ``level`` dots starts from."""
    base = current.split(".") if is_package else current.split(".")[:-1]
    return base[: len(base) - (level - 1)]


def _deepest(name: str, known: dict) -> str:
    """The deepest mxmoe module on ``name``'s path (``mxmoe.ops.quantize.x`` -> ``mxmoe.ops.quantize``)."""
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def resolve(current: str, is_package: bool, node: ast.ImportFrom | ast.Import, known: dict) -> list[str]:
    """The mxmoe modules an import statement loads (attributes of a package count as the package)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = _relative_base(current, is_package, node.level)
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
    return [_deepest(name, known) for name in names if name.startswith(PACKAGE)]


def _dynamic_import_names(current: str, is_package: bool, call: ast.Call) -> list[str]:
    """``importlib.import_module("mxmoe.x")`` / ``import_module("..x", __package__)`` /
    ``__import__("mxmoe.x")``: the module names given as string constants."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in ("import_module", "__import__") or not call.args:
        return []
    first = call.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return ["<dynamic>"]  # a computed module name: refused outright (see the test)
    target = first.value
    if target.startswith("."):
        base = _relative_base(current, is_package, len(target) - len(target.lstrip(".")))
        rest = target.lstrip(".")
        target = ".".join(base + ([rest] if rest else []))
    return [target]


def registered_ops(known: dict[str, Path]) -> dict[str, str]:
    """``mxmoe::NAME`` -> the module that registers it (``torch.library.custom_op``)."""
    out = {}
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("mxmoe::"):
                out.setdefault(node.value.split("::", 1)[1], name)
    return out


def _module_level(body: list[ast.stmt]):
    """Statements that run when the module is imported: the body, and the bodies of
    if / with / try / for / while at module level (not functions or classes; ``if
    TYPE_CHECKING:`` blocks excluded)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            test = node.test
            if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or (
                    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                yield from _module_level(node.orelse)
                continue
            yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, (ast.With, ast.For, ast.While)):
            yield from _module_level(node.body)
            yield from _module_level(getattr(node, "orelse", []))
        elif isinstance(node, ast.Try):
            yield from _module_level(node.body)
            for handler in node.handlers:
                yield from _module_level(handler.body)
            yield from _module_level(node.orelse)
            yield from _module_level(node.finalbody)


def imports(known: dict[str, Path]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(every dependency, module-level imports) of each module, as sets of mxmoe module
    names. Every dependency: import statements at any depth, ``importlib.import_module`` /
    ``__import__`` with a constant name, and ``torch.ops.mxmoe.NAME`` (the module that
    registers the op)."""
    ops = registered_ops(known)
    every: dict[str, set[str]] = {}
    top: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        every[name], top[name] = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                every[name].update(resolve(name, is_package, node, known))
            elif isinstance(node, ast.Call):
                for target in _dynamic_import_names(name, is_package, node):
                    if target == "<dynamic>" or target.startswith(PACKAGE):
                        every[name].add(target if target == "<dynamic>" else _deepest(target, known))
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                  and node.value.attr == PACKAGE and isinstance(node.value.value, ast.Attribute)
                  and node.value.value.attr == "ops" and node.attr in ops):
                every[name].add(ops[node.attr])  # torch.ops.mxmoe.NAME
        for node in _module_level(tree.body):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                top[name].update(resolve(name, is_package, node, known))
        every[name].discard(name)
        top[name].discard(name)
    return every, top


def upward_imports(module: str, every: dict[str, set[str]]) -> list[str]:
    """The dependencies of ``module`` on higher layers (and on computed module names)."""
    mine = layer_of(module)
    return sorted(t for t in every[module] if t == "<dynamic>" or layer_of(t) > mine)


def find_cycles(top: dict[str, set[str]]) -> list[list[str]]:
    """Depth-first search over module-level imports; each back edge is a cycle."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(top.get(m, ())):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(top):
        if m not in state:
            visit(m)
    return cycles


KNOWN = modules()
EVERY, TOP_LEVEL = imports(KNOWN)


@pytest.mark.parametrize("module", sorted(KNOWN))
def test_imports_only_its_own_and_lower_layers(module):
    upward = upward_imports(module, EVERY)
    mine = layer_of(module)
    assert not upward, (f"{module} (layer {LAYERS[mine] if mine < TOP else 'top'}) depends on higher layers "
                        f"(or on a computed module name): {upward}; move the shared code down or the caller up")


def test_no_import_cycles():
    cycles = find_cycles(TOP_LEVEL)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


PLANTED = {
    # an upward import inside a function, through importlib, through __import__, a custom op
    "numerics/a.py": "def f():\n    from ..ops import b\n",
    "numerics/d.py": "import importlib\ndef f():\n    return importlib.import_module('..ops.b', __package__)\n",
    "numerics/e.py": "def f():\n    return __import__('mxmoe.ops.c')\n",
    "numerics/f.py": "import torch\ndef f(x):\n    return torch.ops.mxmoe.planted_op(x)\n",
    "ops/b.py": "if True:\n    from . import c\n",  # a cycle through an if block
    "ops/c.py": "from .b import x\nimport torch\n@torch.library.custom_op('mxmoe::planted_op', mutates_args=())\n"
                "def planted_op(x):\n    return x\n",
}


def test_the_checker_sees_violations(tmp_path, monkeypatch):
    """Both rules fail on a planted tree (so the real tree passing means something)."""
    pkg = tmp_path / PACKAGE
    for sub in ("numerics", "ops"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    for rel, text in PLANTED.items():
        (pkg / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    known = modules()
    every, top = imports(known)
    for planted in ("a", "d", "e", "f"):
        assert upward_imports(f"mxmoe.numerics.{planted}", every), planted
    assert any(set(c) == {"mxmoe.ops.b", "mxmoe.ops.c"} for c in find_cycles(top))
