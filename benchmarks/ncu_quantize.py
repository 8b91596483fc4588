"""Drive each quantization kernel once for Nsight Compute (run under ``ncu``): row-wise,
row + column, column-only and grouped column-wise at (16384, 8192) bf16, in that order."""

import torch

from mxmoe.kernels import quantize as kq

x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16)
offsets = torch.linspace(0, 16384, 65, device="cuda")[1:].round().to(torch.int32)
kq.quantize_rowwise(x)
kq.quantize_rowcol(x)
kq.quantize_colwise(x)
kq.quantize_grouped_colwise(x, offsets)
torch.cuda.synchronize()
