"""An :class:`~mxmoe.numerics.MXTensor` built by hand (from a file, another library, a
test) is checked at construction: every field of the wrong type, dtype, shape or range is
refused naming the field and what would work, so that no kernel or dequantizer reads a
malformed one. Every quantizer's output, in every format, still constructs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mxmoe import quantize_mx
from mxmoe.numerics import ElemFormat, MXTensor, ScaleMode


@pytest.fixture(scope="module")
def mx() -> MXTensor:
    return quantize_mx(torch.randn(4, 64), "e4m3", dim=-1)


def _with(mx: MXTensor, **fields) -> MXTensor:
    d = {f.name: getattr(mx, f.name) for f in dataclasses.fields(MXTensor)}
    d.update(fields)
    return MXTensor(**d)


# (field changes, error, message): one per kind of malformed field
BAD = {
    "qdata not a tensor": (dict(qdata=[[0]]), TypeError, r"MXTensor qdata must be a torch.Tensor, got list"),
    "scale not a tensor": (dict(scale=None), TypeError, r"MXTensor scale must be a torch.Tensor, got NoneType"),
    "qdata float32": (dict(qdata=torch.zeros(4, 64)), TypeError,
                      r"MXTensor qdata of format e4m3 must be torch.float8_e4m3fn, got torch.float32"),
    "qdata of another format": (dict(qdata=torch.zeros(4, 64, dtype=torch.float8_e5m2)), TypeError,
                                r"must be torch.float8_e4m3fn, got torch.float8_e5m2"),
    "scale uint8": (dict(scale=torch.zeros(4, 2, dtype=torch.uint8)), TypeError,
                    r"MXTensor scale must be torch.float8_e8m0fnu \(E8M0\), got torch.uint8"),
    "unknown format": (dict(fmt="e9m9"), ValueError, r"e9m9"),
    "unknown scale mode": (dict(scale_mode="round"), ValueError, r"round"),
    "block_size 0": (dict(block_size=0), ValueError, r"MXTensor block_size must be a positive int"),
    "block_size float": (dict(block_size=32.0), TypeError, r"MXTensor block_size must be an int, got 32.0"),
    "dim bool": (dict(dim=True), TypeError, r"MXTensor dim must be an int, got True"),
    "dim out of range": (dict(dim=2), ValueError, r"MXTensor dim 2 is out of range for qdata of shape \(4, 64\)"),
    "scale of another shape": (dict(scale=torch.zeros(4, 3, dtype=torch.float8_e8m0fnu)), ValueError,
                               r"MXTensor shapes do not match: qdata \(4, 64\), scale \(4, 3\)"),
    "scale of another rank": (dict(scale=torch.zeros(8, dtype=torch.float8_e8m0fnu)), ValueError,
                              r"MXTensor shapes do not match"),
    "blocks along the other dim": (dict(dim=0), ValueError, r"MXTensor shapes do not match"),
    "0-d qdata": (dict(qdata=torch.zeros((), dtype=torch.float8_e4m3fn)), ValueError, r"out of range for qdata"),
    "orig_size past the padding": (dict(orig_size=65), ValueError,
                                   r"MXTensor orig_size 65 does not fit a padded size of 64 \(blocks of 32\): use a "
                                   r"value in \(32, 64\]"),
    "orig_size a whole block short": (dict(orig_size=32), ValueError, r"orig_size 32 does not fit"),
    "negative orig_size": (dict(orig_size=-1), ValueError, r"orig_size -1 does not fit"),
    "orig_size text": (dict(orig_size="64"), TypeError, r"MXTensor orig_size must be an int, got '64'"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_malformed_field_is_refused_by_name(mx, case):
    fields, error, message = BAD[case]
    with pytest.raises(error, match=message):
        _with(mx, **fields)


@pytest.mark.parametrize("fmt", [f.value for f in ElemFormat])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_every_quantizer_output_constructs_again(fmt, dim):
    x = torch.randn(64, 96)
    mx = quantize_mx(x, fmt, dim=dim, pad=True)
    again = _with(mx, fmt=fmt, scale_mode=mx.scale_mode.value, dim=dim)  # names parsed, dim made non-negative
    assert again.fmt is mx.fmt and again.scale_mode is mx.scale_mode and again.dim == dim % 2
    assert torch.equal(again.dequantize(), mx.dequantize())


def test_padding_shorter_than_a_block_is_accepted():
    mx = quantize_mx(torch.randn(4, 40), "e4m3", dim=-1, pad=True)
    assert mx.orig_size == 40 and tuple(mx.qdata.shape) == (4, 64)
    assert _with(mx, orig_size=33).shape == (4, 33)
    assert ScaleMode.parse(mx.scale_mode) is mx.scale_mode
