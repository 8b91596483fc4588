// MXFP8 row-wise + column-wise quantization of a bfloat16 (B, R, C) tensor in one read.
//
// Compiled at run time by NVRTC (mxmoe.kernels.cuda_quantize); these macros come first:
//   NT       threads per block (128 or 256)
//   RB       32-column blocks per row-pass task (1, 2 or 4)
//   GB       32-row blocks per column-pass task (1, 2 or 4)
//   ELEM     0: E4M3, 1: E5M2;  MODE  0: floor, 1: rceil
//   SCRATCH  1: the scales of each tile leave as two whole 512-byte runs into scratch
//            arrays (row scales tile-row-major, column scales tile-column-major), and
//            mx_scales_out moves them to their (B, R, C / 32) and (B, C, R / 32) places,
//            whole lines again; 0: one word per row and per column of each tile straight
//            to their places
//   CPOL     L2 policy of the column code stores (0 none, 1 evict_first, 2 evict_last,
//            3 evict_last on half of them). At 131072 x 7168 the transposed output spans
//            940 MB; kept longer in L2, more of its lines leave for DRAM next to their
//            neighbours: with 2 or 3 the kernel took 1042.7-1053.7 us in three runs against
//            1058.7-1070.6 for 0 in the same runs (results/h200_rowcol_policy/; 1 not timed;
//            an evict_first policy on the reads or on the row code stores was slower)
//   CJ       tiles along R per column-scale job of mx_scales_out (8, 16 or 32; 32: whole
//            128-byte lines, the fastest)
//   SNT      threads per block of mx_scales_out (128, 256 or 512), SMINB its
//            __launch_bounds__ minimum of resident blocks per SM: 256 x 8 (32 registers,
//            full occupancy) moves the scales of 131072 x 7168 in 43 us (2.7 TB/s), against
//            55 us for the earlier pass of 128 threads with 80 registers each
//            (results/h200_rowcol_policy/)
//
// Why CUDA: the Triton kernels hold a tile in registers (a 128 x 128 program needs ~240
// registers per thread), and the row + column Triton kernel stays at ~80% of copy bandwidth
// (benchmarks/NOTES.md, sessions 3-6). Here the tile goes to shared memory by cp.async and
// every output leaves through shared memory as whole 128-byte lines. What was measured on
// the H200 (benchmarks/results/h200_cuda_rowcol/): with the codes stored straight from each
// thread's registers (32-byte runs, every warp store touching 32 lines) the kernel took
// 2.2-2.6x the time (357.9-429 us against 165.5); staged, the read and the code stores alone run at 95% of copy, and the
// scale stores (one word per row and per column of each tile: 3 M partial 32-byte sectors
// against 8.4 M for the codes at 16384 x 8192) cost more than the arithmetic (24 us of
// 167). SCRATCH turns them into whole lines at the price of a second small pass.
//
// Layout. Tile: TR x TC = 128 x 128 of matrix bz at (r0, c0). Phase 1: the tile is copied
// to shared memory as 32-bit words (bfloat16 pairs), row r, word w at
// r * W + (w ^ ((r & 7) << 2)): the XOR swizzle keeps the 16-byte accesses of eight
// consecutive rows (row pass) and the 4-byte accesses of 32 consecutive words (column pass)
// free of bank conflicts. Phase 2, row pass: a task is RB blocks of 32 columns of one row.
// Phase 3, column pass: a task is a pair of columns (one word) times GB blocks of 32 rows.
// Both write their codes to shared memory (row codes (TR, TC) bytes, column codes (TC, TR)
// bytes, 16-byte chunks swizzled by row) and their scale bytes to (TR, 4) and (TC, 4)
// arrays. Phase 4 copies the codes out with consecutive threads on consecutive 16 bytes of
// an output row (whole lines), then the scales.
//
// Numerics: the rules of mxmoe.kernels.triton_quantize._scale_byte_inv and _codes_asm,
// which match mxmoe.numerics.reference bit for bit (docs/NUMERICS.md):
// - amax: integer max of the bfloat16 bit patterns with the sign cleared (max.u16x2): a NaN
//   is the largest pattern, then +inf; non-finite block: amax >= 0x7F80.
// - biased scale exponent b: floor: max(exponent field of amax - emax, 0); rceil:
//   d = amax * float32(1 / max_normal), b = (d_bits + 0x7FFFFF) >> 23 if d_bits > 0x400000
//   else 0. Scale byte: b, or 0xFF for a non-finite block.
// - codes: cvt.rn.satfinite of x * 2^-(b - 127) (round to nearest even, saturating);
//   non-finite blocks: every code 0x7F with the element's sign.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define TR 128  // tile rows
#define TC 128  // tile columns
#define W (TC / 2)  // 32-bit words per tile row
#define NCH 8  // 16-byte chunks per staged row of codes (128 bytes)
#if ELEM == 0
#define EMAX 8
#define INV_MAX_BITS 0x3b124925u  // float32(1 / 448)
#define CVT "cvt.rn.satfinite.e4m3x2.f32"
#else
#define EMAX 15
#define INV_MAX_BITS 0x37924925u  // float32(1 / 57344)
#define CVT "cvt.rn.satfinite.e5m2x2.f32"
#endif


