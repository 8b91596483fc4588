"""CUDA MX quantization kernels, compiled at run time by NVRTC.

One kernel so far, where the Triton kernels fell short of their target (issue 3: row-wise
+ column-wise in one pass at >= 85% of copy bandwidth; the Triton t8 kernel reaches 78.5-82.5%):
``mx_rowcol_bf16`` in ``cuda_rowcol.cu`` quantizes a bfloat16 (B, R, C) tensor row-wise
(blocks along C) and column-wise (blocks along R, written transposed) from one read, with
the same bytes as the Triton kernels and :mod:`mxmoe.numerics.reference` (the rules are
listed at the top of the ``.cu`` file). Each 128 x 128 tile goes to shared memory by
``cp.async``, and every output (codes, and with ``scratch`` the scales through scratch
arrays and the small second kernel ``mx_scales_out``) leaves as whole 128-byte lines; the
column codes are stored with an L2 evict_last policy on half of them (``col_policy``). The
source explains the layout and what was measured.

On the H200 (benchmarks/results/h200_rowcol_policy/: four tables of
``benchmarks/quantize.py`` at 5f83087 and c707de5, and two variant runs): 87.1-87.8% of
copy at 16384 x 8192, 85.4-86.5% at 131072 x 7168, 87.7-89.1% for the (64, 2048, 7168) expert weights (the
target of issue 3 is 85%); the Triton t8 kernel reached 80.9-82.5%, 78.5-79.0% and
83.5-84.6% (results/h200_cuda_rowcol/). The training recipe does not call it: its passes
are quantize-dequantize (Triton); this serves the codes-only op ``quantize_rowcol``.

It is compiled with ``torch.cuda._compile_kernel`` (NVRTC, whose library ships with
PyTorch's CUDA builds; a private PyTorch function, present in 2.11 and 2.13) once per
(element format, scale mode, launch settings) and cached for the process. Nothing is
built at install time, but torch's NVRTC wrapper adds a CUDA toolkit's include path to
every compile (``torch.utils.cpp_extension.include_paths("cuda")``, which needs
``CUDA_HOME``, ``nvcc`` on the PATH or ``/usr/local/cuda``), although this source includes
no header: without a toolkit the compile fails, a warning says so once, and the Triton
kernels run (same bytes, ~80% of copy). :func:`mxmoe.kernels.quantize.launch_tile` uses it only where it applies
(:func:`applies`: bfloat16 codes-only row + column jobs on sm90+, plain scales); all other
jobs, and any setup where the compile step fails (a warning says why, once), take the
Triton kernels, which give the same bytes.

Launch settings (``cfg``): ``mxmoe.kernels.quantize.TUNING["rowcol_cuda"]``, measured on
the H200 by ``benchmarks/quantize.py --sweep-only rowcol_cuda`` (threads, rb, gb, scratch)
and ``benchmarks/rowcol_cuda_variants.py`` (col_policy, cj and the scales pass's launch
shape).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import Tensor

BLOCK = 32
_SOURCE_PATH = Path(__file__).with_name("cuda_rowcol.cu")
_ELEM = {"e4m3": 0, "e5m2": 1}
_MODE = {"floor": 0, "rceil": 1}

_INT32_MAX = 2**31 - 1
_FAILED: dict[tuple, str] = {}  # settings whose compile step failed, and why (they take Triton)


TILE = 128  # rows and columns of a tile (fixed in cuda_rowcol.cu)


# dynamic shared memory per block of mx_rowcol_bf16 (every setting): the bfloat16 tile, its
# row and column codes (one byte per element each) and their scale bytes (4 per row and
# per column)
SMEM_BYTES = TILE * TILE * 4 + 2 * TILE * 4


def _int_in(v, options) -> bool:
    return type(v) is int and v in options  # not bool, not float: they reach the source as #define text


def _settings_ok(cfg: dict) -> bool:
    """cfg: ``threads`` per block (128 or 256), ``rb`` 32-column blocks per row-pass task
    and ``gb`` 32-row blocks per column-pass task (1, 2 or 4 each), ``scratch`` (bool: the
    scales through scratch arrays and a second pass), and optional ``col_policy`` (L2
    policy of the column code stores, 0-3), ``cj`` (tiles per column-scale job: 8, 16, 32),
    ``scale_threads`` (128, 256, 512) and ``scale_min_blocks`` of the second pass (its
    ``__launch_bounds__`` minimum of resident blocks per SM: at most 2048 threads and 13
    blocks of 16.9 KB shared memory per SM); see cuda_rowcol.cu. Integers must be ints."""
    snt, sminb = cfg.get("scale_threads", 128), cfg.get("scale_min_blocks", 1)
    return (_int_in(cfg.get("threads"), (128, 256)) and _int_in(cfg.get("rb"), (1, 2, 4))
            and _int_in(cfg.get("gb"), (1, 2, 4)) and type(cfg.get("scratch", False)) is bool
            and _int_in(cfg.get("col_policy", 0), range(4)) and _int_in(cfg.get("cj", 32), (8, 16, 32))
            and _int_in(snt, (128, 256, 512)) and _int_in(sminb, range(1, 14)) and snt * sminb <= 2048)


def _macros(fmt: str, mode: str, cfg: dict) -> tuple:
    """The compile-time settings of cuda_rowcol.cu as (name, value) pairs (also the cache key)."""
    return (("NT", cfg["threads"]), ("RB", cfg["rb"]), ("GB", cfg["gb"]), ("ELEM", _ELEM[fmt]),
            ("MODE", _MODE[mode]), ("SCRATCH", int(bool(cfg.get("scratch")))), ("CPOL", cfg.get("col_policy", 0)),
            ("CJ", cfg.get("cj", 32)), ("SNT", cfg.get("scale_threads", 128)),
            ("SMINB", cfg.get("scale_min_blocks", 1)))


def source(fmt: str, mode: str, cfg: dict) -> str:
    """The kernel source with its compile-time settings prepended (``#define`` lines)."""
    return "".join(f"#define {k} {v}\n" for k, v in _macros(fmt, mode, cfg)) + _SOURCE_PATH.read_text()


_KERNELS: dict[tuple, tuple] = {}


def _key(fmt: str, mode: str, cfg: dict, device_index: int) -> tuple:
    """The compile cache key: every compile-time setting and the device."""
    return (_macros(fmt, mode, cfg), device_index)


def is_compiled(fmt: str, mode: str, cfg: dict, device_index: int) -> bool:
    """Whether the kernels for these settings are compiled and loaded on this device (so a
    call that :func:`applies` to runs them rather than the Triton fallback)."""
    return _key(fmt, mode, cfg, device_index) in _KERNELS


def _compiled(fmt: str, mode: str, cfg: dict, device_index: int):
    """(mx_rowcol_bf16, mx_scales_out) compiled for these settings on this device, on first
    use; None while a CUDA graph is being captured and they are not compiled yet (loading a
    module is not a stream operation a graph can hold), or if compiling failed (warned
    once per settings)."""
    key = _key(fmt, mode, cfg, device_index)
    if key in _FAILED:
        return None
    if key not in _KERNELS:
        if torch.cuda.is_current_stream_capturing():
            return None
        major, minor = torch.cuda.get_device_capability(device_index)
        try:
            with torch.cuda.device(device_index):
                text = source(fmt, mode, cfg)
                main = torch.cuda._compile_kernel(text, "mx_rowcol_bf16", compute_capability=f"{major}{minor}")
                main.set_shared_memory_config(SMEM_BYTES)  # opt-in above 48 KB
                scales = torch.cuda._compile_kernel(text, "mx_scales_out", compute_capability=f"{major}{minor}")
        except Exception as err:  # NVRTC missing or refusing: the Triton kernels give the same bytes
            _FAILED[key] = f"{type(err).__name__}: {err}"
            warnings.warn(f"mxmoe: the CUDA row + column quantizer could not be compiled for {key} "
                          f"({_FAILED[key]}); using the Triton kernels instead (same bytes, slower). torch's NVRTC "
                          f"wrapper needs a CUDA toolkit (CUDA_HOME, nvcc on the PATH or /usr/local/cuda) for its "
                          f"include path", RuntimeWarning, stacklevel=4)
            return None
        _KERNELS[key] = (main, scales)
    return _KERNELS[key]


def available() -> bool:
    """Whether this PyTorch can compile CUDA source at run time (a CUDA build with NVRTC)."""
    return (torch.cuda.is_available() and hasattr(torch.cuda, "_compile_kernel")
            and torch.version.cuda is not None)


def applies(x3: Tensor, fmt: str, mode: str, cfg: dict) -> bool:
    """Whether ``mx_rowcol_bf16`` takes this row + column job: x3 (B, R, C) bfloat16 on a
    CUDA device of compute capability >= 9.0 (``max.u16x2``), unit stride along C, 16-byte
    aligned rows (the ``cp.async`` copies), R and C multiples of 32 (the op refuses others
    anyway), int32 strides and sizes, E4M3 or E5M2, and ``cfg`` enabled and valid."""
    if not (cfg.get("enabled", True) and available() and _settings_ok(cfg)):
        return False
    if fmt not in _ELEM or mode not in _MODE or x3.dim() != 3 or not x3.is_cuda or x3.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x3.device) < (9, 0):
        return False
    return _layout_ok(tuple(x3.shape), tuple(x3.stride()), x3.data_ptr())


