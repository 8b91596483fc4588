"""Pure-torch reference of MX quantization: the contract every kernel is tested against.

Each function follows one rule of ``docs/NUMERICS.md`` (OCP MX v1.0 plus NVIDIA's
``rceil`` scale rule). Everything here works on any device and is the CPU backend of
mxmoe. Block functions take a contiguous tensor viewed as ``(P, n_blocks, block_size, S)``
("blocked along dim 2"): P is the product of the sizes before the blocked dimension, S of
those after it, so any blocked dimension is reached with a view, never a transpose.

All arithmetic is float32 with exact power-of-two steps, so nothing here depends on the
platform's rounding of transcendental functions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .formats import (
    E8M0_EXPONENT_BIAS,
    E8M0_MAX_EXPONENT,
    E8M0_MIN_EXPONENT,
    E8M0_NAN,
    FP8_NAN_CODE,
    FP8_SIGN_BIT,
    INT8_IMPLIED_SCALE_EXP,
    ElemFormat,
    ScaleMode,
)

_FP8_FORMATS = (ElemFormat.E4M3, ElemFormat.E5M2)
# float32 bit layout
_F32_MANTISSA_BITS = 23
_F32_EXP_BIAS = 127
_F32_MIN_SUBNORMAL_EXP = -149


def exp2i(e: Tensor) -> Tensor:
    """Exact 2^e as float32 for integer ``e`` in [-149, 127], built from the bits.

    Args:
        e: integer tensor, any shape; values outside [-149, 127] are clamped.

    Returns:
        float32 tensor of ``e``'s shape; 2^-127 and below are float32 subnormals, kept.
    """
    e = e.to(torch.int32).clamp(_F32_MIN_SUBNORMAL_EXP, _F32_EXP_BIAS)
    normal_bits = torch.bitwise_left_shift((e + _F32_EXP_BIAS).clamp(min=1), _F32_MANTISSA_BITS)
    subnormal_bits = torch.bitwise_left_shift(
        torch.ones_like(e), (e - _F32_MIN_SUBNORMAL_EXP).clamp(0, _F32_MANTISSA_BITS - 1)
    )
    bits = torch.where(e >= 1 - _F32_EXP_BIAS, normal_bits, subnormal_bits)
    return bits.view(torch.float32)


def floor_log2(x: Tensor) -> Tensor:
    """floor(log2(x)) for positive finite float32 ``x`` (subnormals included), as int32.

    Read off the float's exponent (``torch.frexp``), never from a rounded log.
    """
    _, exponent = torch.frexp(x)  # x = m * 2^exponent, m in [0.5, 1)
    return exponent - 1


def ceil_log2(x: Tensor) -> Tensor:
    """ceil(log2(x)) for positive finite float32 ``x`` (subnormals included), as int32."""
    mantissa, exponent = torch.frexp(x)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def torch_mx_scale_bits(amax: Tensor, fmt: ElemFormat, scale_mode: ScaleMode) -> Tensor:
    """E8M0 scale byte of each block from its amax (docs/NUMERICS.md, "Choosing the scale").

    Args:
        amax: float32, any shape: max |v| over each block (NaN or inf if the block has one).
        fmt: element format; its ``emax_elem`` (floor) or ``max_normal`` (rceil) is used.
        scale_mode: ``FLOOR``: e = floor(log2(amax)) - emax_elem (OCP MX v1.0 section
            6.3). ``RCEIL``: e = ceil(log2(d)), d = amax * float32(1 / max_normal) rounded
            to float32 (NVIDIA MXFP8 recipe, ``cvt.rp.satfinite.ue8m0``).

    Returns:
        uint8 tensor of ``amax``'s shape: b = clamp(e, -127, 127) + 127; 0 for an all-zero
        block; 255 (NaN) for a block holding NaN or +-inf.
    """
    spec = fmt.spec
    amax = amax.to(torch.float32)
    if scale_mode is ScaleMode.FLOOR:
        e = floor_log2(amax) - spec.emax_elem
        is_zero = amax == 0
    elif scale_mode is ScaleMode.RCEIL:
        inv_max_normal = torch.tensor(1.0 / spec.max_normal, dtype=torch.float32, device=amax.device)
        d = amax * inv_max_normal  # float32 product, as the hardware does
        e = ceil_log2(d)
        is_zero = d == 0  # amax == 0, or a subnormal amax whose d underflows: e -> -127
    else:  # pragma: no cover - enum is closed
        raise ValueError(f"unknown scale mode {scale_mode!r}")
    e = torch.where(is_zero, E8M0_MIN_EXPONENT, e).clamp(E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT)
    bits = e + E8M0_EXPONENT_BIAS
    bits = torch.where(torch.isfinite(amax), bits, E8M0_NAN)
    return bits.to(torch.uint8)


def e8m0_to_float32(scale_bits: Tensor) -> Tensor:
    """Value of E8M0 bytes as float32: 2^(b - 127) exactly (b = 0 -> 2^-127), NaN for 255."""
    b = scale_bits.view(torch.uint8) if scale_bits.dtype != torch.uint8 else scale_bits
    b = b.to(torch.int32)
    value = exp2i(b - E8M0_EXPONENT_BIAS)
    return torch.where(b == E8M0_NAN, float("nan"), value)


def round_to_elem_grid(y: Tensor, fmt: ElemFormat) -> Tensor:
    """Round float32 ``y`` to the element grid: nearest, ties to even, subnormals kept, then
    saturate to +-max_normal (docs/NUMERICS.md, "Elements"). Finite input only.

    This is the format-generic rule. For FP8 it equals torch's own float8 cast after
    clamping (``tests/numerics`` checks that on every float8 value and the midpoints).

    Returns:
        float32 tensor of ``y``'s shape whose values lie on the element grid; the sign of
        zero is kept.
    """
    spec = fmt.spec
    y = y.to(torch.float32)
    # Exponent of the grid spacing: that of |y|'s binade, not below the subnormal range.
    k = floor_log2(y.abs()).clamp(min=spec.min_normal_exp)
    k = torch.where(y == 0, spec.min_normal_exp, k)
    quantum_exp = k - spec.mbits
    # y / quantum and back are exact power-of-two steps; torch.round is ties-to-even.
    q = torch.round(y * exp2i(-quantum_exp)) * exp2i(quantum_exp)
    q = q.clamp(-spec.max_normal, spec.max_normal)
    return torch.copysign(q, y)


def _encode_small_float(q: Tensor, fmt: ElemFormat) -> Tensor:
    """Bits of grid values ``q`` (float32) of an FP6/FP4 format, one element per uint8:
    sign << (ebits + mbits) | exponent field << mbits | mantissa field."""
    spec = fmt.spec
    a = q.abs()
    is_normal = a >= 2.0**spec.min_normal_exp
    k = torch.where(is_normal, floor_log2(torch.where(is_normal, a, 1.0)), spec.min_normal_exp)
    exp_field = torch.where(is_normal, k + spec.bias, 0)
    significand = (a * exp2i(spec.mbits - k)).to(torch.int32)  # exact integer
    mant_field = significand - torch.where(is_normal, 1 << spec.mbits, 0)
    sign = torch.signbit(q).to(torch.int32)
    code = (sign << (spec.ebits + spec.mbits)) | (exp_field << spec.mbits) | mant_field
    return code.to(torch.uint8)


def _decode_small_float(code: Tensor, fmt: ElemFormat) -> Tensor:
    """Inverse of :func:`_encode_small_float`: uint8 codes -> float32 element values."""
    spec = fmt.spec
    c = code.to(torch.int32)
    mant_field = c & ((1 << spec.mbits) - 1)
    exp_field = (c >> spec.mbits) & ((1 << spec.ebits) - 1)
    negative = ((c >> (spec.ebits + spec.mbits)) & 1).bool()
    is_normal = exp_field > 0
    significand = mant_field + torch.where(is_normal, 1 << spec.mbits, 0)
    k = torch.where(is_normal, exp_field - spec.bias, spec.min_normal_exp)
    value = significand.to(torch.float32) * exp2i(k - spec.mbits)
    return torch.where(negative, -value, value)


def pack_fp4(codes: Tensor, dim: int = -1) -> Tensor:
    """Pack 4-bit codes (uint8, values 0..15) two per byte along ``dim``, the element with
    the even index in the low nibble (torch ``float4_e2m1fn_x2`` convention).

    Args:
        codes: uint8, size along ``dim`` even.
        dim: the packing dimension.

    Returns:
        Contiguous ``float4_e2m1fn_x2`` tensor, ``dim`` halved.
    """
    dim = dim % codes.dim()
    shape = list(codes.shape)
    P, S = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
    pairs = codes.contiguous().view(P, shape[dim] // 2, 2, S)
    packed = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
    shape[dim] //= 2
    return packed.view(shape).view(torch.float4_e2m1fn_x2)


def unpack_fp4(packed: Tensor, dim: int = -1) -> Tensor:
    """Inverse of :func:`pack_fp4`: packed bytes -> uint8 codes, ``dim`` doubled."""
    dim = dim % packed.dim()
    b = packed.contiguous().view(torch.uint8)
    shape = list(b.shape)
    P, S = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
    b = b.view(P, shape[dim], 1, S)
    codes = torch.cat((b & 0xF, b >> 4), dim=2)
    shape[dim] *= 2
    return codes.view(shape)


BLOCK_AXIS = 2  # blocks run along dim 2 of the (P, n_blocks, block_size, S) view


def block_amax(x_blocks: Tensor) -> Tensor:
    """max |v| of each block as float32, (P, n_blocks, 1, S); NaN if the block holds NaN."""
    return x_blocks.abs().to(torch.float32).amax(dim=BLOCK_AXIS, keepdim=True)


def torch_quantize_blocks(
    x_blocks: Tensor, fmt: ElemFormat, scale_mode: ScaleMode
) -> tuple[Tensor, Tensor]:
    """Quantize blocks along dim 2.

    Args:
        x_blocks: float32/bfloat16/float16 (P, n_blocks, block_size, S).
        fmt, scale_mode: element format and scale rule.

    Returns:
        ``(codes, scale_bits)``: codes (P, n_blocks, block_size, S) in the storage dtype
        of ``fmt`` (float8 dtypes for FP8, uint8 for FP6 and FP4 before packing, int8 for
        INT8); scale_bits uint8 (P, n_blocks, 1, S). A block holding NaN or +-inf gets
        scale 255 and NaN elements (FP8: code 0x7F with the input's sign bit; formats
        without a NaN code store signed zeros, the NaN scale makes the block NaN on
        dequantization).
    """
    x = x_blocks.to(torch.float32)
    scale_bits = torch_mx_scale_bits(block_amax(x), fmt, scale_mode)
    nonfinite = scale_bits == E8M0_NAN
    # Divide by the scale: multiply by 2^-(b - 127), exact (NaN blocks use 2^0, fixed below).
    e = torch.where(nonfinite, 0, scale_bits.to(torch.int32) - E8M0_EXPONENT_BIAS)
    y = x * exp2i(-e)
    any_nonfinite = x.device.type != "cpu" or bool(nonfinite.any())  # free on the CPU
    if any_nonfinite:
        y = torch.where(nonfinite, torch.copysign(torch.zeros_like(y), x), y)
    spec = fmt.spec
    if fmt in _FP8_FORMATS:
        # Saturate first: torch's float8 cast rounds to nearest-even but may overflow to NaN.
        codes = y.clamp_(-spec.max_normal, spec.max_normal).to(spec.torch_dtype)
        if any_nonfinite:
            nan_code = torch.where(torch.signbit(x), FP8_SIGN_BIT | FP8_NAN_CODE, FP8_NAN_CODE)
            codes_u8 = torch.where(nonfinite, nan_code.to(torch.uint8), codes.view(torch.uint8))
            codes = codes_u8.view(spec.torch_dtype)
        return codes, scale_bits
    q = round_to_elem_grid(y, fmt)
    if fmt is ElemFormat.INT8:
        codes = (q * 2.0 ** (-INT8_IMPLIED_SCALE_EXP)).to(torch.int8)
        return codes, scale_bits
    return _encode_small_float(q, fmt), scale_bits


def decode_elements(codes: Tensor, fmt: ElemFormat) -> Tensor:
    """Element values of unpacked codes as float32 (FP8 NaN codes decode to NaN)."""
    if fmt in _FP8_FORMATS:
        return codes.to(torch.float32)
    if fmt is ElemFormat.INT8:
        return codes.to(torch.float32) * 2.0**INT8_IMPLIED_SCALE_EXP
    return _decode_small_float(codes, fmt)


def torch_dequantize_blocks(codes: Tensor, scale_bits: Tensor, fmt: ElemFormat) -> Tensor:
    """v'_i = P_i * 2^(b - 127) in float32 (docs/NUMERICS.md, "Dequantization").

    Args:
        codes: (P, n_blocks, block_size, S) unpacked element codes.
        scale_bits: uint8 or float8_e8m0fnu (P, n_blocks, 1, S).

    Returns:
        float32 (P, n_blocks, block_size, S); a block with scale 255 is all NaN.
    """
    return decode_elements(codes, fmt) * e8m0_to_float32(scale_bits)
