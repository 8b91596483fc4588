"""GPU kernels (Triton, and one CUDA/CUTLASS grouped GEMM built at first use), registered as
``torch.library`` custom ops (``torch.ops.mxmoe.*``) where autograd or ``torch.compile`` see
them: :mod:`mxmoe.kernels.quantize` (MX quantizers), :mod:`mxmoe.kernels.moe_experts` (the
fused MoE expert and combine kernels), :mod:`mxmoe.kernels.grouped_zero_fill` (zeroing the
parts of a grouped-GEMM output no group writes) and
:mod:`mxmoe.kernels.cutlass_mx_grouped_gemm` (the sm90 grouped GEMM that quantizes the MXFP8
weight in its mainloop). Importing this package alone does not import Triton."""