__device__ __forceinline__ int swz(int r, int w) { return r * W + (w ^ ((r & 7) << 2)); }

// staged chunk c of row r: eight threads writing chunk c of eight consecutive rows (or
// reading eight consecutive chunks of one row) hit eight different bank groups
__device__ __forceinline__ int chunk(int r, int c) { return c ^ (r & 7); }

__device__ __forceinline__ u32 absmax2(u32 m, u32 w) {
    u32 out;
    asm("max.u16x2 %0, %1, %2;" : "=r"(out) : "r"(m), "r"(w & 0x7FFF7FFFu));
    return out;
}

__device__ __forceinline__ float lo_f(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(u32 w) { return __uint_as_float(w & 0xFFFF0000u); }

// the codes of a * inv, b * inv, c * inv, d * inv (inv = 2^-e, exact), a's in the low byte
__device__ __forceinline__ u32 cvt4(float a, float b, float c, float d, float inv) {
    const float ya = __fmul_rn(a, inv), yb = __fmul_rn(b, inv), yc = __fmul_rn(c, inv), yd = __fmul_rn(d, inv);
    u16 h0, h1;
    asm(CVT " %0, %1, %2;" : "=h"(h0) : "f"(yb), "f"(ya));
    asm(CVT " %0, %1, %2;" : "=h"(h1) : "f"(yd), "f"(yc));
    return (u32)h0 | ((u32)h1 << 16);
}

// amax16: the block's max bfloat16 pattern (sign clear) -> scale byte, 2^-e, non-finite
__device__ __forceinline__ u32 scale_of(u32 amax16, float* inv, bool* nf) {
    u32 amax = amax16 << 16;
    *nf = amax >= 0x7F800000u;
#if MODE == 0
    int b = (int)(amax >> 23) - EMAX;
    b = b > 0 ? b : 0;
#else
    u32 d = __float_as_uint(__fmul_rn(__uint_as_float(amax), __uint_as_float(INV_MAX_BITS)));
    int b = d > 0x400000u ? (int)((d + 0x7FFFFFu) >> 23) : 0;
#endif
    *inv = __uint_as_float((u32)(254 - b) << 23);  // normal for the b of finite blocks (<= 247)
    return *nf ? 255u : (u32)b;
}

__device__ __forceinline__ u32 nan_word(u32 signs) { return (signs & 0x80808080u) | 0x7F7F7F7Fu; }

// the NaN-rule word of four rows of one column of a column pair: byte `sel` of each of
// v[0..3] (0x0051: the even column's sign bytes, 0x0073: the odd column's)
__device__ __forceinline__ u32 col_nan_word(const u32* v, int sel) {
    return nan_word(__byte_perm(__byte_perm(v[0], v[1], sel), __byte_perm(v[2], v[3], sel), 0x5410));
}

__device__ __forceinline__ void st16(u8* p, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

template <int P>
__device__ __forceinline__ unsigned long long l2_policy() {
    unsigned long long pol = 0;
    if (P == 1) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    if (P == 2) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    if (P == 3) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 0.5;" : "=l"(pol));
    return pol;
}

template <int P>
__device__ __forceinline__ void st16p(u8* p, u32 a, u32 b, u32 c, u32 d, unsigned long long pol) {
    if (P == 0) st16(p, a, b, c, d);
    else asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;"
                      :: "l"(p), "r"(a), "r"(b), "r"(c), "r"(d), "l"(pol) : "memory");
}

__device__ __forceinline__ void put16(u8* row, int key, int c, const u32* q) {
    *reinterpret_cast<uint4*>(row + 16 * chunk(key, c)) = make_uint4(q[0], q[1], q[2], q[3]);
}

// x (B, R, C) bfloat16, unit stride along C; grid (C / TC, R / TR, B). SCRATCH: s_row and
// s_col are the scratch arrays (B, R / TR, C / TC, TR, 4) and (B, C / TC, R / TR, TC, 4).
extern "C" __global__ void __launch_bounds__(NT) mx_rowcol_bf16(
    const u16* __restrict__ x, int stride_b, int stride_r, int R, int C, int B,
    u8* __restrict__ q_row, u8* __restrict__ s_row, u8* __restrict__ q_col, u8* __restrict__ s_col)
{
    extern __shared__ __align__(16) u32 smem[];
    u32* const tile = smem;                                  // TR * W words
    u8* const out_r = reinterpret_cast<u8*>(smem + TR * W);  // (TR, TC) row codes
    u8* const out_c = out_r + TR * TC;                       // (TC, TR) column codes
    u8* const sr = out_c + TR * TC;                          // (TR, 4) row scales
    u8* const sc = sr + TR * 4;                              // (TC, 4) column scales
    const int ty = blockIdx.y, tx = blockIdx.x;
    const int c0 = tx * TC, r0 = ty * TR, bz = blockIdx.z;
    const int rows = min(TR, R - r0), cols = min(TC, C - c0);

    // phase 1: global -> shared, 16 bytes per cp.async
    {
        const u16* xb = x + (i64)bz * stride_b + (i64)r0 * stride_r + c0;
        const u32 tile_s = (u32)__cvta_generic_to_shared(tile);
        for (int i = threadIdx.x; i < TR * (TC / 8); i += NT) {
            const int r = i / (TC / 8), ch = i % (TC / 8);
            if (r < rows && ch * 8 < cols) {
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                             :: "r"(tile_s + 4u * (u32)swz(r, ch * 4)), "l"(xb + (i64)r * stride_r + ch * 8)
                             : "memory");
            }
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
    }

    // phase 2: row-wise, blocks along C
    for (int t = threadIdx.x; t < TR * (TC / 32 / RB); t += NT) {
        const int r = t % TR, rb = t / TR;
        if (r >= rows) continue;
#pragma unroll
        for (int k = 0; k < RB; k++) {
            const int blk = rb * RB + k;
            if (blk * 32 >= cols) break;
            u32 w[16];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const uint4 v = *reinterpret_cast<const uint4*>(&tile[swz(r, blk * 16 + 4 * j)]);
                w[4 * j] = v.x; w[4 * j + 1] = v.y; w[4 * j + 2] = v.z; w[4 * j + 3] = v.w;
            }
            u32 m = 0;
#pragma unroll
            for (int j = 0; j < 16; j++) m = absmax2(m, w[j]);
            float inv;
            bool nf;
            const u32 sb = scale_of(max(m & 0xFFFFu, m >> 16), &inv, &nf);
            u32 q[8];
#pragma unroll
            for (int j = 0; j < 8; j++)
                q[j] = cvt4(lo_f(w[2 * j]), hi_f(w[2 * j]), lo_f(w[2 * j + 1]), hi_f(w[2 * j + 1]), inv);
            if (nf) {
#pragma unroll
                for (int j = 0; j < 8; j++) q[j] = nan_word(__byte_perm(w[2 * j], w[2 * j + 1], 0x7531));
            }
            put16(out_r + r * TC, r, 2 * blk, q);
            put16(out_r + r * TC, r, 2 * blk + 1, q + 4);
            sr[r * 4 + blk] = (u8)sb;
        }
    }

    // phase 3: column-wise, blocks along R (the transposed copy)
    for (int t = threadIdx.x; t < W * (TR / 32 / GB); t += NT) {
        const int p = t % W, gg = t / W;
        if (2 * p >= cols) continue;
#pragma unroll
        for (int k = 0; k < GB; k++) {
            const int g = gg * GB + k;
            if (g * 32 >= rows) break;
            u32 v[32];
#pragma unroll
            for (int i = 0; i < 32; i++) v[i] = tile[swz(g * 32 + i, p)];
            u32 m = 0;
#pragma unroll
            for (int i = 0; i < 32; i++) m = absmax2(m, v[i]);
            float inv_lo, inv_hi;
            bool nf_lo, nf_hi;
            const u32 sb_lo = scale_of(m & 0xFFFFu, &inv_lo, &nf_lo);
            const u32 sb_hi = scale_of(m >> 16, &inv_hi, &nf_hi);
            u32 lo[8], hi[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                lo[j] = cvt4(lo_f(v[4 * j]), lo_f(v[4 * j + 1]), lo_f(v[4 * j + 2]), lo_f(v[4 * j + 3]), inv_lo);
                hi[j] = cvt4(hi_f(v[4 * j]), hi_f(v[4 * j + 1]), hi_f(v[4 * j + 2]), hi_f(v[4 * j + 3]), inv_hi);
            }
            if (nf_lo) {
#pragma unroll
                for (int j = 0; j < 8; j++) lo[j] = col_nan_word(v + 4 * j, 0x0051);
            }
            if (nf_hi) {
#pragma unroll
                for (int j = 0; j < 8; j++) hi[j] = col_nan_word(v + 4 * j, 0x0073);
            }
            put16(out_c + 2 * p * TR, p, 2 * g, lo);
            put16(out_c + 2 * p * TR, p, 2 * g + 1, lo + 4);
            put16(out_c + (2 * p + 1) * TR, p, 2 * g, hi);
            put16(out_c + (2 * p + 1) * TR, p, 2 * g + 1, hi + 4);
            sc[2 * p * 4 + g] = (u8)sb_lo;
            sc[(2 * p + 1) * 4 + g] = (u8)sb_hi;
        }
    }

    // phase 4: codes out, 16 bytes per thread, consecutive threads along an output row
    __syncthreads();
    const unsigned long long pol_c = l2_policy<CPOL>();
    for (int i = threadIdx.x; i < TR * NCH; i += NT) {
        const int r = i / NCH, c = i % NCH;
        if (r < rows && c * 16 < cols) {
            const uint4 v = *reinterpret_cast<const uint4*>(out_r + r * TC + 16 * chunk(r, c));
            st16(q_row + ((i64)bz * R + r0 + r) * C + c0 + 16 * c, v.x, v.y, v.z, v.w);
        }
    }
    for (int i = threadIdx.x; i < TC * NCH; i += NT) {
        const int k = i / NCH, c = i % NCH;
        if (k < cols && c * 16 < rows) {
            const uint4 v = *reinterpret_cast<const uint4*>(out_c + k * TR + 16 * chunk(k >> 1, c));
            st16p<CPOL>(q_col + ((i64)bz * C + c0 + k) * R + r0 + 16 * c, v.x, v.y, v.z, v.w, pol_c);
        }
    }
    // ... and the scales: 4 bytes per row and per column of the tile
#if SCRATCH == 1
    {   // row scales tile-row-major, column scales tile-column-major
        const i64 tile_r = ((i64)bz * gridDim.y + ty) * gridDim.x + tx, tile_c = ((i64)bz * gridDim.x + tx) * gridDim.y + ty;
        for (int i = threadIdx.x; i < TR + TC; i += NT) {  // bytes of blocks outside the tensor: never read
            if (i < TR) reinterpret_cast<u32*>(s_row)[tile_r * TR + i] = reinterpret_cast<const u32*>(sr)[i];
            else reinterpret_cast<u32*>(s_col)[tile_c * TC + i - TR] = reinterpret_cast<const u32*>(sc)[i - TR];
        }
    }
#else
    for (int i = threadIdx.x; i < TR + TC; i += NT) {
        const bool is_row = i < TR;
        const int j = is_row ? i : i - TR;
        if (j >= (is_row ? rows : cols)) continue;
        const int n = min(4, ((is_row ? cols : rows) + 31) / 32);  // blocks of this row / column in the tile
        u8* dst = is_row ? s_row + ((i64)bz * R + r0 + j) * (C / 32) + c0 / 32
                         : s_col + ((i64)bz * C + c0 + j) * (R / 32) + r0 / 32;
        const u32 bytes = reinterpret_cast<const u32*>(is_row ? sr : sc)[j];
        if (n == 4 && ((unsigned long long)dst & 3) == 0) *reinterpret_cast<u32*>(dst) = bytes;
        else for (int b = 0; b < n; b++) dst[b] = (u8)(bytes >> (8 * b));
    }
#endif
}

