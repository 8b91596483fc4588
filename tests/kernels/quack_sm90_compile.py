"""Compile every QuACK GEMM of mxmoe.kernels.quack_moe for sm90 on a machine without a GPU
(run by tests/kernels/test_quack_moe.py in a subprocess; needs quack-kernels).

QuACK builds its kernels from fake tensors (TVM-FFI) and honours ``QUACK_ARCH`` for a
CPU-only build; CuTe-DSL compiles through NVVM to a cubin, then loads it with the CUDA
driver. Here the load (``Compiler.jit``) is replaced by a no-op and QuACK's
``COMPILE_ONLY`` skips the launch, so each wrapper's exact arguments (dtypes, majors,
varlen, gather, concat layout) are traced, lowered and compiled for sm_90a, nothing run.
Prints one line per GEMM kind and "compiled: N".
"""

import functools
import os
import sys

os.environ["QUACK_ARCH"] = "sm_90"
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
os.environ.setdefault("QUACK_CACHE_ENABLED", "0")

import torch  # noqa: E402

import quack.cache_utils as cache_utils  # noqa: E402
from cutlass.base_dsl.compiler import Compiler  # noqa: E402

cache_utils.COMPILE_ONLY = True
cache_utils.CACHE_ENABLED = False
Compiler.jit = lambda self, module, *args, **kwargs: None  # compile to a cubin, load nothing

import quack.gemm_interface as gi  # noqa: E402

for name in ("gemm_out", "gemm_act_out", "gemm_dact_out", "gemm_gated_out", "gemm_dgated_out"):
    op = getattr(gi, name)
    setattr(gi, name, getattr(op, "_init_fn", op))  # the CUDA-only custom ops' Python bodies
for name in ("gemm_tuned", "gemm_act_tuned", "gemm_dact_tuned", "gemm_gated_tuned", "gemm_dgated_tuned"):
    tuned = getattr(gi, name)
    setattr(gi, name, functools.partial(tuned.fn, config=None))  # the default sm90 config, no autotuning

from mxmoe.kernels import quack_moe  # noqa: E402


def main() -> int:
    T, k, E, D, F = 256, 2, 4, 256, 128
    A = T * k
    bf = dict(dtype=torch.bfloat16)
    x, dy = torch.zeros(T, D, **bf), torch.zeros(T, D, **bf)
    w13, w2 = torch.zeros(E, 2 * F, D, **bf), torch.zeros(E, D, F, **bf)
    src = torch.zeros(A, dtype=torch.int32)
    cu = quack_moe.cu_seqlens(torch.tensor([A // 4, A // 2, 3 * A // 4, A], dtype=torch.int32))
    h, act = quack_moe.gated_up_projection(x, src, cu, w13)
    print("gated up projection (varlen-M, gathered A, SwiGLU epilogue): ok", flush=True)
    quack_moe.down_projection(act, w2, cu)
    print("down projection (varlen-M): ok", flush=True)
    dh, sact, _ = quack_moe.down_projection_dgated(dy, src, cu, w2, h, torch.zeros(A))
    print("down projection dgrad (varlen-M, gathered A, dSwiGLU + score epilogue): ok", flush=True)
    quack_moe.up_projection_dgrad(dh, w13, cu)
    print("up projection dgrad (varlen-M, concat B): ok", flush=True)
    dw13 = torch.zeros_like(w13)
    quack_moe.gathered_weight_grad(x, src, cu, dh, dw13.permute(0, 2, 1), interleaved_b=True)
    print("w13 weight gradient (varlen-K, gathered A, concat out): ok", flush=True)
    quack_moe.gathered_weight_grad(dy, src, cu, sact, torch.zeros_like(w2), interleaved_b=False)
    print("w2 weight gradient (varlen-K, gathered A): ok", flush=True)
    print("compiled: 6")
    return 0


if __name__ == "__main__":
    sys.exit(main())
