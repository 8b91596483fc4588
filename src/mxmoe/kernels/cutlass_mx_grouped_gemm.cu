// CUTLASS 4.2 sm90 grouped (ptr-array) GEMM that quantizes the MXFP8 weight inside its
// mainloop: the forward and dgrad GEMMs of mxmoe.ops.grouped_mm.mx_grouped_mm for bf16
// weights on sm90 (host side: mxmoe/kernels/cutlass_mx_grouped_gemm.py, which builds this
// file with nvcc at first use and calls NAME_forward).
//
// Per expert g (a group): D_g (Nout x S_g) = W_g (Nout x K) . X_g^T, W the expert weight
// (the register operand A), X_g the expert's S_g token rows (B, K-major), D_g column-major
// with leading dimension Nout, so that it is out[rows of g] (S_g x Nout) row-major. The raw
// bf16 weight is quantized to MXFP8 (32-element blocks along the contraction; element
// format FMT, scale rule MODE) and dequantized in registers between the tensor-core
// instructions of CUTLASS's mixed-input register-operand (RS) mainloop: the weight is
// carried as a 16-bit type and the mainloop's per-k-block conversion is replaced by the
// block quantization (the MixedInputUtils specialization below). The values are those of
// quantizing the weight in a separate pass (mxmoe.ops.quantize.fake_quantize_operand), bit
// for bit.
//
// Compile-time settings (nvcc -D), one build per combination:
//   FMT   0 E4M3, 1 E5M2 elements
//   MODE  0 rceil, 1 floor scale rule (docs/NUMERICS.md)
//   WT    0 the forward: A = W_g, K contiguous. 1 the dgrad, dX_g (S_g x K) = dY_g (S_g x N)
//         W_g: A = W_g^T (K x N: Nout = K, contracted over N), whose memory is W_g as it
//         lies (K contiguous: M-major), quantized along N by the same arithmetic
//   RASTER 0 CUTLASS's tile order; 1 the token tiles of one block of weight rows back to
//         back (the dgrad's build)
//   NAME  the prefix of the C entries
// The CTA tile is 128 weight rows x 320 tokens x 64 k, 3 pipeline stages, no cluster,
// CUTLASS's cooperative schedule. Built with nvcc -arch=sm_90a into a shared library whose
// C functions take device pointers (NAME_forward: no host synchronization after the first
// call of a shape).
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED  // the m64n160 wgmma (below)
#include <cstdint>
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

#ifndef NAME
#define NAME mx_grouped_gemm
#endif
#ifndef FMT
#define FMT 0  // 0 E4M3, 1 E5M2
#endif
#ifndef MODE
#define MODE 0  // 0 rceil, 1 floor (docs/NUMERICS.md)
#endif
#ifndef WT
#define WT 0  // 1: the dgrad, A = the weight transposed (its memory M-major)
#endif
#ifndef RASTER
#define RASTER 0  // 1: the grouped scheduler walks the token tiles first (AlongN; the dgrad)
#endif
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

