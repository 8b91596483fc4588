"""Design (d) of the MXFP8 grouped GEMM on sm90: the raw weight quantized inside a Gluon
wgmma kernel whose quantization overlaps the tensor-core work (experimental).

Forward of the expert GEMM, out[t, n] = sum_k xq[t, k] Q(w[e(t), n, :])[k], with xq the
activation already quantized and dequantized (a quantize pass) and Q the MX quantization of
the weight along k, dequantized (docs/NUMERICS.md). Per program one output tile of
BLOCK_W weight rows (output features) by BLOCK_T tokens of one expert; the weight rows are
the wgmma M side, the tokens the N side, so a tile of BLOCK_T = 256 covers a whole expert of
up to 256 tokens and each weight element is quantized once per such tile.

Main loop, step i (explicitly software pipelined, one partition of 8 warps):

1. the raw weight tile i+1 is loaded into registers (prefetch) while tile i, already in
   registers, is quantized: block amax over 32 consecutive k (a 3-D view), the scale and
   the element rounding of :mod:`mxmoe.kernels.triton_quantize` (the same helpers, so the
   values are bit for bit the quantize pass's), dequantized to bf16;
2. the bf16 tile goes to a double-buffered shared-memory tile; the token tile i+STAGES-2
   is requested with cp.async into a ring of STAGES;
3. wgmma (async) of the weight tile by the token tile, at most one in flight: the
   quantization of step i+1 runs while the tensor core works on step i.

Triton 3.6's Gluon dialect (triton.experimental.gluon); run only on the H200 (no CPU
interpreter for Gluon's wgmma), where benchmarks/grouped_gemm_wq.py checks its output
bit-equal to design (a) at every shape it times. A measurement prototype, kept here rather
than in the library: it covers the forward only, and it is slower than design (a)
(benchmarks/NOTES.md, session 11).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from mxmoe.kernels import triton_quantize as tq

try:  # Gluon (Triton >= 3.5); the module imports without it, the kernel then is None
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
except ImportError:  # pragma: no cover - older Triton
    gluon = None

if gluon is not None:
    # the elementwise quantization helpers of the Triton kernels, compiled as Gluon functions
    _g_scale_exponent = gluon.jit(tq._scale_exponent.fn)
    _g_quantize_values = gluon.jit(tq._quantize_values.fn)
    _g_dequantized = gluon.jit(tq._dequantized.fn)
    _g_nan_codes = gluon.jit(tq._nan_codes.fn)

    @gluon.jit
    def _g_fake_quantize_rows(w, ELEM: gl.constexpr, MODE: gl.constexpr):
        """w (R, NB, 32) float32: each (r, b) row of 32 quantized (amax, scale, rounding)
        and dequantized, float32 values."""
        abs_bits = w.to(gl.int32, bitcast=True) & 0x7FFFFFFF
        amax = gl.max(abs_bits, axis=2)
        e, nf = _g_scale_exponent(gl.expand_dims(amax, 2), ELEM, MODE)
        e_x = gl.broadcast(e, w)[0]
        nf_x = gl.broadcast(nf, w)[0]
        r, _ = _g_quantize_values(w, e_x, nf_x, ELEM, 1, False)
        return _g_dequantized(r, e_x, nf_x)

    @gluon.jit
    def _store_tile_t(acc, out_ptr, n0, row0, row1, N, BLOCK_W: gl.constexpr, BLOCK_T: gl.constexpr,
                      num_warps: gl.constexpr):
        """Store acc (BLOCK_W weight rows, BLOCK_T tokens; float32) transposed as bf16 into
        out[t, n] for t in [row0, row1), n in [n0, N): n fastest in memory."""
        ol: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, num_warps], [0, 1])
        o = gl.convert_layout(acc.to(gl.bfloat16), ol)
        on = n0 + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, ol))
        ot = row0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, ol))
        o_ptrs = out_ptr + gl.expand_dims(ot.to(gl.int64) * N, 0) + gl.expand_dims(on, 1)
        gl.store(o_ptrs, o, mask=gl.expand_dims(on < N, 1) & gl.expand_dims(ot < row1, 0))

    @gluon.jit
    def _wq_fwd_kernel(x_ptr, w_ptr, out_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, N, K, col_tiles,
                       BLOCK_W: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                       ELEM: gl.constexpr, MODE: gl.constexpr, W_ASYNC: gl.constexpr, QUANT: gl.constexpr,
                       MMA: gl.constexpr, num_warps: gl.constexpr):
        pid = gl.program_id(0)
        rt = pid // col_tiles
        ct = pid - rt * col_tiles
        e = gl.load(tile_e_ptr + rt)
        if e >= 0:
            row0 = gl.load(tile_r0_ptr + rt)
            row1 = gl.load(tile_r1_ptr + rt)
            n0 = ct * BLOCK_W
            NB: gl.constexpr = BLOCK_K // 32
            # raw weight tile (BLOCK_W, NB, 32): 8 consecutive k per thread, 4 threads per block
            w3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [32 // (4 * NB), NB, 4], [num_warps, 1, 1], [2, 1, 0])
            wn = n0 + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, gl.SliceLayout(2, w3)))
            wb = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(2, w3)))
            wk = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, w3)))
            wk3 = gl.expand_dims(gl.expand_dims(wb, 0), 2) * 32 + gl.expand_dims(gl.expand_dims(wk, 0), 1)
            wn3 = gl.expand_dims(gl.expand_dims(wn, 1), 2)
            w_rows = (e.to(gl.int64) * N + wn3.to(gl.int64)) * K
            # token tile (BLOCK_T, BLOCK_K), 8 consecutive k per thread (16-byte cp.async)
            xl: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_K // 8), BLOCK_K // 8], [num_warps, 1], [1, 0])
            xt = row0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, xl))
            xk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, xl))
            x_ptrs = x_ptr + gl.expand_dims(xt.to(gl.int64) * K, 1) + gl.expand_dims(xk, 0)
            x_row_ok = gl.expand_dims(xt < row1, 1)

            x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_T, BLOCK_K], gl.bfloat16)
            w_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_W, BLOCK_K], gl.bfloat16)
            x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_T, BLOCK_K], x_sl)
            w_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_W, BLOCK_K], w_sl)
            acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, BLOCK_T, 16])
            acc = gl.zeros((BLOCK_W, BLOCK_T), dtype=gl.float32, layout=acc_l)
            n_k = gl.cdiv(K, BLOCK_K)
            w_ok = wn3 < N
            if W_ASYNC:  # raw weight tiles through a cp.async ring like the token tiles
                wr_sl: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 1, [2, 1, 0])
                wr_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_W, NB, 32], wr_sl)
            for s in gl.static_range(STAGES - 2):
                k_ok = gl.expand_dims(xk + s * BLOCK_K < K, 0) & (s < n_k)
                async_copy.async_copy_global_to_shared(x_smem.index(s), x_ptrs + s * BLOCK_K, mask=x_row_ok & k_ok)
                if W_ASYNC:
                    async_copy.async_copy_global_to_shared(wr_smem.index(s), w_ptr + w_rows + s * BLOCK_K + wk3,
                                                           mask=w_ok & (wk3 + s * BLOCK_K < K) & (s < n_k))
                async_copy.commit_group()
            if not W_ASYNC:
                w_next = gl.load(w_ptr + w_rows + wk3, mask=w_ok & (wk3 < K), other=0.0)
            for i in range(n_k):
                if W_ASYNC:
                    async_copy.wait_group(STAGES - 3)  # tile i landed (this thread's copies)
                    gl.thread_barrier()  # ... and every thread's
                    w_cur = wr_smem.index(i % STAGES).load(w3)
                else:
                    w_cur = w_next
                    k_next = (i + 1) * BLOCK_K
                    w_next = gl.load(w_ptr + w_rows + k_next + wk3, mask=w_ok & (wk3 + k_next < K), other=0.0)
                if QUANT:
                    wq = _g_fake_quantize_rows(w_cur.to(gl.float32), ELEM, MODE).to(gl.bfloat16)
                else:  # timing reference: the same kernel without the quantization
                    wq = w_cur
                w_smem.index(i % 2).store(gl.reshape(wq, [BLOCK_W, BLOCK_K]))
                j = i + STAGES - 2  # the stage it refills was read by wgmma i - 2, finished
                k_ok = gl.expand_dims(xk + j * BLOCK_K < K, 0) & (j < n_k)
                async_copy.async_copy_global_to_shared(x_smem.index(j % STAGES), x_ptrs + j * BLOCK_K,
                                                       mask=x_row_ok & k_ok)
                if W_ASYNC:
                    async_copy.async_copy_global_to_shared(wr_smem.index(j % STAGES), w_ptr + w_rows + j * BLOCK_K + wk3,
                                                           mask=w_ok & (wk3 + j * BLOCK_K < K) & (j < n_k))
                async_copy.commit_group()
                async_copy.wait_group(STAGES - 2)
                gl.thread_barrier()
                fence_async_shared()
                if MMA:  # MMA=False: timing reference, everything but the tensor-core work
                    acc = warpgroup_mma(w_smem.index(i % 2), x_smem.index(i % STAGES).permute((1, 0)), acc,
                                        is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _store_tile_t(acc, out_ptr, n0, row0, row1, N, BLOCK_W, BLOCK_T, num_warps)
else:  # pragma: no cover
    _store_tile_t = _wq_fwd_kernel = None


def tile_table(offsets: Tensor, T: int, N: int, rows: int, cols: int, order: str = "weight", equal: bool = False
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One entry per program of a static grid of (T // rows + E) * cdiv(N, cols): (expert or
    -1, first token row, end row of its tile, first weight row n0), int32, computed on the
    device without a host sync. Each expert's S tokens are cut into tiles of ``rows``
    (``equal=False``; the last one shorter) or into ceil(S / rows) near-equal chunks of at
    most ``rows`` (``equal=True``: 300 tokens at rows = 320 make one chunk, at 256 two of
    150). The programs of one expert are consecutive; within it, ``order="weight"`` puts all
    token tiles of a weight tile in a row (the weight tile is read once), ``order="token"``
    all weight tiles of a token tile. Offsets are clamped into [0, T] and made
    non-decreasing. Every token row of every expert is in exactly one tile per weight tile.

    Raises:
        ValueError: ``order`` not "weight" or "token".
    """
    if order not in ("weight", "token"):
        raise ValueError(f"order must be 'weight' or 'token', got {order!r}")
    E = offsets.numel()
    col_tiles = triton.cdiv(N, cols)
    ends = torch.cummax(offsets.to(torch.int64).clamp(min=0, max=T), 0).values
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    size = ends - starts
    tiles = (size + rows - 1) // rows
    length = (size + tiles.clamp(min=1) - 1) // tiles.clamp(min=1) if equal else torch.full_like(size, rows)
    cum = (tiles * col_tiles).cumsum(0)
    p = torch.arange((T // rows + E) * col_tiles, device=offsets.device)
    e = torch.searchsorted(cum, p, right=True)
    valid = e < E
    ec = e.clamp(max=E - 1)
    local = p - (cum[ec] - tiles[ec] * col_tiles)
    if order == "weight":
        nt = tiles[ec].clamp(min=1)
        ct, rt = local // nt, local % nt
    else:
        rt, ct = local // col_tiles, local % col_tiles
    row0 = starts[ec] + rt * length[ec]
    row1 = torch.minimum(row0 + length[ec], ends[ec])
    return (torch.where(valid, ec, -1).to(torch.int32), row0.to(torch.int32), row1.to(torch.int32),
            (ct * cols).to(torch.int32))


def check_wq_args(xq: Tensor, w: Tensor, offsets: Tensor, stages: int, name: str, tma: bool = False) -> None:
    """The argument checks of designs (d), (e) and (f), as :func:`mxmoe.mx_grouped_mm` makes
    them, plus what the kernels need: bf16 operands, two ring stages at least, one CUDA
    device, and with ``tma`` (designs (e), (f)) K a multiple of 8 (TMA's 16-byte row pitch).

    Raises:
        TypeError: xq or w not bfloat16, offsets not int32/int64.
        ValueError: shapes (xq (T, K), w (E, N, K), offsets (E,)), K not a multiple of 8
            with ``tma``, stages not an int >= 2, tensors not all on one CUDA device.
    """
    if xq.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise TypeError(f"xq and w must be bfloat16, got {xq.dtype} and {w.dtype}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"offsets must be int32 cumulative end rows, got dtype {offsets.dtype}")
    if xq.dim() != 2 or w.dim() != 3 or xq.shape[1] != w.shape[2]:
        raise ValueError(f"expected xq (T, K) and w (E, N, K), got {tuple(xq.shape)} and {tuple(w.shape)}")
    if offsets.shape != (w.shape[0],):
        raise ValueError(f"offsets must have shape (E,) = ({w.shape[0]},), got {tuple(offsets.shape)}")
    if tma and xq.shape[1] % 8:
        raise ValueError(f"{name} needs K a multiple of 8 (TMA's 16-byte row pitch), got K={xq.shape[1]}")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 2:
        raise ValueError(f"stages must be an int >= 2 (the ring refills one stage while it reads another), "
                         f"got {stages!r}")
    if not (xq.device == w.device == offsets.device) or xq.device.type != "cuda":
        raise ValueError(f"{name} runs on one CUDA (sm90) device, got xq on {xq.device}, w on {w.device}, "
                         f"offsets on {offsets.device}")


def wq_operands(xq: Tensor, w: Tensor, offsets: Tensor, stages: int, name: str
                ) -> tuple[Tensor, Tensor, Tensor, bool]:
    """The opening of designs (e) and (f): :func:`check_wq_args` (with TMA's rules), the
    operands made contiguous and the (T, N) bf16 output allocated. Returns (xq, w, out,
    nothing): ``nothing`` when T, N, E or K is zero, and then ``out`` is zeros.

    Raises:
        TypeError, ValueError: as :func:`check_wq_args` says.
    """
    check_wq_args(xq, w, offsets, stages, name, tma=True)
    xq, w = xq.contiguous(), w.contiguous()
    T, K = xq.shape
    E, N, _ = w.shape
    out = torch.empty(T, N, dtype=torch.bfloat16, device=xq.device)
    nothing = T == 0 or N == 0 or E == 0 or K == 0
    return xq, w, out.zero_() if nothing else out, nothing


def gluon_grouped_mm_wq_fwd(xq: Tensor, w: Tensor, offsets: Tensor, *, fmt: str = "e4m3", mode: str = "rceil",
                            block_w: int = 128, block_t: int = 256, block_k: int = 64, stages: int = 4,
                            num_warps: int = 8, w_async: bool = True, quantize: bool = True, mma: bool = True) -> Tensor:
    """out (T, N) bf16 = xq[t] Q(w[e])^T: design (d) (module docs). xq (T, K) bf16 dequantized
    MX values along K; w (E, N, K) bf16 raw, contiguous; offsets (E,) int32 cumulative ends.
    Rows at and past offsets[-1] are zeros. CUDA (sm90) only. ``quantize=False`` (the raw
    weight) and ``mma=False`` (no tensor-core work: zeros) are timing references, not results.

    Raises:
        RuntimeError: no Gluon in this Triton. TypeError, ValueError: as :func:`check_wq_args`
            says (offsets of another shape or device are refused: the kernel would read past w).
    """
    from mxmoe.kernels.quantize import _codes
    from mxmoe.ops.gemm import zero_rows_past_end

    if _wq_fwd_kernel is None:
        raise RuntimeError(f"design (d) needs Triton's Gluon dialect (Triton >= 3.5), found {triton.__version__}")
    check_wq_args(xq, w, offsets, stages, "design (d)")
    elem, _, mode_code = _codes(fmt, mode)
    xq, w = xq.contiguous(), w.contiguous()
    T, K = xq.shape
    E, N, _ = w.shape
    out = torch.empty(T, N, dtype=torch.bfloat16, device=xq.device)
    if T == 0 or N == 0:
        return out
    te, r0, r1, _ = tile_table(offsets, T, 1, block_t, 1)  # one entry per token tile
    col_tiles = triton.cdiv(N, block_w)
    _wq_fwd_kernel[(te.numel() * col_tiles,)](
        xq, w, out, te, r0, r1, N, K, col_tiles, BLOCK_W=block_w, BLOCK_T=block_t, BLOCK_K=block_k,
        STAGES=stages, ELEM=elem, MODE=mode_code, W_ASYNC=w_async, QUANT=quantize, MMA=mma,
        num_warps=num_warps)
    return zero_rows_past_end(out, offsets)
