"""Edge cases of ``mx_grouped_mm`` seen in public reports of other MoE libraries, forward
and backward, under the bf16 and mxfp8 recipes, on the pure-torch reference path and on
the Triton quantizers (run by the Triton interpreter without a GPU; tests/conftest.py).

Each case is checked three ways:
- against float64 products of the same quantized operands (each expert on its own,
  wgrad operands blocked along that expert's tokens): agreement to float32 rounding,
  |out - ref| <= 2 K 2^-24 (|A| |B|) entry by entry (Higham's bound for a float32 dot
  product of length K is K u |A||B| with u = 2^-24; factor 2 of headroom), see
  ``test_ops.Product``;
- against unquantized float64 with the SQNR floors of ``test_ops.SQNR_FLOOR_DB`` (one
  table; the edge cases measure above it, see the comment there);
- structurally: rows past the last offset hold NaN / inf garbage that must never be read
  (outputs and input grads there exactly 0), no NaN anywhere, dW of empty experts exactly 0.

tests/gpu/test_grouped_mm_cuda.py runs the same cases at model shapes on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from mxmoe import get_recipe, mx_grouped_mm
from test_ops import SQNR_FLOOR_DB, Product, expert_products, qdq64, sqnr_db


def _cpu_triton_or_skip() -> None:
    """These cases build CPU tensors: the Triton backend then needs the interpreter (the
    suite sets it on machines without a GPU). On the GPU, tests/gpu/test_grouped_mm_cuda.py
    runs the same cases with CUDA tensors."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors on the Triton backend need TRITON_INTERPRET=1 (GPU: tests/gpu/test_grouped_mm_cuda.py)")


def spread_sizes(E: int, used: list[int], tokens: list[int]) -> list[int]:
    """E experts, all empty except ``used[i]`` which gets ``tokens[i]``."""
    sizes = [0] * E
    for e, n in zip(used, tokens):
        sizes[e] = n
    return sizes


# name: (group sizes, K, N, garbage rows past the last offset)
EDGE_CASES = {
    # the group sizes: uneven, two empty experts, none a multiple of 32
    "issue_sizes_with_empty": ([162, 0, 2577, 446, 0, 83], 64, 40, 7),
    # every token routed to one expert (the others empty, including the first and last)
    "all_tokens_one_expert": ([0, 0, 517, 0], 96, 48, 3),
    # 33 experts: not a power of two, most empty, the last one used
    "33_experts_mostly_empty": (spread_sizes(33, [1, 7, 32], [45, 1, 70]), 64, 32, 2),
    # 64 experts, a single token in several of them (a 32-block holding one token)
    "64_experts_single_tokens": (spread_sizes(64, [0, 5, 6, 40, 63], [1, 1, 33, 1, 64]), 64, 32, 1),
    # 128 experts, three used
    "128_experts_three_used": (spread_sizes(128, [3, 64, 100], [31, 96, 65]), 32, 48, 4),
    # 256 experts, four used (first and last among them)
    "256_experts_four_used": (spread_sizes(256, [0, 17, 200, 255], [40, 2, 90, 27]), 32, 32, 0),
    # T = 0 tokens routed, but garbage rows present: nothing may be read
    "no_tokens_only_garbage": ([0, 0, 0], 64, 32, 5),
    # N = 33: output rows not 16-byte aligned, a 2-element tail block in dgrad
    "n_33": ([50, 0, 77], 64, 33, 2),
    # K = 1408 (44 blocks; DeepSeek-style expert width)
    "k_1408": ([40, 0, 57], 1408, 32, 2),
    # K = 2880 (90 blocks; gpt-oss width)
    "k_2880": ([21, 0, 44], 2880, 33, 2),
}
# Cases small enough for the Triton interpreter (tens of seconds in all on two cores).
TRITON_CASES = ["all_tokens_one_expert", "33_experts_mostly_empty", "256_experts_four_used",
                "no_tokens_only_garbage", "n_33", "k_2880"]


