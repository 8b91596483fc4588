"""Design (f) of the MXFP8 grouped GEMM on sm90: the raw weight quantized inside a CUDA
wgmma kernel that runs in 2-CTA clusters sharing the token tile by TMA multicast
(experimental; forward only).

Forward of the expert GEMM, out[t, n] = sum_k xq[t, k] Q(w[e(t), n, :])[k]: xq the
activation already quantized and dequantized (a quantize pass, bf16), Q the MX quantization
of the raw bf16 weight along k, dequantized (docs/NUMERICS.md).

Why (benchmarks/NOTES.md, session 12): design (e) (Gluon) moves 48 KB from L2 per CTA and
(128 x 256 x 64) step and its data movement alone is slower than CUTLASS's bf16 grouped
GEMM, which runs the same tile in 2-CTA clusters that multicast the shared operand (32 KB
per CTA and step). Triton 3.6's Gluon has no multicast, so this is CUDA (NVRTC, sm_90a).

Per cluster: one expert, one chunk of at most ``tokens`` (320) token rows (the wgmma N
side: an m64n256 accumulator, and an m64n64 one for rows 256..319 when the chunk is longer
than 256) and 2 x 128 weight rows (the M side; CTA rank r takes rows n0 + 128 r). Each
expert's tokens are cut into ceil(S / 320) near-equal chunks (``gluon_wq.tile_table``), so the
issue's 205-307 tokens per expert take one chunk each instead of 256 + a nearly empty
tile. Each CTA loads its own raw weight tile (128 x 64 per step, TMA) and half of the token
tile, multicast to both CTAs. 384 threads: warpgroups 0 and 1 consume (64 weight rows each:
the raw tile from shared memory to registers, the PTX quantization of design (e)
(``gluon_wq_tma.qdq_block_asm``), the bf16 tile back to a swizzled shared tile, the wgmmas
from shared memory, one group in flight), warpgroup 2 produces (one thread issues the TMA
loads into a ring of STAGES; setmaxnreg moves registers from it to the consumers: without
it ptxas serialized the wgmmas). Stage release goes to the empty barriers of both CTAs (a
stage is refilled by both producers). The output leaves through shared memory in 16-byte
row pieces (``epi``). ``direct=True`` feeds the raw weight tile to the wgmma (a bf16 GEMM
on this skeleton, a timing reference). A persistent variant (each cluster walks the table,
the ring runs on across tiles; commit 6ef8133) was exact and 2-5% slower on the H200
(results/h200_design_e/persistent_6ef8133.json) and is not kept.

Run only on the H200: benchmarks/wq_kernels_bench.py --design f checks it against design
(a) and times it (results/h200_design_e/). Compiled at first use by
torch.cuda._compile_kernel (NVRTC), launched through the driver (cuLaunchKernel with the
TMA descriptors by value).
"""

from __future__ import annotations

import ctypes
import re

import torch
from torch import Tensor

from gluon_wq import tile_table, wq_operands
from gluon_wq_tma import qdq_block_asm

THREADS = 384
SMEM_LIMIT = 232448  # bytes of dynamic shared memory one CTA may take on sm90


def _wgmma_asm(n: int) -> str:
    regs = ", ".join(f"%{i}" for i in range(n // 2))
    a, b, p = n // 2, n // 2 + 1, n // 2 + 2
    return ("{\\n.reg .pred p;\\nsetp.ne.b32 p, %" + str(p) + ", 0;\\n"
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{" + regs + f"}}, %{a}, %{b}, p, 1, 1, 0, 0;\\n}}")


