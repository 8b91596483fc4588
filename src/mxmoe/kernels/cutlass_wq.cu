// CUTLASS 4.2 sm90 grouped (ptr-array) GEMMs of issue 4, sessions 13-14: design (b) with
// CUTLASS's mixed-input mainloop, and design (g), the MXFP8 weight quantization inside it
// (benchmarks/cutlass_mixed.py times and checks every variant; benchmarks/NOTES.md,
// sessions 13 and 14). The library (mxmoe/kernels/cutlass_wq.py) builds one of them at first
// use, VARIANT 3 with the settings of its BUILD, and calls NAME_forward; the other variants
// are measurements (benchmarks/cutlass_mixed/build.sh builds them all).
//
// Per expert g (a group): D_g (Nout x S_g) = W_g (Nout x K) . X_g^T, W the expert weight
// (the register operand A, K-major), X_g the expert's S_g token rows (B, K-major), D_g
// column-major with leading dimension Nout, so that it is out[rows of g] (S_g x Nout)
// row-major. VARIANT (compile-time):
//   0  bf16 weight, bf16 tokens: CUTLASS's TMA warp-specialized cooperative kernel (the
//      skeleton torch._grouped_mm runs on sm90, roles of the operands swapped)
//   1  float_e4m3 weight converted to bf16 in registers (mixed input, no scale)
//   2  float_e4m3 weight times a bf16 scale per CHUNK weight elements along K (mixed
//      input, ConvertAndScale); with CHUNK = 32 and power-of-two scales this is the MXFP8
//      weight exactly (E8M0 scale = a power of two, exact in bf16)
//   3  the raw bf16 weight, quantized to MXFP8 (E4M3, 32-element blocks along K, FMT / MODE)
//      and dequantized in registers inside the mainloop: CUTLASS's mixed-input
//      register-operand (RS) mainloop with the weight carried as a 16-bit type and its
//      per-k-block conversion replaced by the block quantization (the MixedInputUtils
//      specialization below; QDQ picks its arithmetic); exact: the values of design
//      (a)'s quantize pass, bit for bit
//   WT = 1 (VARIANT 3, LOOP 4; session 15): the dgrad, dX_g (S_g x K) = dY_g (S_g x N) W_g:
//      the register operand is W_g^T (K x N: Nout = K, contracted over N), whose memory is
//      W_g as it lies (K contiguous: M-major), quantized along N by the same arithmetic
// TM, TN, TK: the CTA tile; CM: CTAs per cluster along M (weight rows), multicasting the
// token tile. Built with nvcc -arch=sm_90a into a shared library whose C functions take
// device pointers (NAME_forward: no host synchronization after the first call of a shape).
#if defined(TN) && TN == 320
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED  // the m64n160 wgmma (below)
#endif
#include <cstdlib>  // getenv, atoi (RASTER 2)
#include <cstdint>
#include <cstdio>
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include <cuda_fp16.h>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

using namespace cute;

#ifndef VARIANT
#define VARIANT 0
#endif
#ifndef NAME
#define NAME v0
#endif
#ifndef FMT
#define FMT 0  // VARIANT 3 and 4: 0 E4M3, 1 E5M2
#endif
#ifndef MODE
#define MODE 0  // VARIANT 3: 0 rceil, 1 floor (docs/NUMERICS.md)
#endif
#ifndef STAGES
#define STAGES 4  // VARIANT 3 and 4: pipeline stages
#endif
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

