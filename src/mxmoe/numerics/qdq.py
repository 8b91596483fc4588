"""Fused quantize-dequantize ("fake quantization") in pure torch.

``torch_fake_quantize_mx(x, ...)`` returns exactly ``torch_quantize_mx(x, ...).dequantize(out_dtype)``
(tests/numerics/test_qdq.py checks it bit for bit) with fewer passes over memory, which is what
the emulated MXFP8 GEMMs need on the CPU:

- blocks are reached through a view (no transposes), and the scales are applied by
  broadcasting;
- for FP8 with bf16/float32 output, rounding is torch's float8 cast (round to nearest
  even, after saturation), and decoding re-reads the FP8 bits as the high bits of a
  bf16/float32 and multiplies by 2^(bias_out - bias_elem): exact, subnormals included,
  and much faster on the CPU than a float8 -> float conversion;
- a block holding NaN or inf needs no extra pass: its E8M0 scale 255 decodes to NaN and
  the final multiply spreads it over the block, as the rules require.

Other formats and float16 output take the reference path (quantize, then dequantize).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .formats import E8M0_EXPONENT_BIAS, MX_BLOCK_SIZE, ElemFormat, ScaleMode
from .mx_tensor import blocked_view, check_quantize_call, torch_quantize_mx, zero_pad_to_block
from .reference import block_amax, e8m0_to_float32, exp2i, torch_mx_scale_bits

# Where the FP8 bits go inside a wider float: shift left by (target mantissa bits - element
# mantissa bits) into a value 2^(target bias - element bias) too small.
_FAST_OUT = {torch.bfloat16: (torch.int16, 7, 127), torch.float32: (torch.int32, 23, 127)}
_SIGN_BIT = {torch.int16: -(1 << 15), torch.int32: -(1 << 31)}


def _fp8_codes_to_float(codes: Tensor, fmt: ElemFormat, out_dtype: torch.dtype) -> Tensor:
    """Exact element values of finite FP8 codes in ``out_dtype`` (bf16 or float32).

    Bits S.EEEE.MMM (E4M3) shifted into S.EEEEEEEE.MMMMMMM... keep exponent and mantissa
    fields; the value is then the element value times 2^(elem_bias - out_bias) for normals
    and subnormals alike. NaN/inf codes give finite junk: callers only use them in blocks
    whose scale is NaN.
    """
    spec = fmt.spec
    int_dtype, out_mbits, out_bias = _FAST_OUT[out_dtype]
    v = codes.view(torch.int8).to(int_dtype)  # sign-extends: the sign lands in the top bit
    shift = out_mbits - spec.mbits
    magnitude_mask = 0x7F << shift
    bits = torch.bitwise_left_shift(v, shift) & (_SIGN_BIT[int_dtype] | magnitude_mask)
    return bits.view(out_dtype) * (2.0 ** (out_bias - spec.bias))


def torch_fake_quantize_mx(
    x: Tensor,
    fmt: ElemFormat | str = ElemFormat.E4M3,
    *,
    block_size: int = MX_BLOCK_SIZE,
    dim: int = -1,
    scale_mode: ScaleMode | str = ScaleMode.RCEIL,
    pad: bool = False,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``torch_quantize_mx(x, ...).dequantize(out_dtype)`` in one pass-light function (the
    pure-torch backend of :func:`mxmoe.fake_quantize_mx`).

    Args:
        x, fmt, block_size, dim, scale_mode, pad: as :func:`~mxmoe.quantize_mx`.
        out_dtype: float32, bfloat16 or float16; default x's dtype.

    Returns:
        Tensor of x's shape and ``out_dtype``, contiguous, equal bit for bit to the
        dequantized MXTensor. Never requires grad (as :func:`~mxmoe.quantize_mx`).

    Raises:
        The errors of :func:`~mxmoe.quantize_mx`.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    fmt, scale_mode, dim, x = check_quantize_call(x, fmt, block_size, dim, scale_mode, pad)
    fast = fmt in (ElemFormat.E4M3, ElemFormat.E5M2) and out_dtype in _FAST_OUT and x.dtype in _FAST_OUT
    size = x.shape[dim]
    if not fast or (size % block_size and not pad):
        return torch_quantize_mx(x, fmt, block_size=block_size, dim=dim, scale_mode=scale_mode, pad=pad).dequantize(out_dtype)
    if size % block_size:  # zero padding leaves every amax, hence every scale, unchanged
        out = torch_fake_quantize_mx(zero_pad_to_block(x, dim, block_size), fmt, block_size=block_size, dim=dim,
                                     scale_mode=scale_mode, out_dtype=out_dtype)
        return out.narrow(dim, 0, size).contiguous()
    spec = fmt.spec
    xb = blocked_view(x.contiguous(), dim, block_size)  # (P, n_blocks, block_size, S)
    scale_bits = torch_mx_scale_bits(block_amax(xb), fmt, scale_mode)  # (P, n_blocks, 1, S)
    scale_exp = scale_bits.to(torch.int32) - E8M0_EXPONENT_BIAS
    # x / 2^e in x's dtype: exact (a power of two; results below the element grid's
    # half-step only ever round to zero). NaN-scale blocks divide by 2^128 (harmless).
    y = xb * exp2i(-scale_exp).to(x.dtype)
    codes = y.clamp_(-spec.max_normal, spec.max_normal).to(spec.torch_dtype)
    out = _fp8_codes_to_float(codes, fmt, out_dtype)
    out = out * e8m0_to_float32(scale_bits).to(out_dtype)  # NaN scale -> NaN block
    return out.view(x.shape)
