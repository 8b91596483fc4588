"""Design (e) of the MXFP8 grouped GEMM on sm90: design (d)'s weight quantized inside a
Gluon wgmma kernel, with TMA operand loads and the quantization written in PTX (experimental).

Forward of the expert GEMM, out[t, n] = sum_k xq[t, k] Q(w[e(t), n, :])[k]: xq the
activation already quantized and dequantized (a quantize pass, bf16), Q the MX quantization
of the raw bf16 weight along k, dequantized (docs/NUMERICS.md). Per program one output tile
of BLOCK_W weight rows (the wgmma M side) by BLOCK_T tokens of one expert (the N side).

What changed against design (d) (benchmarks/gluon_wq.py; NOTES.md, session 11, says why
(d) lost: ~17 SASS instructions per weight element, and a cp.async skeleton slower than
cuBLAS):

- operands by TMA into a ring of STAGES (raw weight tile and token tile per stage), one
  mbarrier per stage, issued STAGES - 1 steps ahead by one thread; no cp.async groups;
- each thread owns one whole 32-element block of the raw weight tile (one row, 32
  consecutive k), so the block amax needs no shuffles, and one PTX block per thread does
  the whole block: packed bf16x2 amax (max.u16x2 on the sign-cleared bits), the scale
  exponent (rceil or floor, the quantizers' rule), then per pair of elements the multiply
  by 2^-e, cvt.rn.satfinite.{e4m3,e5m2}x2, the exact decode back to f16x2, the multiply by
  2^e and the bf16 pack: ~9.4 SASS instructions per element against ~17;
- non-finite blocks: the dequantization scale is NaN, so every element of the block is NaN
  in the GEMM (the quantize pass writes NaN too; the payload never leaves the kernel);
- program order: the tiles of one expert together, weight-tile major (all token tiles of a
  weight tile in a row: the weight tile is read from HBM once) or token-tile major.

Bit-exactness against design (a) rests on the same rules as the quantizers' PTX path
(round to nearest even with saturation in cvt.rn.satfinite; the scale from the float32
amax times 1/max in rceil mode, :func:`mxmoe.kernels.triton_quantize._scale_exponent`);
benchmarks/wq_kernels_bench.py checks the output bit-equal to (a) on the H200 at every shape
it times. Triton 3.6's Gluon dialect; sm90 only (no CPU interpreter for Gluon or TMA).
"""

from __future__ import annotations

import struct

import torch
import triton
from torch import Tensor

try:  # Gluon (Triton >= 3.5); the module imports without it, the kernel then is None
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    gluon = None

from gluon_wq import _store_tile_t, tile_table, wq_operands  # noqa: E402 - _store_tile_t None without Gluon


def _f32_hex(v: float) -> str:
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


