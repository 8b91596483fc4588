"""The suite and the library on machines with and without a GPU.

A run of the whole suite on the H200 (``benchmarks/run_h200.sh``) found failures that the
CPU CI cannot see, all in the tests: Triton
kernels given CPU tensors (the interpreter takes them, a GPU build does not), runs on the
"auto" device compared with CPU expectations, expert-parallel ranks on gloo handed a CUDA
device, and checkpoints of GPU runs loaded without a map location and compared with CPU
tensors. The first kinds are caught by running the suite on the GPU; the last one is
checked here, on every machine."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _torch_load_calls(path: Path) -> list[tuple[int, bool, bool]]:
    """(line, names a map location, passes ``weights_only=True``) of each call of
    ``torch.load`` in a Python file, also through ``import torch as T``, ``from torch import
    load [as f]`` and ``torch.serialization.load``; ``map_location=None`` counts as none,
    ``**kwargs`` too; only the literal keyword ``weights_only=True`` counts as weights only
    (a variable, ``**kwargs`` or the default do not: the default changed across torch
    versions and ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` overrides it)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    torch_names, serialization_names, load_names = {"torch"}, set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch":
                    torch_names.add(a.asname or "torch")
                elif a.name == "torch.serialization" and a.asname:
                    serialization_names.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.serialization"):
            for a in node.names:
                if a.name == "load":
                    load_names.add(a.asname or "load")
                elif a.name == "serialization":
                    serialization_names.add(a.asname or "serialization")

    def is_load(f: ast.expr) -> bool:
        if isinstance(f, ast.Name):
            return f.id in load_names
        if not (isinstance(f, ast.Attribute) and f.attr == "load"):
            return False
        v = f.value
        if isinstance(v, ast.Name):
            return v.id in torch_names or v.id in serialization_names
        return isinstance(v, ast.Attribute) and v.attr == "serialization" and isinstance(v.value, ast.Name) \
            and v.value.id in torch_names

    def names_map_location(call: ast.Call) -> bool:
        return any(k.arg == "map_location" and not (isinstance(k.value, ast.Constant) and k.value.value is None)
                   for k in call.keywords) or len(call.args) >= 2

    def weights_only(call: ast.Call) -> bool:
        return any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                   for k in call.keywords)

    return [(n.lineno, names_map_location(n), weights_only(n)) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and is_load(n.func)]


def test_every_torch_load_names_its_map_location():
    """A checkpoint written on a GPU holds CUDA tensors: loaded without a map location it
    fails on a CPU-only machine, and a test that compares it with CPU tensors fails on a GPU
    machine (tests/train/test_export.py once did)."""
    files = sorted(f for d in ("src", "tests", "benchmarks") for f in (ROOT / d).rglob("*.py"))
    calls = {f"{p.relative_to(ROOT)}:{line}": ok for p in files for line, ok, _ in _torch_load_calls(p)}
    assert len(calls) >= 5, calls  # the checker finds the loads there are (src 1, tests 4 at the time of writing)
    assert [k for k, ok in calls.items() if not ok] == []


def test_every_torch_load_of_the_library_is_weights_only():
    """A checkpoint is a pickle: loaded with the full unpickler, a planted ``__reduce__``
    runs any code (``os.system``, ``open(path, "w")``) the moment ``mxmoe eval``, ``mxmoe
    export`` or ``mxmoe train --resume`` reads it. Every ``torch.load`` of the library and
    of the benchmarks passes ``weights_only=True`` (all of them go through
    :func:`mxmoe.train.checkpoint.load_checkpoint`)."""
    files = sorted(f for d in ("src", "benchmarks") for f in (ROOT / d).rglob("*.py"))
    calls = {f"{p.relative_to(ROOT)}:{line}": wo for p in files for line, _, wo in _torch_load_calls(p)}
    assert calls, "the checker finds no torch.load in src (the loader of mxmoe.train.checkpoint has one)"
    assert [k for k, wo in calls.items() if not wo] == []


def _full_unpickling_calls(path: Path) -> list[int]:
    """Lines of the calls in a Python file that unpickle with the full unpickler:
    ``pickle.load``/``loads``/``Unpickler`` (also ``cPickle``, ``dill``, ``joblib.load``)
    and ``np.load``/``numpy.load`` with ``allow_pickle`` other than a literal False."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)):
            continue
        mod, attr = n.func.value.id, n.func.attr
        pickles = mod in ("pickle", "cPickle", "dill") and attr in ("load", "loads", "Unpickler") \
            or mod == "joblib" and attr == "load"
        numpy_pickles = mod in ("np", "numpy") and attr == "load" and any(
            k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
            for k in n.keywords)
        if pickles or numpy_pickles:
            lines.append(n.lineno)
    return lines


def test_the_library_unpickles_nothing_with_the_full_unpickler():
    files = sorted((ROOT / "src").rglob("*.py"))
    assert [f"{p.relative_to(ROOT)}:{line}" for p in files for line in _full_unpickling_calls(p)] == []


def test_the_checker_sees_a_load_without_map_location(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import torch\nimport torch as T\nfrom torch import load as ld\n"
                 "a = torch.load('c.pt', weights_only=False)\n"                  # 4: none
                 "b = torch.load('c.pt', map_location='cpu', weights_only=True)\n"  # 5
                 "c = T.load('c.pt')\n"                                          # 6: none
                 "d = ld('c.pt', map_location=None, weights_only=wo)\n"          # 7: None is none
                 "e = torch.serialization.load('c.pt', 'cpu')\n"                 # 8: positional
                 "g = torch.load('c.pt', **kw)\n"                                # 9: unknown, counted as none
                 "h = other.load('c.pt')\n")                                     # not torch's
    assert sorted(_torch_load_calls(f)) == [(4, False, False), (5, True, True), (6, False, False),
                                            (7, False, False), (8, True, False), (9, False, False)]


def test_the_checker_sees_full_unpickling(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import pickle, numpy as np\n"
                 "a = pickle.load(open('x', 'rb'))\n"           # 2
                 "b = pickle.loads(data)\n"                     # 3
                 "c = np.load('x.npy')\n"                       # safe: allow_pickle defaults to False
                 "d = np.load('x.npy', allow_pickle=False)\n"   # safe
                 "e = np.load('x.npy', allow_pickle=True)\n"    # 6
                 "g = json.load(open('x'))\n")                  # not a pickle
    assert _full_unpickling_calls(f) == [2, 3, 6]
