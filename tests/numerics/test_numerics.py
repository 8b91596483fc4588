"""MX numerics reference: bit-exact against docs/NUMERICS.md, its worked cases and an
independent oracle (tests/numerics/mx_oracle.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import mx_oracle
from mxmoe import ElemFormat, ScaleMode, dequantize_mx, from_blocked_scales, quantize_mx, to_blocked_scales
from mxmoe.numerics.reference import exp2i, pack_fp4, round_to_elem_grid, unpack_fp4

CASES_PATH = Path(__file__).parent / "data" / "mx_blocks.json"
SHARED_CASES_PATH = Path(__file__).resolve().parents[3] / "shared" / "cases" / "mx_blocks.json"
ALL_FORMATS = [f.value for f in ElemFormat]
ALL_MODES = [m.value for m in ScaleMode]


def _load_cases():
    return json.loads(CASES_PATH.read_text())["cases"]


def _floats(values) -> torch.Tensor:
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def _same_values(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal value by value, NaN where expected NaN, and the sign of zeros equal."""
    actual, expected = actual.double(), expected.double()
    nan_ok = torch.equal(torch.isnan(actual), torch.isnan(expected))
    finite = ~torch.isnan(expected)
    return (
        nan_ok
        and torch.equal(actual[finite], expected[finite])
        and torch.equal(torch.signbit(actual[finite]), torch.signbit(expected[finite]))
    )


@pytest.mark.parametrize("copy,shared", [
    (CASES_PATH, SHARED_CASES_PATH),
    (Path(__file__).resolve().parents[2] / "docs" / "NUMERICS.md", SHARED_CASES_PATH.parents[1] / "docs" / "NUMERICS.md"),
])
def test_in_repo_copies_match_the_shared_contract(copy, shared):
    """tests/numerics/data/mx_blocks.json and docs/NUMERICS.md are copies of the project's shared
    contract (../shared beside a developer checkout; CI checks out the repository alone)."""
    if not shared.exists():
        pytest.skip(f"{shared} is not beside this checkout")
    assert copy.read_bytes() == shared.read_bytes()


def _bf16_exact(case) -> bool:
    x = _floats(case["values"]).float()
    return torch.equal(x.to(torch.bfloat16).float().nan_to_num(7.0), x.nan_to_num(7.0))


# every case with float32 input; with bfloat16 input too where its values are bf16-exact
_CASE_PARAMS = [pytest.param(c, torch.float32, id=f"{c['name']}-f32") for c in _load_cases()] + [
    pytest.param(c, torch.bfloat16, id=f"{c['name']}-bf16") for c in _load_cases() if _bf16_exact(c)
]


@pytest.mark.parametrize("case,in_dtype", _CASE_PARAMS)
def test_worked_cases_bit_exact(case, in_dtype):
    x = _floats(case["values"]).to(torch.float32).to(in_dtype)
    mx = quantize_mx(x, case["fmt"], scale_mode=case["scale_mode"])
    assert mx.scale.dtype == torch.float8_e8m0fnu
    assert mx.scale.view(torch.uint8).item() == case["scale_byte"]
    assert _same_values(mx.elements(), _floats(case["elements"]))
    assert _same_values(mx.dequantize(torch.float32), _floats(case["dequantized"]).float())