namespace {
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using Bf16 = cutlass::bfloat16_t;
using E4m3 = cutlass::float_e4m3_t;
using ElementQ = cute::conditional_t<FMT == 1, cutlass::float_e5m2_t, E4m3>;  // VARIANT 4's codes
using ElementW = cute::conditional_t<VARIANT == 0, Bf16, cute::conditional_t<VARIANT == 3, cutlass::half_t,
                                     cute::conditional_t<VARIANT == 4, ElementQ, E4m3>>>;
using ElementScale = Bf16;
#ifndef LOOP
#define LOOP 0  // VARIANT 3's consumer loop: 0 CUTLASS's, 2 or 4 ours (below)
#endif
#ifndef WT
#define WT 0  // 1 (VARIANT 3 only): the dgrad, A = the weight transposed (its memory M-major)
#endif
// W (Nout x K): K contiguous; WT: the transpose of a row-major (K x Nout) matrix, Nout contiguous
using LayoutW = cute::conditional_t<WT, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
using LayoutX = cutlass::layout::ColumnMajor;   // X^T (K x S) with K contiguous: X row-major
using LayoutD = cutlass::layout::ColumnMajor;   // D (Nout x S), Nout contiguous
constexpr int AlignW = 128 / cutlass::sizeof_bits<ElementW>::value;
constexpr int AlignX = 8;
constexpr int AlignD = 8;
using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
using ClusterShape = Shape<Int<CM>, _1, _1>;
#ifndef RASTER
#define RASTER 0  // 1: the grouped scheduler walks the token tiles first (AlongN; the dgrad, session 16)
#endif
#ifndef PINGPONG
#define PINGPONG 0  // 1: one warpgroup per (TM = 64) tile, two tiles in flight per CTA
#endif
using KernelSchedule = cute::conditional_t<PINGPONG, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
using EpilogueSchedule = cute::conditional_t<PINGPONG, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                             cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, LayoutD*, AlignD, Bf16, LayoutD*, AlignD, EpilogueSchedule>::CollectiveOp;

#if VARIANT == 3 && WT
}  // namespace
// The mixed-input collective asserts that the converted operand is K-major in memory: its
// own consumer loop copies shared memory to registers element-wise in the MMA's layout.
// Ours (LOOP 4) reads the M-major tile with ldmatrix.trans, which yields the K-major
// register fragment the wgmma takes; the collective's producer (TMA) and shared-memory
// layout follow the stride type and support either major. So the WT build declares its
// stride type acceptable to that assertion (the one use of is_k_major for this type here).
template <>
constexpr bool cutlass::gemm::detail::is_k_major<cutlass::detail::TagToStrideA_t<cutlass::layout::ColumnMajor*>>() {
  return true;
}
namespace {
#endif
#if VARIANT == 3
// The collective the builder would make for a 16-bit weight converted in registers (it
// builds mixed-input kernels only for operands of different widths): the raw bf16 weight
// travels as half_t (TMA and shared memory move bits), TransformA marks the collective
// whose per-k-block conversion is the MXFP8 quantization (the MixedInputUtils
// specialization below).
struct QdqTransform {};
namespace cd = cutlass::gemm::collective::detail;
// The wgmma atom: CUTLASS's choice for TN a multiple of 256 (one m64n256 per k-block); TN =
// 320 (one tile for up to 320 tokens of an expert: the issue's (16384, 2048, 1408, 64) has
// 209-310 per expert, two 256-token tiles for half of them) as two m64n160 wgmmas per
// k-block (n160 is one of CUTLASS's extended shapes, enabled at the top; the selector would
// pick n64 for 320).
#if TN == 320
using MmaAtomQ = cute::SM90::GMMA::MMA_64x160x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>;
#else
static_assert(TN <= 256, "the token tile is one TMA box (at most 256 rows) unless TN = 320");
using MmaAtomQ = decltype(cute::GMMA::rs_op_selector<Bf16, Bf16, float, TileShape, GMMA::Major::K, GMMA::Major::K>());
#endif
using TiledMmaQ = decltype(cute::make_tiled_mma(MmaAtomQ{}, Layout<Shape<Int<PINGPONG ? 1 : 2>, _1, _1>>{}));
// WT: the weight tile in shared memory as in memory (M contiguous, 128-byte swizzle), read
// into the K-major register fragment with ldmatrix.trans (SmemCopyAtomAQ; our consumer loop)
using SmemAtomAQ = decltype(cd::rs_smem_selector<WT ? GMMA::Major::MN : GMMA::Major::K, cutlass::half_t, Int<TM>,
                                                 Int<TK>, false>());
#if WT
static_assert(LOOP == 4, "WT needs our consumer loop (its ldmatrix.trans copy): LOOP 4");
using SmemCopyAtomAQ = Copy_Atom<cute::SM75_U16x8_LDSM_T, cutlass::half_t>;
#else
using SmemCopyAtomAQ = Copy_Atom<cute::AutoVectorizingCopy, cutlass::half_t>;
#endif
#if TN == 320
// The token tile in shared memory as two 160-row halves with a gap between them: a TMA
// box holds at most 256 rows, and cute makes one box of a contiguous 320-row tile (the driver
// refuses it and the kernel then waits forever: tried at ea8e339); the 4 KiB gap makes each half
// one box (two TMA loads per stage) and the B operand of one m64n160 wgmma. 128-byte swizzle,
// K-major, as CUTLASS's own atom; the gap keeps the swizzle period and the stride divisibility cute needs.
using SmemAtomB128 = GMMA::Layout_K_SW128_Atom<Bf16>;
static_assert(TK == 64, "TN = 320 builds its token tile for TK = 64");
using SmemAtomBQ = decltype(cute::make_composed_layout(
    SmemAtomB128{}.layout_a(), SmemAtomB128{}.offset(),
    Layout<Shape<Shape<_8, Int<20>, _2>, _64>, Stride<Stride<_64, _512, Int<160 * 64 + 2048>>, _1>>{}));
#else
using SmemAtomBQ = decltype(cd::rs_smem_selector<GMMA::Major::K, Bf16, Int<TN>, Int<TK>, false>());
#endif
constexpr int StagesQ = STAGES;
template <class TransformA>
using CollectiveQ = cutlass::gemm::collective::CollectiveMma<
    cutlass::gemm::MainloopSm90ArrayTmaGmmaWarpSpecializedMixedInput<StagesQ, ClusterShape, KernelSchedule>,
    TileShape, cute::tuple<cutlass::half_t>, cutlass::detail::TagToStrideA_t<LayoutW*>, Bf16,
    cutlass::detail::TagToStrideB_t<LayoutX*>, TiledMmaQ,
    decltype(cd::sm90_cluster_shape_to_tma_atom(shape<1>(ClusterShape{}))), SmemAtomAQ,
    SmemCopyAtomAQ, TransformA,
    decltype(cd::sm90_cluster_shape_to_tma_atom(shape<0>(ClusterShape{}))), SmemAtomBQ, void, cute::identity>;
using MainloopQ = CollectiveQ<QdqTransform>;
// complete the plain collective (and with it its MixedInputUtils) before the specialization
// below derives from that MixedInputUtils
static_assert(sizeof(typename CollectiveQ<cute::identity>::SharedStorage) > 0);
#elif VARIANT == 4
// Design (b) in CUTLASS (session 15): the weight's MXFP8 copy, written by a quantize pass
// (codes K-major; E8M0 scales with the two 32-element blocks of a 64-element k-tile packed
// in one uint16 per row, the first block in the low byte, M-major), converted in registers
// by the mixed-input mainloop in ConvertAndScale mode (scale chunk 64 = TK: one uint16 per
// row and k-tile); the conversion itself is ours (the MixedInputUtils specialization
// below: code to bf16, times 2^e, the arithmetic of VARIANT 3's decode).
struct E8m0PairTransform {};
namespace cd = cutlass::gemm::collective::detail;
static_assert(TK == 64, "VARIANT 4 packs the two E8M0 scales of a 64-element k-tile in one uint16");
static_assert(!WT, "VARIANT 4 reads K-major codes (the dgrad's are written transposed by its pass)");
using TiledMma8 = decltype(cute::make_tiled_mma(
    cute::GMMA::rs_op_selector<Bf16, Bf16, float, TileShape, GMMA::Major::K, GMMA::Major::K>(),
    Layout<Shape<Int<PINGPONG ? 1 : 2>, _1, _1>>{}));
template <class TransformA>
using Collective8 = cutlass::gemm::collective::CollectiveMma<
    cutlass::gemm::MainloopSm90ArrayTmaGmmaWarpSpecializedMixedInput<STAGES, ClusterShape, KernelSchedule>,
    TileShape, cute::tuple<ElementQ, uint16_t>, cutlass::detail::TagToStrideA_t<LayoutW*>, Bf16,
    cutlass::detail::TagToStrideB_t<LayoutX*>, TiledMma8,
    decltype(cd::sm90_cluster_shape_to_tma_atom(shape<1>(ClusterShape{}))),
    decltype(cd::rs_smem_selector<GMMA::Major::K, ElementQ, Int<TM>, Int<TK>, false>()),
    Copy_Atom<cute::AutoVectorizingCopy, ElementQ>, TransformA,
    decltype(cd::sm90_cluster_shape_to_tma_atom(shape<0>(ClusterShape{}))),
    decltype(cd::rs_smem_selector<GMMA::Major::K, Bf16, Int<TN>, Int<TK>, false>()), void, cute::identity>;
using Mainloop = Collective8<E8m0PairTransform>;
static_assert(sizeof(typename Collective8<cute::identity>::SharedStorage) > 0);
#else
using OperandA = cute::conditional_t<VARIANT == 2, cute::tuple<ElementW, ElementScale>, ElementW>;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, OperandA, LayoutW*, AlignW, Bf16, LayoutX*, AlignX,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;
#endif

}  // namespace