def qdq_block_asm(fmt: str, mode: str) -> str:
    """PTX that quantizes and dequantizes one 32-element MX block of bfloat16 values.

    Operands: $16..$31 the block's 32 bf16 values, two per register (element 2i in the low
    half of $(16 + i)); results $0..$15 the dequantized bf16 values in the same order.
    ``fmt`` "e4m3" or "e5m2"; ``mode`` "rceil" or "floor" (docs/NUMERICS.md, the rules of
    :func:`mxmoe.kernels.triton_quantize._scale_exponent`, which this follows step by step).
    """
    if fmt not in ("e4m3", "e5m2") or mode not in ("rceil", "floor"):
        raise ValueError(f"fmt must be e4m3 or e5m2 and mode rceil or floor, got {fmt!r}, {mode!r}")
    emax, vmax = (8, 448.0) if fmt == "e4m3" else (15, 57344.0)
    lines = [".reg .b32 a<16>, m, t, bits, db, dexp, dman, e, es, sc, xl, xh, g;",
             ".reg .b16 h, g0, g1;", ".reg .f32 d, inv, scf, x0, x1, y0, y1;", ".reg .pred p, q, z, nf;"]
    # block amax on the sign-cleared bf16 bits, two lanes at a time (NaN bits sort above inf)
    lines += [f"and.b32 a{i}, ${16 + i}, 0x7FFF7FFF;" for i in range(16)]
    n = 16
    while n > 1:
        lines += [f"max.u16x2 a{i}, a{i}, a{i + n // 2};" for i in range(n // 2)]
        n //= 2
    lines += ["shr.b32 t, a0, 16;", "and.b32 m, a0, 0xFFFF;", "max.u32 m, m, t;", "shl.b32 bits, m, 16;",
              "setp.ge.u32 nf, bits, 0x7F800000;"]
    if mode == "floor":  # floor(log2 amax) - emax
        lines += ["bfe.u32 e, bits, 23, 8;", f"add.s32 e, e, {-(127 + emax)};"]
    else:  # ceil(log2(amax * (1/max))) in float32, subnormal quotients as the reference
        lines += ["mov.b32 d, bits;", f"mul.f32 d, d, {_f32_hex(1.0 / vmax)};", "mov.b32 db, d;",
                  "bfe.u32 dexp, db, 23, 8;", "and.b32 dman, db, 0x7FFFFF;", "setp.ne.u32 p, dman, 0;",
                  "selp.u32 t, 1, 0, p;", "add.s32 e, dexp, t;", "add.s32 e, e, -127;",
                  "setp.gt.u32 q, dman, 0x400000;", "selp.s32 es, -126, -127, q;", "setp.eq.u32 z, dexp, 0;",
                  "selp.s32 e, es, e, z;"]
    lines += ["max.s32 e, e, -127;", "min.s32 e, e, 127;", "selp.s32 e, 0, e, nf;",
              # 2^-e (a normal float32 for e in [-127, 127]) and 2^e (2^-127 a subnormal), NaN if non-finite
              "sub.s32 t, 127, e;", "shl.b32 t, t, 23;", "mov.b32 inv, t;",
              "add.s32 t, e, 127;", "shl.b32 sc, t, 23;", "setp.lt.s32 q, e, -126;", "selp.b32 sc, 0x400000, sc, q;",
              "selp.b32 sc, 0x7FC00000, sc, nf;", "mov.b32 scf, sc;"]
    for i in range(16):
        lines += [f"shl.b32 xl, ${16 + i}, 16;", f"and.b32 xh, ${16 + i}, 0xFFFF0000;", "mov.b32 x0, xl;",
                  "mov.b32 x1, xh;", "mul.f32 x0, x0, inv;", "mul.f32 x1, x1, inv;",
                  f"cvt.rn.satfinite.{fmt}x2.f32 h, x1, x0;", f"cvt.rn.f16x2.{fmt}x2 g, h;", "mov.b32 {g0, g1}, g;",
                  "cvt.f32.f16 y0, g0;", "cvt.f32.f16 y1, g1;", "mul.f32 y0, y0, scf;", "mul.f32 y1, y1, scf;",
                  f"cvt.rn.bf16x2.f32 ${i}, y1, y0;"]
    return "{\n" + "\n".join(lines) + "\n}"


if gluon is not None:
    @gluon.jit
    def _qdq_blocks(w, ASM: gl.constexpr):
        """w (R, C) bf16, each thread holding whole 32-element blocks along C -> the same
        values quantized and dequantized (bf16)."""
        return gl.inline_asm_elementwise(ASM, "=r," * 16 + "r," * 15 + "r", [w], dtype=gl.bfloat16,
                                         is_pure=True, pack=32)

    @gluon.jit
    def _wq_tma_fwd_kernel(x_desc, w_desc, out_ptr, prog_e, prog_r0, prog_r1, prog_n0, N, K,
                           BLOCK_W: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                           ASM: gl.constexpr, QUANT: gl.constexpr, MMA: gl.constexpr, DIRECT: gl.constexpr,
                           num_warps: gl.constexpr):
        pid = gl.program_id(0)
        e = gl.load(prog_e + pid)
        if e >= 0:
            row0 = gl.load(prog_r0 + pid)
            row1 = gl.load(prog_r1 + pid)
            n0 = gl.load(prog_n0 + pid)
            w_row = e * N + n0
            x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_T, BLOCK_K], x_desc.layout)
            w_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_W, BLOCK_K], w_desc.layout)
            q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_W, BLOCK_K], w_desc.layout)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for p in gl.static_range(STAGES):
                mbarrier.init(ready.index(p), count=1)
            n_k = gl.cdiv(K, BLOCK_K)
            nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
            for p in gl.static_range(STAGES - 1):
                ok = p < n_k
                mbarrier.expect(ready.index(p), nbytes, pred=ok)
                tma.async_copy_global_to_shared(x_desc, [row0, p * BLOCK_K], ready.index(p), x_ring.index(p), pred=ok)
                tma.async_copy_global_to_shared(w_desc, [w_row, p * BLOCK_K], ready.index(p), w_ring.index(p), pred=ok)
            # one thread per 32-element block: a row of the tile, 32 consecutive k
            wl: gl.constexpr = gl.BlockedLayout([1, 32], [32 // (BLOCK_K // 32), BLOCK_K // 32], [num_warps, 1], [1, 0])
            acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, BLOCK_T, 16])
            acc = gl.zeros((BLOCK_W, BLOCK_T), dtype=gl.float32, layout=acc_l)
            for i in range(n_k):
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                if DIRECT:  # timing reference: the raw weight tile straight from the ring (a bf16 GEMM)
                    a_op = w_ring.index(s)
                else:
                    wr = w_ring.index(s).load(wl)
                    if QUANT:
                        wq = _qdq_blocks(wr, ASM)
                    else:  # timing reference: the same kernel without the quantization
                        wq = wr
                    q_smem.index(i % 2).store(wq)
                    fence_async_shared()
                    gl.thread_barrier()
                    a_op = q_smem.index(i % 2)
                if MMA:  # MMA=False: timing reference, everything but the tensor-core work
                    acc = warpgroup_mma(a_op, x_ring.index(s).permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                # wgmma i - 1 is done and every thread read its raw tile: refill its stage
                j = i + STAGES - 1
                sj = j % STAGES
                ok = j < n_k
                mbarrier.expect(ready.index(sj), nbytes, pred=ok)
                tma.async_copy_global_to_shared(x_desc, [row0, j * BLOCK_K], ready.index(sj), x_ring.index(sj), pred=ok)
                tma.async_copy_global_to_shared(w_desc, [w_row, j * BLOCK_K], ready.index(sj), w_ring.index(sj),
                                                pred=ok)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            for p in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(p))
            _store_tile_t(acc, out_ptr, n0, row0, row1, N, BLOCK_W, BLOCK_T, num_warps)
