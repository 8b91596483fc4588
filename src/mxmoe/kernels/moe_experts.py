"""Host side of the fused MoE kernels (:mod:`mxmoe.kernels.triton_moe_experts`).

| function | reads | writes |
|---|---|---|
| :func:`triton_gather_fake_quantize_rows` | x (T, D), src (A,) | (A, D) dequantized MXFP8 of x[src], blocks along D |
| :func:`triton_quantize_grouped_gather` | x (T, D), src (A,), offsets (E,) | codes (D, Ap), scales (D, Ap / 32), padded offsets: x[src] blocked along each expert's tokens |
| :func:`triton_swiglu_quantize` | h (A, 2F) | act (A, F) dequantized MXFP8 of silu(gate) * up; codes (A, 2F) + scales (A, 2F / 32) of h |
| :func:`triton_swiglu_backward` | codes + scales of h, d(act) (A, F) | dh (A, 2F), recomputed act (A, F), optionally each row's act . d(act) (A,) float32 |
| :func:`triton_combine_rows_backward` | dy (T, D), w (T, k), inv (A,) | d(y sorted) (A, D) alone: each routed row's dy times its weight |
| :func:`triton_sum_token_rows` | x (A, D), rows (T * k,), optional weights (T, k) | (T, D): each token's k rows summed (weighted: the combine) in float32 |

D and F must be multiples of 32 (the callers in :mod:`mxmoe.ops.moe_experts` check and
otherwise take the composed path). FP8 element formats only.

Each function is a ``torch.library`` custom op (``mxmoe::...``) with a fake (meta)
implementation, as are the quantizers of :mod:`mxmoe.kernels.quantize`: under
``torch.compile`` the launches stay opaque calls, so Dynamo and Inductor never trace or
recompile the Triton kernels themselves (Inductor failed to build one of them on the H200).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from . import triton_moe_experts as km
from .quantize import _check_tensor, _codes, _grid, _grouped_launch, _launch_settings, interpreting

BLOCK = 32
# (rows, columns) per program and warps, on the GPU and under the interpreter
TUNING = {"gather": ((32, 128), 4), "swiglu": ((32, 64), 4), "swiglu_bwd": ((32, 64), 4),
          "combine_bwd": ((4, 512), 4), "sum_rows": ((4, 512), 4)}
_INTERPRETER_TILE = (64, 128)


def _tile(kind: str) -> tuple[int, int, int]:
    (r, c), w = TUNING[kind]
    if interpreting():
        r, c = _INTERPRETER_TILE
    return r, c, w


def _check(t: Tensor, name: str, width: int) -> None:
    _check_tensor(t, name)  # float32/bfloat16, on CUDA (or the interpreter)
    if width % BLOCK:
        raise ValueError(f"{name}'s blocked width is {width}, not a multiple of {BLOCK}")


def _check_src(src_A: Tensor, T: int, name: str = "src", of: str = "x") -> None:
    """src: 1-D integer rows of a (T, ...) tensor; off CUDA each in [0, T) (IndexError), on
    CUDA unchecked (a host sync; the fused expert op checks its routing on the CPU)."""
    if src_A.dtype.is_floating_point or src_A.dim() != 1:
        raise TypeError(f"{name} must be a 1-D integer tensor, got {src_A.dtype} {tuple(src_A.shape)}")
    if src_A.device.type != "cuda" and src_A.numel():
        lo, hi = int(src_A.min()), int(src_A.max())
        if lo < 0 or hi >= T:
            raise IndexError(f"{name} holds rows {lo}..{hi}; {of} has {T} rows (valid: 0..{T - 1})")


def _saved_codes_elem(q: Tensor, s: Tensor, shape: tuple[int, int], producer: str) -> int:
    """Codes (R, C) and E8M0 scales (R, C / 32) saved by ``producer``, checked against the
    expected (R, C): returns the element format code (0 E4M3, 1 E5M2) their dtype selects.
    Raises TypeError (dtypes) or ValueError (shapes)."""
    if q.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or s.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"codes must be float8_e4m3fn or float8_e5m2 (their dtype selects the element format) and "
                        f"scales float8_e8m0fnu, as {producer} returns them; got {q.dtype}, {s.dtype}")
    R, C = shape
    if tuple(q.shape) != (R, C) or tuple(s.shape) != (R, C // BLOCK):
        raise ValueError(f"codes {tuple(q.shape)} / scales {tuple(s.shape)} do not match the other inputs: "
                         f"expected ({R}, {C}) / ({R}, {C // BLOCK})")
    return 0 if q.dtype == torch.float8_e4m3fn else 1


@torch.library.custom_op("mxmoe::gather_fake_quantize_rows", mutates_args=())
def triton_gather_fake_quantize_rows(x_TD: Tensor, src_A: Tensor, fmt: str, mode: str,
                                     out_dtype: torch.dtype) -> Tensor:
    """out[a] = dequantize(quantize(x[src[a]], blocks along D)): the token permute fused
    with the forward GEMM operand's MXFP8 rounding. x (T, D) float32/bf16 with unit column
    stride; src (A,) integer rows in [0, T) (checked off CUDA: IndexError; on CUDA a check
    would be a host sync). Returns (A, D) ``out_dtype``."""
    _check(x_TD, "x", x_TD.shape[1])
    _check_src(src_A, x_TD.shape[0])
    src_A = src_A.to(torch.int64)  # 64-bit row offsets in the kernel
    elem, _, mode_code = _codes(fmt, mode)
    A, D = src_A.numel(), x_TD.shape[1]
    if x_TD.stride(1) != 1:
        x_TD = x_TD.contiguous()
    out = torch.empty(A, D, dtype=out_dtype, device=x_TD.device)
    if A and D:
        br, bc, w = _tile("gather")
        cfg = _launch_settings("rows")
        km._gather_fake_quant_rows_kernel[_grid(triton.cdiv(A, br) * triton.cdiv(D, bc), what="gather")](
            x_TD, x_TD.stride(0), src_A.contiguous(), A, D, out, ELEM=elem, MODE=mode_code,
            HW_ROUND=cfg["hw_round"], SOFT_CASTS=cfg["soft_casts"], BLOCK_R=br, BLOCK_C=bc, num_warps=w)
    return out


@triton_gather_fake_quantize_rows.register_fake
def _(x_TD, src_A, fmt, mode, out_dtype):
    return x_TD.new_empty(src_A.numel(), x_TD.shape[1], dtype=out_dtype)


@torch.library.custom_op("mxmoe::quantize_grouped_gather", mutates_args=())
def triton_quantize_grouped_gather(x_TD: Tensor, src_A: Tensor, offsets_E: Tensor, fmt: str,
                                   mode: str) -> tuple[Tensor, Tensor, Tensor]:
    """Codes (D, Ap) and scales (D, Ap / 32) of x[src] quantized along tokens, each expert's
    tokens in their own blocks (the per-expert padded layout of
    :mod:`mxmoe.numerics.grouped`, Ap = 32 * (A // 32 + E)), and the padded offsets.

    src_A: (A,) integer rows of x, each in [0, T). On CUDA this is not checked (the check
    would be a device-to-host sync; the fused expert op checks its routing on the CPU
    before any kernel runs); elsewhere (the interpreter) it raises IndexError."""
    _check_src(src_A, x_TD.shape[0])
    out = _grouped_launch(x_TD, offsets_E, fmt, mode, True, None, src=src_A.contiguous())
    return out["q"], out["s"], out["padded_offsets"]


@triton_quantize_grouped_gather.register_fake
def _(x_TD, src_A, offsets_E, fmt, mode):
    D, A, E = x_TD.shape[1], src_A.numel(), offsets_E.numel()
    Ap = BLOCK * (A // BLOCK + E)
    return (x_TD.new_empty(D, Ap, dtype=_codes(fmt, mode)[1]),
            x_TD.new_empty(D, Ap // BLOCK, dtype=torch.float8_e8m0fnu),
            x_TD.new_empty(E, dtype=torch.int32))


@torch.library.custom_op("mxmoe::swiglu_quantize", mutates_args=())
def triton_swiglu_quantize(h_A2F: Tensor, fmt: str, mode: str, act_dtype: torch.dtype
                           ) -> tuple[Tensor, Tensor, Tensor]:
    """From h = [gate | up] (A, 2F), contiguous: act = silu(gate) * up (float32 math) as
    dequantized MXFP8 along F in ``act_dtype``; h's codes (A, 2F) and E8M0 scales
    (A, 2F / 32), blocks along F within gate and within up."""
    A, F2 = h_A2F.shape
    F = F2 // 2
    if F2 % 2:
        raise ValueError(f"h must be [gate | up] of even width 2F, got width {F2}")
    _check(h_A2F, "h", F)
    elem, q_dtype, mode_code = _codes(fmt, mode)
    h_A2F = h_A2F.contiguous()
    dev = h_A2F.device
    act = torch.empty(A, F, dtype=act_dtype, device=dev)
    hq = torch.empty(A, F2, dtype=torch.uint8, device=dev)
    hs = torch.empty(A, F2 // BLOCK, dtype=torch.uint8, device=dev)
    if A and F:
        br, bc, w = _tile("swiglu")
        cfg = _launch_settings("rows")
        km._swiglu_fwd_kernel[_grid(triton.cdiv(A, br) * triton.cdiv(F, bc), what="swiglu")](
            h_A2F, A, F, act, hq, hs, ELEM=elem, MODE=mode_code, HW_ROUND=cfg["hw_round"],
            SOFT_CASTS=cfg["soft_casts"], BLOCK_R=br, BLOCK_C=bc, num_warps=w)
    return act, hq.view(q_dtype), hs.view(torch.float8_e8m0fnu)


@triton_swiglu_quantize.register_fake
def _(h_A2F, fmt, mode, act_dtype):
    A, F2 = h_A2F.shape
    return (h_A2F.new_empty(A, F2 // 2, dtype=act_dtype), h_A2F.new_empty(A, F2, dtype=_codes(fmt, mode)[1]),
            h_A2F.new_empty(A, F2 // BLOCK, dtype=torch.float8_e8m0fnu))


@torch.library.custom_op("mxmoe::swiglu_backward", mutates_args=())
def triton_swiglu_backward(hq: Tensor, hs: Tensor, dact_AF: Tensor, out_dtype: torch.dtype, row_dot: bool = False,
                           dh_mode: str | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """d(gate) | d(up) (A, 2F) and the recomputed act = silu(gate) * up (A, F), both in
    ``out_dtype``, from the saved codes/scales of h and d(act) (A, F); with ``row_dot`` also
    (A,) float32 sum over F of act * d(act) (act in float32, before its rounding; summed in
    column tiles, then the tiles in order), else an empty tensor; with ``dh_mode`` (the
    scale rule, "floor" / "rceil"; the element format is the codes') also dh quantized to
    MXFP8 along 2F and dequantized to ``out_dtype`` (bit-equal to quantizing the returned
    dh), else an empty tensor."""
    A, F = dact_AF.shape
    _check(dact_AF, "d(act)", F)
    elem = _saved_codes_elem(hq, hs, (A, 2 * F), "triton_swiglu_quantize")
    dev = dact_AF.device
    dh = torch.empty(A, 2 * F, dtype=out_dtype, device=dev)
    act = torch.empty(A, F, dtype=out_dtype, device=dev)
    br, bc, w = _tile("swiglu_bwd")
    n_cb = triton.cdiv(F, bc) if F else 0
    parts = torch.zeros(A if row_dot else 0, n_cb, dtype=torch.float32, device=dev)
    quant = dh_mode is not None
    mode_code = _codes("e4m3" if elem == 0 else "e5m2", dh_mode)[2] if quant else 0
    dhq = torch.empty(A if quant else 0, 2 * F if quant else 0, dtype=out_dtype, device=dev)
    if A and F:
        cfg = _launch_settings("rows")
        km._swiglu_bwd_kernel[_grid(triton.cdiv(A, br) * n_cb, what="swiglu backward")](
            hq.view(torch.uint8), hs.view(torch.uint8), dact_AF.contiguous(), A, F, dh, act,
            parts if row_dot else dh, dhq if quant else dh, ELEM=elem, SOFT_CASTS=cfg["soft_casts"], ROW_DOT=row_dot,
            QUANT_DH=quant, MODE=mode_code, HW_ROUND=cfg["hw_round"], BLOCK_R=br, BLOCK_C=bc, num_warps=w)
    return dh, act, parts.sum(dim=1) if row_dot else parts.new_empty(0), dhq


@triton_swiglu_backward.register_fake
def _(hq, hs, dact_AF, out_dtype, row_dot=False, dh_mode=None):
    A, F = dact_AF.shape
    q = dh_mode is not None
    return (dact_AF.new_empty(A, 2 * F, dtype=out_dtype), dact_AF.new_empty(A, F, dtype=out_dtype),
            dact_AF.new_empty(A if row_dot else 0, dtype=torch.float32),
            dact_AF.new_empty(A if q else 0, 2 * F if q else 0, dtype=out_dtype))


def _check_rows(rows: Tensor, name: str, n: int) -> None:
    """A 1-D int64 tensor of n row indices; off CUDA also each in [0, n) (on CUDA the check
    would be a device-to-host sync: the callers pass permutations they built)."""
    if rows.dtype != torch.int64 or rows.dim() != 1 or rows.numel() != n:
        raise ValueError(f"{name} must be a 1-D int64 tensor of {n} rows, got {rows.dtype} {tuple(rows.shape)}")
    _check_src(rows, n, name, of="the indexed tensor")


def _check_bf16(t: Tensor, name: str) -> None:
    """The combine kernels round each product to bf16 before summing, which keeps the GPU
    compiler from contracting product and sum into one FMA (float32 products would be
    contracted on the GPU and not in torch or the interpreter: other bits)."""
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} is {t.dtype}; the fused combine kernels take bfloat16 (the torch path of "
                        f"mxmoe.nn.moe.combine_weighted covers other dtypes)")


@torch.library.custom_op("mxmoe::combine_rows_backward", mutates_args=())
def triton_combine_rows_backward(dy_TD: Tensor, w_Tk: Tensor, inv_A: Tensor) -> Tensor:
    """The rows' gradient of the combine y_TD[t] = sum_j w[t, j] * y[inv[t * k + j]]:
    d_y_sorted (A, D) in dy's dtype, row inv[t * k + j] = dy[t] * w[t, j] rounded to dy's
    dtype (the weights' own gradient is not computed here:
    :func:`mxmoe.ops.moe_experts.mx_moe_experts` gives it from its backward).

    Args:
        dy_TD: (T, D) bfloat16. w_Tk: (T, k) combine weights in dy's dtype.
        inv_A: (A,) int64 sorted row of each assignment, A = T * k.

    Raises:
        ValueError / TypeError: shapes, dy or weights not bf16; IndexError (off CUDA): inv
            outside [0, A). On CUDA inv is not checked (a host sync): it must be a
            permutation of range(A).
    """
    if dy_TD.dim() != 2:
        raise ValueError(f"dy must be (T, D), got shape {tuple(dy_TD.shape)}")
    T, D = dy_TD.shape
    _check_tensor(dy_TD, "dy")
    _check_bf16(dy_TD, "dy")
    if w_Tk.dim() != 2 or w_Tk.shape[0] != T:
        raise ValueError(f"weights must be (T, k) with T = {T} (dy's rows), got {tuple(w_Tk.shape)}")
    k = w_Tk.shape[1]
    A = T * k
    _check_rows(inv_A, "inv", A)
    if w_Tk.dtype != dy_TD.dtype:
        raise TypeError(f"weights are {w_Tk.dtype}, dy is {dy_TD.dtype}: pass the weights in dy's dtype")
    dys = torch.empty(A, D, dtype=dy_TD.dtype, device=dy_TD.device)
    if A and D:
        br, bc, w = _tile("combine_bwd")
        km._combine_rows_backward_kernel[_grid(triton.cdiv(T, br) * triton.cdiv(D, bc), what="combine rows backward")](
            dy_TD.contiguous(), w_Tk.contiguous(), inv_A.contiguous(), T, D, dys, TOPK=k,
            SOFT_CASTS=_launch_settings("rows")["soft_casts"], BLOCK_R=br, BLOCK_C=bc, num_warps=w)
    return dys


@triton_combine_rows_backward.register_fake
def _(dy_TD, w_Tk, inv_A):
    return dy_TD.new_empty(w_Tk.shape[0] * w_Tk.shape[1], dy_TD.shape[1])


@torch.library.custom_op("mxmoe::sum_token_rows", mutates_args=())
def triton_sum_token_rows(x_AD: Tensor, rows_A: Tensor, k: int, out_dtype: torch.dtype,
                          weights_Tk: Tensor | None = None, round_products: bool = False) -> Tensor:
    """out[t] = sum over j = 0..k-1 of x[rows[t * k + j]] (times weights[t, j] if given,
    each product rounded to x's dtype first with ``round_products``), in float32 in that
    order, rounded once to ``out_dtype``: the un-permute of a routed gradient, or with
    weights the combine of expert outputs; a gather (deterministic, no atomics). x (A, D)
    float32/bfloat16; rows (A,) int64, A = T * k; weights (T, k) float32. Returns (T, D)."""
    A, D = x_AD.shape
    _check_tensor(x_AD, "x")
    _check_rows(rows_A, "rows", A)
    if k < 1 or A % k:
        raise ValueError(f"{A} rows are not k = {k} rows per token")
    T = A // k
    if weights_Tk is not None and (weights_Tk.dtype != torch.float32 or tuple(weights_Tk.shape) != (T, k)
                                   or weights_Tk.device != x_AD.device):
        raise ValueError(f"weights must be float32 ({T}, {k}) on x's device {x_AD.device}, one per row, got "
                         f"{weights_Tk.dtype} {tuple(weights_Tk.shape)} on {weights_Tk.device}")
    out = torch.empty(T, D, dtype=out_dtype, device=x_AD.device)
    if A and D:
        br, bc, w = _tile("sum_rows")
        has_w = weights_Tk is not None
        km._sum_token_rows_kernel[_grid(triton.cdiv(T, br) * triton.cdiv(D, bc), what="sum rows")](
            x_AD.contiguous(), rows_A.contiguous(), T, D, weights_Tk.contiguous() if has_w else x_AD, out, TOPK=k,
            HAS_W=has_w, ROUND_PRODUCTS=round_products, SOFT_CASTS=_launch_settings("rows")["soft_casts"],
            BLOCK_R=br, BLOCK_C=bc, num_warps=w)
    return out


@triton_sum_token_rows.register_fake
def _(x_AD, rows_A, k, out_dtype, weights_Tk=None, round_products=False):
    if weights_Tk is not None and weights_Tk.device != x_AD.device:  # a meta tensor among real ones lands here
        raise ValueError(f"weights must be float32 on x's device {x_AD.device}, got {weights_Tk.device}")
    if k < 1:
        raise ValueError(f"k = {k}: at least one row per token")
    return x_AD.new_empty(x_AD.shape[0] // k, x_AD.shape[1], dtype=out_dtype)