#if VARIANT >= 3
namespace mxq {
// The MX block quantization of benchmarks/gluon_wq_tma.qdq_block_asm (design (e), exact
// against the quantizers), per pair of bf16 values of one row: the scale exponent e from
// the block amax (the rule of mxmoe.kernels.triton_quantize._scale_exponent), then per
// value x: cvt.rn.satfinite(x * 2^-e) to E4M3/E5M2, decoded, times 2^e, to bf16.
constexpr int kEmax = FMT == 0 ? 8 : 15;
constexpr uint32_t kInvMaxBits = FMT == 0 ? 0x3b124925u : 0x37924925u;  // float32(1 / 448), float32(1 / 57344)
constexpr int kBias = FMT == 0 ? 7 : 15;  // the element format's exponent bias
constexpr int kShift = FMT == 0 ? 4 : 3;  // QDQ 4: a code's bits at bits 8..15, shifted right to bf16's positions
constexpr uint32_t kMagMask = FMT == 0 ? 0x07F007F0u : 0x0FE00FE0u;
// the smallest e at which the smallest nonzero dequantized value (the smallest subnormal
// code, 2^(-bias - mantissa bits + 1), times 2^e) is a normal bf16 (>= 2^-126)
constexpr int kFastMin = FMT == 0 ? -117 : -110;

__device__ __forceinline__ uint32_t vmax2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// the codes of two float32 values (cvt.rn.satfinite: round to nearest even, saturate to the
// largest finite code, NaN stays NaN), x1 in the high byte
__device__ __forceinline__ unsigned short cvt_codes(float x0, float x1) {
  unsigned short h;
#if FMT == 0
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(x1), "f"(x0));
#else
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(h) : "f"(x1), "f"(x0));
#endif
  return h;
}

// the exact float16 values of two codes (the low byte in the low half)
__device__ __forceinline__ uint32_t codes_to_f16x2(unsigned short h) {
  uint32_t g;
#if FMT == 0
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(g) : "h"(h));
#else
  asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(g) : "h"(h));
#endif
  return g;
}

// amax: the block's largest sign-cleared bf16 bit pattern (NaN patterns sort above inf)
__device__ __forceinline__ void block_scale(uint32_t amax16, float& inv, float& sc) {
  const uint32_t bits = amax16 << 16;
  const bool nf = bits >= 0x7F800000u;
  int e;
#if MODE == 1
  e = int((bits >> 23) & 0xFFu) - (127 + kEmax);
#else
  const uint32_t db = __float_as_uint(__fmul_rn(__uint_as_float(bits), __uint_as_float(kInvMaxBits)));
  const int dexp = int((db >> 23) & 0xFFu);
  const uint32_t dman = db & 0x7FFFFFu;
  e = dexp - 127 + (dman != 0u ? 1 : 0);
  if (dexp == 0) e = dman > 0x400000u ? -126 : -127;
#endif
  e = min(max(e, -127), 127);
  if (nf) e = 0;
  inv = __uint_as_float(uint32_t(127 - e) << 23);
  uint32_t s = uint32_t(e + 127) << 23;
  if (e < -126) s = 0x400000u;  // 2^-127, a float32 subnormal
  if (nf) s = 0x7FC00000u;      // a non-finite block dequantizes to NaN
  sc = __uint_as_float(s);
}

// QDQ: 1 the float32 arithmetic of design (e); 2 (default) fewer instructions; 4 no float
// conversion in the decode (exact, but slower on the H200: NOTES.md); 5 QDQ 2 with one slow /
// fast branch per warp (QDQ 2 computes both paths under predicates); timing references,
// not results: 0 the raw weight into the MMA (no quantization), 3 the block amax and
// scales computed, the raw weight into the MMA.
#ifndef QDQ
#define QDQ 2
#endif

// QDQ 2: the scale exponent in integer arithmetic (rceil: e = EA - 127 - emax + (MA > 0x60)
// for the amax's bf16 exponent field EA and mantissa MA, clamped to [-127, 127]: equal to
// the float32 rule of block_scale for every finite bf16 amax, both formats, checked
// exhaustively on the CPU: tests/test_wq_prototypes.py), and the multiplies by 2^-e and 2^e
// in bf16x2 (exact: powers of two; the multiply by 2^-e feeds the float8 conversion, which
// rounds anything below bf16's normal range to zero anyway). Rows with e < kFastMin, where
// dequantized values could be bf16 subnormals, take QDQ 1's float32 multiply back.
__device__ __forceinline__ int scale_exp(uint32_t amax16, bool& nf) {
  nf = amax16 >= 0x7F80u;
#if MODE == 1
  int e = int(amax16 >> 7) - (127 + kEmax);
#else
  int e = int(amax16 >> 7) - (127 + kEmax) + ((amax16 & 0x7Fu) > 0x60u ? 1 : 0);
#endif
  e = min(max(e, -127), 127);
  return nf ? 0 : e;
}

struct RowScale {
  uint32_t inv2;  // bf16x2 2^-e
  uint32_t sc2;   // bf16x2 2^e (NaN for a non-finite block)
  float sc;       // float32 2^e for the rows with e < kFastMin
  bool slow;
};

__device__ __forceinline__ RowScale row_scale(uint32_t amax16) {
  bool nf;
  const int e = scale_exp(amax16, nf);
  RowScale r;
  r.inv2 = (uint32_t(127 - e) << 7) * 0x10001u;
  r.sc2 = nf ? 0x7FC07FC0u : (uint32_t(127 + e) << 7) * 0x10001u;
  uint32_t s = uint32_t(e + 127) << 23;
  if (e < -126) s = 0x400000u;
  if (nf) s = 0x7FC00000u;  // QDQ 5's warp-wide slow path runs for the non-finite rows too
  r.sc = __uint_as_float(s);
  r.slow = e < kFastMin && !nf;
  return r;
}

// the pair's two codes (cvt.rn.satfinite from the values times 2^-e, a bf16x2 multiply: exact)
__device__ __forceinline__ unsigned short encode_pair(uint32_t x, uint32_t inv2) {
  uint32_t v;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(v) : "r"(x), "r"(inv2));
  const float x0 = __uint_as_float(v << 16), x1 = __uint_as_float(v & 0xFFFF0000u);
  return cvt_codes(x0, x1);
}

// slow decode (any row): cvt to f16x2, float32 multiply by 2^e, bf16 pack
__device__ __forceinline__ uint32_t decode_slow(unsigned short h, float sc) {
  const uint32_t g = codes_to_f16x2(h);
  const float y0 = __fmul_rn(__half2float(__ushort_as_half((unsigned short)(g & 0xFFFFu))), sc);
  const float y1 = __fmul_rn(__half2float(__ushort_as_half((unsigned short)(g >> 16))), sc);
  uint32_t out;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(y1), "f"(y0));
  return out;
}