def _random_blocks(n_blocks: int, block: int, gen: torch.Generator, lo: int = -40, hi: int = 40) -> torch.Tensor:
    """Blocks whose magnitudes sit around 2^e with e drawn per block in [lo, hi], values
    spread over about 12 binades inside each block, random signs, some exact zeros."""
    exps = torch.randint(lo, hi + 1, (n_blocks, 1), generator=gen).double()
    inner = torch.rand(n_blocks, block, generator=gen, dtype=torch.float64) * 12 - 11
    sign = torch.where(torch.rand(n_blocks, block, generator=gen) < 0.5, -1.0, 1.0).double()
    x = sign * torch.exp2(exps + inner)
    x[torch.rand(n_blocks, block, generator=gen) < 0.05] = 0.0
    return x.float()


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_random_blocks_match_oracle(fmt, mode, in_dtype):
    gen = torch.Generator().manual_seed(hash((fmt, mode, str(in_dtype))) % 2**31)
    x = _random_blocks(48, 32, gen).to(in_dtype)
    mx = quantize_mx(x, fmt, scale_mode=mode)
    scale_bytes = mx.scale.view(torch.uint8).reshape(-1).tolist()
    elems = mx.elements()
    deq = mx.dequantize()
    for i in range(x.shape[0]):
        b, want_elems, want_deq = mx_oracle.quantize_block(x[i].float().numpy(), fmt, mode)
        assert scale_bytes[i] == b, f"block {i}: scale byte {scale_bytes[i]} != oracle {b}"
        np.testing.assert_array_equal(elems[i].double().numpy(), want_elems)
        np.testing.assert_array_equal(deq[i].numpy(), want_deq)
        assert not torch.isinf(deq[i]).any()


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("mode", ALL_MODES)
def test_special_blocks_every_format(fmt, mode):
    """NaN and +-Inf blocks give scale 255 and an all-NaN block; zero blocks give b = 0
    with signed zeros; float32 subnormals are kept (not flushed)."""
    x = torch.zeros(5, 32)
    x[0, 3] = float("nan")
    x[1, 7] = float("inf")
    x[2, 0] = -float("inf")
    x[3, 1] = -0.0
    x[4] = torch.linspace(-1e-39, 1e-39, 32)  # float32 subnormals
    x[:3, 10] = 5.0  # finite neighbours of the non-finite values
    mx = quantize_mx(x, fmt, scale_mode=mode)
    b = mx.scale.view(torch.uint8).reshape(-1).tolist()
    assert b[:3] == [255, 255, 255]
    assert b[3] == 0
    deq = mx.dequantize()
    assert torch.isnan(deq[:3]).all()
    assert torch.equal(deq[3], torch.zeros(32))
    assert torch.signbit(deq[3, 1]) == (fmt != "int8")  # two's complement has no -0
    want = mx_oracle.quantize_block(x[4].numpy(), fmt, mode)
    assert b[4] == want[0]
    np.testing.assert_array_equal(deq[4].numpy(), want[2])
    if fmt in ("e4m3", "e5m2"):
        codes = mx.qdata.view(torch.uint8)[:3]
        assert torch.isnan(mx.qdata[:3].float()).all()
        # NaN code 0x7F carrying the input's sign bit
        assert codes[2, 0].item() == 0xFF and codes[2, 10].item() == 0x7F


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_generic_rounding_equals_torch_float8_cast(fmt):
    """The FP8 fast path (torch's float8 cast after saturation) equals the format-generic
    rounding rule on every float8 value, every midpoint between neighbours (ties), points
    just off the midpoints, and values beyond max normal."""
    spec = ElemFormat(fmt).spec
    codes = torch.arange(256, dtype=torch.uint8).view(spec.torch_dtype).float()
    grid = torch.sort(codes[torch.isfinite(codes)].unique()).values
    mids = (grid[1:] + grid[:-1]) / 2
    eps = torch.nextafter(mids, torch.full_like(mids, math.inf)) - mids
    probes = torch.cat([grid, mids, mids + eps, mids - eps, torch.tensor([spec.max_normal * 1.07, 1e30])])
    probes = torch.cat([probes, -probes])
    via_cast = probes.clamp(-spec.max_normal, spec.max_normal).to(spec.torch_dtype).float()
    generic = round_to_elem_grid(probes, ElemFormat(fmt))
    assert torch.equal(via_cast, generic)
    assert torch.equal(torch.signbit(via_cast), torch.signbit(generic))


def test_exp2i_exact_over_float32_range():
    e = torch.arange(-149, 128)
    got = exp2i(e).double()
    want = torch.tensor([math.ldexp(1.0, int(k)) for k in e], dtype=torch.float64)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_transposed_view_equals_contiguous_copy(fmt):
    gen = torch.Generator().manual_seed(1)
    base = _random_blocks(8, 96, gen).reshape(96, 8)  # (K=96, M=8)
    view = base.t()  # (8, 96), non-contiguous
    for dim in (0, 1):
        a = quantize_mx(view if dim == 1 else base, fmt, dim=dim)
        b = quantize_mx((view if dim == 1 else base).contiguous(), fmt, dim=dim)
        assert torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8))
        assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    # dim 0 of the transposed view blocks the same values as dim 1 of the original
    x = torch.randn(64, 32)
    a = quantize_mx(x.t(), fmt, dim=0)  # (32, 64) blocked along its first dim
    b = quantize_mx(x.t().contiguous(), fmt, dim=0)
    c = quantize_mx(x, fmt, dim=1)
    assert torch.equal(a.dequantize(), b.dequantize())
    assert torch.equal(a.dequantize(), c.dequantize().t())
    assert a.scale.shape == (1, 64) and c.scale.shape == (64, 1)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_any_rank_and_dim_matches_blockwise_oracle(fmt, dim):
    gen = torch.Generator().manual_seed(7)
    x =  _random_blocks(64 * 64 * 2, 32, gen, -6, 6).reshape(64, 64, 64)
    mx = quantize_mx(x, fmt, dim=dim)
    d = dim % 3
    assert mx.qdata.shape[d] == (32 if fmt == "e2m1" else 64)
    assert mx.scale.shape[d] == 2 and mx.scale.is_contiguous()
    ref = quantize_mx(x.movedim(d, -1).contiguous(), fmt, dim=-1)
    assert torch.equal(mx.dequantize(), ref.dequantize().movedim(-1, d))


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_equal_their_float32_upcast(in_dtype, out_dtype):
    x = (torch.randn(16, 64) * 30).to(in_dtype)
    a = quantize_mx(x)
    b = quantize_mx(x.float())
    assert torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8))
    assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    out = a.dequantize(out_dtype)
    assert out.dtype == out_dtype
    assert torch.equal(out, b.dequantize(torch.float32).to(out_dtype))