namespace {
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using Bf16 = cutlass::bfloat16_t;
using ElementW = cutlass::half_t;  // the raw bf16 weight's bits (TMA and shared memory move bits)
// the CTA tile (weight rows, tokens, k) and the pipeline stages
constexpr int TM = 128;
constexpr int TN = 320;
constexpr int TK = 64;
constexpr int STAGES = 3;
// W (Nout x K): K contiguous; WT: the transpose of a row-major (K x Nout) matrix, Nout contiguous
using LayoutW = cute::conditional_t<WT, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
using LayoutX = cutlass::layout::ColumnMajor;   // X^T (K x S) with K contiguous: X row-major
using LayoutD = cutlass::layout::ColumnMajor;   // D (Nout x S), Nout contiguous
constexpr int AlignD = 8;
using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
using ClusterShape = Shape<_1, _1, _1>;
using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, LayoutD*, AlignD, Bf16, LayoutD*, AlignD, EpilogueSchedule>::CollectiveOp;

#if WT
}  // namespace
// The mixed-input collective asserts that the converted operand is K-major in memory: its
// own consumer loop copies shared memory to registers element-wise in the MMA's layout.
// Ours (Mainloop below) reads the M-major tile with ldmatrix.trans, which yields the K-major
// register fragment the wgmma takes; the collective's producer (TMA) and shared-memory
// layout follow the stride type and support either major. So the WT build declares its
// stride type acceptable to that assertion (the one use of is_k_major for this type here).
template <>
constexpr bool cutlass::gemm::detail::is_k_major<cutlass::detail::TagToStrideA_t<cutlass::layout::ColumnMajor*>>() {
  return true;
}
namespace {
#endif
// The collective the builder would make for a 16-bit weight converted in registers (it
// builds mixed-input kernels only for operands of different widths): the raw bf16 weight
// travels as half_t (TMA and shared memory move bits), TransformA marks the collective
// whose per-k-block conversion is the MXFP8 quantization (the MixedInputUtils
// specialization below).
struct QdqTransform {};
namespace cd = cutlass::gemm::collective::detail;
// The wgmma atom: the 320-token tile (one tile for an expert of up to 320 tokens, whose
// weight tile is then quantized once) as two m64n160 wgmmas per k-block (n160 is one of
// CUTLASS's extended shapes, enabled at the top; the selector would pick n64 for 320).
using MmaAtomQ = cute::SM90::GMMA::MMA_64x160x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>;
using TiledMmaQ = decltype(cute::make_tiled_mma(MmaAtomQ{}, Layout<Shape<_2, _1, _1>>{}));
// WT: the weight tile in shared memory as in memory (M contiguous, 128-byte swizzle), read
// into the K-major register fragment with ldmatrix.trans (SmemCopyAtomAQ; our consumer loop)
using SmemAtomAQ = decltype(cd::rs_smem_selector<WT ? GMMA::Major::MN : GMMA::Major::K, cutlass::half_t, Int<TM>,
                                                 Int<TK>, false>());
#if WT
using SmemCopyAtomAQ = Copy_Atom<cute::SM75_U16x8_LDSM_T, cutlass::half_t>;
#else
using SmemCopyAtomAQ = Copy_Atom<cute::AutoVectorizingCopy, cutlass::half_t>;
#endif
// The token tile in shared memory as two 160-row halves with a gap between them: a TMA
// box holds at most 256 rows, and cute makes one box of a contiguous 320-row tile (which the
// driver refuses, and the kernel then waits forever); the 4 KiB gap makes each half
// one box (two TMA loads per stage) and the B operand of one m64n160 wgmma. 128-byte swizzle,
// K-major, as CUTLASS's own atom; the gap keeps the swizzle period and the stride divisibility cute needs.
using SmemAtomB128 = GMMA::Layout_K_SW128_Atom<Bf16>;
static_assert(TK == 64, "the 320-token tile is laid out for TK = 64");
using SmemAtomBQ = decltype(cute::make_composed_layout(
    SmemAtomB128{}.layout_a(), SmemAtomB128{}.offset(),
    Layout<Shape<Shape<_8, Int<20>, _2>, _64>, Stride<Stride<_64, _512, Int<160 * 64 + 2048>>, _1>>{}));
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

}  // namespace