// QDQ 2's fast decode: the codes' exact values packed to bf16, then times 2^e in bf16x2
__device__ __forceinline__ uint32_t decode_bf16(unsigned short h, uint32_t sc2) {
  const uint32_t g = codes_to_f16x2(h);
  const float y0 = __half2float(__ushort_as_half((unsigned short)(g & 0xFFFFu)));
  const float y1 = __half2float(__ushort_as_half((unsigned short)(g >> 16)));
  uint32_t b, out;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(b) : "f"(y1), "f"(y0));
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out) : "r"(b), "r"(sc2));
  return out;
}

// VARIANT 4: the RowScale of an E8M0 scale byte s (2^(s - 127); 0xFF: NaN) for the decode
// alone (no encode: inv2 unused); s = 0 (2^-127, no normal bf16) and every e < kFastMin
// take the float32 decode
__device__ __forceinline__ RowScale e8m0_row_scale(uint32_t s) {
  const bool nf = s == 0xFFu;
  RowScale r;
  r.inv2 = 0u;
  r.sc2 = nf ? 0x7FC07FC0u : (s << 7) * 0x10001u;  // the bf16 exponent field of 2^e is s
  uint32_t b = s << 23;
  if (s == 0u) b = 0x400000u;
  if (nf) b = 0x7FC00000u;
  r.sc = __uint_as_float(b);
  r.slow = int(s) - 127 < kFastMin && !nf;
  return r;
}

__device__ __forceinline__ uint32_t qdq_pair2(uint32_t x, const RowScale& r) {
  const unsigned short h = encode_pair(x, r.inv2);
  return r.slow ? decode_slow(h, r.sc) : decode_bf16(h, r.sc2);
}

// QDQ 4: QDQ 2 with the decode of the two E4M3/E5M2 codes done in integer arithmetic
// instead of cvt (tried because QDQ 2's fewer instructions ran no faster than QDQ 1, on the
// guess that the three float conversions per pair share a slow pipe; QDQ 4 ran 5-8% slower). A
// code's exponent and mantissa bits
// placed in a bf16's (E4M3 at bits 4..10, E5M2 at 5..11) read as the code's value times
// 2^-(127 - bias), subnormal codes included (bf16 subnormals); one bf16x2 multiply by
// 2^(127 - bias + e) then gives the dequantized value, exact where 2^(127 - bias + e) is
// a bf16 and the smallest nonzero result is normal; other rows take QDQ 1's float path.

struct RowScale4 {
  uint32_t inv2;  // bf16x2 2^-e
  uint32_t sc2;   // bf16x2 2^(127 - bias + e) (NaN for a non-finite block)
  float sc;       // float32 2^e for the slow rows
  bool slow;      // 2^(127 - bias + e) is no bf16, or the smallest nonzero result would be subnormal
};

__device__ __forceinline__ RowScale4 row_scale4(uint32_t amax16) {
  bool nf;
  const int e = scale_exp(amax16, nf);
  RowScale4 r;
  r.inv2 = (uint32_t(127 - e) << 7) * 0x10001u;
  r.slow = !nf && (e < kFastMin || e > kBias);
  // the bf16 exponent field of 2^(127 - bias + e): 254 - bias + e, in [1, 254] when fast
  r.sc2 = nf ? 0x7FC07FC0u : (uint32_t((254 - kBias + e) & 0xFF) << 7) * 0x10001u;
  uint32_t s = uint32_t(e + 127) << 23;
  if (e < -126) s = 0x400000u;
  if (nf) s = 0x7FC00000u;  // the warp-wide slow path runs for the non-finite rows too
  r.sc = __uint_as_float(s);
  return r;
}

// fast decode: the codes' bits into bf16 positions, one bf16x2 multiply, the signs back
__device__ __forceinline__ uint32_t decode_fast(unsigned short h, uint32_t sc2) {
  const uint32_t y8 = __byte_perm(uint32_t(h), 0u, 0x1404);  // code 0 in byte 1, code 1 in byte 3
  const uint32_t mag = (y8 >> kShift) & kMagMask;
  uint32_t p;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(p) : "r"(mag), "r"(sc2));
  return p | (y8 & 0x80008000u);
}

__device__ __forceinline__ uint32_t qdq_pair(uint32_t x, float inv, float sc) {
  const float x0 = __fmul_rn(__uint_as_float(x << 16), inv);
  const float x1 = __fmul_rn(__uint_as_float(x & 0xFFFF0000u), inv);
  return decode_slow(cvt_codes(x0, x1), sc);
}
}  // namespace mxq

