"""fake_quantize_mx equals quantize_mx(...).dequantize(...) bit for bit, on every path."""

from __future__ import annotations

import pytest
import torch

from mxmoe import ElemFormat, ScaleMode, quantize_mx
from mxmoe import fake_quantize_mx


def hard_values(shape, gen: torch.Generator) -> torch.Tensor:
    """Blocks over 2^-40..2^40 with zeros, -0, float32 subnormals, NaN, +-inf, values at
    and around max normal, so that every branch of the rules is exercised."""
    n = torch.Size(shape).numel()
    exps = torch.randint(-40, 41, (n // 32 + 1, 1), generator=gen).double()
    inner = torch.rand(n // 32 + 1, 32, generator=gen, dtype=torch.float64) * 12 - 11
    x = (torch.exp2(exps + inner) * torch.where(torch.rand(n // 32 + 1, 32, generator=gen) < 0.5, -1, 1)).float()
    x = x.reshape(-1)[:n]
    specials = torch.tensor([0.0, -0.0, 1e-40, -3e-42, 448.0, 464.0, 57344.0, 61440.0, 1e38])
    idx = torch.randint(0, n, (n // 20,), generator=gen)
    x[idx] = specials[torch.randint(0, len(specials), (len(idx),), generator=gen)]
    for v in (float("nan"), float("inf"), -float("inf")):
        x[torch.randint(0, n, (max(n // 400, 1),), generator=gen)] = v
    return x.reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, except that any NaN matches any NaN."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    return torch.equal(a[~nan_a].view(-1).float().view(torch.int32), b[~nan_b].view(-1).float().view(torch.int32))


@pytest.mark.parametrize("fmt", [f.value for f in ElemFormat])
@pytest.mark.parametrize("mode", [m.value for m in ScaleMode])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 1])
def test_fake_quantize_equals_quantize_dequantize(fmt, mode, in_dtype, out_dtype, dim):
    gen = torch.Generator().manual_seed(hash((fmt, mode, str(in_dtype), str(out_dtype), dim)) % 2**31)
    x = hard_values((96, 64), gen).to(in_dtype)
    want = quantize_mx(x, fmt, dim=dim, scale_mode=mode).dequantize(out_dtype)
    got = fake_quantize_mx(x, fmt, dim=dim, scale_mode=mode, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == x.shape
    assert same_bits(got, want)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_fake_quantize_3d_padded_and_views(dim):
    gen = torch.Generator().manual_seed(dim)
    x = hard_values((40, 37, 50), gen).to(torch.bfloat16).transpose(0, 2)  # non-contiguous
    want = quantize_mx(x, dim=dim, pad=True).dequantize(torch.bfloat16)
    got = fake_quantize_mx(x, dim=dim, pad=True, out_dtype=torch.bfloat16)
    assert got.shape == x.shape and same_bits(got, want)
    with pytest.raises(ValueError, match="pad=True"):
        fake_quantize_mx(x, dim=dim)


def test_fp8_code_decoding_covers_every_code():
    """Every finite E4M3 / E5M2 code decodes exactly through the bit re-interpretation."""
    from mxmoe.numerics.qdq import _fp8_codes_to_float

    for fmt in (ElemFormat.E4M3, ElemFormat.E5M2):
        codes = torch.arange(256, dtype=torch.uint8).view(fmt.spec.torch_dtype)
        want = codes.float()
        finite = torch.isfinite(want)
        for out in (torch.float32, torch.bfloat16):
            got = _fp8_codes_to_float(codes, fmt, out)
            assert torch.equal(got[finite].float(), want[finite])
            assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))


def every_finite_float16() -> torch.Tensor:
    """Every finite float16 value (63,488 bit patterns with both signs), each heading its
    own 32-block of zeros so that it is its block's amax."""
    bits = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    v = bits[torch.isfinite(bits)]
    x = torch.zeros(v.numel(), 32, dtype=torch.float16)
    x[:, 0] = v
    return x


@pytest.mark.parametrize("fmt", [f.value for f in ElemFormat])
@pytest.mark.parametrize("mode", [m.value for m in ScaleMode])
def test_float16_round_trip_is_finite_and_saturates(fmt, mode):
    """A float16 tensor's round trip stays finite for every finite float16 value, every
    element format and scale rule: the MX value (float32) rounded to float16 and saturated
    to +-65504 (docs/ARCHITECTURE.md); 65504 under rceil E4M3 is MX 65536."""
    x = every_finite_float16()
    mx = quantize_mx(x, fmt, scale_mode=mode)
    exact = mx.dequantize(torch.float32)
    want = exact.clamp(-65504, 65504).to(torch.float16)
    for got in (mx.dequantize(torch.float16), fake_quantize_mx(x, fmt, scale_mode=mode)):
        assert torch.isfinite(got).all()
        assert same_bits(got, want)
    if fmt == "e4m3" and mode == "rceil":
        assert exact[x[:, 0] == 65504][0, 0].item() == 65536.0


def test_float16_gemm_operands_near_65504_stay_finite():
    """mx_linear in float16 with inputs where the MX value rounds past float16's range."""
    from mxmoe import mx_linear

    x = torch.full((4, 64), 65000.0, dtype=torch.float16)
    w = torch.full((8, 64), 2.0**-12, dtype=torch.float16)
    y = mx_linear(x, w, "mxfp8")
    assert torch.isfinite(y).all()
