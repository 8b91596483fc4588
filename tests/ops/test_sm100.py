"""The sm100 native MXFP8 grouped GEMM path (mxmoe.ops.sm100), checked on the CPU.

No Blackwell GPU is available, so the PyTorch op is replaced by a float64 emulator that
enforces the argument rules the real op has (dtypes, shapes, strides, scale counts and the
per-group blocked scale layouts, as read from the PyTorch and FBGEMM sources cited below)
and computes the product by un-blocking the scales with ``from_blocked_scales``. What it
leaves unwritten on the GPU (rows past the last offset, empty groups, the early exit when
total_M // G == 0) comes back as NaN here, so the wrappers must zero it themselves.

Sources of the rules:
- pytorch aten/src/ATen/native/cuda/GroupedBlas.cpp: ``_scaled_grouped_mm_cuda`` (dims,
  16-divisibility, int32 offsets, bf16 output, transposed mat_b), ``_check_scales_blocked``
  (2-D scale rows >= M / N; 3-D mat_b scale (G, round_up(K/32, 4) * round_up(N, 128))),
  ``_mx8_mx8_bf16_grouped_mm_fbgemm`` (e8m0 scales, SWIZZLE_32_4_4 on CUDA),
  ``_scaled_grouped_mm_cuda_v2`` / ``check_mxfp8_recipe`` (BlockWise1x32, e4m3 data).
- FBGEMM fbgemm_gpu/experimental/gen_ai/src/quantize/mx8mx8bf16_grouped.cu
  ``mx8mx8bf16_grouped_mm`` (XQ row-major, WQ column-major, scales contiguous, M /= G
  early exit) and cutlass_extensions/mx8mx8bf16_grouped/mx8mx8bf16_grouped_common.cuh
  ``set_stacked_kernel_args_kernel`` (per-group scale offsets; 2d-2d group sizes % 16,
  offsets <= total; empty groups not written).
"""

from __future__ import annotations

import pytest
import torch

from mxmoe import from_blocked_scales, get_recipe, to_blocked_scales
from mxmoe.ops import backend, sm100
from test_ops import Product, qdq64

E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
BLOCK = 32


def ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def dequant_rows(q_RK: torch.Tensor, s_RC: torch.Tensor) -> torch.Tensor:
    """float64 values of FP8 codes (R, K) with one E8M0 scale per 32 along K (R, K / 32)."""
    byte = s_RC.view(torch.uint8).to(torch.float64)
    scale = torch.where(byte == 255, float("nan"), torch.exp2(byte - 127))
    return q_RK.to(torch.float64) * scale.repeat_interleave(BLOCK, dim=1)[:, : q_RK.shape[1]]