def _layout_ok(shape: tuple[int, int, int], strides: tuple[int, int, int], data_ptr: int) -> bool:
    """The layout part of :func:`applies` for a bfloat16 (B, R, C) tensor (strides in
    elements, data_ptr in bytes): the grid's y and z within 65535, R and C multiples of 32,
    unit stride along C, rows (and matrices, when B > 1) at 16-byte boundaries, strides,
    sizes and scratch words within int32."""
    B, R, C = shape
    return (-(-R // TILE) <= 65535 and B <= 65535 and R % BLOCK == 0 and C % BLOCK == 0 and strides[2] == 1
            and strides[1] % 8 == 0 and (strides[0] % 8 == 0 or B == 1) and data_ptr % 16 == 0
            and max(strides[0] if B > 1 else 0, strides[1], R, C) <= _INT32_MAX
            and B * -(-R // TILE) * -(-C // TILE) * TILE <= _INT32_MAX)


def rowcol(x3: Tensor, fmt: str, mode: str, cfg: dict) -> dict[str, Tensor] | None:
    """Row-wise and transposed column-wise codes and scales of x3 (B, R, C) bfloat16 (see
    :func:`applies`), as uint8 tensors: ``q_row`` (B, R, C), ``s_row`` (B, R, C / 32),
    ``q_col`` (B, C, R), ``s_col`` (B, C, R / 32). Returns None if the kernel cannot be
    compiled here (a warning says why, once; the caller then takes Triton) or not yet
    compiled while a CUDA graph is being captured."""
    B, R, C = x3.shape
    dev = x3.device
    kernels = _compiled(fmt, mode, cfg, dev.index if dev.index is not None else torch.cuda.current_device())
    if kernels is None:
        return None
    main, scales = kernels
    u8 = torch.uint8
    out = {"q_row": torch.empty(B, R, C, dtype=u8, device=dev),
           "s_row": torch.empty(B, R, C // BLOCK, dtype=u8, device=dev),
           "q_col": torch.empty(B, C, R, dtype=u8, device=dev),
           "s_col": torch.empty(B, C, R // BLOCK, dtype=u8, device=dev)}
    if not (B and R and C):
        return out
    nty, ntx = -(-R // TILE), -(-C // TILE)
    stream = torch.cuda.current_stream(dev)
    scratch = bool(cfg.get("scratch"))
    jobs = nty * -(-ntx // 32) + ntx * -(-nty // cfg.get("cj", 32))  # scale jobs per matrix
    with torch.cuda.device(dev):
        if scratch:
            scr_r = torch.empty(B * nty * ntx * TILE * 4, dtype=u8, device=dev)
            scr_c = torch.empty_like(scr_r)
            s_dst = (scr_r, scr_c)
        else:
            s_dst = (out["s_row"], out["s_col"])
        main(grid=(ntx, nty, B), block=(cfg["threads"], 1, 1),
             args=[x3, x3.stride(0) if B > 1 else 0, x3.stride(1), R, C, B, out["q_row"], s_dst[0], out["q_col"],
                   s_dst[1]],
             shared_mem=SMEM_BYTES, stream=stream)
        if scratch:
            scales(grid=(jobs, 1, B), block=(cfg.get("scale_threads", 128), 1, 1),
                   args=[scr_r, scr_c, R, C, out["s_row"], out["s_col"]], stream=stream)
    return out