#if VARIANT == 3
namespace cutlass::gemm::collective::detail {
// The weight's per-k-block conversion of the mixed-input mainloop, replaced by the MXFP8
// quantization. A thread's A fragment of one k-block (16 k) of an m64k16 wgmma holds 8
// values: rows r = lane / 4 and r + 8 (of its warp's 16), k = 2 (lane % 4) + {0, 1} and
// + 8, as 4 words (r: 0, 2; r + 8: 1, 3). A 32-element block is two k-blocks (2j, 2j + 1)
// of the 4 lanes that share a row: k-block 2j computes the block amax (its own 8 values of
// each row and those of k-block 2j + 1, both in registers by then: the mainloop loads two
// k-blocks ahead), reduces it over the 4 lanes (two xor shuffles) and keeps the two rows'
// scales for k-block 2j + 1.
template <>
struct MixedInputUtils<::MainloopQ> : MixedInputUtils<::CollectiveQ<cute::identity>> {
#ifndef EARLY
#define EARLY 1
#endif
#if EARLY
  // The mainloop loads k-block k + 2 of the A fragment from shared memory right before it
  // converts k-block k + 1, so the amax of a pair (2j, 2j + 1), taken at k-block 2j, waited
  // for the load of 2j + 1 issued just before it (ncu: short-scoreboard stalls on the
  // amax). Here the request for k-block 2 also loads k-block 3 (the same stage; its
  // registers are dead since the previous k-tile's conversion of k-block 3), and the request
  // for k-block 3 loads nothing: the pair (2, 3) arrives one k-block earlier. The pair
  // (0, 1) of the next k-tile still loads right before its conversion (its stage is waited
  // for there).
  template <class SmemTiledCopyA, class TensorASmemView, class TensorACopyView, class... Ts, class... Us>
  CUTLASS_DEVICE static void copy_tensors_MK(SmemTiledCopyA const& smem_tiled_copy_A, TensorASmemView const& tCsA,
                                             TensorACopyView& tCrA_copy_view, cute::tuple<Ts...> const&,
                                             cute::tuple<Us...> const&, int k_block, int read_stage) {
    static_assert(decltype(size<2>(tCrA_copy_view))::value == 4, "four k-blocks per k-tile (TK = 64)");
    if (k_block == 3) return;
    copy(smem_tiled_copy_A, tCsA(_, _, k_block, read_stage), tCrA_copy_view(_, _, k_block));
    if (k_block == 2) copy(smem_tiled_copy_A, tCsA(_, _, 3, read_stage), tCrA_copy_view(_, _, 3));
  }
#endif
  template <class ThreadMma, class TensorStorage>
  CUTLASS_DEVICE static auto partition_extra_mma_info(ThreadMma const&, TensorStorage&) {
#if QDQ == 4
    // rows r and r + 8, and whether a lane of the warp has a slow row (element 2's .slow)
    return cute::make_tuple(cutlass::Array<mxq::RowScale4, 3>{});
#elif QDQ == 5
    return cute::make_tuple(cutlass::Array<mxq::RowScale, 3>{});  // the same for QDQ 5
#elif QDQ >= 2 || QDQ == 0
    return cute::make_tuple(cutlass::Array<mxq::RowScale, 2>{});  // rows r and r + 8
#else
    return cute::make_tuple(cutlass::Array<float, 4>{});  // 2^-e and 2^e of rows r and r + 8
#endif
  }
  template <class TiledMma, class... Ts>
  CUTLASS_DEVICE static auto retile_extra_mma_info(TiledMma const&, cute::tuple<Ts...>&, int const) {
    return cute::make_tuple();
  }
  template <class EngineIn, class EngineOut, class LayoutIn, class LayoutOut, class... Ts>
  CUTLASS_DEVICE static void dequantize_A_kblock(Tensor<EngineIn, LayoutIn> const& tCrA_load,
                                                 Tensor<EngineOut, LayoutOut>& tCrA_mma,
                                                 cute::tuple<Ts...>& extra, int const k_block) {
    static_assert(decltype(size(tCrA_load(_, _, 0)))::value == 8, "one m64 atom per thread along M");
    static_assert(decltype(size<2>(tCrA_load))::value % 2 == 0, "k-blocks come in pairs (32-element blocks)");
#if QDQ >= 2 || QDQ == 0
    auto& rs = cute::get<0>(extra);
#else
    auto& s = cute::get<0>(extra);
#endif
    const uint32_t* a = reinterpret_cast<const uint32_t*>(raw_pointer_cast(tCrA_load.data()));
    uint32_t* q = reinterpret_cast<uint32_t*>(raw_pointer_cast(tCrA_mma.data())) + 4 * k_block;
    const uint32_t* w = a + 4 * k_block;
#if QDQ == 0
    // one bf16x2 multiply by 1.0 per pair (a plain register copy made ptxas serialize the
    // wgmmas: C7513)
    for (int i = 0; i < 4; ++i) asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(q[i]) : "r"(w[i]), "r"(0x3F803F80u));
    (void)rs;
#else
    if ((k_block & 1) == 0) {
      const uint32_t* v = w + 4;  // k-block 2j + 1
      constexpr uint32_t M = 0x7FFF7FFFu;
      uint32_t rg = mxq::vmax2(mxq::vmax2(w[0] & M, w[2] & M), mxq::vmax2(v[0] & M, v[2] & M));
      uint32_t rh = mxq::vmax2(mxq::vmax2(w[1] & M, w[3] & M), mxq::vmax2(v[1] & M, v[3] & M));
      uint32_t m = mxq::vmax2(__byte_perm(rg, rh, 0x5410), __byte_perm(rg, rh, 0x7632));
      m = mxq::vmax2(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
      m = mxq::vmax2(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
#if QDQ == 4
      rs[0] = mxq::row_scale4(m & 0xFFFFu);
      rs[1] = mxq::row_scale4(m >> 16);
      rs[2].slow = __any_sync(0xFFFFFFFFu, rs[0].slow || rs[1].slow);  // one branch per warp
#elif QDQ >= 2
      rs[0] = mxq::row_scale(m & 0xFFFFu);
      rs[1] = mxq::row_scale(m >> 16);
#if QDQ == 5
      rs[2].slow = __any_sync(0xFFFFFFFFu, rs[0].slow || rs[1].slow);  // one branch per warp
#endif
#else
      mxq::block_scale(m & 0xFFFFu, s[0], s[1]);
      mxq::block_scale(m >> 16, s[2], s[3]);
#endif
    }
#if QDQ == 3
    // the scales computed (an empty volatile asm uses them), the raw weight into the MMA
    asm volatile("" :: "r"(rs[0].inv2), "r"(rs[0].sc2), "r"(rs[1].inv2), "r"(rs[1].sc2));
    for (int i = 0; i < 4; ++i) asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(q[i]) : "r"(w[i]), "r"(0x3F803F80u));
#elif QDQ == 4 || QDQ == 5
    // one slow / fast branch per warp (rs[2].slow: a real branch, not both paths under
    // predicates); the fast decode: QDQ 4's in integer arithmetic, QDQ 5's that of QDQ 2
    const unsigned short h[4] = {mxq::encode_pair(w[0], rs[0].inv2), mxq::encode_pair(w[1], rs[1].inv2),
                                 mxq::encode_pair(w[2], rs[0].inv2), mxq::encode_pair(w[3], rs[1].inv2)};
    if (rs[2].slow) {
      for (int i = 0; i < 4; ++i) q[i] = mxq::decode_slow(h[i], rs[i & 1].sc);
    } else {
      for (int i = 0; i < 4; ++i)
        q[i] = QDQ == 4 ? mxq::decode_fast(h[i], rs[i & 1].sc2) : mxq::decode_bf16(h[i], rs[i & 1].sc2);
    }
#elif QDQ == 2
    q[0] = mxq::qdq_pair2(w[0], rs[0]);
    q[1] = mxq::qdq_pair2(w[1], rs[1]);
    q[2] = mxq::qdq_pair2(w[2], rs[0]);
    q[3] = mxq::qdq_pair2(w[3], rs[1]);
#else
    q[0] = mxq::qdq_pair(w[0], s[0], s[1]);
    q[1] = mxq::qdq_pair(w[1], s[2], s[3]);
    q[2] = mxq::qdq_pair(w[2], s[0], s[1]);
    q[3] = mxq::qdq_pair(w[3], s[2], s[3]);
#endif
#endif  // QDQ == 0
  }
};
}  // namespace cutlass::gemm::collective::detail