class ScaledGroupedMMEmulator:
    """Stands in for ``torch._scaled_grouped_mm`` on MXFP8 arguments. Records each call's
    float64 result (before the bf16 cast) in ``last_f64``."""

    def __init__(self):
        self.calls = 0
        self.last_f64 = None

    def __call__(self, mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                 use_fast_accum=False):
        self.calls += 1
        # GroupedBlas.cpp _scaled_grouped_mm_cuda + is_mx8mx8bf16 / check_mxfp8_recipe
        assert mat_a.dtype == E4M3 and mat_b.dtype == E4M3, (mat_a.dtype, mat_b.dtype)
        assert scale_a.dtype == E8M0 and scale_b.dtype == E8M0, (scale_a.dtype, scale_b.dtype)
        assert mat_a.dim() == 2 and mat_b.dim() in (2, 3), "MXFP8 supports 2d-2d and 2d-3d only"
        assert mat_a.is_contiguous(), "XQ must be row major (fbgemm mx8mx8bf16_grouped_mm)"
        assert mat_b.transpose(-2, -1).is_contiguous(), "WQ must be column major (fbgemm mx8mx8bf16_grouped_mm)"
        assert mat_a.size(-1) % 16 == 0, "trailing dimension of mat_a divisible by 16"
        assert mat_b.size(-2) % 16 == 0 and mat_b.size(-1) % 16 == 0, "mat_b shape divisible by 16"
        assert bias is None and scale_result is None
        assert offs is not None and offs.dtype == torch.int32 and offs.dim() == 1 and offs.is_contiguous()
        assert out_dtype in (None, torch.bfloat16), "only bf16 output for grouped gemm"
        assert scale_a.is_contiguous() and scale_b.is_contiguous(), "scales must be contiguous"
        assert scale_a.dim() == 2, "for block-scaled, scale must have the parent's 2 dims"
        ends = offs.tolist()
        assert all(b >= a for a, b in zip([0] + ends, ends)), "offsets non-decreasing"
        G = offs.numel()
        flat_a = scale_a.reshape(-1)
        if mat_b.dim() == 3:
            return self._2d_3d(mat_a, mat_b, flat_a, scale_b, ends, G)
        assert scale_b.dim() == 2
        return self._2d_2d(mat_a, mat_b, flat_a, scale_b.reshape(-1), scale_a.size(0), scale_b.size(0), ends, G)

    def _2d_3d(self, mat_a, mat_b, flat_a, scale_b, ends, G):
        M, K = mat_a.shape
        assert mat_b.size(0) == G and mat_b.size(1) == K, "XQ (total_M, K), WQ (G, K, N)"
        N = mat_b.size(2)
        kc4 = ceil_to(K // BLOCK, 4)
        assert flat_a.numel() // kc4 >= M, "_check_scales_blocked: scale_a rows >= M"
        assert tuple(scale_b.shape) == (G, kc4 * ceil_to(N, 128)), "_check_scales_blocked: 3-D scale shape"
        assert ends[-1] <= M, "group end offsets must be <= M"
        out = torch.full((M, N), float("nan"), dtype=torch.float64)  # at::empty: unwritten rows
        if M // G == 0:  # mx8mx8bf16_grouped_mm: M /= G; if (M == 0) return output_actual
            self.last_f64 = out
            return out.to(torch.bfloat16)
        start, scale_row = 0, 0
        for g, end in enumerate(ends):
            n = end - start
            if n > 0:
                rows = ceil_to(n, 128)
                a_scales = from_blocked_scales(flat_a[scale_row * kc4:(scale_row + rows) * kc4], n, K // BLOCK)
                b_scales = from_blocked_scales(scale_b[g], N, K // BLOCK)
                a = dequant_rows(mat_a[start:end], a_scales)
                b = dequant_rows(mat_b[g].t(), b_scales)  # (N, K)
                out[start:end] = a @ b.t()
                scale_row += rows
            start = end
        self.last_f64 = out
        return out.to(torch.bfloat16)

    def _2d_2d(self, mat_a, mat_b, flat_a, flat_b, rows_a, rows_b, ends, G):
        M, total_K = mat_a.shape
        assert mat_b.size(0) == total_K, "XQ (M, total_K), WQ (total_K, N)"
        N = mat_b.size(1)
        assert rows_a >= M and rows_b >= N, "_check_scales_blocked: scale rows >= M / N"
        assert ends[-1] <= total_K, "group end offsets must be <= K"
        M128, N128 = ceil_to(M, 128), ceil_to(N, 128)
        out = torch.full((G, M, N), float("nan"), dtype=torch.float64)  # empty groups unwritten
        start, col = 0, 0
        for g, end in enumerate(ends):
            k = end - start
            assert k % 16 == 0, "group sizes along K must be multiples of 16"
            assert k % BLOCK == 0, "the kernel reads k / 32 scale columns: groups must be multiples of 32"
            c4 = ceil_to(k // BLOCK, 4)
            if k > 0:
                assert flat_a.numel() >= M128 * (col + c4) and flat_b.numel() >= N128 * (col + c4)
                a_scales = from_blocked_scales(flat_a[M128 * col:M128 * (col + c4)], M, k // BLOCK)
                b_scales = from_blocked_scales(flat_b[N128 * col:N128 * (col + c4)], N, k // BLOCK)
                a = dequant_rows(mat_a[:, start:end], a_scales)  # (M, k)
                b = dequant_rows(mat_b[start:end].t(), b_scales)  # (N, k)
                out[g] = a @ b.t()
            col += c4
            start = end
        self.last_f64 = out
        return out.to(torch.bfloat16)


class FunctionalEmulator:
    """Stands in for ``torch.nn.functional.scaled_grouped_mm`` (the v2 API): checks the
    recipe and swizzle enums (check_mxfp8_recipe; SWIZZLE_32_4_4 on CUDA), then runs the
    same kernel emulation."""

    def __init__(self):
        self.inner = ScaledGroupedMMEmulator()

    def __call__(self, mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None, swizzle_b=None,
                 bias=None, offs=None, output_dtype=torch.bfloat16, contraction_dim=(), use_fast_accum=False):
        F = torch.nn.functional
        assert scale_recipe_a == F.ScalingType.BlockWise1x32 and scale_recipe_b == F.ScalingType.BlockWise1x32
        assert swizzle_a == F.SwizzleType.SWIZZLE_32_4_4 and swizzle_b == F.SwizzleType.SWIZZLE_32_4_4
        return self.inner(mat_a, mat_b, scale_a, scale_b, offs=offs, bias=bias, out_dtype=output_dtype)

    @property
    def last_f64(self):
        return self.inner.last_f64


@pytest.fixture(params=["functional", "private"])
def emulator(request, monkeypatch):
    """Install the emulator behind whichever API the test asks for."""
    if request.param == "functional":
        if not hasattr(torch.nn.functional, "scaled_grouped_mm"):
            pytest.skip("this torch has no torch.nn.functional.scaled_grouped_mm")
        emu = FunctionalEmulator()
        monkeypatch.setattr(torch.nn.functional, "scaled_grouped_mm", emu)
    else:
        emu = ScaledGroupedMMEmulator()
        monkeypatch.delattr(torch.nn.functional, "scaled_grouped_mm", raising=False)
        monkeypatch.setattr(torch, "_scaled_grouped_mm", emu, raising=False)
    assert backend.scaled_grouped_mm_api() == request.param
    return emu


# ---- scale layouts against a per-group loop -------------------------------------------

def random_scales(rows, cols, seed):
    return torch.randint(0, 255, (rows, cols), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8).view(E8M0)


LAYOUT_SIZES = {
    "jagged_with_empty": [162, 0, 257, 46, 0, 83],  # groups not multiples of 32 / 128, empty experts
    "one_group_of_129": [129],  # one row past a 128-row tile
    "all_in_last": [0, 0, 0, 300],  # every row in the last expert
    "fewer_rows_than_tile": [1, 2, 3],  # T < 128
}


@pytest.mark.parametrize("name", list(LAYOUT_SIZES))
def test_blocked_m_groups_is_per_group_blocked(name):
    sizes = LAYOUT_SIZES[name]
    T, C = sum(sizes) + 7, 5  # 7 rows past the last offset, C not a multiple of 4
    scale = random_scales(T, C, len(name))
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    got = sm100.blocked_scales_m_groups(scale, offsets)
    assert got.dtype == E8M0 and got.is_contiguous() and got.shape[0] >= T and got.shape[1] == ceil_to(C, 4)
    want = torch.zeros(got.numel(), dtype=torch.uint8)
    start, row = 0, 0
    for n in sizes:  # group g's own blocked matrix at row sum_{i<g} round_up(n_i, 128)
        if n:
            part = to_blocked_scales(scale[start:start + n]).view(torch.uint8)
            want[row * ceil_to(C, 4):row * ceil_to(C, 4) + part.numel()] = part
            row += ceil_to(n, 128)
        start += n
    assert torch.equal(got.view(torch.uint8).reshape(-1), want)


@pytest.mark.parametrize("name", list(LAYOUT_SIZES))
def test_blocked_k_groups_is_per_group_blocked(name):
    sizes = LAYOUT_SIZES[name]
    R = 130  # rows past a 128-row tile
    padded = [ceil_to(n, 32) for n in sizes]  # the per-expert padded token layout
    C = sum(padded) // 32 + 3  # 3 block columns past the last group
    scale = random_scales(R, C, len(name) + 1)
    offsets = torch.tensor(padded).cumsum(0).to(torch.int32)
    got = sm100.blocked_scales_k_groups(scale, offsets)
    R128 = ceil_to(R, 128)
    assert got.dtype == E8M0 and got.is_contiguous() and got.shape == (R128, C + 4 * len(sizes))
    want = torch.zeros(got.numel(), dtype=torch.uint8)
    col, pos = 0, 0
    for n in padded:  # group g's (R, n / 32) blocked at R128 * sum_{i<g} round_up(n_i / 32, 4)
        nb = n // 32
        if nb:
            part = to_blocked_scales(scale[:, col:col + nb]).view(torch.uint8)
            want[R128 * pos:R128 * pos + part.numel()] = part
        col += nb
        pos += ceil_to(nb, 4)
    assert torch.equal(got.view(torch.uint8).reshape(-1), want)


def test_whole_matrix_layout_is_not_the_grouped_one():
    """The layout matters: blocking the scales of all tokens as one matrix (what
    ``to_blocked_scales`` or the kernels' ``blocked=True`` give) puts groups after the first
    at the wrong bytes."""
    sizes = [100, 60]
    scale = random_scales(160, 4, 0)
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    grouped = sm100.blocked_scales_m_groups(scale, offsets).view(torch.uint8).reshape(-1)
    whole = to_blocked_scales(scale).view(torch.uint8)
    assert not torch.equal(grouped[:whole.numel()], whole)


# ---- the three GEMMs through the emulated op -----------------------------------------

CASES = {
    # name: (group sizes, K, N, rows past the last offset)
    "jagged_with_empty": ([162, 0, 257, 46, 0, 83], 64, 48, 5),  # groups not multiples of 32/128, empty experts
    "odd_widths": ([40, 0, 25], 40, 33, 3),  # K and N padded (K -> 64 / 48, N -> 48 / 64)
    "fewer_tokens_than_experts": ([1, 0, 2, 0, 0, 0, 0, 0], 32, 32, 0),  # T // E == 0: kernel early exit
    "all_in_one_expert": ([0, 0, 300, 0], 96, 32, 0),  # every token routed to one expert
}


def make_inputs(sizes, K, N, extra, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(sizes)
    x = torch.randn(T + extra, K, generator=gen)
    dy = torch.randn(T + extra, N, generator=gen)
    x[T:] = float("nan")  # rows past the last offset: never read
    dy[T:] = float("nan")
    w = torch.randn(len(sizes), N, K, generator=gen) / 8
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    return x, w, dy, offsets


def check_bf16_rounding(out, ref, scale):
    """out is ref (float64) rounded once to bfloat16 (unit roundoff 2^-8: 8 significant bits), up to
    float64 summation-order noise."""
    err = (out.double() - ref).abs()
    assert bool((err <= 2.0**-8 * ref.abs() + 2.0**-40 * scale).all()), err.max().item()


@pytest.mark.parametrize("name", list(CASES))
def test_native_forward_dgrad_wgrad(name, emulator):
    sizes, K, N, extra = CASES[name]
    x, w, dy, offsets = make_inputs(sizes, K, N, extra, seed=len(name))
    T = sum(sizes)
    recipe = get_recipe("mxfp8")
    starts = [0] + offsets.tolist()[:-1]
    xq, dyq = qdq64(x[:T], 1), qdq64(dy[:T], 1)

    out = sm100.native_grouped_mm_nt(x, w, offsets, recipe)
    assert out.shape == (T + extra, N) and out.dtype == torch.float32
    assert torch.equal(out[T:], torch.zeros(extra, N))
    emulated = emulator.last_f64
    for e, (s, t) in enumerate(zip(starts, offsets.tolist())):
        if t > s:
            p = Product(xq[s:t], qdq64(w[e], 1).t())  # dequantize, then float64 matmul
            assert p.agrees(emulated[s:t, :N])  # the kernel's product, to float32 rounding
            check_bf16_rounding(out[s:t], p.value, p.scale)

    dx = sm100.native_grouped_mm_nn(dy, w, offsets, recipe)
    assert dx.shape == (T + extra, K) and torch.equal(dx[T:], torch.zeros(extra, K))
    emulated = emulator.last_f64
    for e, (s, t) in enumerate(zip(starts, offsets.tolist())):
        if t > s:
            p = Product(dyq[s:t], qdq64(w[e], 0))
            assert p.agrees(emulated[s:t, :K])
            check_bf16_rounding(dx[s:t], p.value, p.scale)

    dw = sm100.native_grouped_mm_tn(dy, x, offsets, recipe)
    assert dw.shape == (len(sizes), N, K) and dw.dtype == torch.float32
    emulated = emulator.last_f64
    for e, (s, t) in enumerate(zip(starts, offsets.tolist())):
        if t == s:
            assert torch.equal(dw[e], torch.zeros(N, K)), "an expert without tokens has exactly zero dW"
        else:  # this expert's tokens alone, blocked along tokens, zero padded to 32
            p = Product(qdq64(dy[s:t], 0).t(), qdq64(x[s:t], 0))
            assert p.agrees(emulated[e, :, :K])
            check_bf16_rounding(dw[e], p.value, p.scale)
    assert not any(torch.isnan(t).any() for t in (out, dx, dw))


def test_native_args_layout(emulator):
    """The argument tensors themselves: dtypes, shapes, strides (what the docstring promises)."""
    sizes, K, N = [30, 0, 70], 40, 33
    x, w, dy, offsets = make_inputs(sizes, K, N, 0, seed=1)
    recipe = get_recipe("mxfp8")
    a = sm100.native_args_nt(x, w, offsets, recipe)
    assert a.mat_a.shape == (100, 64) and a.mat_a.is_contiguous()
    assert a.mat_b.shape == (3, 64, 48) and a.mat_b.stride(-2) == 1  # column-major
    assert a.scale_b.shape == (3, 128 * 4) and a.scale_a.shape == (128 * (100 // 128 + 3), 4)
    assert a.offs.dtype == torch.int32 and torch.equal(a.offs, offsets)
    b = sm100.native_args_tn(dy, x, offsets, recipe)
    assert b.mat_a.shape == (N, 32 * (100 // 32 + 3)) and b.mat_a.is_contiguous()
    assert b.mat_b.shape == (32 * (100 // 32 + 3), 48) and b.mat_b.stride(-2) == 1
    assert b.offs.tolist() == [32, 64, 64 + 96]  # per-expert padded token layout (an empty expert: one zero block)


def test_empty_inputs_never_call_the_op(emulator):
    recipe = get_recipe("mxfp8")
    w = torch.randn(3, 16, 32)
    offsets = torch.zeros(3, dtype=torch.int32)
    assert sm100.native_grouped_mm_nt(torch.randn(0, 32), w, offsets, recipe).shape == (0, 16)
    assert sm100.native_grouped_mm_nn(torch.randn(0, 16), w, offsets, recipe).shape == (0, 32)
    assert torch.equal(sm100.native_grouped_mm_tn(torch.randn(0, 16), torch.randn(0, 32), offsets, recipe),
                       torch.zeros(3, 16, 32))
    calls = emulator.inner.calls if isinstance(emulator, FunctionalEmulator) else emulator.calls
    assert calls == 0


def test_emulator_rejects_what_the_op_rejects(emulator):
    """The emulator is not a rubber stamp: a row-major mat_b, float32 scales or a
    non-bf16 output fail as on the GPU."""
    sizes, K, N = [40, 24], 64, 32
    x, w, _, offsets = make_inputs(sizes, K, N, 0, seed=2)
    a = sm100.native_args_nt(x, w, offsets, get_recipe("mxfp8"))
    inner = emulator.inner if isinstance(emulator, FunctionalEmulator) else emulator
    with pytest.raises(AssertionError, match="column major"):
        inner(a.mat_a, a.mat_b.contiguous(), a.scale_a, a.scale_b, offs=a.offs)
    with pytest.raises(AssertionError):
        inner(a.mat_a, a.mat_b, a.scale_a.view(torch.uint8), a.scale_b, offs=a.offs)
    with pytest.raises(AssertionError, match="bf16"):
        inner(a.mat_a, a.mat_b, a.scale_a, a.scale_b, offs=a.offs, out_dtype=torch.float32)


def test_predicate(monkeypatch):
    """CPU tensors never take the native path; CUDA needs capability major 10, an API, a
    passing probe and an E4M3 recipe."""
    assert not backend.use_native_mx_grouped_mm("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(backend, "_probe", lambda index: True)
    for cap, want in (((9, 0), False), ((10, 0), True), ((10, 3), True), ((12, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, c=cap: c)
        assert backend.use_native_mx_grouped_mm("cuda") is want, cap
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (10, 0))
    assert backend.use_native_mx_grouped_mm("cuda:0", get_recipe("mxfp8-floor"))
    assert not backend.use_native_mx_grouped_mm("cuda:0", get_recipe("bf16"))
    assert not backend.use_native_mx_grouped_mm("cuda:0", get_recipe("mxfp8", fmt="e5m2"))
    monkeypatch.setattr(backend, "_probe", lambda index: False)  # a build without the kernel
    assert not backend.use_native_mx_grouped_mm("cuda:0")
    monkeypatch.setattr(backend, "_probe", lambda index: True)
    monkeypatch.delattr(torch.nn.functional, "scaled_grouped_mm", raising=False)
    monkeypatch.delattr(torch, "_scaled_grouped_mm", raising=False)
    assert backend.scaled_grouped_mm_api() is None
    assert not backend.use_native_mx_grouped_mm("cuda:0")
