"""The MX tensor and its pure-torch quantizer: :class:`MXTensor`, :func:`torch_quantize_mx`,
:func:`torch_dequantize_mx`.

These are the reference (docs/NUMERICS.md) and the CPU backend. The public
:func:`mxmoe.quantize_mx` / :func:`mxmoe.dequantize_mx` (:mod:`mxmoe.ops.quantize`) choose
between them and the Triton kernels by the rule of :mod:`mxmoe.ops.backend`; every
backend gives the same bytes.

Layout conventions (shared by every backend):
- ``qdata`` keeps the logical shape of the (padded) input, contiguous, with the blocked
  dimension where it was; FP4 packs two elements per byte along the blocked dimension,
  so that dimension is halved there.
- ``scale`` has the input's shape with the blocked dimension divided by ``block_size``,
  contiguous, dtype ``torch.float8_e8m0fnu``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .formats import MX_BLOCK_SIZE, ElemFormat, ScaleMode
from .reference import decode_elements, pack_fp4, torch_dequantize_blocks, torch_quantize_blocks, unpack_fp4

SUPPORTED_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class MXTensor:
    """A tensor quantized to an MX format: element codes plus one E8M0 scale per block.

    Attributes:
        qdata: element codes, shape of the padded input (blocked dim halved for FP4);
            dtype ``float8_e4m3fn`` / ``float8_e5m2`` (FP8), ``uint8`` one element per byte
            (FP6: sign, exponent, mantissa in the low 6 bits), ``float4_e2m1fn_x2``
            (FP4, two per byte, even index in the low nibble) or ``int8`` (INT8, value
            code / 64).
        scale: ``float8_e8m0fnu``, the padded input's shape with ``dim`` divided by
            ``block_size``; byte b stands for 2^(b - 127), 255 for NaN.
        fmt: element format. block_size: elements per block (32 in the OCP spec).
        dim: the blocked dimension (non-negative). scale_mode: rule that chose the scales.
        orig_size: size of ``dim`` before zero padding (``quantize_mx(pad=True)``);
            dequantization drops the padding.

    Construction checks that the fields describe one MX tensor (``fmt`` and
    ``scale_mode`` may be given by name and are parsed; a negative ``dim`` is made
    non-negative).

    Raises:
        TypeError: ``qdata``/``scale`` is not a tensor or has the wrong dtype for ``fmt``
            (:data:`~mxmoe.numerics.formats.ELEM_SPECS`) / E8M0, or ``block_size``,
            ``dim``, ``orig_size`` is not an int.
        ValueError: an unknown ``fmt``/``scale_mode``, ``qdata`` and ``scale`` on different
            devices, ``block_size`` < 1 (or odd for E2M1), ``dim`` out of range, ``qdata`` and ``scale`` shapes that do not
            match (every dimension equal except ``dim``, where ``qdata`` holds
            ``block_size`` elements per scale, half as many bytes for E2M1), or an
            ``orig_size`` outside ``(padded - block_size, padded]``.
    """

    qdata: Tensor
    scale: Tensor
    fmt: ElemFormat
    block_size: int
    dim: int
    scale_mode: ScaleMode
    orig_size: int

    def __post_init__(self) -> None:
        self.fmt = ElemFormat.parse(self.fmt)
        self.scale_mode = ScaleMode.parse(self.scale_mode)
        for name in ("qdata", "scale"):
            value = getattr(self, name)
            if not isinstance(value, Tensor):
                raise TypeError(f"MXTensor {name} must be a torch.Tensor, got {type(value).__name__}")
        for name in ("block_size", "dim", "orig_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"MXTensor {name} must be an int, got {value!r}")
        want = self.fmt.spec.torch_dtype
        if self.qdata.dtype != want:
            raise TypeError(f"MXTensor qdata of format {self.fmt.value} must be {want}, got {self.qdata.dtype}")
        if self.scale.dtype != torch.float8_e8m0fnu:
            raise TypeError(f"MXTensor scale must be torch.float8_e8m0fnu (E8M0), got {self.scale.dtype}")
        if self.block_size < 1 or (self.fmt is ElemFormat.E2M1 and self.block_size % 2):
            raise ValueError(f"MXTensor block_size must be a positive int (even for e2m1), got {self.block_size}")
        if self.qdata.device != self.scale.device:
            raise ValueError(f"MXTensor qdata and scale must be on one device, got qdata on {self.qdata.device} and "
                             f"scale on {self.scale.device}")
        ndim = self.qdata.dim()
        if ndim == 0 or not -ndim <= self.dim < ndim:
            raise ValueError(f"MXTensor dim {self.dim} is out of range for qdata of shape {tuple(self.qdata.shape)}")
        self.dim %= ndim
        per_byte = 2 if self.fmt is ElemFormat.E2M1 else 1
        expect = list(self.scale.shape)
        if len(expect) == ndim:
            expect[self.dim] = expect[self.dim] * self.block_size // per_byte
        if tuple(self.qdata.shape) != tuple(expect):
            raise ValueError(
                f"MXTensor shapes do not match: qdata {tuple(self.qdata.shape)}, scale {tuple(self.scale.shape)}, "
                f"block_size {self.block_size}, dim {self.dim}; the scale must have qdata's shape with dim "
                f"{self.dim} holding one scale per {self.block_size} elements")
        padded = self.scale.shape[self.dim] * self.block_size
        if not max(0, padded - self.block_size) < self.orig_size <= padded and not (padded == 0 == self.orig_size):
            raise ValueError(f"MXTensor orig_size {self.orig_size} does not fit a padded size of {padded} "
                             f"(blocks of {self.block_size}): use a value in ({max(0, padded - self.block_size)}, "
                             f"{padded}]")

    @property
    def padded_shape(self) -> torch.Size:
        """Shape of the padded input (``dim`` a multiple of ``block_size``)."""
        shape = list(self.scale.shape)
        shape[self.dim] *= self.block_size
        return torch.Size(shape)

    @property
    def shape(self) -> torch.Size:
        """Shape of the original (unpadded) input and of :meth:`dequantize`'s result."""
        shape = list(self.padded_shape)
        shape[self.dim] = self.orig_size
        return torch.Size(shape)

    def codes(self) -> Tensor:
        """Unpacked element codes, shape :attr:`padded_shape` (FP4 unpacked to one per uint8)."""
        if self.fmt is ElemFormat.E2M1:
            return unpack_fp4(self.qdata, self.dim)
        return self.qdata

    def elements(self) -> Tensor:
        """Element values P_i as float32, shape :attr:`padded_shape` (scales not applied;
        FP8 NaN codes give NaN)."""
        return decode_elements(self.codes(), self.fmt)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """Values P_i * 2^(b - 127), computed exactly in float32, then rounded to ``dtype``
        (pure torch: :func:`torch_dequantize_mx`; :func:`mxmoe.dequantize_mx` also runs
        the Triton kernel on CUDA).

        Args:
            dtype: float32, bfloat16 or float16.

        Returns:
            Tensor of shape :attr:`shape` (padding dropped), contiguous; blocks with scale
            255 are NaN.

        Raises:
            TypeError: ``dtype`` is not a supported float dtype.
        """
        return torch_dequantize_mx(self, dtype)