def test_fp4_pack_unpack_round_trip_and_nibble_order():
    codes = torch.randint(0, 16, (3, 7, 64), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (3, 7, 32)
    assert torch.equal(unpack_fp4(packed), codes)
    small = pack_fp4(torch.tensor([[0x1, 0xA, 0xF, 0x0]], dtype=torch.uint8)).view(torch.uint8)
    assert small.tolist() == [[0xA1, 0x0F]]  # even index in the low nibble
    # quantize_mx packs along the blocked dim, also when it is not the last one
    x = torch.randn(64, 6)
    mx = quantize_mx(x, "e2m1", dim=0)
    assert mx.qdata.shape == (32, 6)
    row = quantize_mx(x.t().contiguous(), "e2m1", dim=1)
    assert torch.equal(mx.dequantize(), row.dequantize().t())


def test_fp4_and_fp6_codes_are_the_bit_layout():
    # E2M1: 0 0.5 1 1.5 2 3 4 6 are codes 0..7; the sign is bit 3
    x = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -6] + [0.0] * 22)
    mx = quantize_mx(x, "e2m1", scale_mode="floor")
    assert mx.scale.view(torch.uint8).item() == 127
    assert mx.codes()[:10].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9, 15]
    # E3M2 (bias 3): 28 = 1.75 * 2^4 -> sign 0, exp 7, mantissa 3 = 0b011111
    y = torch.tensor([28.0, -0.0625] + [0.0] * 30)
    mx6 = quantize_mx(y, "e3m2", scale_mode="floor")
    assert mx6.scale.view(torch.uint8).item() == 127
    assert mx6.codes()[:2].tolist() == [0b011111, 0b100001]  # -2^-4: min subnormal


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_pad_is_remembered(fmt):
    x = torch.randn(3, 70)
    with pytest.raises(ValueError, match=r"size 70 along dim 1 .* block_size 32.*96.*pad=True"):
        quantize_mx(x, fmt)
    mx = quantize_mx(x, fmt, pad=True)
    assert mx.shape == x.shape and mx.scale.shape == (3, 3)
    out = dequantize_mx(mx)
    assert out.shape == x.shape
    padded = quantize_mx(torch.nn.functional.pad(x, (0, 26)), fmt)
    assert torch.equal(out, padded.dequantize()[:, :70])
    assert torch.equal(mx.scale.view(torch.uint8), padded.scale.view(torch.uint8))


def test_bad_arguments_have_clear_errors():
    x = torch.randn(2, 32)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        quantize_mx(x.double())
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        quantize_mx(torch.ones(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="unknown MX element format 'fp8'.*'e4m3'"):
        quantize_mx(x, "fp8")
    with pytest.raises(ValueError, match="unknown scale mode 'ceil'.*'rceil'"):
        quantize_mx(x, scale_mode="ceil")
    with pytest.raises(ValueError, match="dim=2 is out of range"):
        quantize_mx(x, dim=2)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        quantize_mx(x, block_size=0)
    with pytest.raises(TypeError, match="MXTensor"):
        dequantize_mx(x)
    with pytest.raises(TypeError, match="dtype torch.int8"):
        quantize_mx(x).dequantize(torch.int8)


def test_blocked_layout_hand_built_example():
    """A (130, 5) scale matrix: 2 row tiles x 2 column tiles, each 512 bytes."""
    rows, cols = 130, 5
    scale = (torch.arange(rows * cols) % 251 + 1).to(torch.uint8).reshape(rows, cols)
    blocked = to_blocked_scales(scale.view(torch.float8_e8m0fnu))
    assert blocked.dtype == torch.float8_e8m0fnu and blocked.shape == (256 * 8,)
    flat = blocked.view(torch.uint8)
    expected = torch.zeros(256 * 8, dtype=torch.uint8)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * 2 + (c // 4)  # row-tile-major, 2 column tiles per row tile
            rr, cc = r % 128, c % 4
            expected[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc] = scale[r, c]
    assert torch.equal(flat, expected)
    # a few positions by hand: row 33, col 2 -> tile 0, byte 1*16 + 1*4 + 2 = 22
    assert flat[22].item() == scale[33, 2].item()
    # row 129, col 4 -> tile 3 (row tile 1, col tile 1), byte (1 % 32) * 16 + 0 + 0
    assert flat[3 * 512 + 16].item() == scale[129, 4].item()
    assert torch.equal(from_blocked_scales(blocked, rows, cols).view(torch.uint8), scale)


def test_blocked_layout_batched_and_inverse():
    scale = torch.randint(0, 255, (3, 200, 9), dtype=torch.uint8)
    blocked = to_blocked_scales(scale)
    assert blocked.shape == (3, 256 * 12)
    for e in range(3):
        assert torch.equal(blocked[e], to_blocked_scales(scale[e]))
    assert torch.equal(from_blocked_scales(blocked, 200, 9), scale)
    with pytest.raises(ValueError, match="3072 bytes"):
        from_blocked_scales(blocked[:, :-1], 200, 9)
