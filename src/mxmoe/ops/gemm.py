"""Grouped GEMMs on already (de)quantized operands: the compute seam of the recipe.

``torch._grouped_mm`` where the running torch supports the device and dtype (probed once);
operands whose sizes miss its 16-byte alignment rule are zero padded (exact) rather than
looped over, so no path reads the offsets on the host. A loop over experts (which does)
remains only where torch._grouped_mm is missing. Both give exact zeros where no token contributes: rows past
the last offset of a forward/dgrad output, and the weight gradient of an expert with no
tokens.

Legend: T tokens, K / N contraction and output features, E experts.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor


_GROUPED_MM_SUPPORTED: dict[tuple[str, torch.dtype], bool] = {}


def _grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs for (device type, dtype): probed once per key. A plain
    dict, not functools.cache, so that torch.compile reads the cached answer instead of
    tracing the probe (Dynamo traces through functools.cache wrappers)."""
    key = (device_type, dtype)
    if key not in _GROUPED_MM_SUPPORTED:
        _GROUPED_MM_SUPPORTED[key] = _probe_grouped_mm(device_type, dtype)
    return _GROUPED_MM_SUPPORTED[key]


@torch.compiler.disable  # first call under torch.compile: run the probe eagerly
def _probe_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device_type == "cuda":
        major, _ = torch.cuda.get_device_capability()
        if major < 9 or dtype != torch.bfloat16:
            return False
    try:
        a = torch.ones(16, 16, dtype=dtype, device=device_type)
        b = torch.ones(2, 16, 16, dtype=dtype, device=device_type)
        offs = torch.tensor([8, 16], dtype=torch.int32, device=device_type)
        out = torch._grouped_mm(a, b, offs=offs)
        return bool((out == 16).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``; under torch.compile through the opaque op
    ``mxmoe::grouped_mm``, which keeps the operands' strides as traced. Inductor otherwise
    may lay an operand out anew (a transposed dY materialized row-major) and move a group
    boundary onto the contiguous dim, where torch._grouped_mm needs 16-byte aligned group
    sizes: a device-side assert on the H200 for the bf16 layer's wgrad."""
    offs = offs.to(torch.int32)
    if torch.compiler.is_compiling():
        return _grouped_mm_op(a, b, offs)
    return torch._grouped_mm(a, b, offs=offs)


_EXACT = getattr(torch.Tag, "needs_exact_strides", None) or torch.Tag.needs_fixed_stride_order


@torch.library.custom_op("mxmoe::grouped_mm", mutates_args=(), tags=(_EXACT,))
def _grouped_mm_op(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm_op.register_fake
def _(a, b, offs):
    return torch._grouped_mm(a, b, offs=offs)  # torch's meta kernel: shape, dtype and strides


_ALIGN_BYTES = 16


def _aligned(t: Tensor) -> bool:
    """2-D / 3-D operand with a unit stride in one of its last two dims (the contiguous one)
    and every other stride a positive multiple of 16 bytes (torch._grouped_mm's rule).
    Only that one dim is exempt: a size-1 dim also has stride 1, and its stride still
    counts (an operand (T, 1) has strides (1, 1) and is not aligned)."""
    strides = t.stride()
    if strides[-1] == 1:
        inner = t.dim() - 1
    elif strides[-2] == 1:
        inner = t.dim() - 2
    else:
        return False
    return all(s > 0 and (s * t.element_size()) % _ALIGN_BYTES == 0 for i, s in enumerate(strides) if i != inner)


def _use_grouped_mm(*operands: Tensor) -> bool:
    a = operands[0]
    return _grouped_mm_supported(a.device.type, a.dtype) and all(_aligned(t) for t in operands)


_ALIGN_ELEMS = 8  # 16 bytes of bf16


def _pad_to(t: Tensor, sizes: dict[int, int]) -> Tensor:
    """``t`` contiguous, zero padded at the end of each dim d to ``sizes[d]`` (exact for a GEMM:
    padded contraction entries are zeros, padded output rows / columns are sliced off)."""
    if all(t.shape[d] == n for d, n in sizes.items()):
        return t.contiguous()
    shape = list(t.shape)
    for d, n in sizes.items():
        shape[d] = n
    out = t.new_zeros(shape)
    out[tuple(slice(0, m) for m in t.shape)] = t
    return out


def _up(n: int) -> int:
    return (n + _ALIGN_ELEMS - 1) // _ALIGN_ELEMS * _ALIGN_ELEMS


def _grouped_mm_device_ok(a: Tensor) -> bool:
    """torch._grouped_mm runs here (device, dtype); shapes are padded to its alignment
    (on the CPU too, where it is supported, so the CPU tests exercise the padding)."""
    return _grouped_mm_supported(a.device.type, a.dtype)


def _group_bounds(offsets_E: Tensor) -> list[tuple[int, int]]:
    ends = offsets_E.tolist()  # host sync: only on the fallback path
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None  # finds, does not import


def zero_rows_past_end(x_TC: Tensor, offsets_E: Tensor) -> Tensor:
    """x with the rows at and past offsets_E[-1] set to zero (x itself if there are none).

    On CUDA this stays free of host synchronization: a contiguous 2-D x (the GEMM outputs
    here, which nothing else references yet) is zeroed in place by a kernel that reads the
    last offset on the device (:mod:`mxmoe.kernels.grouped_zero_fill`), other layouts through a mask. On
    the CPU reading the last offset costs nothing and the common case is a no-op (under
    torch.compile the mask, which needs no host read).
    """
    T = x_TC.shape[0]
    if offsets_E.numel() == 0:
        return torch.zeros_like(x_TC)
    if x_TC.device.type == "cpu" and not torch.compiler.is_compiling():
        n = int(offsets_E[-1])
        if n >= T:
            return x_TC
        out = x_TC.clone()
        out[n:] = 0
        return out
    if x_TC.device.type == "cuda" and x_TC.is_contiguous() and x_TC.dim() == 2 and _TRITON_AVAILABLE:
        # an output fresh from the GEMM: zero its tail in place, moving no data when there is none
        from ..kernels.grouped_zero_fill import zero_rows_past_end_

        return zero_rows_past_end_(x_TC, offsets_E)
    keep = torch.arange(T, device=x_TC.device) < offsets_E[-1].to(torch.int64)
    return torch.where(keep.unsqueeze(1), x_TC, torch.zeros((), dtype=x_TC.dtype, device=x_TC.device))


def grouped_mm_nt(x_TK: Tensor, w_ENK: Tensor, offsets_E: Tensor, all_rows: bool = False) -> Tensor:
    """out[t] = x[t] @ w[e(t)]^T for the rows t of group e; zero rows past the last offset.

    Args:
        x_TK: (T, K); w_ENK: (E, N, K), same dtype; offsets_E: (E,) int32 cumulative ends.
        all_rows: the caller guarantees offsets[-1] == T (every row in a group), which
            skips the pass that zeroes the rows past the end.

    Returns:
        (T, N) in x's dtype (float32 accumulation).
    """
    T = x_TK.shape[0]
    E, N, _ = w_ENK.shape
    if T == 0 or E == 0:
        return x_TK.new_zeros(T, N)
    if _use_grouped_mm(x_TK, w_ENK) and (N * x_TK.element_size()) % _ALIGN_BYTES == 0:
        out = _grouped_mm(x_TK, w_ENK.transpose(-2, -1), offsets_E)
    elif _grouped_mm_device_ok(x_TK):  # pad K and N to 16 bytes: no per-expert loop, no host sync
        K = x_TK.shape[1]
        xp = _pad_to(x_TK, {1: _up(K)})
        wp = _pad_to(w_ENK, {1: _up(N), 2: _up(K)})
        out = _grouped_mm(xp, wp.transpose(-2, -1), offsets_E)[:, :N]
    else:
        out = x_TK.new_empty(T, N)
        for e, (s, t) in enumerate(_group_bounds(offsets_E)):
            out[s:t] = x_TK[s:t] @ w_ENK[e].t()
    return out if all_rows else zero_rows_past_end(out, offsets_E)


def grouped_mm_nn(dy_TN: Tensor, w_ENK: Tensor, offsets_E: Tensor, all_rows: bool = False) -> Tensor:
    """dx[t] = dy[t] @ w[e(t)] (the dgrad of :func:`grouped_mm_nt`); zero rows past the end.

    Args:
        dy_TN: (T, N); w_ENK: (E, N, K); offsets_E: (E,) int32. all_rows: as
            :func:`grouped_mm_nt`.

    Returns:
        (T, K) in dy's dtype.
    """
    T = dy_TN.shape[0]
    E, _, K = w_ENK.shape
    if T == 0 or E == 0:
        return dy_TN.new_zeros(T, K)
    if _use_grouped_mm(dy_TN, w_ENK) and (K * dy_TN.element_size()) % _ALIGN_BYTES == 0:
        out = _grouped_mm(dy_TN, w_ENK, offsets_E)
    elif _grouped_mm_device_ok(dy_TN):  # pad K and N to 16 bytes: no per-expert loop, no host sync
        N = dy_TN.shape[1]
        dyp = _pad_to(dy_TN, {1: _up(N)})
        wp = _pad_to(w_ENK, {1: _up(N), 2: _up(K)})
        out = _grouped_mm(dyp, wp, offsets_E)[:, :K]
    else:
        out = dy_TN.new_empty(T, K)
        for e, (s, t) in enumerate(_group_bounds(offsets_E)):
            out[s:t] = dy_TN[s:t] @ w_ENK[e]
    return out if all_rows else zero_rows_past_end(out, offsets_E)


_CPU_TILE_COLS = 16  # columns torch's CPU grouped GEMM may load at once past a group's end


def _cpu_wgrad_operands(a_NL: Tensor, b_KL: Tensor, offsets_E: Tensor) -> tuple[Tensor, Tensor, int]:
    """The wgrad operands for torch's CPU ``torch._grouped_mm``: contiguous copies whose
    columns from offsets[-1] up to a multiple of 16 are zeros, where the kernel could read
    something that is not an exact zero's partner (below); the operands unchanged otherwise.

    torch 2.13's CPU kernel (AVX-512) loads the last group's columns in tiles past
    offsets[-1], and multiplies the extra ones by zero: NaN or inf there (rows a caller
    left past the last offset) turned whole weight gradients into NaN, and an operand
    with tokens as its contiguous dim was read past its end (in a row-major view of a
    wider buffer: whatever lies there). So a copy is made where either can happen. A
    contiguous operand is passed as it is (its rows' extra loads fall on the next row's
    finite values, multiplied by zero; whether the last row is read past the allocation
    was not established); the library's callers pass tokens-outer or contiguous operands,
    so its results are unchanged by this function unless NaN or inf lie past offsets[-1]. On the CPU reading the last offset
    costs no device sync; under torch.compile the columns are masked instead."""
    L = a_NL.shape[1]
    if torch.compiler.is_compiling():
        keep = torch.arange(L, device=a_NL.device) < offsets_E[-1].to(torch.int64)
        end = L
        a_NL = torch.where(keep, a_NL, torch.zeros((), dtype=a_NL.dtype))
        b_KL = torch.where(keep, b_KL, torch.zeros((), dtype=b_KL.dtype))
    else:
        end = min(L, int(offsets_E[-1]))
        # a row-major view of a wider buffer: the extra loads of its rows land in the buffer
        narrow = any(t.stride(1) == 1 and t.stride(0) != t.shape[1] for t in (a_NL, b_KL))
        if not narrow and (end == L or (torch.isfinite(a_NL[:, end:]).all()
                                        and torch.isfinite(b_KL[:, end:]).all())):
            # what lies past the last offset is finite (multiplied by zero) or absent:
            # the operands as they are
            return a_NL, b_KL, L
    Lp = -(-end // _CPU_TILE_COLS) * _CPU_TILE_COLS
    return _pad_to(a_NL[:, :end], {1: Lp}), _pad_to(b_KL[:, :end], {1: Lp}), Lp


def grouped_mm_tn(a_NL: Tensor, b_KL: Tensor, offsets_E: Tensor, nonempty_groups: bool = False) -> Tensor:
    """dw[e] = a[:, group e] @ b[:, group e]^T (the wgrad, contraction over tokens L);
    exact zeros for empty groups.

    Args:
        a_NL: (N, L) (dY transposed); b_KL: (K, L) (X transposed); offsets_E: (E,) int32
            cumulative ends of the groups along L (plain or per-expert padded layout).
            Columns past the last offset are not read.
        nonempty_groups: the caller guarantees that every group has columns, zeros for an
            expert without tokens (the per-expert padded layout of
            :mod:`mxmoe.numerics.grouped` gives it one block of zeros): the GEMM then
            writes every matrix itself and no zeroing pass runs after it.

    Returns:
        (E, N, K) in a's dtype.
    """
    N, L = a_NL.shape
    K = b_KL.shape[0]
    E = offsets_E.numel()
    if L == 0 or E == 0:
        return a_NL.new_zeros(E, N, K)
    if a_NL.device.type == "cpu":
        a_NL, b_KL, L = _cpu_wgrad_operands(a_NL, b_KL, offsets_E)
        if L == 0:
            return a_NL.new_zeros(E, N, K)
    if _use_grouped_mm(a_NL, b_KL) and (K * a_NL.element_size()) % _ALIGN_BYTES == 0:
        out = _grouped_mm(a_NL, b_KL.t(), offsets_E)
    elif _grouped_mm_device_ok(a_NL):  # pad N, K and L to 16 bytes: no per-expert loop, no host sync
        # tokens stay the outer dim of both copies: torch._grouped_mm asserts (on the device)
        # when the groups run along an operand's contiguous dim and their sizes are not
        # 16-byte aligned, as tokens per expert rarely are
        Lp = _up(L)
        ap = _pad_to(a_NL.t(), {0: Lp, 1: _up(N)}).t()  # (Np, Lp), strides (1, Np)
        bp = _pad_to(b_KL.t(), {0: Lp, 1: _up(K)})  # (Lp, Kp) row-major
        out = _grouped_mm(ap, bp, offsets_E)[:, :N, :K]
    else:
        out = a_NL.new_empty(E, N, K)
        for e, (s, t) in enumerate(_group_bounds(offsets_E)):
            out[e] = a_NL[:, s:t] @ b_KL[:, s:t].t()
    if nonempty_groups:
        return out
    if out.device.type == "cuda" and out.is_contiguous() and _TRITON_AVAILABLE:
        # an output fresh from the GEMM: zero only the empty experts' matrices, in place
        from ..kernels.grouped_zero_fill import zero_empty_groups_

        return zero_empty_groups_(out, offsets_E)
    sizes = torch.diff(offsets_E.to(torch.int64), prepend=offsets_E.new_zeros(1, dtype=torch.int64))
    return torch.where((sizes > 0).view(E, 1, 1), out, torch.zeros((), dtype=out.dtype, device=out.device))
