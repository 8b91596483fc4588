"""Blackwell ("blocked", "swizzled") layout of MX scales and its inverse.

Block-scaled MMA on sm100 (cuBLAS, CUTLASS, ``torch._scaled_mm`` with E8M0 scales) reads
scales in tiles of 128 rows x 4 scale columns. Each tile is stored as 512 contiguous bytes,
a 32 x 16 block: the scale of row r, column c inside the tile sits at byte
``(r % 32) * 16 + (r // 32) * 4 + c``. Tiles follow each other row-tile-major
(all column tiles of rows 0..127, then of rows 128..255, ...). Rows are zero-padded to a
multiple of 128 and scale columns to a multiple of 4 (docs/NUMERICS.md, "Blackwell scale
layout"; cuBLAS documentation, "1D block scaling factors layout").
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCKED_TILE_ROWS = 128
BLOCKED_TILE_COLS = 4
_SUBTILE_ROWS = 32  # 128 rows = 4 groups of 32, interleaved within each 16-byte row


def _ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def blocked_scales_numel(rows: int, cols: int) -> int:
    """Bytes of the blocked layout of a (rows, cols) scale matrix (after padding)."""
    return _ceil_to(rows, BLOCKED_TILE_ROWS) * _ceil_to(cols, BLOCKED_TILE_COLS)


def to_blocked_scales(scale: Tensor) -> Tensor:
    """Rearrange row-major scales into the Blackwell blocked layout.

    Args:
        scale: (..., rows, cols) with cols = K / block_size, any 1-byte dtype (normally
            ``float8_e8m0fnu``); leading dims (for example experts) are independent
            matrices.

    Returns:
        Tensor (..., R * C) in ``scale``'s dtype, contiguous, where R = rows rounded up to
        128 and C = cols rounded up to 4; padding bytes are 0.

    Raises:
        TypeError: ``scale`` is not a tensor.
        ValueError: ``scale`` has fewer than 2 dims or is not a 1-byte dtype.
    """
    if not isinstance(scale, Tensor):
        raise TypeError(f"scale must be a torch.Tensor of E8M0 scales, got {type(scale).__name__}")
    if scale.dim() < 2:
        raise ValueError(f"scale must be (..., rows, cols), got shape {tuple(scale.shape)}")
    if scale.element_size() != 1:
        raise ValueError(f"scale must be a 1-byte dtype (float8_e8m0fnu or uint8), got {scale.dtype}")
    *lead, rows, cols = scale.shape
    R, C = _ceil_to(rows, BLOCKED_TILE_ROWS), _ceil_to(cols, BLOCKED_TILE_COLS)
    b = scale.view(torch.uint8)
    padded = torch.zeros(*lead, R, C, dtype=torch.uint8, device=scale.device)
    padded[..., :rows, :cols] = b
    # (.., R/128, 4 groups of 32 rows, 32, C/4, 4) -> (.., R/128, C/4, 32, 4 groups, 4)
    t = padded.reshape(*lead, R // BLOCKED_TILE_ROWS, BLOCKED_TILE_ROWS // _SUBTILE_ROWS, _SUBTILE_ROWS,
                       C // BLOCKED_TILE_COLS, BLOCKED_TILE_COLS)
    n = len(lead)
    t = t.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return t.reshape(*lead, R * C).contiguous().view(scale.dtype)


def from_blocked_scales(blocked: Tensor, rows: int, cols: int) -> Tensor:
    """Inverse of :func:`to_blocked_scales`: blocked (..., R * C) -> row-major (..., rows, cols).

    Args:
        blocked: (..., R * C), 1-byte dtype, R and C as in :func:`to_blocked_scales`.
        rows, cols: the unpadded scale matrix shape.

    Returns:
        Contiguous tensor (..., rows, cols) in ``blocked``'s dtype (padding dropped).

    Raises:
        TypeError: ``blocked`` is not a tensor.
        ValueError: ``rows``/``cols`` not integers >= 0, or the last dim of ``blocked`` is
            not R * C for these rows and cols.
    """
    if not isinstance(blocked, Tensor):
        raise TypeError(f"blocked must be a torch.Tensor of E8M0 scales, got {type(blocked).__name__}")
    for name, value in (("rows", rows), ("cols", cols)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    R, C = _ceil_to(rows, BLOCKED_TILE_ROWS), _ceil_to(cols, BLOCKED_TILE_COLS)
    if blocked.dim() < 1 or blocked.shape[-1] != R * C:
        raise ValueError(
            f"blocked scales of a ({rows}, {cols}) matrix have {R * C} bytes in the last dim, "
            f"got shape {tuple(blocked.shape)}"
        )
    lead = blocked.shape[:-1]
    n = len(lead)
    t = blocked.view(torch.uint8).reshape(*lead, R // BLOCKED_TILE_ROWS, C // BLOCKED_TILE_COLS, _SUBTILE_ROWS,
                                          BLOCKED_TILE_ROWS // _SUBTILE_ROWS, BLOCKED_TILE_COLS)
    t = t.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4).reshape(*lead, R, C)
    return t[..., :rows, :cols].contiguous().view(blocked.dtype)
