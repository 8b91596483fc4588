"""Degenerate inputs of the public ops (a 0-d x, K = 0, a weight on another device such as
the meta device, a non-integer dim) end in a ValueError / TypeError naming the argument
and what would work, never in an internal error or in uninitialized memory."""

from __future__ import annotations

import pytest
import torch

from mxmoe import fake_quantize_mx, mx_grouped_mm, mx_linear, quantize_mx

OFFS = torch.tensor([2, 4], dtype=torch.int32)

CASES = {
    "mx_linear 0-d x": (lambda: mx_linear(torch.tensor(1.0), torch.randn(8, 64)), ValueError,
                        r"x is a 0-d tensor; mx_linear takes x of shape \(\.\.\., K\)"),
    "mx_linear K = 0": (lambda: mx_linear(torch.randn(4, 0), torch.randn(8, 0)), ValueError,
                        r"x has K = 0 features \(shape \(4, 0\)\); mx_linear needs K >= 1"),
    "mx_linear meta w": (lambda: mx_linear(torch.randn(4, 64), torch.empty(8, 64, device="meta")), ValueError,
                         r"x and w must be on one device, got x on cpu and w on meta"),
    "mx_linear meta x": (lambda: mx_linear(torch.empty(4, 64, device="meta"), torch.randn(8, 64)), ValueError,
                         r"x and w must be on one device, got x on meta and w on cpu"),
    "mx_linear list x": (lambda: mx_linear([1.0], torch.randn(8, 64)), TypeError, r"takes tensors x and w, got list"),
    "mx_grouped_mm K = 0": (lambda: mx_grouped_mm(torch.randn(4, 0), torch.randn(2, 8, 0), OFFS), ValueError,
                            r"x has K = 0 \(shape \(4, 0\)\); mx_grouped_mm needs K >= 1"),
    "mx_grouped_mm meta w": (lambda: mx_grouped_mm(torch.randn(4, 64), torch.empty(2, 8, 64, device="meta"), OFFS),
                             ValueError, r"x, w and offsets must be on one device, got cpu, meta, cpu"),
    "quantize_mx float dim": (lambda: quantize_mx(torch.randn(4, 64), "e4m3", dim=1.0), TypeError,
                              r"dim must be an int \(the dimension to block\), got 1.0 of type float"),
    "quantize_mx bool dim": (lambda: quantize_mx(torch.randn(4, 64), "e4m3", dim=True), TypeError,
                             r"dim must be an int"),
    "quantize_mx dim out of range": (lambda: quantize_mx(torch.randn(4, 64), "e4m3", dim=2), ValueError,
                                     r"dim=2 is out of range for a 2-d tensor; use a dim in \[-2, 1\]"),
    "quantize_mx 0-d": (lambda: quantize_mx(torch.tensor(1.0), "e4m3"), ValueError, r"x is a 0-d tensor"),
    "fake_quantize_mx float dim": (lambda: fake_quantize_mx(torch.randn(4, 64), "e4m3", dim=0.5), TypeError,
                                   r"dim must be an int"),
}


@pytest.mark.parametrize("case", CASES)
def test_degenerate_inputs_are_refused_by_name(case):
    call, error, message = CASES[case]
    with pytest.raises(error, match=message):
        call()
