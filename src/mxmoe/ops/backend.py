"""Which implementation runs each pass: the one place the backend of a GEMM or quantizer
is chosen.

The rule (every choice gives the same bits, except rule 4's bf16 experts, which agree to
bf16 rounding; only speed and memory differ):

1. Quantizers (``quantize_mx``, ``dequantize_mx``, ``fake_quantize_mx`` and every operand
   quantization of the recipe): :func:`use_triton`. The recipe's ``backend`` field decides:
   "reference" is pure torch (:mod:`mxmoe.numerics`), "triton" the kernels of
   :mod:`mxmoe.kernels` (FP8 elements, block 32, float32/bfloat16 data; CUDA tensors, or
   the CPU under ``TRITON_INTERPRET=1``), "auto" Triton for CUDA tensors it covers and the
   reference otherwise.
2. Grouped GEMMs of ``mx_grouped_mm`` (:func:`grouped_gemm_backend`), first match wins:
   a. ``NATIVE_MXFP8``: a quantizing E4M3 recipe on an sm100 GPU whose torch has a
      working ``torch._scaled_grouped_mm`` (block-scaled tensor cores; untested on
      hardware: :mod:`mxmoe.ops.sm100`). The wgrad of a ``wgrad_high_precision`` recipe
      runs ``DEQUANTIZED``.
   b. ``CUTLASS_QUANTIZED_WEIGHT``: forward or dgrad of a quantizing recipe on sm90 with
      bf16 activations and weights, few tokens per expert, no weight copy cached for the
      weight, and the CUTLASS build available (:func:`mxmoe.kernels.cutlass_mx_grouped_gemm.applies`):
      the weight is quantized inside the GEMM's mainloop instead of in a pass before it.
   c. ``DEQUANTIZED`` otherwise: each operand quantize-dequantized exactly (rule 1), then
      a bf16 (or the activations' dtype) grouped GEMM with float32 accumulation:
      ``torch._grouped_mm`` where the device and dtype support it, a loop over experts
      elsewhere (:mod:`mxmoe.ops.gemm`). The product of two dequantized MXFP8 values is
      exact in float32, so this computes what a block-scaled MXFP8 GEMM computes.
3. The fused MXFP8 expert op (``mx_moe_experts``) and its combine (``combine_rows``) run their
   Triton kernels where rule 1 picks Triton, pure torch otherwise; the MoE layer uses the
   fused op for bf16 activations unless rule 2a applies (:func:`mxmoe.nn.moe.runs_fused`).
4. The bf16 recipe's MoE experts (:func:`use_gathered_experts`): QuACK's gathered grouped
   GEMMs with the SwiGLU, combine and router-score gradient in their epilogues
   (:mod:`mxmoe.ops.moe_experts_gathered`, SonicMoE's dataflow) where ``MXMOE_EXPERT_ENGINE=quack``
   is set, the activations are bf16 on an sm90 GPU, D and F are multiples of 8 and QuACK
   imports (``pip install "mxmoe[hopper]"``); the composed path
   (``mx_grouped_mm`` + ``combine_weighted``) otherwise. Opt-in: this path has not yet
   been run on a GPU (docs/BENCHMARKS.md says when it is measured).
5. The widening of a bf16 weight gradient to float32 master weights
   (:func:`use_triton_widen`): the Triton cast of :mod:`mxmoe.kernels.cast` where the
   recipe's backend is not "reference", the tensor is where the kernel runs ("auto":
   CUDA; "triton": CUDA or the interpreter) and grad mode is off, ``Tensor.to``
   otherwise. Both give the same bits (the cast is exact).
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import os

import torch
from torch import Tensor

from ..kernels import cutlass_mx_grouped_gemm
from ..numerics.formats import MX_BLOCK_SIZE, ElemFormat
from ..numerics.mx_tensor import torch_quantize_mx
from ..recipe import BACKENDS, RECIPES, Recipe

NATIVE_CAPABILITY_MAJOR = 10  # block-scaled MMA (tcgen05): B200 10.0, B300 10.3; torch refuses sm120 here

TRITON_FORMATS = (ElemFormat.E4M3, ElemFormat.E5M2)
TRITON_DTYPES = (torch.float32, torch.bfloat16)

__all__ = ["BACKENDS", "EXPERT_ENGINES", "GroupedGemmBackend", "TRITON_DTYPES", "TRITON_FORMATS",
           "expert_engine", "grouped_gemm_backend", "use_gathered_experts", "use_native_mx_grouped_mm", "use_triton",
           "use_triton_for", "use_triton_widen", "widen_weight_grad"]

EXPERT_ENGINES = ("default", "quack")  # values of MXMOE_EXPERT_ENGINE (unset: "default")


def use_triton(device: torch.device, dtype: torch.dtype, fmt: ElemFormat | str, block_size: int,
               backend: str) -> bool:
    """Rule 1: whether a quantizer for data of ``dtype`` on ``device`` runs the Triton kernels.

    Args:
        device: where the data lives. dtype: the data's dtype.
        fmt: element format. block_size: elements per block.
        backend: "auto", "reference" or "triton" (:data:`mxmoe.recipe.BACKENDS`).

    Returns:
        True for the Triton kernels, False for the pure-torch reference.

    Raises:
        ValueError: unknown backend, or "triton" asked for what it does not cover (the
            message names the format, block size and dtype).
    """
    fmt = ElemFormat.parse(fmt)
    if backend == "reference":
        return False
    covered = fmt in TRITON_FORMATS and block_size == MX_BLOCK_SIZE and dtype in TRITON_DTYPES
    if backend == "auto":
        return device.type == "cuda" and covered and importlib.util.find_spec("triton") is not None
    if backend == "triton":
        if not covered:
            raise ValueError(
                f"backend='triton' covers e4m3/e5m2 elements, block_size 32 and float32/bfloat16 data; "
                f"got fmt={fmt.value!r}, block_size={block_size}, dtype {dtype}: use backend='reference'"
            )
        return True
    raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")


def use_triton_for(x: Tensor, recipe: Recipe, dtype: torch.dtype | None = None) -> bool:
    """Rule 1 for a tensor under a recipe: ``use_triton(x.device, dtype or x.dtype, recipe.fmt,
    recipe.block_size, recipe.backend)``."""
    return use_triton(x.device, x.dtype if dtype is None else dtype, recipe.fmt, recipe.block_size, recipe.backend)


def expert_engine() -> str:
    """The value of ``MXMOE_EXPERT_ENGINE`` ("default" when unset or blank; case and
    surrounding spaces ignored).

    Raises:
        ValueError: a value outside :data:`EXPERT_ENGINES` (the message quotes it).
    """
    raw = os.environ.get("MXMOE_EXPERT_ENGINE", "")
    value = raw.strip().lower() or "default"
    if value not in EXPERT_ENGINES:
        raise ValueError(f"MXMOE_EXPERT_ENGINE={raw!r}; use one of {EXPERT_ENGINES} (or leave it unset)")
    return value


def _check_quack() -> None:
    """ValueError naming the extra to install (or the import error of a broken install)
    when QuACK cannot be imported."""
    from ..kernels import quack_moe

    if not quack_moe.available():
        why = quack_moe.import_error()
        raise ValueError('MXMOE_EXPERT_ENGINE=quack needs QuACK: pip install "mxmoe[hopper]" (quack-kernels '
                         f'{quack_moe.QUACK_VERSIONS["quack-kernels"]}, nvidia-cutlass-dsl '
                         f'{quack_moe.QUACK_VERSIONS["nvidia-cutlass-dsl"]}), or unset it'
                         + (f"; importing it failed: {why}" if why else ""))


def use_gathered_experts(x: Tensor, recipe: Recipe, d_model: int, d_expert: int) -> bool:
    """Rule 4: whether the MoE experts and combine run as
    :func:`mxmoe.ops.moe_experts_gathered.gathered_moe_experts` (QuACK's gathered grouped
    GEMMs): ``MXMOE_EXPERT_ENGINE=quack`` (:func:`expert_engine`), a non-quantizing recipe,
    bf16 activations, an sm90 GPU, D and F multiples of 8 (:func:`mxmoe.kernels.quack_moe.supports`).
    Elsewhere (the CPU, other GPUs, MX recipes, other dtypes) the setting is ignored.

    Raises:
        ValueError: a bad setting (:func:`expert_engine`), or "quack" where the path would
            apply but QuACK cannot be imported (the message names the extra, and the
            import error of a broken install).
    """
    if expert_engine() != "quack" or recipe.quantize or x.dtype != torch.bfloat16:
        return False
    from ..kernels import quack_moe

    if not quack_moe.on_sm90(x):
        return False
    _check_quack()
    return quack_moe.supports(x, d_model, d_expert)


def use_triton_widen(x: Tensor, dtype: torch.dtype, recipe: Recipe) -> bool:
    """Rule 5: whether ``x.to(dtype)`` runs the Triton widening cast. True for a contiguous
    bfloat16 ``x`` cast to float32, with Triton installed, grad mode off (a backward that
    builds a graph for a second derivative keeps ``Tensor.to``, which has a derivative), and
    the recipe's backend "auto" with x on a CUDA device, or "triton" with x on a CUDA
    device or on the CPU under ``TRITON_INTERPRET=1``. Elsewhere ``Tensor.to`` (the same
    bits)."""
    if x.dtype != torch.bfloat16 or dtype != torch.float32 or not x.is_contiguous() or torch.is_grad_enabled():
        return False
    if recipe.backend not in ("auto", "triton") or importlib.util.find_spec("triton") is None:
        return False
    if x.device.type == "cuda":
        return True
    return recipe.backend == "triton" and x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def widen_weight_grad(dw: Tensor, dtype: torch.dtype, recipe: Recipe) -> Tensor:
    """A weight gradient in the parameters' dtype: ``dw.to(dtype)``, through the Triton
    cast where :func:`use_triton_widen` says so (same bits, about twice the bandwidth of
    ``Tensor.to`` on the H200). dw is returned as is when it has the dtype already."""
    if dw.dtype == dtype:
        return dw
    if use_triton_widen(dw, dtype, recipe):
        from ..kernels.cast import widen

        return widen(dw, dtype)
    return dw.to(dtype)


def scaled_grouped_mm_api() -> str | None:
    """Which PyTorch entry point this torch has: "functional"
    (``torch.nn.functional.scaled_grouped_mm`` with ScalingType / SwizzleType), "private"
    (``torch._scaled_grouped_mm``, scale layout implied by the e8m0 dtype) or None."""
    F = torch.nn.functional
    if (hasattr(F, "scaled_grouped_mm") and hasattr(F, "ScalingType") and hasattr(F, "SwizzleType")
            and hasattr(F.ScalingType, "BlockWise1x32") and hasattr(F.SwizzleType, "SWIZZLE_32_4_4")):
        return "functional"
    if hasattr(torch, "_scaled_grouped_mm"):
        return "private"
    return None


def recipe_supported(recipe: Recipe) -> bool:
    """The native kernel covers E4M3 elements, E8M0 scales, blocks of 32 (either scale rule:
    the scales are computed here, the kernel only reads them)."""
    return recipe.quantize and recipe.fmt is ElemFormat.E4M3 and recipe.block_size == MX_BLOCK_SIZE


def use_native_mx_grouped_mm(device: torch.device | str, recipe: Recipe | None = None) -> bool:
    """True where ``mx_grouped_mm`` should call PyTorch's native MXFP8 grouped GEMM.

    Requires a CUDA device of capability major 10 (B200 / B300; torch refuses sm120 for
    this op), a torch with ``_scaled_grouped_mm`` (or ``nn.functional.scaled_grouped_mm``),
    a build that has the kernel (probed once per device with a tiny GEMM checked against
    its float64 value), and, if given, a recipe the kernel covers (:func:`recipe_supported`;
    ``wgrad_high_precision`` recipes use it for forward and dgrad only: the caller decides).
    Untested on hardware: see the module docstring.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if recipe is not None and not recipe_supported(recipe):
        return False
    if scaled_grouped_mm_api() is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index)[0] != NATIVE_CAPABILITY_MAJOR:
        return False
    return _probe(index)


