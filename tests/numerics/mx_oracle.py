"""An independent, deliberately naive oracle of docs/NUMERICS.md, for tests only.

It shares no code with ``mxmoe.numerics``: float64 numpy, the element grid enumerated
from the bit layout, nearest grid point found by search, ties to the even code, the scale
read off ``math.frexp``. Slow, obvious, and a second opinion on every rule.
"""

from __future__ import annotations

import math

import numpy as np

# (ebits, mbits, bias, has_ieee_inf, nan_code_all_ones) per format; INT8 is special-cased.
FLOAT_LAYOUTS = {
    "e4m3": (4, 3, 7),
    "e5m2": (5, 2, 15),
    "e3m2": (3, 2, 3),
    "e2m3": (2, 3, 1),
    "e2m1": (2, 1, 1),
}
MAX_NORMAL = {"e4m3": 448.0, "e5m2": 57344.0, "e3m2": 28.0, "e2m3": 7.5, "e2m1": 6.0, "int8": 127 / 64}


def positive_grid(fmt: str) -> np.ndarray:
    """All non-negative finite element values, indexed by their code (so index parity is
    code parity, which is what ties-to-even looks at)."""
    if fmt == "int8":
        return np.arange(128, dtype=np.float64) / 64.0
    ebits, mbits, bias = FLOAT_LAYOUTS[fmt]
    values = []
    for code in range(1 << (ebits + mbits)):
        e_field, m_field = code >> mbits, code & ((1 << mbits) - 1)
        if e_field == 0:
            v = m_field * 2.0 ** (1 - bias - mbits)
        else:
            v = (1 + m_field / 2**mbits) * 2.0 ** (e_field - bias)
        values.append(v)
    grid = np.array(values)
    return grid[grid <= MAX_NORMAL[fmt]]  # drops E4M3's NaN code and E5M2's inf/NaN codes


def emax_elem(fmt: str) -> int:
    return math.frexp(MAX_NORMAL[fmt])[1] - 1


def scale_exponent(amax: np.float32, fmt: str, mode: str) -> int | None:
    """Unbiased scale exponent, or None for a NaN scale (byte 255)."""
    amax = np.float32(amax)
    if not np.isfinite(amax):
        return None
    if mode == "floor":
        if amax == 0:
            e = -127
        else:
            e = (math.frexp(float(amax))[1] - 1) - emax_elem(fmt)
    else:
        d = np.float32(amax) * np.float32(1.0 / MAX_NORMAL[fmt])  # float32 product
        if d == 0:
            e = -127
        else:
            m, ex = math.frexp(float(d))
            e = ex - 1 if m == 0.5 else ex
    return max(-127, min(127, e))


def round_to_grid(y: float, fmt: str) -> float:
    grid = positive_grid(fmt)
    a = abs(y)
    if a >= grid[-1]:
        r = grid[-1]
    else:
        i = int(np.searchsorted(grid, a))  # grid[i-1] < a <= grid[i]
        if grid[i] == a:
            r = grid[i]
        else:
            lo, hi = grid[i - 1], grid[i]
            if a - lo < hi - a:
                r = lo
            elif hi - a < a - lo:
                r = hi
            else:
                r = lo if (i - 1) % 2 == 0 else hi
    return math.copysign(r, y)


def quantize_block(values: np.ndarray, fmt: str, mode: str) -> tuple[int, np.ndarray, np.ndarray]:
    """One block -> (scale byte, element values, dequantized values as float32)."""
    v = values.astype(np.float32)
    amax = np.max(np.abs(v))
    e = scale_exponent(amax, fmt, mode)
    if e is None:
        nan = np.full(v.shape, np.nan)
        return 255, nan, nan.astype(np.float32)
    elems = np.array([round_to_grid(float(x) / 2.0**e, fmt) for x in v])
    deq = (elems * 2.0**e).astype(np.float32)
    return e + 127, elems, deq