namespace mxq {
// The MX block quantization, per pair of bf16 values of one row: the scale exponent e from
// the block amax (the rule of mxmoe.kernels.triton_quantize._scale_exponent), then per
// value x: cvt.rn.satfinite(x * 2^-e) to E4M3/E5M2, decoded, times 2^e, to bf16.
constexpr int kEmax = FMT == 0 ? 8 : 15;
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

// The scale exponent in integer arithmetic from the block amax (the largest sign-cleared
// bf16 bit pattern of the block; NaN patterns sort above inf): rceil: e = EA - 127 - emax +
// (MA > 0x60) for the amax's bf16 exponent field EA and mantissa MA, floor: e = EA - 127 -
// emax, clamped to [-127, 127]; equal to the reference's float32 rule (amax * float32(1 /
// max_normal), rounded up to a power of two) for every bf16 amax, both formats (checked
// exhaustively on the CPU: tests/kernels/test_cutlass_mx_arithmetic.py). The multiplies by
// 2^-e and 2^e are bf16x2 (exact: powers of two; the multiply by 2^-e feeds the float8
// conversion, which rounds anything below bf16's normal range to zero anyway). Rows with
// e < kFastMin, where dequantized values could be bf16 subnormals, take a float32 multiply.
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
  if (nf) s = 0x7FC00000u;  // the warp-wide slow path runs for the non-finite rows too
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

// fast decode: the codes' exact values packed to bf16, then times 2^e in bf16x2
__device__ __forceinline__ uint32_t decode_bf16(unsigned short h, uint32_t sc2) {
  const uint32_t g = codes_to_f16x2(h);
  const float y0 = __half2float(__ushort_as_half((unsigned short)(g & 0xFFFFu)));
  const float y1 = __half2float(__ushort_as_half((unsigned short)(g >> 16)));
  uint32_t b, out;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(b) : "f"(y1), "f"(y0));
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out) : "r"(b), "r"(sc2));
  return out;
}

}  // namespace mxq

namespace cutlass::gemm::collective::detail {
// The weight's per-k-block conversion of the mixed-input mainloop, replaced by the MXFP8
// quantization. A thread's A fragment of one k-block (16 k) of an m64k16 wgmma holds 8
// values: rows r = lane / 4 and r + 8 (of its warp's 16), k = 2 (lane % 4) + {0, 1} and
// + 8, as 4 words (r: 0, 2; r + 8: 1, 3). A 32-element block is two k-blocks (2j, 2j + 1)
// of the 4 lanes that share a row: k-block 2j computes the block amax (its own 8 values of
// each row and those of k-block 2j + 1, both in registers by then: the consumer loop below
// loads a whole k-tile before it converts one), reduces it over the 4 lanes (two xor shuffles) and keeps the two rows'
// scales for k-block 2j + 1.
template <>
struct MixedInputUtils<::MainloopQ> : MixedInputUtils<::CollectiveQ<cute::identity>> {
  template <class ThreadMma, class TensorStorage>
  CUTLASS_DEVICE static auto partition_extra_mma_info(ThreadMma const&, TensorStorage&) {
    // rows r and r + 8, and whether a row of the warp takes the slow path (element 2's .slow)
    return cute::make_tuple(cutlass::Array<mxq::RowScale, 3>{});
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
    auto& rs = cute::get<0>(extra);
    const uint32_t* a = reinterpret_cast<const uint32_t*>(raw_pointer_cast(tCrA_load.data()));
    uint32_t* q = reinterpret_cast<uint32_t*>(raw_pointer_cast(tCrA_mma.data())) + 4 * k_block;
    const uint32_t* w = a + 4 * k_block;
    if ((k_block & 1) == 0) {
      const uint32_t* v = w + 4;  // k-block 2j + 1
      constexpr uint32_t M = 0x7FFF7FFFu;
      uint32_t rg = mxq::vmax2(mxq::vmax2(w[0] & M, w[2] & M), mxq::vmax2(v[0] & M, v[2] & M));
      uint32_t rh = mxq::vmax2(mxq::vmax2(w[1] & M, w[3] & M), mxq::vmax2(v[1] & M, v[3] & M));
      uint32_t m = mxq::vmax2(__byte_perm(rg, rh, 0x5410), __byte_perm(rg, rh, 0x7632));
      m = mxq::vmax2(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
      m = mxq::vmax2(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
      rs[0] = mxq::row_scale(m & 0xFFFFu);
      rs[1] = mxq::row_scale(m >> 16);
      rs[2].slow = __any_sync(0xFFFFFFFFu, rs[0].slow || rs[1].slow);  // one branch per warp
    }
    // one slow / fast branch per warp (rs[2].slow: a real branch, not both paths under
    // predicates)
    const unsigned short h[4] = {mxq::encode_pair(w[0], rs[0].inv2), mxq::encode_pair(w[1], rs[1].inv2),
                                 mxq::encode_pair(w[2], rs[0].inv2), mxq::encode_pair(w[3], rs[1].inv2)};
    if (rs[2].slow) {
      for (int i = 0; i < 4; ++i) q[i] = mxq::decode_slow(h[i], rs[i & 1].sc);
    } else {
      for (int i = 0; i < 4; ++i) q[i] = mxq::decode_bf16(h[i], rs[i & 1].sc2);
    }
  }
};
}  // namespace cutlass::gemm::collective::detail

namespace {
// Our consumer loop: the MXFP8 quantization of a whole k-tile (four k-blocks) at once,
// issued while the wgmmas of the k-tile before it run. CUTLASS's loop converts one k-block
// between two wgmmas, so each conversion is a short dependent chain (shared-memory load,
// amax, two shuffles, scale, quantize-dequantize) the tensor pipe waits for; here the
// compiler can interleave four such chains, and they have four wgmmas of the warpgroup (and
// as many of the other) to hide behind. Two sets of A-fragment registers (k-tile t's in
// flight while t + 1's are written). Same pipeline protocol as CUTLASS's loop: every stage
// but the last is released here, the last by mma_tail.
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
    Tensor tCrA1 = make_fragment_like(tCrA0);                                  // the second set
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
    warpgroup_fence_operand(accum);
  }
};
}  // namespace

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
};

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
  return 0;
}