@functools.cache
def _probe(index: int) -> bool:
    """Run a 3-expert GEMM (one empty expert, jagged groups) once and compare it with the
    float64 product of the same quantized operands; any error or mismatch disables the path."""
    from .sm100 import native_grouped_mm_nt  # the kernel's arguments; sm100 imports this module

    device = torch.device("cuda", index)
    gen = torch.Generator().manual_seed(0)
    sizes = [40, 0, 88]
    x = torch.randn(sum(sizes), 64, generator=gen).to(device)
    w = torch.randn(len(sizes), 32, 64, generator=gen).to(device)
    offsets = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    try:
        out = native_grouped_mm_nt(x, w, offsets, RECIPES["mxfp8"]).double()
        torch.cuda.synchronize(device)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    xq = torch_quantize_mx(x, "e4m3", dim=1).dequantize().double()
    wq = torch_quantize_mx(w, "e4m3", dim=2).dequantize().double()
    ref = torch.cat([xq[:40] @ wq[0].t(), xq[40:] @ wq[2].t()])
    return bool(torch.isfinite(out).all()) and bool(((out - ref).abs() <= 2.0**-7 * ref.abs() + 1e-3).all())


class GroupedGemmBackend(enum.Enum):
    """The implementations of a grouped GEMM pass (rule 2 of the module docstring)."""

    NATIVE_MXFP8 = "native-mxfp8"
    CUTLASS_QUANTIZED_WEIGHT = "cutlass-quantized-weight"
    DEQUANTIZED = "dequantized"