// SCRATCH's second pass: the scales of mx_rowcol_bf16 from the scratch arrays (row scales
// scr_r (B, nty, ntx, 128) words, column scales scr_c (B, ntx, nty, 128) words) to s_row
// (B, R, C / 32) and s_col (B, C, R / 32). grid (nty * ceil(ntx / 32) + ntx * ceil(nty / CJ),
// 1, B), SNT threads (128, 256 or 512). A block's job: the 4-byte runs of nt (<= 32)
// consecutive tiles of one row of tiles (rows job: tile row a, tiles b0 .. along C; up to
// 32) or of one column of tiles (tile column a, tiles b0 .. along R; up to CJ), consecutive
// in their scratch array (one read of nt * 512 bytes), gathered in buf (128 x 33 words)
// and written as runs of 4 * nt bytes to 128 rows of s_row (columns of s_col). Thread tid
// loads word tid % 128 of every (SNT / 128)-th tile, all loads in flight before the first
// use.
extern "C" __global__ void __launch_bounds__(SNT, SMINB) mx_scales_out(
    const u32* __restrict__ scr_r, const u32* __restrict__ scr_c, int R, int C,
    u8* __restrict__ s_row, u8* __restrict__ s_col)
{
    __shared__ u32 buf[128 * 33];
    constexpr int G = SNT / 128, PER = 32 / G;
    const int nty = (R + TR - 1) / TR, ntx = (C + TC - 1) / TC;
    const int nxc = (ntx + 31) / 32, nyc = (nty + CJ - 1) / CJ;
    int job = blockIdx.x;
    const bool rows_job = job < nty * nxc;
    if (!rows_job) job -= nty * nxc;
    const int a = rows_job ? job / nxc : job / nyc;
    const int b0 = rows_job ? 32 * (job % nxc) : CJ * (job % nyc);
    const int nt = min(rows_job ? 32 : CJ, (rows_job ? ntx : nty) - b0);
    const int bz = blockIdx.z, tid = threadIdx.x;
    const int w = tid % 128, grp = tid / 128;
    const u32* first = (rows_job ? scr_r : scr_c)
        + 128 * (rows_job ? ((i64)bz * nty + a) * ntx + b0 : ((i64)bz * ntx + a) * nty + b0) + w;
    u32 v[PER];
#pragma unroll
    for (int k = 0; k < PER; k++)
        if (grp + G * k < nt) v[k] = __ldcg(first + 128 * (grp + G * k));
#pragma unroll
    for (int k = 0; k < PER; k++)
        if (grp + G * k < nt) buf[w * 33 + grp + G * k] = v[k];
    __syncthreads();
    const int n_lines = min(128, rows_job ? R - a * TR : C - a * TC);  // rows (columns) in this tile row
    const int line_bytes = rows_job ? C / 32 : R / 32;                  // bytes per output row
    for (int idx = tid; idx < n_lines * nt; idx += SNT) {
        const int l = idx / nt, i = idx % nt;
        const i64 line = rows_job ? (i64)bz * R + a * TR + l : (i64)bz * C + a * TC + l;
        u8* dst = (rows_job ? s_row : s_col) + line * line_bytes + 4 * (b0 + i);
        const u32 bytes = buf[l * 33 + i];
        const int n = min(4, line_bytes - 4 * (b0 + i));
        if (n == 4 && ((unsigned long long)dst & 3) == 0) *reinterpret_cast<u32*>(dst) = bytes;
        else for (int b = 0; b < n; b++) dst[b] = (u8)(bytes >> (8 * b));
    }
}
