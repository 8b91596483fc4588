"""GPU check of the pure-torch path: run on a CUDA machine (the H200).

- quantize_mx / fake_quantize_mx on CUDA equal the CPU reference bit for bit (every
  format and scale mode, bf16 and float32 input, blocks over 2^-40..2^40 with NaN / inf);
- mx_linear and mx_grouped_mm on CUDA (torch._grouped_mm in bf16 where supported) against
  float64 products of the same quantized operands, and against the CPU op;
- prints one line per check and exits non-zero on any failure.

    PYTHONPATH=src python3 benchmarks/check_cuda_reference.py
"""

from __future__ import annotations

import sys

import torch

from mxmoe import ElemFormat, ScaleMode, mx_grouped_mm, mx_linear, quantize_mx
from mxmoe.numerics import fake_quantize_mx

failures = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")
    if not ok:
        failures.append(name)


def hard_values(n_blocks: int, gen: torch.Generator) -> torch.Tensor:
    exps = torch.randint(-40, 41, (n_blocks, 1), generator=gen).double()
    inner = torch.rand(n_blocks, 32, generator=gen, dtype=torch.float64) * 12 - 11
    x = (torch.exp2(exps + inner) * torch.where(torch.rand(n_blocks, 32, generator=gen) < 0.5, -1, 1)).float()
    flat = x.view(-1)
    flat[torch.randint(0, flat.numel(), (50,), generator=gen)] = float("nan")
    flat[torch.randint(0, flat.numel(), (50,), generator=gen)] = float("inf")
    flat[torch.randint(0, flat.numel(), (500,), generator=gen)] = 0.0
    return x.view(-1, 256)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(-1).view(torch.uint8)


def main() -> int:
    assert torch.cuda.is_available(), "needs a CUDA device"
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}")
    gen = torch.Generator().manual_seed(0)
    x_cpu = hard_values(4096, gen)  # (512, 256)
    for fmt in ElemFormat:
        for mode in ScaleMode:
            for dtype in (torch.float32, torch.bfloat16):
                xc = x_cpu.to(dtype)
                for dim in (0, 1):
                    a = quantize_mx(xc, fmt, dim=dim, scale_mode=mode)
                    b = quantize_mx(xc.to(dev), fmt, dim=dim, scale_mode=mode)
                    same = torch.equal(bits(a.qdata), bits(b.qdata).cpu()) and torch.equal(
                        bits(a.scale), bits(b.scale).cpu())
                    fa = fake_quantize_mx(xc, fmt, dim=dim, scale_mode=mode, out_dtype=dtype)
                    fb = fake_quantize_mx(xc.to(dev), fmt, dim=dim, scale_mode=mode, out_dtype=dtype).cpu()
                    nan = torch.isnan(fa)
                    same_fq = torch.equal(nan, torch.isnan(fb)) and torch.equal(fa[~nan], fb[~nan])
                    check(f"quantize {fmt.value} {mode.value} {dtype} dim={dim}", same and same_fq)

    # GEMMs: CUDA bf16 path vs float64 products of the same quantized operands
    sizes = [162, 0, 2577, 446, 0, 83]
    T, K, N = sum(sizes) + 7, 2880, 1408
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, K, generator=g)
    x[sum(sizes):] = float("nan")  # rows past the last offset: never read
    w = torch.randn(len(sizes), N, K, generator=g) / 50
    dy = torch.randn(T, N, generator=g)
    xg = x.to(dev, torch.bfloat16).requires_grad_(True)
    wg = w.to(dev).requires_grad_(True)
    y = mx_grouped_mm(xg, wg, offsets.to(dev), "mxfp8")
    y.backward(dy.to(dev, torch.bfloat16))
    torch.cuda.synchronize()
    check("grouped rows past end are zero", bool((y[sum(sizes):] == 0).all()) and bool((xg.grad[sum(sizes):] == 0).all()))
    check("grouped empty experts dW == 0", bool((wg.grad[1] == 0).all()) and bool((wg.grad[4] == 0).all()))
    start = 0
    worst = 0.0
    for e, n in enumerate(sizes):
        if n == 0:
            continue
        rows = slice(start, start + n)
        xq = quantize_mx(x[rows].to(torch.bfloat16), dim=1).dequantize().double()
        wq = quantize_mx(w[e], dim=1).dequantize().double()
        ref = xq @ wq.t()
        err = ((y[rows].double().cpu() - ref).norm() / ref.norm()).item()
        worst = max(worst, err)
        start += n
    check("grouped forward vs float64 of quantized operands", worst < 4e-3, f"(rel err {worst:.2e}, bf16 output)")
    xl = torch.randn(1000, 1024, generator=g)
    wl = torch.randn(512, 1024, generator=g) / 30
    yl = mx_linear(xl.to(dev, torch.bfloat16), wl.to(dev), "mxfp8").double().cpu()
    ref = quantize_mx(xl.to(torch.bfloat16)).dequantize().double() @ quantize_mx(wl).dequantize().double().t()
    err = ((yl - ref).norm() / ref.norm()).item()
    check("linear forward vs float64 of quantized operands", err < 4e-3, f"(rel err {err:.2e})")
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