namespace {
#if LOOP == 0
using Mainloop = MainloopQ;  // CUTLASS's consumer loop: one k-block converted between two wgmmas
#else
// Our consumer loop (LOOP 2 or 4): the MXFP8 quantization of LOOP k-blocks at once (a pair =
// one 32-element block, or a whole k-tile), issued while the wgmmas of the LOOP k-blocks
// before them run. CUTLASS's loop converts one k-block between two wgmmas, so each
// conversion is a short dependent chain (shared-memory load, amax, two shuffles, scale,
// quantize-dequantize) the tensor pipe waits for; here the compiler can interleave two or four
// such chains, and they have two or four wgmmas of the warpgroup (and as many of the other)
// to hide behind. LOOP 4 keeps two sets of A-fragment registers (k-tile t's in flight while
// t + 1's are written). Same pipeline protocol as CUTLASS's loop: every stage but the last
// is released here, the last by mma_tail.
struct Mainloop : MainloopQ {
  using Base = MainloopQ;
  using Utils = cutlass::gemm::collective::detail::MixedInputUtils<MainloopQ>;

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(typename Base::MainloopPipeline pipeline, typename Base::PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          typename Base::TensorStorage& shared_tensors, typename Base::Params const&) {
    using TiledMma = typename Base::TiledMma;
    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Tensor sA = as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(shared_tensors.smem_A.begin()), typename Base::SmemLayoutA{}));  // (M, K, PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.begin()), typename Base::SmemLayoutB{});  // (N, K, PIPE)
    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    const int wg = __shfl_sync(0xFFFFFFFFu, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    auto wg_mma = tiled_mma.get_slice(make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{})(wg));
    Tensor tCsA = thr_mma.partition_A(sA);                                     // (MMA, MMA_M, MMA_K, PIPE)
    Tensor tCrA0 = thr_mma.partition_fragment_A(sA(_, _, Int<0>{}));         // quantized weight (MMA, MMA_M, MMA_K)
    Tensor tCrA1 = make_fragment_like(tCrA0);                                  // LOOP 4's second set
    Tensor tCrW = make_fragment_like<typename Base::RealSwappedElementA>(tCrA0);  // raw weight
    Tensor tCrB = wg_mma.make_fragment_B(wg_mma.partition_B(sB));            // (MMA, MMA_N, MMA_K, PIPE)
    auto copy_A = make_tiled_copy_A(typename Base::SwappedSmemCopyAtomA{}, tiled_mma);
#if WT
    // ldmatrix.trans: each thread gives the shared-memory address of rows other threads
    // receive, so the source is partitioned by the copy (over both warpgroups' rows)
    auto thr_copy_A = copy_A.get_thread_slice(thread_idx);
    Tensor tCsA_copy = thr_copy_A.partition_S(sA);                             // (CPY, CPY_M, CPY_K, PIPE)
#else
    // element-wise copy: each thread reads its own fragment's values (tCsA)
    auto thr_copy_A = copy_A.get_thread_slice(thread_idx % cutlass::NumThreadsPerWarpGroup);
    auto& tCsA_copy = tCsA;
#endif
    Tensor tCrW_view = thr_copy_A.retile_D(tCrW);
    auto extra = Utils::partition_extra_mma_info(thr_mma, shared_tensors);
    constexpr int kBlocks = decltype(size<2>(tCrW))::value;
    static_assert(kBlocks == 4, "four k-blocks per k-tile (TK = 64)");

    // load and quantize k-blocks [k0, k0 + n) of stage into dst
    auto prepare = [&](auto& dst, int k0, int n, int stage) {
      CUTLASS_PRAGMA_UNROLL
      for (int k = k0; k < k0 + n; ++k) copy(copy_A, tCsA_copy(_, _, k, stage), tCrW_view(_, _, k));
      CUTLASS_PRAGMA_UNROLL
      for (int k = k0; k < k0 + n; ++k) Utils::dequantize_A_kblock(tCrW, dst, extra, k);
    };
    auto issue = [&](auto& src, int k0, int n, int stage) {
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k = k0; k < k0 + n; ++k) {
        cute::gemm(tiled_mma, src(_, _, k), tCrB(_, _, k, stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
    };

    typename Base::PipelineState smem_pipe_release = smem_pipe_read;
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(accum);
    pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
    bool first = true;
#if LOOP == 2
    prepare(tCrA0, 0, 2, smem_pipe_read.index());
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      const int stage = smem_pipe_read.index();
      ++smem_pipe_read;
      warpgroup_fence_operand(accum);
      issue(tCrA0, 0, 2, stage);
      warpgroup_wait<1>();  // the previous pair's wgmmas are done: its registers and (at a new k-tile) its stage are free
      if (!first) { pipeline.consumer_release(smem_pipe_release); ++smem_pipe_release; }
      first = false;
      prepare(tCrA0, 2, 2, stage);
      issue(tCrA0, 2, 2, stage);
      warpgroup_wait<1>();
      if (k_tile_count > 1) {
        pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
        prepare(tCrA0, 0, 2, smem_pipe_read.index());
      }
      warpgroup_fence_operand(accum);
    }
#else
    static_assert(LOOP == 4, "LOOP is 0, 2 or 4");
    prepare(tCrA0, 0, kBlocks, smem_pipe_read.index());
    // one k-tile from cur, the next one prepared into nxt
    auto tile = [&](auto& cur, auto& nxt) {
      const int stage = smem_pipe_read.index();
      ++smem_pipe_read;
      warpgroup_fence_operand(accum);
      issue(cur, 0, kBlocks, stage);
      warpgroup_wait<1>();  // the previous k-tile's wgmmas are done: nxt and its stage are free
      if (!first) { pipeline.consumer_release(smem_pipe_release); ++smem_pipe_release; }
      first = false;
      if (k_tile_count > 1) {
        pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
        prepare(nxt, 0, kBlocks, smem_pipe_read.index());
      }
      warpgroup_fence_operand(accum);
      --k_tile_count;
    };
    CUTLASS_PRAGMA_NO_UNROLL
    while (k_tile_count > 0) {
      tile(tCrA0, tCrA1);
      if (k_tile_count == 0) break;
      tile(tCrA1, tCrA0);
    }
#endif
    warpgroup_fence_operand(accum);
  }
};
#endif
}  // namespace
#else  // VARIANT 4
namespace cutlass::gemm::collective::detail {
// VARIANT 4's conversion of one k-block (the m64k16 A fragment of a thread: 8 codes, rows r
// and r + 8 of its warp's 16, as VARIANT 3's), the codes read as 4 pairs (row r, row r + 8,
// row r, row r + 8) and the scales as the uint16 of each row (the collective broadcasts a
// row's scale over the fragment: element 0 is row r's, element 2 row r + 8's); k-blocks 0-1
// of the 64-element k-tile take the low byte, 2-3 the high byte. One slow / fast branch per
// warp, as QDQ 5.
template <>
struct MixedInputUtils<::Mainloop> : MixedInputUtils<::Collective8<cute::identity>> {
  template <class EngineIn, class EngineOut, class LayoutIn, class LayoutOut, class... Ts>
  CUTLASS_DEVICE static void dequantize_A_kblock(Tensor<EngineIn, LayoutIn> const& tCrA_load,
                                                 Tensor<EngineOut, LayoutOut>& tCrA_mma,
                                                 cute::tuple<Ts...>& extra, int const k_block) {
    static_assert(decltype(size(tCrA_load(_, _, 0)))::value == 8, "one m64 atom per thread along M");
    static_assert(decltype(size<2>(tCrA_load))::value == 4, "four k-blocks per k-tile (TK = 64)");
    auto scales = cute::get<1>(extra)(_, _, k_block);
    const int shift = (k_block & 2) ? 8 : 0;
    const mxq::RowScale r0 = mxq::e8m0_row_scale((uint32_t(scales(0)) >> shift) & 0xFFu);
    const mxq::RowScale r1 = mxq::e8m0_row_scale((uint32_t(scales(2)) >> shift) & 0xFFu);
    const unsigned short* h = reinterpret_cast<const unsigned short*>(raw_pointer_cast(tCrA_load.data())) + 4 * k_block;
    uint32_t* q = reinterpret_cast<uint32_t*>(raw_pointer_cast(tCrA_mma.data())) + 4 * k_block;
    if (__any_sync(0xFFFFFFFFu, r0.slow || r1.slow)) {
      for (int i = 0; i < 4; ++i) q[i] = mxq::decode_slow(h[i], (i & 1) ? r1.sc : r0.sc);
    } else {
      for (int i = 0; i < 4; ++i) q[i] = mxq::decode_bf16(h[i], (i & 1) ? r1.sc2 : r0.sc2);
    }
  }
};
}  // namespace cutlass::gemm::collective::detail
#endif  // VARIANT
#endif