def kernel_source(fmt: str, mode: str, stages: int, direct: bool, tokens: int = 320, epi: bool = True) -> str:
    """The CUDA source of design (f) for one element format, scale mode, ring depth and
    variant: ``tokens`` 256 (one m64n256 accumulator per warpgroup) or 320 (one more of
    m64n64 for token chunks longer than 256); ``epi``: the output through shared memory in
    16-byte row pieces, else 2-byte stores from the accumulator fragment; ``direct``: the
    raw weight tile into the MMA (a bf16 GEMM on this skeleton, a timing reference)."""
    if tokens not in (256, 320):
        raise ValueError(f"tokens must be 256 or 320, got {tokens}")
    qdq = re.sub(r"\$(\d+)", r"%\1", qdq_block_asm(fmt, mode)).replace("\n", "\\n")
    acc0 = ", ".join(f'"+f"(acc[{i}])' for i in range(128))
    acc1 = ", ".join(f'"+f"(acc1[{i}])' for i in range(32))
    return r"""
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;
struct __align__(64) TmaDesc { u64 data[16]; };

#define STAGES """ + str(stages) + r"""
#define DIRECT """ + str(int(direct)) + r"""
#define EPI """ + str(int(epi)) + r"""
#define TOKS """ + str(tokens) + r"""
#define X_BYTES (TOKS * 128)
#define W_BYTES (128 * 128)

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n.reg .pred P1;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 "@P1 bra DONE;\nbra WAIT;\nDONE:\n}" :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 cta) {
    asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
                 "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}" :: "r"(bar), "r"(cta) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
    u32 r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r;
}
__device__ __forceinline__ void tma_load(u32 dst, const TmaDesc* map, u32 bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
                 :: "r"(dst), "l"((u64)map), "r"(bar), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void tma_load_mc(u32 dst, const TmaDesc* map, u32 bar, int c0, int c1, u16 mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%3, %4}], [%2], %5;"
                 :: "r"(dst), "l"((u64)map), "r"(bar), "r"(c0), "r"(c1), "h"(mask) : "memory");
}
// wgmma shared-memory descriptor: K-major tile, 128-byte rows, 128-byte swizzle, 8-row atoms (1024 B)
__device__ __forceinline__ u64 gmma_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
__device__ __forceinline__ u32 swz(u32 row, u32 chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }
__device__ __forceinline__ void put(u32 xs, int m, int col, float v) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    asm volatile("st.shared.b16 [%0], %1;" :: "r"(xs + col * 272 + m * 2), "h"(h) : "memory");
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(384, 1)
wq_cluster_fwd(const __grid_constant__ TmaDesc xmap, const __grid_constant__ TmaDesc xmap256,
               const __grid_constant__ TmaDesc wmap,
               unsigned short* __restrict__ out, const int* __restrict__ prog_e, const int* __restrict__ prog_r0,
               const int* __restrict__ prog_r1, const int* __restrict__ prog_n0, int N, int K) {
    extern __shared__ unsigned char smem_raw[];
    const int p = blockIdx.x >> 1;
    const int e = prog_e[p];
    if (e < 0) return;  // both CTAs of the cluster read the same entry
    const u32 rank = cluster_rank();
    const int row0 = prog_r0[p], row1 = prog_r1[p];  // this chunk's token rows [row0, row1), at most TOKS
    const int n0 = prog_n0[p] + 128 * (int)rank;
    const int n_k = (K + 63) / 64;
    const bool two = TOKS > 256 && row1 - row0 > 256;  // the m64n64 accumulator is needed
    u32 base = (smem_u32(smem_raw) + 1023) & ~1023u;
    const u32 xs = base, ws = xs + STAGES * X_BYTES, qs = ws + STAGES * W_BYTES;
    const u32 full = qs + 2 * W_BYTES, empty = full + 8 * STAGES;
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) { mbar_init(full + 8 * s, 1); mbar_init(empty + 8 * s, 4); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    cluster_sync();
    const int wg = tid >> 7;
    if (wg == 2) {  // producer: one thread issues the TMA loads (the weight tile, and half of the token
                    // tile multicast to both CTAs of the cluster)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 256) {
            const int w_row = e * N + n0;
            // a chunk of at most 256 tokens loads 256 rows (128 per CTA, xmap256), a longer one TOKS
            const int half = two ? TOKS / 2 : 128;
            const TmaDesc* xm = two ? &xmap : &xmap256;
            const u32 xbytes = 2 * half * 128;
            for (int i = 0; i < n_k; ++i) {
                const int s = i % STAGES;
                mbar_wait(empty + 8 * s, ((i / STAGES) & 1) ^ 1);
                mbar_expect_tx(full + 8 * s, xbytes + W_BYTES);
                tma_load(ws + s * W_BYTES, &wmap, full + 8 * s, i * 64, w_row);
                tma_load_mc(xs + s * X_BYTES + rank * (half * 128), xm, full + 8 * s, i * 64, row0 + half * (int)rank,
                            (u16)3);
            }
        }
    } else {  // consumers: warpgroup wg takes weight rows 64 wg .. 64 wg + 63 of this CTA
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        float acc[128];
#pragma unroll
        for (int j = 0; j < 128; ++j) acc[j] = 0.f;
#if TOKS > 256
        float acc1[32];
#pragma unroll
        for (int j = 0; j < 32; ++j) acc1[j] = 0.f;
#endif
        const int t = tid & 127;
        const u32 r = 64 * wg + (t >> 1), kb = t & 1;  // this thread's block: row r, k 32 kb .. 32 kb + 31
        for (int i = 0; i < n_k; ++i) {
            const int s = i % STAGES;
            mbar_wait(full + 8 * s, (i / STAGES) & 1);
            u32 a_tile;
#if DIRECT
            a_tile = ws + s * W_BYTES;
#else
            {
                u32 v[16], q[16];
                const u32 src = ws + s * W_BYTES;
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                                 : "=r"(v[4 * j]), "=r"(v[4 * j + 1]), "=r"(v[4 * j + 2]), "=r"(v[4 * j + 3])
                                 : "r"(src + swz(r, 4 * kb + j)));
                asm volatile("@QDQ@"
                    : "=r"(q[0]), "=r"(q[1]), "=r"(q[2]), "=r"(q[3]), "=r"(q[4]), "=r"(q[5]), "=r"(q[6]), "=r"(q[7]),
                      "=r"(q[8]), "=r"(q[9]), "=r"(q[10]), "=r"(q[11]), "=r"(q[12]), "=r"(q[13]), "=r"(q[14]), "=r"(q[15])
                    : "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]), "r"(v[4]), "r"(v[5]), "r"(v[6]), "r"(v[7]),
                      "r"(v[8]), "r"(v[9]), "r"(v[10]), "r"(v[11]), "r"(v[12]), "r"(v[13]), "r"(v[14]), "r"(v[15]));
                a_tile = qs + (i & 1) * W_BYTES;
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};"
                                 :: "r"(a_tile + swz(r, 4 * kb + j)), "r"(q[4 * j]), "r"(q[4 * j + 1]),
                                    "r"(q[4 * j + 2]), "r"(q[4 * j + 3]) : "memory");
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                asm volatile("bar.sync %0, 128;" :: "r"(1 + wg) : "memory");
            }
#endif
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const u64 da = gmma_desc(a_tile + wg * 8192 + kk * 32);
                const u64 db = gmma_desc(xs + s * X_BYTES + kk * 32);
                asm volatile("@WG256@"
                    : @ACC0@
                    : "l"(da), "l"(db), "r"(1));
#if TOKS > 256
                if (two) {
                    const u64 db1 = gmma_desc(xs + s * X_BYTES + 256 * 128 + kk * 32);
                    asm volatile("@WG64@"
                        : @ACC1@
                        : "l"(da), "l"(db1), "r"(1));
                }
#endif
            }
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            if (i > 0 && t == 0) {  // wgmma i - 1 is done: its stage is free as far as this warpgroup goes
                const u32 bar = empty + 8 * ((i - 1) % STAGES);
                mbar_arrive_cluster(bar, 0);
                mbar_arrive_cluster(bar, 1);
            }
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        // tie the accumulators to the wait, so that no read of them is moved above it (ptxas would
        // then serialize the wgmmas of the main loop)
#pragma unroll
        for (int j = 0; j < 128; ++j) asm volatile("" : "+f"(acc[j]) :: "memory");
#if TOKS > 256
#pragma unroll
        for (int j = 0; j < 32; ++j) asm volatile("" : "+f"(acc1[j]) :: "memory");
#endif
        // accumulator fragment of m64nN: d[4c + 2h + b] = (row 16 warp + lane / 4 + 8 h, column 8 c + 2 (lane % 4) + b)
        const int warp = t >> 5, lane = t & 31;
        const int cols = row1 - row0;
#if EPI
        // through shared memory (the token ring, idle now: every load of this CTA has landed and both
        // warpgroups' MMAs are done): tile[token][m] with rows of 272 bytes, then 16-byte row pieces out
        asm volatile("bar.sync 3, 256;" ::: "memory");
#pragma unroll
        for (int j = 0; j < 128; ++j)
            put(xs, 64 * wg + 16 * warp + (lane >> 2) + 8 * ((j >> 1) & 1), 8 * (j >> 2) + 2 * (lane & 3) + (j & 1), acc[j]);
#if TOKS > 256
        if (two) {
#pragma unroll
            for (int j = 0; j < 32; ++j)
                put(xs, 64 * wg + 16 * warp + (lane >> 2) + 8 * ((j >> 1) & 1), 256 + 8 * (j >> 2) + 2 * (lane & 3) + (j & 1),
                    acc1[j]);
        }
#endif
        asm volatile("bar.sync 3, 256;" ::: "memory");
        for (int idx = tid; idx < cols * 16; idx += 256) {
            const int tok = idx >> 4, c = idx & 15;
            const int gt = row0 + tok, n = n0 + 8 * c;
            if (n < N) {
                u32 a0, a1, a2, a3;
                asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3)
                             : "r"(xs + tok * 272 + c * 16));
                unsigned short* o = out + (long long)gt * N + n;
                if ((N & 7) == 0 && n + 8 <= N) {
                    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" :: "l"(o), "r"(a0), "r"(a1), "r"(a2), "r"(a3)
                                 : "memory");
                } else {
                    const u32 wv[4] = {a0, a1, a2, a3};
                    for (int k = 0; k < 8 && n + k < N; ++k) o[k] = (u16)(wv[k >> 1] >> (16 * (k & 1)));
                }
            }
        }
#else
#pragma unroll
        for (int j = 0; j < 128; ++j) {
            const int m = 64 * wg + 16 * warp + (lane >> 2) + 8 * ((j >> 1) & 1);
            const int col = 8 * (j >> 2) + 2 * (lane & 3) + (j & 1);
            const int n = n0 + m;
            if (col < cols && n < N) {
                u16 h;
                asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(acc[j]));
                out[(long long)(row0 + col) * N + n] = h;
            }
        }
#if TOKS > 256
        if (two) {
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                const int m = 64 * wg + 16 * warp + (lane >> 2) + 8 * ((j >> 1) & 1);
                const int col = 256 + 8 * (j >> 2) + 2 * (lane & 3) + (j & 1);
                const int n = n0 + m;
                if (col < cols && n < N) {
                    u16 h;
                    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(acc1[j]));
                    out[(long long)(row0 + col) * N + n] = h;
                }
            }
        }
#endif
#endif
    }
    cluster_sync();  // no CTA leaves while its peer may still arrive on its barriers
}
""".replace("@QDQ@", qdq).replace("@WG256@", _wgmma_asm(256)).replace("@WG64@", _wgmma_asm(64)).replace(
        "@ACC0@", acc0).replace("@ACC1@", acc1)


