"""MX quantization with a backend: the public :func:`quantize_mx`, :func:`dequantize_mx`,
:func:`fake_quantize_mx`, and the quantize-dequantize ("fake quantization") of GEMM
operands as the recipe prescribes.

Each function validates its arguments, then runs the Triton kernels of
:mod:`mxmoe.kernels.quantize` or the pure-torch reference of :mod:`mxmoe.numerics` by rule
1 of :mod:`mxmoe.ops.backend`; both give the same bytes (tests/kernels check them bit for
bit against the reference).

The emulated MXFP8 GEMMs of :mod:`mxmoe.ops.linear` and :mod:`mxmoe.ops.grouped_mm`
quantize each operand along its contraction dimension and multiply the dequantized
values; the product of two dequantized MXFP8 operands is exactly the product of the FP8
elements times the two scales, so a float32 (or bf16 tensor-core) GEMM on them computes
what a block-scaled MXFP8 GEMM computes, up to accumulation order.

Legend of shape suffixes: T tokens (rows), C columns, E experts.

None of these is differentiable: each runs under ``torch.no_grad()``, so its outputs never
require grad on any backend (the autograd Functions of the ops define the gradients).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..numerics.formats import MX_BLOCK_SIZE, ElemFormat, ScaleMode
from ..numerics.grouped import scatter_to_padded_groups
from ..numerics.mx_tensor import (
    MXTensor,
    check_dequantize_call,
    check_quantize_call,
    torch_dequantize_mx,
    torch_quantize_mx,
)
from ..numerics.qdq import torch_fake_quantize_mx
from ..recipe import Recipe
from .backend import TRITON_DTYPES, use_triton, use_triton_for

MX_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_weight_dtype(w: Tensor, name: str, fn: str, recipe: Recipe) -> None:
    """A weight that a quantizing ``recipe`` will quantize must be float32, bfloat16 or
    float16 (what the MX quantizers read); raise a TypeError naming it (``name`` of
    ``fn``) otherwise. The unquantized recipes cast weights to bf16 and take any float.

    Raises:
        TypeError: ``w`` not a floating-point tensor, or (quantizing recipe) not one of
            float32, bfloat16, float16.
    """
    if not isinstance(w, Tensor) or not w.is_floating_point():
        raise TypeError(f"{fn}: the weight {name} must be a floating-point tensor, got "
                        f"{getattr(w, 'dtype', type(w).__name__)}")
    if recipe.quantize and w.dtype not in MX_INPUT_DTYPES:
        raise TypeError(f"{fn}: the weight {name} has dtype {w.dtype}; recipe {recipe.name!r} quantizes it and takes "
                        f"float32, bfloat16 or float16 weights: cast it (e.g. .float()) or use recipe 'bf16'")


def quantize_mx(
    x: Tensor,
    fmt: ElemFormat | str = ElemFormat.E4M3,
    *,
    block_size: int = MX_BLOCK_SIZE,
    dim: int = -1,
    scale_mode: ScaleMode | str = ScaleMode.RCEIL,
    pad: bool = False,
    backend: str = "auto",
) -> MXTensor:
    """Quantize ``x`` to an MX format, blocks of ``block_size`` consecutive values along ``dim``.

    Rules: docs/NUMERICS.md (OCP MX v1.0; ``rceil`` is NVIDIA's MXFP8 training recipe).

    Args:
        x: float32, bfloat16 or float16; any rank >= 1, any strides (non-contiguous views,
            such as transposes, give the same result as their contiguous copy).
        fmt: "e4m3" (default), "e5m2", "e3m2", "e2m3", "e2m1" or "int8".
        block_size: values per block, 32 in the OCP spec; even for "e2m1" (packing).
        dim: the blocked dimension.
        scale_mode: "rceil" (default) or "floor".
        pad: zero-pad ``dim`` up to a multiple of ``block_size`` (remembered in
            ``orig_size``; dequantization returns the original shape). Zeros never change
            a block's amax, so the scales equal those of the unpadded blocks.
        backend: "auto" (default: the Triton kernels for CUDA tensors, FP8 formats and
            block 32; the reference otherwise), "reference" or "triton" (rule 1 of
            :mod:`mxmoe.ops.backend`). Every backend gives the same bytes.

    Returns:
        :class:`~mxmoe.numerics.MXTensor` with contiguous ``qdata`` (the format's storage
        dtype, e.g. ``float8_e4m3fn``, shape of the padded input) and ``scale``
        (``float8_e8m0fnu``, ``dim`` divided by ``block_size``). Not differentiable.

    Note: under ``rceil`` a block whose amax is within one element step of float32's
    largest value rounds its largest element up to 2^(emax+1) (e4m3: 256 with scale
    2^120), which dequantizes to inf in float32. That is what the rule of
    docs/NUMERICS.md gives; it needs inputs above 3.3e38.

    Raises:
        TypeError: ``x`` is not a float32/bfloat16/float16 tensor.
        ValueError: unknown ``fmt``, ``scale_mode`` or ``backend``; ``dim`` out of range;
            size along ``dim`` not a multiple of ``block_size`` and ``pad`` is False; odd
            block size with "e2m1"; backend="triton" for what it does not cover.
    """
    fmt, scale_mode, dim, x = check_quantize_call(x, fmt, block_size, dim, scale_mode, pad)
    if use_triton(x.device, x.dtype, fmt, block_size, backend):
        from ..kernels.quantize import quantize_along_dim

        q, s = quantize_along_dim(x, dim, fmt.value, scale_mode.value, pad)
        return MXTensor(q, s, fmt, block_size, dim, scale_mode, x.shape[dim])
    return torch_quantize_mx(x, fmt, block_size=block_size, dim=dim, scale_mode=scale_mode, pad=pad)


def dequantize_mx(mx: MXTensor, dtype: torch.dtype = torch.float32, backend: str = "auto") -> Tensor:
    """Dequantize ``mx``: v'_i = P_i * 2^(b - 127) exactly in float32, then cast to ``dtype``.

    Args:
        mx: an :class:`~mxmoe.numerics.MXTensor`.
        dtype: float32 (default), bfloat16 or float16 (rounded from the float32 value).
        backend: "auto" (the Triton kernel for CUDA FP8 tensors and float32/bfloat16
            output), "reference" or "triton"; every backend gives the same values
            (blocks with scale 255 are NaN; the NaN payload bits of bfloat16/float16
            output follow the device's float conversion, e.g. 0x7FC0 or 0xFFFF).

    Returns:
        Tensor of ``mx.shape`` (padding dropped), contiguous, blocked dim where it was;
        never requires grad.

    Raises:
        TypeError: ``mx`` is not an MXTensor or ``dtype`` is not a supported float dtype.
        ValueError: unknown backend, or "triton" for what it does not cover.
    """
    check_dequantize_call(mx, dtype)
    if use_triton(mx.qdata.device, dtype, mx.fmt, mx.block_size, backend):
        from ..kernels.quantize import dequantize_rowwise

        with torch.no_grad():
            values = dequantize_rowwise(mx.qdata.movedim(mx.dim, -1), mx.scale.movedim(mx.dim, -1), dtype)
            return values.narrow(-1, 0, mx.orig_size).movedim(-1, mx.dim).contiguous()
    return torch_dequantize_mx(mx, dtype)


def fake_quantize_mx(
    x: Tensor,
    fmt: ElemFormat | str = ElemFormat.E4M3,
    *,
    block_size: int = MX_BLOCK_SIZE,
    dim: int = -1,
    scale_mode: ScaleMode | str = ScaleMode.RCEIL,
    pad: bool = False,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> Tensor:
    """``quantize_mx(x, ...).dequantize(out_dtype)`` in one pass (one fused kernel on the
    Triton backend, ``torch.ops.mxmoe.fake_quantize_along_dim``).

    Args:
        x, fmt, block_size, dim, scale_mode, pad, backend: as :func:`quantize_mx`.
        out_dtype: float32, bfloat16 or float16; default x's dtype.

    Returns:
        Tensor of x's shape and ``out_dtype``, contiguous, equal bit for bit to the
        dequantized MXTensor. Never requires grad.

    Raises:
        The errors of :func:`quantize_mx`.
    """
    fmt, scale_mode, dim, x = check_quantize_call(x, fmt, block_size, dim, scale_mode, pad)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    # the kernel reads x and writes out_dtype: both must be covered (rule 1 for each)
    if use_triton(x.device, x.dtype, fmt, block_size, backend) and use_triton(x.device, out_dtype, fmt, block_size,
                                                                              backend):
        from ..kernels.quantize import fake_quantize_along_dim

        return fake_quantize_along_dim(x, dim, fmt.value, scale_mode.value, out_dtype)
    return torch_fake_quantize_mx(x, fmt, block_size=block_size, dim=dim, scale_mode=scale_mode, pad=pad,
                                  out_dtype=out_dtype)


@torch.no_grad()
def fake_quantize_operand(x: Tensor, recipe: Recipe, dim: int, out_dtype: torch.dtype) -> Tensor:
    """Quantize ``x`` along ``dim`` with the recipe's format and scale rule, dequantize.

    The size along ``dim`` need not be a multiple of the block size: the tail block is
    zero padded (exact for a GEMM whose contraction runs along ``dim``).

    Args:
        x: float32/bfloat16/float16, any shape.
        recipe: a quantizing recipe (``recipe.quantize`` is True).
        dim: blocked dimension (the contraction dimension of the GEMM that reads it).
        out_dtype: dtype of the result (the GEMM's operand dtype).

    Returns:
        Tensor of ``x``'s shape and ``out_dtype``, contiguous.
    """
    return fake_quantize_mx(x, recipe.fmt, block_size=recipe.block_size, dim=dim, scale_mode=recipe.scale_mode,
                            pad=True, out_dtype=out_dtype, backend=recipe.backend)


@torch.no_grad()
def fake_quantize_grouped_tokens(x_TC: Tensor, offsets_E: Tensor, recipe: Recipe,
                                 out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Quantize along tokens with each expert's tokens in their own blocks; dequantize.

    This is the wgrad operand rule of docs/NUMERICS.md: the contraction of
    dW_e = dY_e^T X_e runs over expert e's own tokens, so a 32-block never straddles two
    experts; each expert's last block is zero padded (exact). The result comes in the
    transposed per-expert padded layout of :mod:`mxmoe.numerics.grouped`, ready for a
    grouped GEMM over tokens. No device-to-host synchronization.

    Args:
        x_TC: (T, C) float32/bfloat16, rows sorted by expert; rows past offsets[-1] unread.
        offsets_E: (E,) int32 cumulative end rows.
        recipe: a quantizing recipe. out_dtype: dtype of the result.

    Returns:
        ``(xq_CTp, padded_offsets_E)``: (C, Tp) dequantized values, the transposed view of
        a contiguous (Tp, C) tensor (written without a transpose; ``torch._grouped_mm``
        takes any layout at about the same speed on the H200), and
        (E,) int32 cumulative ends in the padded token layout.
    """
    if out_dtype in TRITON_DTYPES and use_triton_for(x_TC, recipe):
        from ..kernels.quantize import fake_quantize_grouped_colwise

        xq_TpC, padded_offsets = fake_quantize_grouped_colwise(x_TC, offsets_E.to(torch.int32), recipe.fmt.value,
                                                               recipe.scale_mode.value, out_dtype)
        return xq_TpC.t(), padded_offsets
    padded_TpC, padded_offsets = scatter_to_padded_groups(x_TC, offsets_E, recipe.block_size)
    xq = fake_quantize_operand(padded_TpC, recipe, dim=0, out_dtype=out_dtype)
    return xq.t(), padded_offsets


@torch.no_grad()
def fake_quantize_grouped_tokens_pair(a_TC: Tensor, b_TC: Tensor, offsets_E: Tensor, recipe: Recipe,
                                      out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`fake_quantize_grouped_tokens` of the two wgrad operands (dY and X, same rows
    and experts), bit for bit, in one kernel launch on the Triton backend (the padded
    layout computed once; on the H200 this saves a launch and a tail wave per wgrad).

    Args:
        a_TC: (T, CA), b_TC: (T, CB) float32/bfloat16, rows sorted by expert.
        offsets_E: (E,) int32 cumulative end rows. recipe, out_dtype: as
            :func:`fake_quantize_grouped_tokens`.

    Returns:
        ``(a_CTp, b_CTp, padded_offsets_E)``: (CA, Tp) and (CB, Tp) dequantized values
        (transposed views of contiguous (Tp, C) tensors) and (E,) int32 padded ends.

    Raises:
        ValueError: a and b have different row counts.
    """
    if a_TC.dim() != 2 or b_TC.dim() != 2 or a_TC.shape[0] != b_TC.shape[0]:
        raise ValueError(f"expected a (T, CA) and b (T, CB) with the same T, got {tuple(a_TC.shape)} and "
                         f"{tuple(b_TC.shape)}")
    if (out_dtype in TRITON_DTYPES and a_TC.dtype == b_TC.dtype
            and use_triton_for(a_TC, recipe)):
        from ..kernels.quantize import fake_quantize_grouped_colwise_pair

        a_TpC, b_TpC, padded_offsets = fake_quantize_grouped_colwise_pair(
            a_TC, b_TC, offsets_E.to(torch.int32), recipe.fmt.value, recipe.scale_mode.value, out_dtype)
        return a_TpC.t(), b_TpC.t(), padded_offsets
    a_CTp, padded_offsets = fake_quantize_grouped_tokens(a_TC, offsets_E, recipe, out_dtype)
    b_CTp, _ = fake_quantize_grouped_tokens(b_TC, offsets_E, recipe, out_dtype)
    return a_CTp, b_CTp, padded_offsets


@torch.no_grad()
def fake_quantize_rowcol(x: Tensor, recipe: Recipe, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(fake_quantize_operand(x, dim=-1), fake_quantize_operand(x, dim=-2))`` of a 2-D tensor (T, C) or a
    3-D expert weight (E, N, K), bit for bit, with one read of x on the Triton backend (the
    training rule of docs/NUMERICS.md: each copy is quantized from x itself, along the
    contraction dimension of the GEMM that reads it).

    Args:
        x: (T, C) or (E, N, K) float32/bfloat16/float16, any strides.
        recipe: a quantizing recipe. out_dtype: dtype of both results.

    Returns:
        ``(rows, cols)``: x's shape each, contiguous; rows blocked along the last dimension
        (32 consecutive elements of a row share a scale), cols along the one before it
        (T, or N within each expert). Tails that are not multiples of 32 are zero padded
        (exact for the GEMMs).

    Raises:
        ValueError: x is not 2-D or 3-D.
    """
    if x.dim() not in (2, 3):
        raise ValueError(f"fake_quantize_rowcol takes a 2-D (T, C) or 3-D (E, N, K) tensor, got shape "
                         f"{tuple(x.shape)}")
    if out_dtype in TRITON_DTYPES and x.numel() and use_triton_for(x, recipe):
        from ..kernels.quantize import fake_quantize_rowcol as kernel

        return kernel(x, recipe.fmt.value, recipe.scale_mode.value, out_dtype)
    return (fake_quantize_operand(x, recipe, dim=-1, out_dtype=out_dtype),
            fake_quantize_operand(x, recipe, dim=-2, out_dtype=out_dtype))