def check_quantize_args(x: Tensor, block_size: int, dim: int) -> int:
    """Validate the arguments every quantizer shares; returns ``dim`` made non-negative.

    Raises:
        TypeError: x not a float32/bfloat16/float16 tensor.
        ValueError: x 0-d or on the meta device; block_size not a positive int; dim out of range.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}; build it with torch.as_tensor(...)")
    if x.device.type == "meta":
        raise ValueError("x is on the meta device (a shape without data); quantize a tensor that holds values")
    if x.dtype not in SUPPORTED_INPUT_DTYPES:
        raise TypeError(
            f"x has dtype {x.dtype}; quantize_mx takes float32, bfloat16 or float16 (cast first)"
        )
    if x.dim() == 0:
        raise ValueError("x is a 0-d tensor; quantize_mx needs at least one dimension to block")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int (the OCP MX value is 32), got {block_size!r}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int (the dimension to block), got {dim!r} of type {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a {x.dim()}-d tensor; use a dim in [{-x.dim()}, {x.dim() - 1}]")
    return dim % x.dim()


def check_block_multiple(size: int, dim: int, block_size: int, pad: bool) -> None:
    """Raise ValueError unless ``size`` (along ``dim``) is a multiple of ``block_size`` or
    ``pad`` allows zero padding."""
    remainder = size % block_size
    if remainder and not pad:
        raise ValueError(
            f"size {size} along dim {dim} is not a multiple of block_size {block_size}; "
            f"zero-pad it to {size + block_size - remainder} or pass pad=True"
        )


def torch_quantize_mx(
    x: Tensor,
    fmt: ElemFormat | str = ElemFormat.E4M3,
    *,
    block_size: int = MX_BLOCK_SIZE,
    dim: int = -1,
    scale_mode: ScaleMode | str = ScaleMode.RCEIL,
    pad: bool = False,
) -> MXTensor:
    """Quantize ``x`` to an MX format, blocks of ``block_size`` consecutive values along ``dim``.

    The pure-torch reference of :func:`mxmoe.quantize_mx` (any device, every format).
    Rules: docs/NUMERICS.md (OCP MX v1.0; ``rceil`` is NVIDIA's MXFP8 training recipe).

    Args:
        x, fmt, block_size, dim, scale_mode, pad: as :func:`mxmoe.quantize_mx` (x: float32,
            bfloat16 or float16, any rank >= 1, any strides).

    Returns:
        :class:`MXTensor` with contiguous ``qdata`` and ``scale``. Not differentiable: they
        never require grad, whatever ``x`` does (rounding has no useful gradient; the
        MX ops' autograd Functions define theirs, and a straight-through estimator is
        ``x + (fake_quantize_mx(x) - x).detach()``).

    Note: under ``rceil`` a block whose amax is within one element step of float32's
    largest value rounds its largest element up to 2^(emax+1) (e4m3: 256 with scale
    2^120), which dequantizes to inf in float32. That is what the rule of
    docs/NUMERICS.md gives; it needs inputs above 3.3e38.

    Raises:
        TypeError: ``x`` is not a float32/bfloat16/float16 tensor.
        ValueError: unknown ``fmt`` or ``scale_mode``; ``dim`` out of range; size along
            ``dim`` not a multiple of ``block_size`` and ``pad`` is False; odd block size
            with "e2m1".
    """
    fmt, scale_mode, dim, x = check_quantize_call(x, fmt, block_size, dim, scale_mode, pad)
    size = x.shape[dim]
    if size % block_size:
        x = zero_pad_to_block(x, dim, block_size)
    blocks = blocked_view(x.contiguous(), dim, block_size)
    codes, scale_bits = torch_quantize_blocks(blocks, fmt, scale_mode)
    qdata = codes.view(x.shape)
    if fmt is ElemFormat.E2M1:
        qdata = pack_fp4(qdata, dim)
    scale_shape = list(x.shape)
    scale_shape[dim] //= block_size
    scale = scale_bits.view(scale_shape).view(torch.float8_e8m0fnu)
    return MXTensor(qdata, scale, fmt, block_size, dim, scale_mode, size)


def check_quantize_call(x: Tensor, fmt: ElemFormat | str, block_size: int, dim: int,
                        scale_mode: ScaleMode | str, pad: bool) -> tuple[ElemFormat, ScaleMode, int, Tensor]:
    """Validate a quantizer call (every backend runs this first).

    Returns:
        ``(fmt, scale_mode, dim, x)``: the parsed enums, ``dim`` made non-negative and ``x``
        detached (quantization is not differentiable on any backend: the MX ops' autograd
        Functions own gradients).

    Raises:
        The errors of :func:`torch_quantize_mx`.
    """
    fmt = ElemFormat.parse(fmt)
    scale_mode = ScaleMode.parse(scale_mode)
    dim = check_quantize_args(x, block_size, dim)
    if fmt is ElemFormat.E2M1 and block_size % 2:
        raise ValueError(f"e2m1 packs two elements per byte: block_size must be even, got {block_size}")
    check_block_multiple(x.shape[dim], dim, block_size, pad)
    return fmt, scale_mode, dim, x.detach()


def zero_pad_to_block(x: Tensor, dim: int, block_size: int) -> Tensor:
    """``x`` with zeros appended along ``dim`` up to a multiple of ``block_size``."""
    remainder = x.shape[dim] % block_size
    if not remainder:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = block_size - remainder
    return torch.cat([x, x.new_zeros(pad_shape)], dim=dim)


def blocked_view(x: Tensor, dim: int, block_size: int) -> Tensor:
    """View contiguous ``x`` as (P, n_blocks, block_size, S), blocks along ``dim``."""
    shape = x.shape
    P, S = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
    return x.view(P, shape[dim] // block_size, block_size, S)


def check_dequantize_call(mx: MXTensor, dtype: torch.dtype) -> None:
    """Validate a dequantizer call (every backend runs this first).

    Raises:
        TypeError: ``mx`` is not an MXTensor or ``dtype`` is not float32/bfloat16/float16.
    """
    if not isinstance(mx, MXTensor):
        raise TypeError(f"expected an MXTensor, got {type(mx).__name__}")
    if mx.qdata.device.type == "meta":
        raise ValueError("the MXTensor is on the meta device (shapes without data); dequantize one that holds values")
    if dtype not in SUPPORTED_OUTPUT_DTYPES:
        raise TypeError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")


# float16's largest finite value: float16 outputs saturate to it (docs/ARCHITECTURE.md)
FLOAT16_MAX = 65504.0


def torch_dequantize_mx(mx: MXTensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Dequantize ``mx`` in pure torch: v'_i = P_i * 2^(b - 127) exactly in float32, then
    cast to ``dtype`` (the reference of :func:`mxmoe.dequantize_mx`).

    Args:
        mx: an :class:`MXTensor`.
        dtype: float32 (default), bfloat16 or float16 (rounded from the float32 value;
            float16 saturates: values beyond its largest finite 65504 become +-65504, not
            inf; docs/ARCHITECTURE.md, "The three GEMMs of a linear layer").

    Returns:
        Tensor of ``mx.shape`` (padding dropped), contiguous, blocked dim where it was;
        blocks with scale 255 are NaN; never requires grad.

    Raises:
        TypeError: ``mx`` is not an MXTensor or ``dtype`` is not a supported float dtype.
    """
    check_dequantize_call(mx, dtype)
    with torch.no_grad():
        codes = mx.codes().contiguous()
        blocks = blocked_view(codes, mx.dim, mx.block_size)
        scale_bits = mx.scale.view(torch.uint8).reshape(blocks.shape[0], blocks.shape[1], 1, blocks.shape[3])
        values = torch_dequantize_blocks(blocks, scale_bits, mx.fmt).view(codes.shape)
        if mx.orig_size != codes.shape[mx.dim]:
            values = values.narrow(mx.dim, 0, mx.orig_size)
        if dtype == torch.float16:  # saturate (NaN stays NaN): a float16 round trip stays finite
            values = values.clamp(-FLOAT16_MAX, FLOAT16_MAX)
        return values.to(dtype).contiguous()