template <class Args>
void fill_args(Args& args, int groups, void* problems, void* pa, void* pb, void* pd, const State& st) {
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);  // the caller's current device
  hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.f;
  fusion.beta = 0.f;
  auto shapes = reinterpret_cast<typename ProblemShape::UnderlyingProblemShape*>(problems);
  args = Args{cutlass::gemm::GemmUniversalMode::kGrouped,
              {groups, shapes, nullptr},
              {reinterpret_cast<ElementW const**>(pa), st.dA, reinterpret_cast<Bf16 const**>(pb), st.dB},
              {fusion, nullptr, nullptr, reinterpret_cast<Bf16**>(pd), st.dD},
              hw};
#if RASTER
  // the tiles that share one block of weight rows (one per token tile of the expert) run
  // back to back instead of CUTLASS's default order for grouped problems (AlongM: every block
  // of weight rows for one token tile): faster for the dgrad when the weight operand is large
  // against the tokens (at (T, K, N, E) = (65536, 7168, 2048, 64) on the H200, 0.85x the
  // speed of bf16 torch._grouped_mm against 0.82x)
  args.scheduler.raster_order = decltype(args.scheduler.raster_order)::AlongN;
#endif
}
}  // namespace

extern "C" {
// The library's entry (mxmoe/kernels/cutlass_mx_grouped_gemm.py): the GEMM with the
// per-group stride arrays (read-only) kept per (device, groups, nout, k), made on the first
// call of a shape on a device (cudaMalloc and synchronous copies: the caller makes that call outside CUDA-graph
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
  fill_args(args, groups, nullptr, nullptr, nullptr, nullptr, st);
  return (long long)Gemm::get_workspace_size(args);
}

const char* CAT(NAME, _last_error)() { return cudaGetErrorString(g_last_error); }

int CAT(NAME, _forward)(int groups, int nout, int k, void* problems, void* pa, void* pb, void* pd, void* workspace,
                        long long workspace_bytes, void* stream) {
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
  fill_args(args, groups, problems, pa, pb, pd, st);
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

static_assert(sizeof(typename Kernel::SharedStorage) <= 232448, "shared memory of sm90 exceeded: fewer STAGES");
}