_KERNELS: dict[tuple, object] = {}


def _kernel(fmt: str, mode: str, stages: int, direct: bool, tokens: int, epi: bool):
    key = (fmt, mode, stages, direct, tokens, epi)
    if key not in _KERNELS:
        k = torch.cuda._compile_kernel(kernel_source(fmt, mode, stages, direct, tokens, epi), "wq_cluster_fwd",
                                       compute_capability="90a")
        k.set_shared_memory_config(smem_bytes(stages, tokens))
        _KERNELS[key] = k
    return _KERNELS[key]


def smem_bytes(stages: int, tokens: int) -> int:
    """Dynamic shared memory of one CTA: 1 KB alignment slack, the ring (token and weight
    tiles), the double-buffered quantized tile, the barriers."""
    return 1024 + stages * (tokens * 128 + 128 * 128) + 2 * 128 * 128 + 16 * stages


def tma_desc(t: Tensor, box_rows: int) -> ctypes.Array:
    """A 2-D TMA descriptor of a row-major bf16 (rows, K) tensor: boxes of box_rows x 64,
    128-byte swizzle, zero fill out of bounds (cuTensorMapEncodeTiled). The 128 bytes sit at
    a 64-byte aligned address inside the returned buffer (the driver asks for it; ctypes
    ignores ``_align_`` before Python 3.13): pass :func:`_aligned` of it.

    Raises:
        RuntimeError: the driver refuses the descriptor (its CUresult in the message).
    """
    lib = torch.cuda._utils._get_gpu_runtime_library()
    rows, K = t.shape
    buf = ctypes.create_string_buffer(128 + 64)
    dims = (ctypes.c_uint64 * 2)(K, rows)
    strides = (ctypes.c_uint64 * 1)(K * 2)
    box = (ctypes.c_uint32 * 2)(64, box_rows)
    estr = (ctypes.c_uint32 * 2)(1, 1)
    # data type 9 = BFLOAT16, interleave 0 = none, swizzle 3 = 128B, L2 promotion 3 = 256B, fill 0 = zeros
    res = lib.cuTensorMapEncodeTiled(_aligned(buf), 9, 2, ctypes.c_void_p(t.data_ptr()), dims, strides, box,
                                     estr, 0, 3, 3, 0)
    if res != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {res} for shape {tuple(t.shape)}")
    return buf