def garbage(rows: int, cols: int) -> torch.Tensor:
    """NaN, +-inf and 3e38 in turn: whatever a caller leaves past the last offset."""
    pattern = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38])
    return pattern.repeat(rows * cols // 4 + 1)[: rows * cols].view(rows, cols)


def octave_both(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Gaussian values scaled by 2^k along both axes (k over -4..4). With plain Gaussian
    data nearly every 32-block gets the same scale, so an operand blocked along the wrong
    axis (or across two experts) would agree with the reference anyway; not here."""
    x = torch.randn(rows, cols, generator=gen)
    r = torch.exp2((torch.arange(rows) * 7 % 9 - 4).float()).view(-1, 1)
    c = torch.exp2((torch.arange(cols) * 5 % 9 - 4).float()).view(1, -1)
    return x * r * c


def make_case(name: str, dtype=torch.float32, spread: bool = True):
    """Inputs of an edge case: octave-spread values (``spread``, for the agreement checks)
    or plain Gaussian ones (for the SQNR floors, which were measured on Gaussian data)."""
    sizes, K, N, extra = EDGE_CASES[name]
    T = sum(sizes)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    values = octave_both if spread else (lambda r, c, g: torch.randn(r, c, generator=g))
    x = torch.cat([values(T, K, gen), garbage(extra, K)]).to(dtype)
    w = torch.stack([values(N, K, gen) for _ in sizes]) / 8
    dy = torch.cat([values(T, N, gen), garbage(extra, N)]).to(dtype)
    offsets = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    return sizes, x, w, dy, offsets


def run(x, w, dy, offsets, recipe):
    xg = x.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    y = mx_grouped_mm(xg, wg, offsets, recipe)
    y.backward(dy)
    return y.detach(), xg.grad, wg.grad


def same_operand_products(x, w, dy, sizes, recipe):
    """Per-expert float64 products of the operands the recipe feeds the GEMMs, quantized by
    hand (test_ops.qdq64): lists (rows, Product) for out and dx, one Product or None
    (empty expert) per expert for dw."""
    if recipe.quantize:
        mode = recipe.scale_mode.value
        xa, dya = qdq64(x, 1, mode), qdq64(dy, 1, mode)
        w_k = lambda e: qdq64(w[e], 1, mode)  # noqa: E731  along K (forward)
        w_n = lambda e: qdq64(w[e], 0, mode)  # noqa: E731  along N (dgrad)
        tok = lambda t: qdq64(t, 0, mode)  # noqa: E731  along this expert's tokens (wgrad)
    else:  # bf16 operands, float32 accumulation
        bf = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
        xa, dya = bf(x), bf(dy)
        w_k = w_n = lambda e: bf(w[e])  # noqa: E731
        tok = bf
    return expert_products(xa, dya, w_k, w_n, lambda rows: Product(tok(dy[rows]).t(), tok(x[rows])), sizes)


def check_structure(sizes, y, dx, dw, K, N):
    T = sum(sizes)
    extra = y.shape[0] - T
    assert torch.equal(y[T:], torch.zeros(extra, N, dtype=y.dtype)), "rows past the last offset must be 0"
    assert torch.equal(dx[T:], torch.zeros(extra, K, dtype=dx.dtype)), "their input grads must be 0"
    for t in (y, dx, dw):
        assert not torch.isnan(t).any() and not torch.isinf(t).any()
    for e, n in enumerate(sizes):
        if n == 0:
            assert torch.equal(dw[e], torch.zeros(N, K)), f"expert {e} has no tokens: its dW must be exactly 0"


# Unit roundoff of the GEMM's output dtype: the bf16 recipe runs its GEMMs in bfloat16
# (float32 accumulation, bfloat16 result, as a bf16 tensor-core GEMM does), so its out, dx
# and dw carry one bfloat16 rounding (8 significant bits); mxfp8 GEMMs on float32
# activations return float32.
OUTPUT_ROUNDING = {"bf16": 2.0**-8, "mxfp8": 0.0}


def agrees(p: Product, got: torch.Tensor, out_rounding: float) -> bool:
    """Higham's float32 bound of test_ops.Product plus one rounding of the result."""
    err = (got.double() - p.value).abs()
    return bool((err <= 2 * p.k * 2.0**-24 * p.scale + out_rounding * p.value.abs()).all())


def check_against_products(sizes, x, w, dy, y, dx, dw, recipe):
    T = sum(sizes)
    u = OUTPUT_ROUNDING[recipe.name]
    ys, dxs, dws = same_operand_products(x[:T], w, dy[:T], sizes, recipe)
    for rows, p in ys:
        assert agrees(p, y[rows], u), f"out rows {rows}: {p.max_ulps_off(y[rows]):.0f} ulps"
    for rows, p in dxs:
        assert agrees(p, dx[rows], u), f"dx rows {rows}: {p.max_ulps_off(dx[rows]):.0f} ulps"
    for e, p in enumerate(dws):
        if p is not None:
            assert agrees(p, dw[e], u), f"dw[{e}]: {p.max_ulps_off(dw[e]):.0f} ulps"


def sqnr_against_unquantized(sizes, x, w, dy, y, dx, dw):
    """SQNR in dB of out, dx and dw against the float64 GEMMs of the unquantized inputs."""
    T = sum(sizes)
    ref_y, ref_dx, ref_dw = [], [], []
    start = 0
    for e, n in enumerate(sizes):
        xe, dye = x[start:start + n].double(), dy[start:start + n].double()
        start += n
        ref_y.append(xe @ w[e].double().t())
        ref_dx.append(dye @ w[e].double())
        ref_dw.append(dye.t() @ xe)
    return {
        "out": sqnr_db(torch.cat(ref_y), y[:T]),
        "dx": sqnr_db(torch.cat(ref_dx), dx[:T]),
        "dw": sqnr_db(torch.stack(ref_dw), dw),
    }


MIN_TOKENS_FOR_SQNR = 64  # below this the SQNR of a few dozen values is too noisy for a floor


@pytest.mark.parametrize("name", list(EDGE_CASES))
@pytest.mark.parametrize("recipe_name", ["bf16", "mxfp8"])
def test_edge_case_reference(name, recipe_name):
    sizes, x, w, dy, offsets = make_case(name)
    recipe = get_recipe(recipe_name, backend="reference")
    y, dx, dw = run(x, w, dy, offsets, recipe)
    K, N = x.shape[1], w.shape[1]
    assert y.shape == (x.shape[0], N) and dx.shape == x.shape and dw.shape == w.shape
    check_structure(sizes, y, dx, dw, K, N)
    check_against_products(sizes, x, w, dy, y, dx, dw, recipe)
    if sum(sizes) >= MIN_TOKENS_FOR_SQNR:
        sizes, x, w, dy, offsets = make_case(name, spread=False)
        y, dx, dw = run(x, w, dy, offsets, recipe)
        check_structure(sizes, y, dx, dw, K, N)
        got = sqnr_against_unquantized(sizes, x, w, dy, y, dx, dw)
        for tensor, db in got.items():
            floor = SQNR_FLOOR_DB[(recipe_name, tensor)]
            assert db >= floor, f"{tensor}: {db:.1f} dB < {floor} dB"


@pytest.mark.parametrize("name", TRITON_CASES)
def test_edge_case_triton_quantizers(name):
    """The Triton quantizers (interpreter on the CPU) give the same bytes as the reference,
    so the whole op is bit-identical between the two backends, edges included."""
    _cpu_triton_or_skip()
    sizes, x, w, dy, offsets = make_case(name)
    got = run(x, w, dy, offsets, get_recipe("mxfp8", backend="triton"))
    want = run(x, w, dy, offsets, get_recipe("mxfp8", backend="reference"))
    check_structure(sizes, *got, x.shape[1], w.shape[1])
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bf16_activations_with_garbage_rows(backend):
    """bfloat16 activations (the model's dtype) with NaN / inf garbage past the last offset
    and empty experts: zeros there, no NaN, empty experts' dW exactly 0, and the values
    match the float32 run of the same bf16 inputs to bf16 rounding of the output."""
    if backend == "triton":
        _cpu_triton_or_skip()
    sizes, x, w, dy, offsets = make_case("n_33", dtype=torch.bfloat16)
    recipe = get_recipe("mxfp8", backend=backend)
    y, dx, dw = run(x, w, dy, offsets, recipe)
    assert y.dtype == dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    check_structure(sizes, y, dx, dw, x.shape[1], w.shape[1])
    T = sum(sizes)
    y32, dx32, _ = run(x.float(), w, dy.float(), offsets, recipe)
    for a, b in ((y[:T], y32[:T]), (dx[:T], dx32[:T])):
        assert torch.allclose(a.float(), b, rtol=2.0**-7, atol=1e-6)


def test_offsets_past_rows_are_the_callers_contract():
    """All rows belong to experts (offsets[-1] == T): nothing is zeroed, nothing dropped
    (the no-garbage counterpart of the cases above)."""
    sizes, x, w, dy, offsets = make_case("n_33")
    T = sum(sizes)
    y, dx, dw = run(x[:T], w, dy[:T], offsets, get_recipe("mxfp8", backend="reference"))
    ys, dxs, _ = same_operand_products(x[:T], w, dy[:T], sizes, get_recipe("mxfp8"))
    assert all(p.agrees(y[rows]) for rows, p in ys) and all(p.agrees(dx[rows]) for rows, p in dxs)


@pytest.mark.parametrize("K,N", [(1, 8), (8, 1), (1, 1), (3, 5)])  # a size-1 dim has stride 1 too
@pytest.mark.parametrize("recipe_name", ["bf16", "mxfp8"])
def test_size_one_and_odd_widths(K, N, recipe_name):
    """K or N of 1 (a (T, 1) operand has strides (1, 1): its row stride must still meet
    torch._grouped_mm's 16-byte rule, so it is zero padded), and odd widths."""
    from mxmoe import mx_grouped_mm
    from mxmoe.recipe import get_recipe

    g = torch.Generator().manual_seed(K * 10 + N)
    sizes = [5, 0, 7]
    x = torch.randn(12, K, generator=g).bfloat16().requires_grad_(True)
    w = torch.randn(3, N, K, generator=g).requires_grad_(True)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    y = mx_grouped_mm(x, w, offs, get_recipe(recipe_name, backend="reference"))
    y.float().sum().backward()
    assert y.shape == (12, N) and torch.isfinite(y.float()).all()
    assert torch.isfinite(x.grad.float()).all() and torch.all(w.grad[1] == 0)
    if recipe_name == "bf16":  # against a per-expert loop in float32 on the bf16 operands
        want = torch.cat([x[:5].float() @ w[0].bfloat16().float().t(), x[5:12].float() @ w[2].bfloat16().float().t()])
        assert torch.allclose(y.float(), want, rtol=2**-7, atol=1e-6)


def test_padded_layout_gives_an_empty_expert_one_zero_block():
    """The per-expert padded token layout (numerics.grouped): ceil(n / 32) blocks per
    expert and one for an expert without tokens, within the bound 32 (T // 32 + E); the
    Blackwell 128-row scale groups keep 0 rows for an empty group (empty_block=False)."""
    from mxmoe.numerics.grouped import padded_group_layout

    sizes = [0, 1, 32, 33, 0, 0, 64]
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    T = sum(sizes) + 5
    starts, padded, Tp = padded_group_layout(offsets, T)
    blocks = [max(1, -(-n // 32)) for n in sizes]
    assert torch.diff(starts).tolist() == blocks and padded.tolist() == (32 * torch.tensor(blocks).cumsum(0)).tolist()
    assert int(padded[-1]) <= Tp == 32 * (T // 32 + len(sizes))
    starts128, padded128, _ = padded_group_layout(offsets, T, 128, empty_block=False)
    assert torch.diff(starts128).tolist() == [-(-n // 128) for n in sizes]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_experts_dw_is_zero_from_the_gemm_itself(backend, monkeypatch):
    """The MXFP8 wgrad runs on the padded layout with nonempty_groups=True: no zeroing pass
    runs after the GEMM (it is made to fail here), yet the empty experts' dW is exactly 0,
    because their one block of zeros is part of the GEMM; a leftover value in the output
    buffer cannot survive (the GEMM writes every expert's matrix)."""
    if backend == "triton":
        _cpu_triton_or_skip()
    from mxmoe.ops import gemm

    def no_zeroing(*args, **kwargs):
        raise AssertionError("the padded wgrad must not need a zeroing pass")

    monkeypatch.setattr("mxmoe.kernels.grouped_zero_fill.zero_empty_groups_", no_zeroing, raising=False)
    real_new_empty = torch.Tensor.new_empty

    def garbage_new_empty(self, *shape, **kw):  # fresh float buffers hold NaN, not the allocator's zeros
        t = real_new_empty(self, *shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty", garbage_new_empty)
    sizes = [162, 0, 257, 46, 0, 83]
    E, K, N = len(sizes), 64, 40
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), K, requires_grad=True)
    w = torch.randn(E, N, K, requires_grad=True)
    seen = []
    real_tn = gemm.grouped_mm_tn
    monkeypatch.setattr("mxmoe.ops.grouped_mm.grouped_mm_tn",
                        lambda *a, **k: seen.append(k.get("nonempty_groups")) or real_tn(*a, **k))
    mx_grouped_mm(x, w, offsets, get_recipe("mxfp8", backend=backend)).square().sum().backward()
    assert seen == [True]
    for e in (1, 4):
        assert torch.equal(w.grad[e], torch.zeros(N, K))
    assert torch.isfinite(w.grad).all() and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("L, ends", [
    (136, [50, 50, 127]),  # last group ends off a multiple of 8, inside the padded length
    (128, [33, 97, 120]),
    (129, [64, 128]),
    (24, [8, 20]),
    (40, [0, 0, 0]),  # no tokens at all
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wgrad_never_reads_past_the_last_offset(L, ends, dtype):
    """Columns past offsets[-1] hold NaN / inf: the grouped wgrad GEMM must not read them
    (torch 2.13's CPU torch._grouped_mm did for the last group: every such case)."""
    from mxmoe.ops.gemm import grouped_mm_tn

    gen = torch.Generator().manual_seed(L)
    a = torch.randn(40, L, generator=gen).to(dtype)
    b = torch.randn(64, L, generator=gen).to(dtype)
    a[:, ends[-1]:] = float("nan")
    b[:, ends[-1]:] = float("inf")
    out = grouped_mm_tn(a, b, torch.tensor(ends, dtype=torch.int32)).double()
    start = 0
    for e, end in enumerate(ends):
        want = a[:, start:end].double() @ b[:, start:end].double().t()
        tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
        assert torch.isfinite(out[e]).all()
        assert torch.allclose(out[e], want, rtol=tol, atol=tol * (want.abs().max().item() + 1)), e
        start = end


@pytest.mark.parametrize("L, ends", [(40, [21, 40]), (40, [16, 33]), (24, [8, 24]), (129, [64, 128])])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wgrad_never_reads_past_a_narrow_operand(L, ends, dtype):
    """Operands with tokens as the contiguous dim, views of wider buffers filled with NaN:
    the wgrad GEMM reads only the view (torch 2.13's CPU torch._grouped_mm read past it)."""
    from mxmoe.ops.gemm import grouped_mm_tn

    gen = torch.Generator().manual_seed(L + len(ends))
    wide_a = torch.full((40, L + 8), float("nan"), dtype=dtype)
    wide_b = torch.full((64, L + 8), float("inf"), dtype=dtype)
    wide_a[:, :L] = torch.randn(40, L, generator=gen).to(dtype)
    wide_b[:, :L] = torch.randn(64, L, generator=gen).to(dtype)
    a, b = wide_a[:, :L], wide_b[:, :L]
    out = grouped_mm_tn(a, b, torch.tensor(ends, dtype=torch.int32)).double()
    start = 0
    for e, end in enumerate(ends):
        want = a[:, start:end].double() @ b[:, start:end].double().t()
        tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
        assert torch.isfinite(out[e]).all(), e
        assert torch.allclose(out[e], want, rtol=tol, atol=tol * (want.abs().max().item() + 1)), e
        start = end
