"""The CUTLASS quantized-weight grouped GEMM (:mod:`mxmoe.kernels.cutlass_mx_grouped_gemm`)
inside ``mx_grouped_mm`` on an sm90 GPU: bit-equal to the weight-pass path, and taken
where its rule says and only there.

Each case runs ``mx_grouped_mm`` forward + backward twice: with the GEMM allowed and with
``MXMOE_GROUPED_WQ=0`` (the weight quantized in a pass, then bf16 ``torch._grouped_mm``),
and checks the outputs, input gradients and weight gradients bit for bit, rows past the
last offset zero, and whether the CUTLASS forward and dgrad ran (counted at their entry
points) against what the rule expects: group sizes with empty experts, all tokens on one
expert, 33-300 experts, K and N of 8 / 40 / 1416, int64 offsets, E5M2 and floor recipes,
and the cases it must decline (N = 33, T = 0, float32 weights, a weight not 16-byte
aligned, more tokens per expert than its limits). Then CUDA-graph capture of forward and
dgrad, at a token count seen before and at a new one.

Skipped (not failed) without an sm90 GPU, or when the library is neither given
(``MXMOE_CUTLASS_WQ_LIB`` / ``MXMOE_CUTLASS_WQ_DGRAD_LIB``), nor cached, nor buildable
(nvcc and CUTLASS 4.2's headers: ``MXMOE_CUTLASS_DIR`` or the ``nvidia-cutlass`` wheel).
Only the E4M3 / rceil builds are compiled here if missing (about 2 minutes each); cases of
other formats and scale modes run only when their builds are in the cache.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from mxmoe.kernels import cutlass_mx_grouped_gemm as cg
from mxmoe.ops.grouped_mm import mx_grouped_mm, mx_grouped_mm_dgrad
from mxmoe.recipe import get_recipe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = torch.device("cuda")
LIB_ENV = {"forward": "MXMOE_CUTLASS_WQ_LIB", "dgrad": "MXMOE_CUTLASS_WQ_DGRAD_LIB"}
DEFAULT_BUILD = ("e4m3", "rceil")


def unavailable(fmt: str, mode: str) -> str | None:
    """Why the forward and dgrad builds for (fmt, mode) cannot run here (None: they can;
    loading or building them happens here, once)."""
    if torch.cuda.get_device_capability() != (9, 0):
        return f"sm_90a code; this GPU is sm{''.join(map(str, torch.cuda.get_device_capability()))}"
    for op in ("forward", "dgrad"):
        given = os.environ.get(LIB_ENV[op])
        if not given and not cg.cached_path(fmt, mode, op).exists():
            if (fmt, mode) != DEFAULT_BUILD:
                return f"no cached {op} build for {fmt} / {mode} (only {DEFAULT_BUILD} is built by the tests)"
            if cg.nvcc_path() is None:
                return "no nvcc (MXMOE_NVCC, PATH or CUDA_HOME) to build the library"
            root = cg.cutlass_dir()
            if root is None or not (Path(root) / "include" / "cutlass" / "cutlass.h").exists():
                return "no CUTLASS 4.2 headers (MXMOE_CUTLASS_DIR or the nvidia-cutlass wheel)"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            if cg.library(fmt, mode, op) is None:
                return f"the {op} library failed to build or load: {cg._FAILED.get((fmt, mode, op), '?')}"
    return None


@pytest.fixture(scope="module")
def default_build():
    why = unavailable(*DEFAULT_BUILD)
    if why:
        pytest.skip(f"CUTLASS quantized-weight GEMM not available: {why}")


@pytest.fixture
def calls(monkeypatch, default_build):
    """Counts of the CUTLASS forward ("fwd") and dgrad ("dgrad") calls that returned a result."""
    counts = {"fwd": 0, "dgrad": 0}
    for name, key in (("grouped_mm_nt_wq", "fwd"), ("grouped_mm_nn_wq", "dgrad")):
        original = getattr(cg, name)

        def counted(*a, _original=original, _key=key, **k):
            out = _original(*a, **k)
            counts[_key] += out is not None
            return out

        monkeypatch.setattr(cg, name, counted)
    monkeypatch.delenv("MXMOE_GROUPED_WQ", raising=False)
    return counts


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def run(x, w, offsets, recipe, allowed: bool, monkeypatch, calls):
    """Forward + backward of mx_grouped_mm; returns (out, dx, dw, (forward ran, dgrad ran))."""
    monkeypatch.setenv("MXMOE_GROUPED_WQ", "1" if allowed else "0")
    before = dict(calls)
    xx = x.detach().requires_grad_(True)  # no clone: a clone would realign a misaligned weight
    ww = w.detach().requires_grad_(True)
    out = mx_grouped_mm(xx, ww, offsets, recipe)
    out.backward(torch.randn_like(out, generator=torch.Generator(DEV).manual_seed(1)))
    torch.cuda.synchronize()
    return out.detach(), xx.grad, ww.grad, (calls["fwd"] > before["fwd"], calls["dgrad"] > before["dgrad"])


E4M3_FLOOR = "mxfp8-floor"
# (id, sizes, K, N, recipe name or (name, overrides), extra): extra keys pad (NaN rows past the end), wdtype, offs64,
# misalign, expect (forward runs the CUTLASS GEMM), expect_dgrad (default: expect)
CASES = [
    ("sizes [162,0,2577,446,0,83] K=1408 N=64", [162, 0, 2577, 446, 0, 83], 1408, 64, "mxfp8", {}),
    ("all tokens on one expert of 8", [0, 0, 2048, 0, 0, 0, 0, 0], 2048, 256, "mxfp8", {}),
    *[(f"E={E}, 200 tokens each, K=2048 N=1408", [200] * E, 2048, 1408, "mxfp8", {}) for E in (33, 64, 128, 256)],
    ("K=2880 N=256 ragged", [300, 17, 0, 900, 31], 2880, 256, "mxfp8", {}),
    ("rows past the last offset are NaN", [100, 0, 250], 1024, 128, "mxfp8", {"pad": 77}),
    ("E5M2", [200, 0, 300, 57], 1408, 128, ("mxfp8", {"fmt": "e5m2"}), {}),
    ("floor scales", [200, 0, 300, 57], 1408, 128, E4M3_FLOOR, {}),
    ("E5M2 with floor scales", [200, 0, 300, 57], 1408, 128, (E4M3_FLOOR, {"fmt": "e5m2"}), {}),
    ("K=40 (one partial k-tile)", [100, 0, 257, 31], 40, 64, "mxfp8", {}),
    ("N=40 (the dgrad's partial k-tile)", [100, 0, 257, 31], 64, 40, "mxfp8", {}),
    ("K=8", [50, 70], 8, 16, "mxfp8", {}),
    ("N=8", [50, 70], 16, 8, "mxfp8", {}),
    ("K=1416 N=136", [300, 17, 0, 333], 1416, 136, "mxfp8", {}),
    ("E=300, 100 tokens each", [100] * 300, 512, 128, "mxfp8", {}),
    ("int64 offsets", [162, 0, 257, 446, 0, 83], 1408, 64, "mxfp8", {"offs64": True}),
    ("every expert empty, rows past the end", [0, 0, 0, 0], 256, 64, "mxfp8", {"pad": 50}),
    ("misaligned weight: declined", [100, 200], 256, 64, "mxfp8", {"misalign": True, "expect": False}),
    ("N=33: declined", [100, 200], 256, 33, "mxfp8", {"expect": False}),
    ("T=0: declined", [0, 0, 0], 256, 64, "mxfp8", {"expect": False}),
    ("float32 weights: declined", [100, 200], 256, 64, "mxfp8", {"wdtype": torch.float32, "expect": False}),
    ("1000 tokens per expert: dgrad only", [1000, 1000], 256, 64, "mxfp8", {"expect": False, "expect_dgrad": True}),
    ("1200 tokens per expert: declined", [1200, 1200], 256, 64, "mxfp8", {"expect": False}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bit_equal_to_the_weight_pass_path(case, monkeypatch, calls):
    _, sizes, K, N, recipe_spec, extra = case
    recipe = get_recipe(recipe_spec) if isinstance(recipe_spec, str) else get_recipe(recipe_spec[0], **recipe_spec[1])
    if (recipe.fmt.value, recipe.scale_mode.value) != DEFAULT_BUILD:
        why = unavailable(recipe.fmt.value, recipe.scale_mode.value)
        if why:
            pytest.skip(why)
    pad, wdtype = extra.get("pad", 0), extra.get("wdtype", torch.bfloat16)
    expect = extra.get("expect", True)
    expect_dgrad = extra.get("expect_dgrad", expect)
    gen = torch.Generator(DEV).manual_seed(0)
    E, T = len(sizes), sum(sizes) + pad
    x = torch.randn(T, K, device=DEV, generator=gen).to(torch.bfloat16)
    if pad:
        x[T - pad:] = float("nan")  # rows past the last offset: never read
    w = (torch.randn(E, N, K, device=DEV, generator=gen) * 0.05).to(wdtype)
    if extra.get("misalign"):  # contiguous, but 2 bytes past a 16-byte boundary
        buf = torch.empty(w.numel() + 1, device=DEV, dtype=wdtype)
        buf[1:].copy_(w.flatten())
        w = buf[1:].view(E, N, K)
    offsets = torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int64 if extra.get("offs64") else torch.int32)
    og, dxg, dwg, ran = run(x, w, offsets, recipe, True, monkeypatch, calls)
    oa, dxa, dwa, _ = run(x, w, offsets, recipe, False, monkeypatch, calls)
    assert ran == (expect, expect_dgrad), f"CUTLASS (forward, dgrad) ran {ran}, expected {(expect, expect_dgrad)}"
    assert same(og, oa), "outputs differ from the weight-pass path"
    assert same(dxg, dxa), "input gradients differ from the weight-pass path"
    assert same(dwg.to(torch.bfloat16), dwa.to(torch.bfloat16)), "weight gradients differ"
    if pad:
        assert bool((og[T - pad:] == 0).all()) and bool((dxg[T - pad:] == 0).all()), "rows past the end not zero"


def _graph_inputs(sizes, gen):
    x = torch.randn(sum(sizes), 2048, device=DEV, dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(sum(sizes), 1408, device=DEV, dtype=torch.bfloat16, generator=gen)
    return x, dy, torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)


def test_cuda_graph_replay(monkeypatch, calls):
    """Forward and dgrad captured after one eager call of the shape, replayed: equal to eager."""
    r = get_recipe("mxfp8")
    gen = torch.Generator(DEV).manual_seed(2)
    w = (torch.randn(4, 1408, 2048, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    x, dy, offsets = _graph_inputs([250, 0, 310, 180], gen)
    eager, eager_dx = mx_grouped_mm(x, w, offsets, r), mx_grouped_mm_dgrad(dy, w, offsets, r)
    graph = torch.cuda.CUDAGraph()
    before = dict(calls)
    with torch.cuda.graph(graph):
        static, static_dx = mx_grouped_mm(x, w, offsets, r), mx_grouped_mm_dgrad(dy, w, offsets, r)
    graph.replay()
    torch.cuda.synchronize()
    assert calls["fwd"] > before["fwd"] and calls["dgrad"] > before["dgrad"], "CUTLASS did not run in the capture"
    assert same(static, eager) and same(static_dx, eager_dx)


def _table_kernel_variants() -> int | None:
    """Compiled variants of the argument tables' Triton kernel (None: another Triton's cache layout)."""
    from mxmoe.kernels import group_tables

    try:
        return sum(len(c[0]) for c in group_tables._group_tables_kernel.device_caches.values())
    except (AttributeError, TypeError, IndexError, KeyError):
        return None


def test_cuda_graph_capture_at_a_new_token_count(monkeypatch, calls):
    """A capture at a token count never run eagerly (768; 740 above is not a multiple of 16),
    with a weight shape run before: the CUTLASS GEMMs run in the graph (their per-shape
    allocations exist), equal eager, and the argument tables' kernel compiles no new variant
    inside the capture (it has no value specialization)."""
    r = get_recipe("mxfp8")
    gen = torch.Generator(DEV).manual_seed(3)
    w = (torch.randn(4, 1408, 2048, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    x, dy, offsets = _graph_inputs([250, 0, 310, 180], gen)
    mx_grouped_mm(x, w, offsets, r), mx_grouped_mm_dgrad(dy, w, offsets, r)  # the weight shape, once eagerly
    x2, dy2, offsets2 = _graph_inputs([256, 0, 320, 192], gen)
    compiled = _table_kernel_variants()
    graph = torch.cuda.CUDAGraph()
    before = dict(calls)
    with torch.cuda.graph(graph):
        static, static_dx = mx_grouped_mm(x2, w, offsets2, r), mx_grouped_mm_dgrad(dy2, w, offsets2, r)
    graph.replay()
    torch.cuda.synchronize()
    assert calls["fwd"] > before["fwd"] and calls["dgrad"] > before["dgrad"], "CUTLASS did not run in the capture"
    if compiled is not None:
        assert _table_kernel_variants() == compiled, "the tables kernel compiled a new variant inside the capture"
    assert same(static, mx_grouped_mm(x2, w, offsets2, r)) and same(static_dx, mx_grouped_mm_dgrad(dy2, w, offsets2, r))