def _aligned(buf: ctypes.Array) -> ctypes.c_void_p:
    """The first 64-byte aligned address inside ``buf`` (which has 64 bytes to spare)."""
    addr = ctypes.addressof(buf)
    return ctypes.c_void_p((addr + 63) & ~63)


def cuda_grouped_mm_wq_fwd(xq: Tensor, w: Tensor, offsets: Tensor, *, fmt: str = "e4m3", mode: str = "rceil",
                           stages: int = 3, tokens: int = 320, order: str = "weight", direct: bool = False,
                           epi: bool = True) -> Tensor:
    """out (T, N) bf16 = xq[t] Q(w[e])^T: design (f) (module docs). xq (T, K) bf16 dequantized
    MX values along K; w (E, N, K) bf16 raw; offsets (E,) int32 cumulative ends. Rows at and
    past offsets[-1] are zeros. sm90 only; K a multiple of 8. ``tokens``: the most token
    rows per cluster (256 or 320; at 320 only 3 stages fit in shared memory).

    Raises:
        TypeError, ValueError: as ``gluon_wq.check_wq_args`` says (through ``wq_operands``); tokens not 256 or 320;
            stages and tokens that need more than sm90's shared memory.
        RuntimeError: the driver refuses the TMA descriptors or the launch.
    """
    from mxmoe.ops.gemm import zero_rows_past_end

    fmt, mode = getattr(fmt, "value", fmt), getattr(mode, "value", mode)
    if tokens not in (256, 320):
        raise ValueError(f"tokens must be 256 or 320, got {tokens!r}")
    xq, w, out, nothing = wq_operands(xq, w, offsets, stages, "design (f)")
    if smem_bytes(stages, tokens) > SMEM_LIMIT:
        raise ValueError(f"stages={stages} with tokens={tokens} needs {smem_bytes(stages, tokens)} bytes of shared "
                         f"memory, more than the {SMEM_LIMIT} of sm90; use fewer stages")
    if nothing:
        return out
    T, K = xq.shape
    E, N, _ = w.shape
    pe, pr0, pr1, pn0 = tile_table(offsets, T, N, tokens, 256, order, equal=True)
    kern = _kernel(fmt, mode, stages, direct, tokens, epi)
    xd, wd = tma_desc(xq, tokens // 2), tma_desc(w.view(E * N, K), 128)
    xd256 = xd if tokens == 256 else tma_desc(xq, 128)  # the box of chunks of at most 256 tokens
    ptrs = [ctypes.c_void_p(a.data_ptr()) for a in (out, pe, pr0, pr1, pn0)]
    ints = [ctypes.c_int(N), ctypes.c_int(K)]
    descs = [_aligned(d) for d in (xd, xd256, wd)]  # kernel parameters by value: pointers to their bytes
    params = (ctypes.c_void_p * 10)(*[d.value for d in descs],
                                    *[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in [*ptrs, *ints]])
    lib = torch.cuda._utils._get_gpu_runtime_library()
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    res = lib.cuLaunchKernel(kern.func, 2 * pe.numel(), 1, 1, THREADS, 1, 1, smem_bytes(stages, tokens), stream,
                             params, None)
    if res != 0:
        raise RuntimeError(f"cuLaunchKernel failed with CUresult {res}")
    return zero_rows_past_end(out, offsets)
