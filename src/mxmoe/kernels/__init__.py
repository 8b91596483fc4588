"""GPU kernels (Triton). Import :mod:`mxmoe.kernels.quantize` for the MX quantization
custom ops and :mod:`mxmoe.kernels.grouped_gemm` for the MXFP8 grouped GEMMs
(``torch.ops.mxmoe.*``); importing this package alone does not import Triton."""