namespace {
using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
using StrideA = typename Kernel::InternalStrideA;
using StrideB = typename Kernel::InternalStrideB;
using StrideD = typename Kernel::InternalStrideD;

struct State {
  int groups = 0, nout = 0, k = 0;
  StrideA* dA = nullptr;
  StrideB* dB = nullptr;
  StrideD* dD = nullptr;
  void* dS = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
State g_state;

// st's per-group stride arrays on the current device (every group has the same strides:
// weights Nout x K, tokens and outputs with K / Nout elements per row); 0, or 1 if an
// allocation or copy failed (nothing left allocated then)
int alloc_strides(State& st, int groups, int nout, int k) {
  st.groups = groups; st.nout = nout; st.k = k;
  std::vector<StrideA> a(groups, cutlass::make_cute_packed_stride(StrideA{}, {nout, k, 1}));
  std::vector<StrideB> b(groups, cutlass::make_cute_packed_stride(StrideB{}, {1 << 20, k, 1}));
  std::vector<StrideD> d(groups, cutlass::make_cute_packed_stride(StrideD{}, {nout, 1 << 20, 1}));
  if (cudaMalloc(&st.dA, groups * sizeof(StrideA)) || cudaMalloc(&st.dB, groups * sizeof(StrideB)) ||
      cudaMalloc(&st.dD, groups * sizeof(StrideD)) ||
      cudaMemcpy(st.dA, a.data(), groups * sizeof(StrideA), cudaMemcpyHostToDevice) ||
      cudaMemcpy(st.dB, b.data(), groups * sizeof(StrideB), cudaMemcpyHostToDevice) ||
      cudaMemcpy(st.dD, d.data(), groups * sizeof(StrideD), cudaMemcpyHostToDevice)) {
    cudaFree(st.dA); cudaFree(st.dB); cudaFree(st.dD);  // cudaFree(nullptr) is a no-op
    st.dA = nullptr; st.dB = nullptr; st.dD = nullptr;
    return 1;
  }
#if VARIANT == 4
  {  // the scales' strides: (Nout, K / 64) per group, Nout contiguous
    using StrideS = typename Mainloop::StrideScale;
    std::vector<StrideS> sv(groups, cutlass::make_cute_packed_stride(StrideS{}, {nout, (k + TK - 1) / TK, 1}));
    if (cudaMalloc(&st.dS, groups * sizeof(StrideS)) ||
        cudaMemcpy(st.dS, sv.data(), groups * sizeof(StrideS), cudaMemcpyHostToDevice)) {
      cudaFree(st.dA); cudaFree(st.dB); cudaFree(st.dD); cudaFree(st.dS);
      st.dA = nullptr; st.dB = nullptr; st.dD = nullptr; st.dS = nullptr;
      return 1;
    }
  }
#endif
  return 0;
}

template <class Args>
void fill_args(Args& args, int groups, void* problems, void* pa, void* pb, void* ps, void* pd, int chunk,
               const State& st = g_state) {
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);  // the caller's current device
  hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.f;
  fusion.beta = 0.f;
  auto shapes = reinterpret_cast<typename ProblemShape::UnderlyingProblemShape*>(problems);
#if VARIANT == 2 || VARIANT == 4
  {
    using StrideS = typename Mainloop::StrideScale;
    args = Args{cutlass::gemm::GemmUniversalMode::kGrouped,
                {groups, shapes, nullptr},
                {reinterpret_cast<ElementW const**>(pa), st.dA, reinterpret_cast<Bf16 const**>(pb), st.dB,
                 reinterpret_cast<typename Mainloop::NonVoidElementScale const**>(ps),
                 reinterpret_cast<StrideS const*>(st.dS), chunk},
                {fusion, nullptr, nullptr, reinterpret_cast<Bf16**>(pd), st.dD},
                hw};
  }
#else
  {
    args = Args{cutlass::gemm::GemmUniversalMode::kGrouped,
                {groups, shapes, nullptr},
                {reinterpret_cast<ElementW const**>(pa), st.dA, reinterpret_cast<Bf16 const**>(pb), st.dB},
                {fusion, nullptr, nullptr, reinterpret_cast<Bf16**>(pd), st.dD},
                hw};
  }
#endif
#if RASTER == 2
  {  // a measurement build (benchmarks/wq_raster.py): the order and the swizzle from the environment
    using RO = decltype(args.scheduler.raster_order);
    const char* r = getenv("MXMOE_WQ_RASTER");
    const char* z = getenv("MXMOE_WQ_SWIZZLE");
    if (r) args.scheduler.raster_order = r[0] == 'n' ? RO::AlongN : (r[0] == 'h' ? RO::Heuristic : RO::AlongM);
    if (z) args.scheduler.max_swizzle_size = atoi(z);  // no effect without host problem shapes
  }
#elif RASTER
  // the tiles that share one block of weight rows (one per token tile of the expert) run
  // back to back instead of CUTLASS's default order for grouped problems (AlongM: every block
  // of weight rows for one token tile): the dgrad at (65536, 7168, 2048, 64), whose weight
  // operand per expert (29 MB) is seven times its tokens', ran 0.848-0.851x instead of
  // 0.817-0.821x (benchmarks/wq_raster.py, session 16); no change at (16384, 2048, 1408, 64);
  // slower at the skewed E = 16 routing (0.815 against 0.834), which the dgrad's bound
  // (cutlass_wq.MAX_TOKENS_PER_EXPERT_DGRAD) leaves to design (a)
  args.scheduler.raster_order = decltype(args.scheduler.raster_order)::AlongN;
#endif
}
}  // namespace

