"""MX element formats, scale modes and the constants of the OCP Microscaling spec.

Source of every number here: OCP Microscaling Formats (MX) Specification v1.0, sections
5.3 (element data types) and 5.4 (scale, E8M0), restated in ``docs/NUMERICS.md`` of the
shared project docs. ``emax_elem`` is the exponent of the largest normal element
(``floor(log2(max_normal))``); the ``floor`` scale rule subtracts it from the block amax
exponent.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

# Block size of every MX format in the OCP spec (k = 32).
MX_BLOCK_SIZE = 32

# E8M0 scale: unsigned byte b, value 2^(b - 127); b = 255 is NaN; no zero, no infinity.
E8M0_EXPONENT_BIAS = 127
E8M0_NAN = 255
E8M0_MIN_EXPONENT = -127  # b = 0 -> 2^-127
E8M0_MAX_EXPONENT = 127  # b = 254 -> 2^127

# Sign bit and NaN code for 8-bit float elements (E4M3: S.1111.111; E5M2: S.11111.11).
FP8_SIGN_BIT = 0x80
FP8_NAN_CODE = 0x7F


def _parse_enum(cls, value, what: str):
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).lower())
    except ValueError:
        names = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown {what} {value!r}; use one of {names}") from None


class ElemFormat(str, enum.Enum):
    """Element format of an MX block (OCP MX v1.0, section 5.3)."""

    E4M3 = "e4m3"  # MXFP8 E4M3
    E5M2 = "e5m2"  # MXFP8 E5M2
    E3M2 = "e3m2"  # MXFP6 E3M2
    E2M3 = "e2m3"  # MXFP6 E2M3
    E2M1 = "e2m1"  # MXFP4 E2M1
    INT8 = "int8"  # MXINT8, two's complement with implied scale 2^-6

    @classmethod
    def parse(cls, value: "ElemFormat | str") -> "ElemFormat":
        """Return the format named by ``value``.

        Raises:
            ValueError: ``value`` names no MX element format.
        """
        return _parse_enum(cls, value, "MX element format")

    @property
    def spec(self) -> "ElemSpec":
        """The element format's bit layout and limits (:data:`ELEM_SPECS`)."""
        return ELEM_SPECS[self]


class ScaleMode(str, enum.Enum):
    """Rule that picks a block's E8M0 scale from its amax (docs/NUMERICS.md)."""

    FLOOR = "floor"  # OCP MX v1.0 section 6.3: e = floor(log2(amax)) - emax_elem
    RCEIL = "rceil"  # NVIDIA recipe: e = ceil(log2(amax / max_normal)); nothing saturates

    @classmethod
    def parse(cls, value: "ScaleMode | str") -> "ScaleMode":
        """Return the scale mode named by ``value``.

        Raises:
            ValueError: ``value`` names no scale mode.
        """
        return _parse_enum(cls, value, "scale mode")


@dataclass(frozen=True)
class ElemSpec:
    """Bit layout and range of one element format.

    Attributes:
        ebits, mbits: exponent and mantissa bits (sign bit not counted; 0 and 7 for INT8).
        bias: exponent bias (unused for INT8).
        max_normal: largest finite magnitude (for INT8: 127/64).
        emax_elem: floor(log2(max_normal)); the ``floor`` scale rule subtracts it.
        min_normal_exp: exponent of the smallest normal (1 - bias); the grid spacing below
            it is constant (subnormals), 2^(min_normal_exp - mbits).
        bits: storage bits per element (8, 6 or 4).
        torch_dtype: the torch dtype ``MXTensor.qdata`` uses for this format.
    """

    ebits: int
    mbits: int
    bias: int
    max_normal: float
    emax_elem: int
    bits: int
    torch_dtype: torch.dtype

    @property
    def min_normal_exp(self) -> int:
        """Unbiased exponent of the smallest normal value (1 - bias)."""
        return 1 - self.bias

    @property
    def min_subnormal(self) -> float:
        """Smallest positive (subnormal) magnitude: 2^(min_normal_exp - mbits)."""
        return 2.0 ** (self.min_normal_exp - self.mbits)


# INT8 elements are k / 64 for integer k in [-127, 127] (OCP MX v1.0 section 5.3.3; the
# code -128 is not used so that the grid is symmetric).
INT8_IMPLIED_SCALE_EXP = -6
INT8_MAX_CODE = 127

ELEM_SPECS: dict[ElemFormat, ElemSpec] = {
    ElemFormat.E4M3: ElemSpec(4, 3, 7, 448.0, 8, 8, torch.float8_e4m3fn),
    ElemFormat.E5M2: ElemSpec(5, 2, 15, 57344.0, 15, 8, torch.float8_e5m2),
    ElemFormat.E3M2: ElemSpec(3, 2, 3, 28.0, 4, 6, torch.uint8),
    ElemFormat.E2M3: ElemSpec(2, 3, 1, 7.5, 2, 6, torch.uint8),
    ElemFormat.E2M1: ElemSpec(2, 1, 1, 6.0, 2, 4, torch.float4_e2m1fn_x2),
    # INT8 is a fixed-point grid. Described as a float format with no exponent range
    # (min_normal_exp = 1 - bias = 0) and 6 fraction bits, its spacing is
    # 2^(min_normal_exp - mbits) = 2^INT8_IMPLIED_SCALE_EXP everywhere, as it must be.
    ElemFormat.INT8: ElemSpec(0, 6, 1, INT8_MAX_CODE / 64.0, 0, 8, torch.int8),
}
