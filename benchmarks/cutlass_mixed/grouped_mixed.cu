// CUTLASS sm90 grouped (ptr-array) GEMMs for the design (b) experiment of issue 4
// (benchmarks/cutlass_mixed.py builds and times them; benchmarks/NOTES.md, session 13).
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
// TM, TN, TK: the CTA tile; CM: CTAs per cluster along M (weight rows), multicasting the
// token tile. Built with nvcc -arch=sm_90a into one shared library whose C functions take
// device pointers only (no host synchronization).
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

using namespace cute;

#ifndef VARIANT
#define VARIANT 0
#endif
#ifndef NAME
#define NAME v0
#endif
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

namespace {
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using Bf16 = cutlass::bfloat16_t;
using E4m3 = cutlass::float_e4m3_t;
using ElementW = cute::conditional_t<VARIANT == 0, Bf16, E4m3>;
using ElementScale = Bf16;
using LayoutW = cutlass::layout::RowMajor;      // W (Nout x K), K contiguous
using LayoutX = cutlass::layout::ColumnMajor;   // X^T (K x S) with K contiguous: X row-major
using LayoutD = cutlass::layout::ColumnMajor;   // D (Nout x S), Nout contiguous
constexpr int AlignW = 128 / cutlass::sizeof_bits<ElementW>::value;
constexpr int AlignX = 8;
constexpr int AlignD = 8;
using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
using ClusterShape = Shape<Int<CM>, _1, _1>;
using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, LayoutD*, AlignD, Bf16, LayoutD*, AlignD, EpilogueSchedule>::CollectiveOp;

using OperandA = cute::conditional_t<VARIANT == 2, cute::tuple<ElementW, ElementScale>, ElementW>;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, OperandA, LayoutW*, AlignW, Bf16, LayoutX*, AlignX,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;

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

template <class Args>
void fill_args(Args& args, int groups, void* problems, void* pa, void* pb, void* ps, void* pd, int chunk) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;
  hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.f;
  fusion.beta = 0.f;
  auto shapes = reinterpret_cast<typename ProblemShape::UnderlyingProblemShape*>(problems);
#if VARIANT == 2
  {
    using StrideS = typename Mainloop::StrideScale;
    args = Args{cutlass::gemm::GemmUniversalMode::kGrouped,
                {groups, shapes, nullptr},
                {reinterpret_cast<ElementW const**>(pa), g_state.dA, reinterpret_cast<Bf16 const**>(pb), g_state.dB,
                 reinterpret_cast<ElementScale const**>(ps), reinterpret_cast<StrideS const*>(g_state.dS), chunk},
                {fusion, nullptr, nullptr, reinterpret_cast<Bf16**>(pd), g_state.dD},
                hw};
  }
#else
  {
    args = Args{cutlass::gemm::GemmUniversalMode::kGrouped,
                {groups, shapes, nullptr},
                {reinterpret_cast<ElementW const**>(pa), g_state.dA, reinterpret_cast<Bf16 const**>(pb), g_state.dB},
                {fusion, nullptr, nullptr, reinterpret_cast<Bf16**>(pd), g_state.dD},
                hw};
  }
#endif
}
}  // namespace

extern "C" {
// Allocates the per-group stride arrays (every group has the same strides) for groups
// experts of Nout x K weights. Returns 0 on success.
int CAT(NAME, _setup)(int groups, int nout, int k, int chunk) {
  g_state.groups = groups; g_state.nout = nout; g_state.k = k;
  std::vector<StrideA> a(groups, cutlass::make_cute_packed_stride(StrideA{}, {nout, k, 1}));
  std::vector<StrideB> b(groups, cutlass::make_cute_packed_stride(StrideB{}, {1 << 20, k, 1}));
  std::vector<StrideD> d(groups, cutlass::make_cute_packed_stride(StrideD{}, {nout, 1 << 20, 1}));
  if (cudaMalloc(&g_state.dA, groups * sizeof(StrideA)) || cudaMalloc(&g_state.dB, groups * sizeof(StrideB)) ||
      cudaMalloc(&g_state.dD, groups * sizeof(StrideD))) return 1;
  cudaMemcpy(g_state.dA, a.data(), groups * sizeof(StrideA), cudaMemcpyHostToDevice);
  cudaMemcpy(g_state.dB, b.data(), groups * sizeof(StrideB), cudaMemcpyHostToDevice);
  cudaMemcpy(g_state.dD, d.data(), groups * sizeof(StrideD), cudaMemcpyHostToDevice);
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

int CAT(NAME, _smem)() { return int(sizeof(typename Kernel::SharedStorage)); }
}
