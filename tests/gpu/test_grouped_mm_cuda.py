"""``mx_grouped_mm`` on the GPU at model shapes: forward, dgrad and wgrad, in whatever
implementation :func:`mxmoe.ops.backend.grouped_gemm_backend` picks there.

tests/ops cover the edge cases at small shapes on the CPU; here, per recipe and case:

- out / dx / dw against float64 products of the same quantized operands (quantized with
  the pure-torch reference, each operand along its own contraction dimension, the wgrad
  operands along each expert's own tokens), on sampled rows and experts, entry by entry:
  |got - ref| <= 2 K 2^-24 (|A| |B|) + 2^-8 |ref| (float32 accumulation, one bfloat16
  rounding of the result);
- no NaN / inf in out, dx, dw although rows past the last offset hold NaN / inf; those
  rows' out and dx exactly 0; dW of experts with no tokens exactly 0;
- bitwise determinism across two runs;
- no host synchronization in forward + backward (``torch.cuda.set_sync_debug_mode("error")``
  after a warm-up run);
- CUDA-graph capture of forward + backward, replayed on new values, bitwise equal to eager.
"""

from __future__ import annotations

import pytest
import torch

from mxmoe import get_recipe, mx_grouped_mm, quantize_mx

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = torch.device("cuda")
GARBAGE_ROWS = 64  # rows past the last offset, filled with NaN / inf / 3e38


