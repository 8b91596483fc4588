"""GPU kernels (Triton). Import :mod:`mxmoe.kernels.quantize` for the MX quantization
custom ops (``torch.ops.mxmoe.*``); importing this package alone does not import Triton."""