extern "C" {
#if RASTER == 2
int CAT(NAME, _raster_from_env)() { return 1; }  // marks a measurement build for benchmarks/wq_raster.py
#endif
// Allocates the per-group stride arrays (every group has the same strides) for groups
// experts of Nout x K weights. Returns 0 on success.
int CAT(NAME, _setup)(int groups, int nout, int k, int chunk) {
  cudaFree(g_state.dA); cudaFree(g_state.dB); cudaFree(g_state.dD); cudaFree(g_state.dS);  // a previous setup's
  g_state.dA = nullptr; g_state.dB = nullptr; g_state.dD = nullptr; g_state.dS = nullptr;
  if (alloc_strides(g_state, groups, nout, k)) return 1;
#if VARIANT == 2
  {
    using StrideS = typename Mainloop::StrideScale;
    const int scale_k = (k + chunk - 1) / chunk;
    std::vector<StrideS> s(groups, cutlass::make_cute_packed_stride(StrideS{}, {nout, scale_k, 1}));
    if (cudaMalloc(&g_state.dS, groups * sizeof(StrideS))) return 1;
    cudaMemcpy(g_state.dS, s.data(), groups * sizeof(StrideS), cudaMemcpyHostToDevice);
  }
#endif
  return 0;
}

// problems: int32 (groups, 3) = (Nout, S_g, K); pa/pb/ps/pd: device arrays of groups
// pointers (weight, tokens, scales, output of group g). Launches on stream. Returns 0,
// or 2 (can_implement refused), 3 (initialize failed), 4 (run failed).
int CAT(NAME, _run)(void* problems, void* pa, void* pb, void* ps, void* pd, int chunk, void* stream) {
  typename Gemm::Arguments args;
  fill_args(args, g_state.groups, problems, pa, pb, ps, pd, chunk);
  Gemm gemm;
  size_t ws = Gemm::get_workspace_size(args);
  if (ws > g_state.workspace_bytes) {
    if (g_state.workspace) cudaFree(g_state.workspace);
    if (cudaMalloc(&g_state.workspace, ws)) return 5;
    g_state.workspace_bytes = ws;
  }
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 2;
  if (gemm.initialize(args, g_state.workspace, reinterpret_cast<cudaStream_t>(stream)) != cutlass::Status::kSuccess) return 3;
  if (gemm.run(reinterpret_cast<cudaStream_t>(stream)) != cutlass::Status::kSuccess) return 4;
  return 0;
}

// The library's entry (mxmoe/kernels/cutlass_wq.py): the same GEMM with the per-group stride
// arrays (read-only) kept per (device, groups, nout, k), made on the first call of a shape on
// a device (cudaMalloc and synchronous copies: the caller makes that call outside CUDA-graph
// capture), so that shapes can alternate (layers of different widths) and later calls only
// launch; a mutex guards the map (ctypes calls run without the GIL). The workspace (the
// kernel's per-SM TMA descriptors) comes from the caller for each call, from its stream's
// allocator, so that launches on different streams never share one: NAME_workspace_bytes
// gives its size. problems: int32 (groups, 3) = (Nout, S_g, K); pa / pb / pd: device arrays
// of the groups' weight, token and output pointers, on the current device. Returns 0, or 1
// (allocation or copy failed), 2 (can_implement refused), 3 (initialize failed), 4 (launch
// failed), 5 (workspace too small); NAME_last_error names the CUDA error behind 1 / 4.
static cudaError_t g_last_error = cudaSuccess;

long long CAT(NAME, _workspace_bytes)(int groups) {
  State st;
  typename Gemm::Arguments args;
  fill_args(args, groups, nullptr, nullptr, nullptr, nullptr, nullptr, 0, st);
  return (long long)Gemm::get_workspace_size(args);
}

const char* CAT(NAME, _last_error)() { return cudaGetErrorString(g_last_error); }

static int forward_impl(int groups, int nout, int k, void* problems, void* pa, void* pb, void* ps, void* pd,
                        void* workspace, long long workspace_bytes, void* stream) {
  static std::map<std::tuple<int, int, int, int>, State> states;
  static std::mutex lock;
  cudaGetLastError();  // a stale error of this (static) runtime would fail the launch check below
  int device = 0;
  cudaGetDevice(&device);
  State st;
  {
    std::lock_guard<std::mutex> guard(lock);
    const auto key = std::make_tuple(device, groups, nout, k);
    auto it = states.find(key);
    if (it == states.end()) {
      if (alloc_strides(st, groups, nout, k)) { g_last_error = cudaGetLastError(); return 1; }
      it = states.emplace(key, st).first;
    }
    st = it->second;  // the stride pointers (never freed: one small set per shape and device)
  }
  typename Gemm::Arguments args;
  fill_args(args, groups, problems, pa, pb, ps, pd, TK, st);
  if ((long long)Gemm::get_workspace_size(args) > workspace_bytes) return 5;
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 2;
  if (gemm.initialize(args, workspace, reinterpret_cast<cudaStream_t>(stream)) != cutlass::Status::kSuccess) return 3;
  if (gemm.run(reinterpret_cast<cudaStream_t>(stream)) != cutlass::Status::kSuccess) {
    g_last_error = cudaGetLastError();
    return 4;
  }
  return 0;
}

#if VARIANT == 4
// VARIANT 4's entry: NAME_forward with ps, the device array of the groups' scale pointers
// (uint16 (K / 64, Nout) per group, Nout contiguous: the two E8M0 bytes of a k-tile's row)
int CAT(NAME, _forward_scaled)(int groups, int nout, int k, void* problems, void* pa, void* pb, void* ps, void* pd,
                               void* workspace, long long workspace_bytes, void* stream) {
  return forward_impl(groups, nout, k, problems, pa, pb, ps, pd, workspace, workspace_bytes, stream);
}
#else
int CAT(NAME, _forward)(int groups, int nout, int k, void* problems, void* pa, void* pb, void* pd, void* workspace,
                        long long workspace_bytes, void* stream) {
  return forward_impl(groups, nout, k, problems, pa, pb, nullptr, pd, workspace, workspace_bytes, stream);
}
#endif

static_assert(sizeof(typename Kernel::SharedStorage) <= 232448, "shared memory of sm90 exceeded: fewer STAGES");
int CAT(NAME, _smem)() { return int(sizeof(typename Kernel::SharedStorage)); }
}
