"""The expert GEMMs of an MoE layer as QuACK grouped GEMMs (sm90; the ``hopper`` extra).

QuACK (``quack-kernels``, Apache-2.0; the GEMM library SonicMoE is built on) has CuTe-DSL
grouped GEMMs over variable-length groups: varlen-M (each expert's rows of the output),
varlen-K (each expert's tokens as the contraction of a weight gradient), with the rows of
A gathered through an index inside the GEMM's operand loads, and epilogues that apply a
gated activation, its gradient, a per-row scale and a per-row reduction. Each function
below is one such GEMM in the layout of mxmoe's MoE layer; together they are the
dataflow of SonicMoE (arXiv 2512.14080, section 3): no permuted copy of x or dy, SwiGLU in
the up-projection's epilogue, the router-score gradient from the down-projection's dgrad
epilogue, x and the pre-activation h the only activations kept for backward.

Layouts (T tokens, D model width, F expert width, E experts, A = T * k routed rows sorted
by expert; bf16 unless stated):

| name | shape | meaning |
|---|---|---|
| x_TD | (T, D) | tokens, not permuted |
| src_A | (A,) int32 | the token of each sorted row |
| cu_E1 | (E + 1,) int32 | 0 then each expert's cumulative end row (:func:`cu_seqlens`) |
| w13_E2FD | (E, 2F, D) contiguous | [gate; up] rows, mxmoe's layout (QuACK's ``concat_layout``) |
| w2_EDF | (E, D, F) contiguous | down projection |
| h_A2F | (A, 2F) | pre-activation, columns interleaved [g0, u0, g1, u1, ...] (QuACK's gated layout) |

Numerics (QuACK's epilogues): float32 accumulation; h and the outputs rounded once to bf16
from float32; silu(g) * u and its gradient in float32 from the float32 accumulator (up
projection) or from the bf16 h (dgrad). The same arithmetic in torch is the reference the
tests compare with.

QuACK compiles each GEMM kind on first use and autotunes it over its sm90 configurations
(``quack.gemm_config``); the compiled kernels are cached on disk (``QUACK_CACHE_DIR``). Its
autotuning key includes the tensors' shapes, so each new token count T tunes again (a
training run at a fixed batch shape tunes once, in its first steps; evaluation at another
T, or varying sequence packing, tunes per shape). Tuning runs kernels, so it cannot happen
inside a CUDA-graph capture: run the shapes eagerly first (the trainer's warm-up steps do).
Importing this module does not import QuACK; :func:`available` says whether it can.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor

QUACK_VERSIONS = {"quack-kernels": "0.4.1", "nvidia-cutlass-dsl": "4.4.2"}  # the tested pins (pyproject's hopper extra)
SM90_MAJOR = 9


_IMPORT_ERROR: list[str] = []  # why importing QuACK failed, once tried


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether ``quack.gemm_interface`` can be imported (the ``hopper`` extra is installed).
    Cached: importing QuACK loads the CuTe-DSL runtime once. :func:`import_error` says why not."""
    if importlib.util.find_spec("quack") is None:
        return False
    try:
        import quack.gemm_interface  # noqa: F401
    except Exception as err:  # a broken CuTe-DSL install is "not available", not a crash at layer build
        _IMPORT_ERROR.append(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        return False
    return True


def import_error() -> str | None:
    """The import error of a QuACK that is installed but does not import (after
    :func:`available` returned False), or None."""
    return _IMPORT_ERROR[-1] if _IMPORT_ERROR else None


def _gemm_interface():
    import quack.gemm_interface as gi

    return gi


def cu_seqlens(offsets_E: Tensor) -> Tensor:
    """(E + 1,) int32 [0, offsets...]: QuACK's cumulative group boundaries from mxmoe's
    (E,) int32 cumulative end rows (:mod:`mxmoe.ops.offsets`)."""
    return torch.cat([offsets_E.new_zeros(1), offsets_E]).to(torch.int32)


def gated_up_projection(x_TD: Tensor, src_A: Tensor, cu_E1: Tensor, w13_E2FD: Tensor) -> tuple[Tensor, Tensor]:
    """h = x[src] w13_e^T for each expert's rows, and act = silu(gate) * up in the epilogue.

    Args:
        x_TD: (T, D) bf16, contiguous. src_A: (A,) int32 token of each sorted row (the
            gather happens in the GEMM's A loads). cu_E1: (E + 1,) int32.
        w13_E2FD: (E, 2F, D) bf16 contiguous [gate; up].

    Returns:
        h_A2F (A, 2F) bf16 interleaved [g0, u0, ...]; act_AF (A, F) bf16.
    """
    gi = _gemm_interface()
    A, F2 = src_A.numel(), w13_E2FD.shape[1]
    h = torch.empty(A, F2, dtype=x_TD.dtype, device=x_TD.device)
    act = torch.empty(A, F2 // 2, dtype=x_TD.dtype, device=x_TD.device)
    gi.gemm_gated(x_TD, w13_E2FD.permute(0, 2, 1), activation="swiglu", preact_out=h, postact_out=act,
                  cu_seqlens_m=cu_E1, A_idx=src_A, concat_layout=("B",))
    return h, act


def down_projection(act_AF: Tensor, w2_EDF: Tensor, cu_E1: Tensor) -> Tensor:
    """y_AD = act w2_e^T for each expert's rows: (A, F) x (E, D, F) -> (A, D) bf16."""
    gi = _gemm_interface()
    y = torch.empty(act_AF.shape[0], w2_EDF.shape[1], dtype=act_AF.dtype, device=act_AF.device)
    gi.gemm(act_AF, w2_EDF.permute(0, 2, 1), out=y, cu_seqlens_m=cu_E1)
    return y


def down_projection_dgated(dy_TD: Tensor, src_A: Tensor, cu_E1: Tensor, w2_EDF: Tensor, h_A2F: Tensor,
                           scores_A: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The down projection's dgrad with the SwiGLU backward and the combine's backward in
    its epilogue.

    g_a = dy[src[a]] w2_e (the gradient of expert output row a before its router score),
    then with s = scores[a] and [gate, up] = h[a]:
    dh[a] = dswiglu(gate, up; s * g_a) (interleaved, bf16); sact[a] = s * silu(gate) * up
    (bf16, the w2 weight-gradient operand); ds[a] = sum_n silu(gate) * up * g_a (float32:
    the gradient of router score a, since y_a . dy_t = act_a . g_a).

    Args:
        dy_TD: (T, D) bf16 contiguous gradient of the layer output. src_A, cu_E1: as above.
        w2_EDF: (E, D, F) bf16. h_A2F: (A, 2F) bf16 saved pre-activation (interleaved).
        scores_A: (A,) float32 router score of each sorted row.

    Returns:
        dh_A2F (A, 2F) bf16 interleaved, sact_AF (A, F) bf16, ds_A (A,) float32.
    """
    gi = _gemm_interface()
    A, F2 = h_A2F.shape
    dh = torch.empty(A, F2, dtype=h_A2F.dtype, device=h_A2F.device)
    sact = torch.empty(A, F2 // 2, dtype=h_A2F.dtype, device=h_A2F.device)
    _, _, ds = gi.gemm_dgated(dy_TD, w2_EDF, PreAct=h_A2F, activation="swiglu", dx_out=dh, postact_out=sact,
                              colvec_scale=scores_A, colvec_reduce=True, cu_seqlens_m=cu_E1, A_idx=src_A,
                              dynamic_scheduler=False)
    return dh, sact, ds


def up_projection_dgrad(dh_A2F: Tensor, w13_E2FD: Tensor, cu_E1: Tensor) -> Tensor:
    """dx_AD = dh w13_e for each expert's rows: (A, 2F) interleaved x (E, 2F, D) [gate;
    up] -> (A, D) bf16 (one row per routed row; the caller sums each token's k rows)."""
    gi = _gemm_interface()
    dx = torch.empty(dh_A2F.shape[0], w13_E2FD.shape[2], dtype=dh_A2F.dtype, device=dh_A2F.device)
    gi.gemm(dh_A2F, w13_E2FD, out=dx, cu_seqlens_m=cu_E1, dynamic_scheduler=False, concat_layout=("B",))
    return dx


def gathered_weight_grad(a_TC: Tensor, src_A: Tensor, cu_E1: Tensor, b_AN: Tensor, out_ECN: Tensor,
                         interleaved_b: bool) -> Tensor:
    """out[e] = a[src_e]^T b_e: a weight gradient as one varlen-K grouped GEMM whose
    contraction runs over each expert's rows, the rows of a gathered through src inside
    the GEMM (no permuted copy of a).

    Args:
        a_TC: (T, C) bf16 contiguous (x for w13, dy for w2). src_A, cu_E1: as above.
        b_AN: (A, N) bf16 contiguous (dh for w13, interleaved; s * act for w2).
        out_ECN: (E, C, N) bf16 view to write: ``dw13.permute(0, 2, 1)`` of a contiguous
            (E, 2F, D) dw13 (with ``interleaved_b``: b's interleaved columns land as
            [gate; up] rows), or a contiguous (E, D, F) dw2.

    Returns:
        ``out_ECN``.
    """
    gi = _gemm_interface()
    gi.gemm(a_TC.T, b_AN, out=out_ECN, cu_seqlens_k=cu_E1, A_idx=src_A, dynamic_scheduler=False,
            concat_layout=("out",) if interleaved_b else None)
    return out_ECN


def on_sm90(x: Tensor) -> bool:
    """Whether x is on an sm90 (Hopper) GPU."""
    return x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == SM90_MAJOR


def supports(x_TD: Tensor, d_model: int, d_expert: int) -> bool:
    """Whether these GEMMs apply: x on an sm90 GPU, QuACK importable, and D and F multiples
    of 8 (16-byte rows for the TMA loads)."""
    return on_sm90(x_TD) and d_model % 8 == 0 and d_expert % 8 == 0 and available()