def routed_sizes(T: int, E: int, kind: str, seed: int) -> list[int]:
    """Tokens per expert. "uniform": multinomial over E experts, with expert 1 emptied into
    expert 0 (an empty expert at scale); "skewed": a quarter of the experts draw 70% of the
    tokens."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "skewed":
        hot = max(E // 4, 1)
        p = torch.cat([torch.full((hot,), 0.7 / hot), torch.full((E - hot,), 0.3 / max(E - hot, 1))])
    else:
        p = torch.full((E,), 1.0 / E)
    sizes = torch.bincount(torch.multinomial(p, T, replacement=True, generator=gen), minlength=E).tolist()
    if kind == "uniform" and E > 1:
        sizes[0] += sizes[1]
        sizes[1] = 0
    return sizes


def one_hot_sizes(E: int, used: dict[int, int]) -> list[int]:
    sizes = [0] * E
    for e, n in used.items():
        sizes[e] = n
    return sizes


# (name, group sizes, K, N)
CASES = [
    ("(32768, 4096, 2048, 16) uniform", routed_sizes(32768, 16, "uniform", 0), 4096, 2048),
    ("(65536, 7168, 2048, 64) uniform", routed_sizes(65536, 64, "uniform", 1), 7168, 2048),
    ("(16384, 2048, 1408, 64) uniform", routed_sizes(16384, 64, "uniform", 2), 2048, 1408),
    ("(32768, 4096, 2048, 64) skewed", routed_sizes(32768, 64, "skewed", 3), 4096, 2048),
    ("sizes [162,0,2577,446,0,83] K=2880 N=2048", [162, 0, 2577, 446, 0, 83], 2880, 2048),
    ("16384 tokens on one expert of 8, K=1408 N=2048", one_hot_sizes(8, {5: 16384}), 1408, 2048),
    ("33 experts, K=2048 N=1408", routed_sizes(8192, 33, "uniform", 4), 2048, 1408),
    ("128 experts skewed, K=2048 N=1024", routed_sizes(8192, 128, "skewed", 5), 2048, 1024),
    ("256 experts, 37 used, K=1408 N=512", one_hot_sizes(256, {e: 17 * e + 1 for e in range(0, 256, 7)}), 1408, 512),
    ("T=0, 16 experts", [0] * 16, 2048, 1408),
    ("N=33, K=4096, 16 experts", routed_sizes(16384, 16, "uniform", 6), 4096, 33),
    ("K=1408 N=2048, 64 experts", routed_sizes(16384, 64, "uniform", 7), 1408, 2048),
    ("K=2880 N=2880, 32 experts", routed_sizes(16384, 32, "uniform", 8), 2880, 2880),
]


def octaves(n: int, step: int) -> torch.Tensor:
    """2^k with k cycling over -4..4: magnitudes that vary along an axis."""
    return torch.exp2((torch.arange(n, device=DEV) * step % 9 - 4).float())


def spread(rows: int, cols: int, gen) -> torch.Tensor:
    """Gaussian values scaled by octaves along both axes: an operand blocked along the wrong
    axis would get other scales (with plain Gaussian data every block gets the same)."""
    return torch.randn(rows, cols, generator=gen, device=DEV) * octaves(rows, 7).view(-1, 1) * octaves(cols, 5)


def make_inputs(sizes, K, N, seed):
    T = sum(sizes)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    pattern = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38], device=DEV)
    x = torch.empty(T + GARBAGE_ROWS, K, device=DEV, dtype=torch.bfloat16)
    dy = torch.empty(T + GARBAGE_ROWS, N, device=DEV, dtype=torch.bfloat16)
    x[:T] = spread(T, K, gen)
    dy[:T] = spread(T, N, gen)
    x[T:] = pattern.repeat(GARBAGE_ROWS * K // 4 + 1)[: GARBAGE_ROWS * K].view(GARBAGE_ROWS, K)
    dy[T:] = pattern.repeat(GARBAGE_ROWS * N // 4 + 1)[: GARBAGE_ROWS * N].view(GARBAGE_ROWS, N)
    w = torch.stack([spread(N, K, gen) for _ in sizes]) / 16
    offsets = torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)
    return x, w, dy, offsets


def fwd_bwd(x, w, dy, offsets, recipe):
    xg = x.detach().requires_grad_(True)
    wg = w.detach().requires_grad_(True)
    y = mx_grouped_mm(xg, wg, offsets, recipe)
    y.backward(dy)
    return y.detach(), xg.grad, wg.grad


def qdq64(t: torch.Tensor, dim: int, recipe) -> torch.Tensor:
    """The operand as the recipe feeds it to the GEMM, in float64 (reference quantizer, zero
    padded to 32 along ``dim``; bf16 recipe: rounded to bfloat16)."""
    if not recipe.quantize:
        return t.to(torch.bfloat16).double()
    mx = quantize_mx(t.float(), recipe.fmt, dim=dim, scale_mode=recipe.scale_mode, pad=True, backend="reference")
    return mx.dequantize(torch.float32).double()


def within(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    """got vs a @ b (float64): float32 accumulation over K plus one bfloat16 rounding."""
    ref = a @ b
    bound = 2 * a.shape[-1] * 2.0**-24 * (a.abs() @ b.abs()) + 2.0**-8 * ref.abs()
    err = (got.double() - ref).abs()
    ratio = (err / bound.clamp_min(1e-300)).max().item() if err.numel() else 0.0
    return bool((err <= bound).all()), ratio


def value_failures(sizes, x, w, dy, y, dx, dw, recipe, rng) -> list[str]:
    failed = []
    T = sum(sizes)
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    nonempty = [e for e, n in enumerate(sizes) if n]
    for e in nonempty:  # 4 sampled rows per expert: first, last, two at random
        s, t = starts[e], starts[e + 1]
        rows = torch.tensor(sorted({s, t - 1, *torch.randint(s, t, (2,), generator=rng).tolist()}), device=DEV)
        ok, r = within(y[rows], qdq64(x[rows], 1, recipe), qdq64(w[e], 1, recipe).t())
        if not ok:
            failed.append(f"out of expert {e} ({r:.2f} of the bound)")
        ok, r = within(dx[rows], qdq64(dy[rows], 1, recipe), qdq64(w[e], 0, recipe))
        if not ok:
            failed.append(f"dx of expert {e} ({r:.2f} of the bound)")
    # dw: the largest, the smallest and one random non-empty expert, each on its own tokens
    picks = set()
    if nonempty:
        picks = {max(nonempty, key=lambda e: sizes[e]), min(nonempty, key=lambda e: sizes[e]),
                 nonempty[int(torch.randint(len(nonempty), (1,), generator=rng))]}
    for e in sorted(picks):
        s, t = starts[e], starts[e + 1]
        ok, r = within(dw[e], qdq64(dy[s:t], 0, recipe).t(), qdq64(x[s:t], 0, recipe))
        if not ok:
            failed.append(f"dw of expert {e} ({r:.2f} of the bound)")
    if not all(bool((dw[e] == 0).all()) for e, n in enumerate(sizes) if n == 0):
        failed.append("dw of an empty expert is not exactly 0")
    if not (bool((y[T:] == 0).all()) and bool((dx[T:] == 0).all())):
        failed.append("out or dx not exactly 0 past the last offset")
    if not all(bool(torch.isfinite(t).all()) for t in (y, dx, dw)):
        failed.append("NaN / inf in out, dx or dw")
    return failed


def no_sync_failure(x, w, dy, offsets, recipe) -> str | None:
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        fwd_bwd(x, w, dy, offsets, recipe)
        return None
    except RuntimeError as ex:
        return f"host synchronization in forward + backward: {str(ex).splitlines()[0][:200]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def graph_failure(x, w, dy, offsets, recipe) -> str | None:
    """Capture forward + backward once, replay on new values, compare with eager."""
    sx, sw, sdy, soffs = x.clone().requires_grad_(True), w.clone().requires_grad_(True), dy.clone(), offsets.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graphs asks
        for _ in range(2):
            sx.grad = sw.grad = None
            mx_grouped_mm(sx, sw, soffs, recipe).backward(sdy)
    torch.cuda.current_stream().wait_stream(stream)
    sx.grad = sw.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sy = mx_grouped_mm(sx, sw, soffs, recipe)
        sy.backward(sdy)
    gen = torch.Generator(device=DEV).manual_seed(1234)  # new values in the same buffers, same routing
    with torch.no_grad():
        T = int(offsets[-1]) if offsets.numel() else 0
        sx[:T].copy_(torch.randn(T, x.shape[1], generator=gen, device=DEV))
        sw.copy_(torch.randn(w.shape, generator=gen, device=DEV) / 16)
        sdy[:T].copy_(torch.randn(T, dy.shape[1], generator=gen, device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    ey, edx, edw = fwd_bwd(sx.detach(), sw.detach(), sdy, soffs, recipe)
    if torch.equal(sy, ey) and torch.equal(sx.grad, edx) and torch.equal(sw.grad, edw):
        return None
    return "CUDA-graph replay differs from eager"


# Every case for both recipes, the bf16 recipe with N = 33 included: its wgrad operands
# are padded with the tokens as the outer dimension (ops.gemm.grouped_mm_tn), since
# torch._grouped_mm asserts on the device when token groups lie along the contiguous
# dimension with sizes that are not 16-byte aligned (torch 2.11, H200).


def _params():
    for recipe_name in ("mxfp8", "bf16"):
        for case in CASES:
            yield pytest.param(recipe_name, case, id=f"{recipe_name}-{case[0]}")


@pytest.mark.parametrize("recipe_name,case", list(_params()))
def test_grouped_mm_on_gpu(recipe_name, case):
    name, sizes, K, N = case
    recipe = get_recipe(recipe_name)
    rng = torch.Generator().manual_seed(0)
    x, w, dy, offsets = make_inputs(sizes, K, N, seed=sum(sizes) + K + N)
    y, dx, dw = fwd_bwd(x, w, dy, offsets, recipe)
    y2, dx2, dw2 = fwd_bwd(x, w, dy, offsets, recipe)
    failed = [] if (torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(dw, dw2)) else \
        ["not bitwise deterministic across two runs"]
    del y2, dx2, dw2
    failed += value_failures(sizes, x, w, dy, y, dx, dw, recipe, rng)
    del y, dx, dw
    failed += [f for f in (no_sync_failure(x, w, dy, offsets, recipe), graph_failure(x, w, dy, offsets, recipe)) if f]
    torch.cuda.empty_cache()
    assert not failed, f"[{recipe_name}] {name}: {failed}"