PASSES = ("forward", "dgrad", "wgrad")


def grouped_gemm_backend(pass_: str, a: Tensor, w: Tensor, offsets: Tensor, recipe: Recipe,
                         weight_cached: bool = False) -> GroupedGemmBackend:
    """Rule 2: the implementation of one pass of ``mx_grouped_mm``.

    Args:
        pass_: "forward" (a = x (T, K)), "dgrad" (a = dy (T, N)) or "wgrad" (a = dy).
        w: (E, N, K) expert weights. offsets: (E,) cumulative end rows.
        recipe: the recipe of the call.
        weight_cached: a copy of ``w`` is held by an open ``weight_copy_cache()`` (or the
            forward made the dgrad copy): then the cached copies are used (rule 2c).

    Returns:
        A :class:`GroupedGemmBackend`. Cheap: no host synchronization; the CUTLASS check
        builds nothing.

    Raises:
        ValueError: unknown ``pass_``.
    """
    if pass_ not in PASSES:
        raise ValueError(f"unknown grouped GEMM pass {pass_!r}; use one of {PASSES}")
    if recipe.quantize and use_native_mx_grouped_mm(a.device, recipe):
        if pass_ != "wgrad" or not recipe.wgrad_high_precision:
            return GroupedGemmBackend.NATIVE_MXFP8
    elif (pass_ != "wgrad" and not weight_cached
          and cutlass_mx_grouped_gemm.applies(a, w, offsets, recipe, pass_)):
        return GroupedGemmBackend.CUTLASS_QUANTIZED_WEIGHT
    return GroupedGemmBackend.DEQUANTIZED
