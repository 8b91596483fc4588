"""The quantizers and GEMM ops on a CUDA device against the CPU reference.

- ``quantize_mx`` / ``fake_quantize_mx`` of CUDA tensors ("auto" backend: the Triton
  kernels where they cover the format, the pure-torch reference elsewhere) equal the CPU
  reference bit for bit: every element format and scale mode, float32 and bf16 input,
  blocks along either dimension, values over 2^-40..2^40 with NaN, inf and zeros;
- ``mx_grouped_mm`` (forward and backward) and ``mx_linear`` on CUDA against float64
  products of the same quantized operands.
"""

from __future__ import annotations

import pytest
import torch

from mxmoe import ElemFormat, ScaleMode, fake_quantize_mx, mx_grouped_mm, mx_linear, quantize_mx

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = torch.device("cuda")


def hard_values(n_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """(n_blocks * 32 / 256, 256) float32: 32-blocks with exponents over 2^-40..2^40, random
    signs, 50 NaN, 50 inf and 500 zeros placed at random."""
    exps = torch.randint(-40, 41, (n_blocks, 1), generator=gen).double()
    inner = torch.rand(n_blocks, 32, generator=gen, dtype=torch.float64) * 12 - 11
    x = (torch.exp2(exps + inner) * torch.where(torch.rand(n_blocks, 32, generator=gen) < 0.5, -1, 1)).float()
    flat = x.view(-1)
    flat[torch.randint(0, flat.numel(), (50,), generator=gen)] = float("nan")
    flat[torch.randint(0, flat.numel(), (50,), generator=gen)] = float("inf")
    flat[torch.randint(0, flat.numel(), (500,), generator=gen)] = 0.0
    return x.view(-1, 256)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8).cpu()


@pytest.fixture(scope="module")
def x_cpu() -> torch.Tensor:
    return hard_values(4096, torch.Generator().manual_seed(0))  # (512, 256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("mode", list(ScaleMode), ids=lambda m: m.value)
@pytest.mark.parametrize("fmt", list(ElemFormat), ids=lambda f: f.value)
def test_quantize_on_cuda_equals_cpu_reference(x_cpu, fmt, mode, dtype):
    xc = x_cpu.to(dtype)
    for dim in (0, 1):
        a = quantize_mx(xc, fmt, dim=dim, scale_mode=mode)
        b = quantize_mx(xc.to(DEV), fmt, dim=dim, scale_mode=mode)
        assert torch.equal(bits(a.qdata), bits(b.qdata)), f"codes differ, dim={dim}"
        assert torch.equal(bits(a.scale), bits(b.scale)), f"scales differ, dim={dim}"
        fa = fake_quantize_mx(xc, fmt, dim=dim, scale_mode=mode, out_dtype=dtype)
        fb = fake_quantize_mx(xc.to(DEV), fmt, dim=dim, scale_mode=mode, out_dtype=dtype).cpu()
        nan = torch.isnan(fa)
        assert torch.equal(nan, torch.isnan(fb)), f"NaN positions differ, dim={dim}"
        assert torch.equal(fa[~nan], fb[~nan]), f"fake-quantized values differ, dim={dim}"


def test_grouped_mm_against_float64_of_quantized_operands():
    sizes = [162, 0, 2577, 446, 0, 83]
    T, K, N = sum(sizes) + 7, 2880, 1408
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, K, generator=g)
    x[sum(sizes):] = float("nan")  # rows past the last offset: never read
    w = torch.randn(len(sizes), N, K, generator=g) / 50
    dy = torch.randn(T, N, generator=g)
    xg = x.to(DEV, torch.bfloat16).requires_grad_(True)
    wg = w.to(DEV).requires_grad_(True)
    y = mx_grouped_mm(xg, wg, offsets.to(DEV), "mxfp8")
    y.backward(dy.to(DEV, torch.bfloat16))
    torch.cuda.synchronize()
    end = sum(sizes)
    assert bool((y[end:] == 0).all()) and bool((xg.grad[end:] == 0).all()), "rows past the end must be zero"
    assert bool((wg.grad[1] == 0).all()) and bool((wg.grad[4] == 0).all()), "empty experts must get dW == 0"
    start, worst = 0, 0.0
    for e, n in enumerate(sizes):
        if n == 0:
            continue
        rows = slice(start, start + n)
        xq = quantize_mx(x[rows].to(torch.bfloat16), dim=1).dequantize().double()
        wq = quantize_mx(w[e], dim=1).dequantize().double()
        ref = xq @ wq.t()
        worst = max(worst, ((y[rows].double().cpu() - ref).norm() / ref.norm()).item())
        start += n
    assert worst < 4e-3, f"relative error {worst:.2e} (bf16 output)"


def test_linear_against_float64_of_quantized_operands():
    g = torch.Generator().manual_seed(2)
    xl = torch.randn(1000, 1024, generator=g)
    wl = torch.randn(512, 1024, generator=g) / 30
    yl = mx_linear(xl.to(DEV, torch.bfloat16), wl.to(DEV), "mxfp8").double().cpu()
    ref = quantize_mx(xl.to(torch.bfloat16)).dequantize().double() @ quantize_mx(wl).dequantize().double().t()
    err = ((yl - ref).norm() / ref.norm()).item()
    assert err < 4e-3, f"relative error {err:.2e}"