else:  # pragma: no cover
    _wq_tma_fwd_kernel = None


def gluon_grouped_mm_wq_tma_fwd(xq: Tensor, w: Tensor, offsets: Tensor, *, fmt: str = "e4m3", mode: str = "rceil",
                                block_w: int = 128, block_t: int = 256, block_k: int = 64, stages: int = 3,
                                num_warps: int = 8, order: str = "weight", quantize: bool = True,
                                mma: bool = True, direct: bool = False) -> Tensor:
    """out (T, N) bf16 = xq[t] Q(w[e])^T: design (e) (module docs). xq (T, K) bf16 dequantized
    MX values along K; w (E, N, K) bf16 raw, contiguous; offsets (E,) int32 cumulative ends.
    Rows at and past offsets[-1] are zeros. CUDA (sm90) only; K a multiple of 8 (TMA's
    16-byte row pitch). ``quantize=False`` (the raw weight) and ``mma=False`` (no
    tensor-core work) and ``direct=True`` (the raw weight tile from the ring straight into the
    wgmma: a plain bf16 grouped GEMM on this skeleton) are timing references, not results.

    Raises:
        RuntimeError: no Gluon in this Triton. ValueError/TypeError: as the checks say.
    """
    from mxmoe.ops.gemm import zero_rows_past_end

    fmt, mode = getattr(fmt, "value", fmt), getattr(mode, "value", mode)
    if _wq_tma_fwd_kernel is None:
        raise RuntimeError(f"design (e) needs Triton's Gluon dialect (Triton >= 3.5), found {triton.__version__}")
    xq, w, out, nothing = wq_operands(xq, w, offsets, stages, "design (e)")
    if nothing:
        return out
    T, K = xq.shape
    E, N, _ = w.shape
    pe, pr0, pr1, pn0 = tile_table(offsets, T, N, block_t, block_w, order)
    x_sl = gl.NVMMASharedLayout.get_default_for([block_t, block_k], gl.bfloat16)
    w_sl = gl.NVMMASharedLayout.get_default_for([block_w, block_k], gl.bfloat16)
    x_desc = TensorDescriptor.from_tensor(xq, [block_t, block_k], x_sl)
    w_desc = TensorDescriptor.from_tensor(w.view(E * N, K), [block_w, block_k], w_sl)
    _wq_tma_fwd_kernel[(pe.numel(),)](
        x_desc, w_desc, out, pe, pr0, pr1, pn0, N, K, BLOCK_W=block_w, BLOCK_T=block_t, BLOCK_K=block_k,
        STAGES=stages, ASM=qdq_block_asm(fmt, mode), QUANT=quantize, MMA=mma, DIRECT=direct, num_warps=num_warps)
    return zero_rows_past_end(out, offsets)
