"""The quantized-weight grouped GEMM on sm90: CUTLASS's grouped GEMM with the MXFP8 weight
quantization inside its mainloop, for the forward and the dgrad of ``mx_grouped_mm``.

What it computes. Forward: out[t] = xq[t] @ Q_K(w[e])^T for the token rows t of expert e
(:func:`grouped_mm_nt_wq`); dgrad: dx[t] = dyq[t] @ Q_N(w[e]) (:func:`grouped_mm_nn_wq`).
Q is the recipe's MX quantize-dequantize of the raw bf16 weight (blocks of 32 along K for
the forward, along N for the dgrad), done on each weight tile in registers between the
tensor-core instructions (``cutlass_mx_grouped_gemm.cu``: CUTLASS 4.2's sm90 mixed-input
register-operand mainloop, the block rules of docs/NUMERICS.md in integer and bf16x2
arithmetic) instead of in a pass over the whole weight before a bf16 grouped GEMM. The
values are bit-equal to that pass's (``grouped_mm_nt(xq, fake_quantize_operand(w, recipe,
dim=2), offsets)``, and ``dim=1`` with ``grouped_mm_nn`` for the dgrad): float32
accumulation, bf16 output, rows past ``offsets[-1]`` zero. Its arithmetic is emulated
against the reference on the CPU (tests/kernels/test_cutlass_mx_arithmetic.py); the kernel
itself runs only on sm90 (sm_90a code: not on sm100).

When it applies (:func:`applies`, the rule in :func:`eligible`): an MXFP8 recipe (E4M3 /
E5M2 elements, blocks of 32, rceil / floor), bf16 contiguous tokens and weights on an sm90
GPU, K and N multiples of 8, and few tokens per expert: at most
``MAX_TOKENS_PER_EXPERT`` (forward) / ``MAX_TOKENS_PER_EXPERT_DGRAD`` (dgrad) on average,
where skipping the weight pass outweighs the slower GEMM. Otherwise, or when the library
cannot be built or loaded (one warning says why), the caller quantizes the weight in a pass
(the same values).

Build and cache. Compiled at first use, once per (element format, scale mode, forward /
dgrad), with ``nvcc`` (CUDA >= 12.8) and CUTLASS 4.2's headers (:func:`build_command`;
about 2 minutes), into the cache folder under a name hashing the source and the build
settings (:func:`cached_path`; a filled cache folder can be copied to another machine).
Processes that need the same build at once take turns on a lock file: one compiles.

Environment:
    ``MXMOE_GROUPED_WQ=0``: never use this GEMM.
    ``MXMOE_NVCC``: the nvcc to use (default: ``nvcc`` on the PATH, else ``$CUDA_HOME/bin``).
    ``MXMOE_CUTLASS_DIR``: a CUTLASS 4.2 checkout (``include/`` and
        ``tools/util/include/``); default: the ``cutlass_library`` package of the
        ``nvidia-cutlass`` wheel.
    ``MXMOE_CACHE_DIR``: the cache folder (default ``~/.cache/mxmoe``).
    ``MXMOE_NVCC_FLAGS``: extra nvcc flags, not hashed (e.g. ``-L<dir>`` where nvcc does not
        find ``libcudart_static.a``, as with the CUDA wheels).
    ``MXMOE_CUTLASS_WQ_LIB`` / ``MXMOE_CUTLASS_WQ_DGRAD_LIB``: a library built before with
        :func:`build_command` for the forward / dgrad, used instead of the cache.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import sys
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("cutlass_mx_grouped_gemm.cu")
FORMATS = {"e4m3": 0, "e5m2": 1}  # the source's FMT
SCALE_MODES = {"rceil": 0, "floor": 1}  # the source's MODE
# the two GEMMs and their compile-time settings: the dgrad's weight operand is w_e^T (WT:
# M-major in memory, read with ldmatrix.trans), its tiles walked token tiles first (RASTER)
OPS = {"forward": {}, "dgrad": {"WT": 1, "RASTER": 1}}
_LIB_ENV = {"forward": "MXMOE_CUTLASS_WQ_LIB", "dgrad": "MXMOE_CUTLASS_WQ_DGRAD_LIB"}
# The largest average number of tokens per expert for which this GEMM is used. On the H200
# the forward (the x pass, then this GEMM) ran at 0.90x the speed of bf16 torch._grouped_mm
# at 256 tokens per expert against 0.60x with the weight pass, about even at 1024, slower at
# 2048; the dgrad (its tile order walking the token tiles first) at 0.85x against 0.82-0.85x
# at 1024 and 0.80x against 0.88-0.91x at 2048: 1152 lies between (a bound, not a measured
# crossover).
MAX_TOKENS_PER_EXPERT = 640
MAX_TOKENS_PER_EXPERT_DGRAD = 1152
_ALIGN = 8  # K and N multiples of 8 bf16 (TMA's 16-byte rows of x and w, and of the output)

_LIBS: dict[tuple[str, str, str], ctypes.CDLL] = {}  # (format, mode, op)
_FAILED: dict[tuple[str, str, str], str] = {}
_SHAPES: set[tuple] = set()  # _shape_key()s whose first call (the C entry's allocations) has run
_WORKSPACE: dict[tuple, int] = {}  # (device, format, mode, op, E): workspace bytes


def enabled() -> bool:
    """False when ``MXMOE_GROUPED_WQ=0`` turns the quantized-weight GEMM off."""
    return os.environ.get("MXMOE_GROUPED_WQ", "1") != "0"


def cutlass_dir() -> Path | None:
    """The CUTLASS 4.2 root whose ``include/cutlass/cutlass.h`` the build uses:
    ``MXMOE_CUTLASS_DIR``, else the ``cutlass_library`` package's ``source`` folder (the
    ``nvidia-cutlass`` wheel), else None."""
    env = os.environ.get("MXMOE_CUTLASS_DIR")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "source"


def nvcc_path() -> str | None:
    """``MXMOE_NVCC``, else ``nvcc`` on the PATH, else ``$CUDA_HOME/bin/nvcc``, else None."""
    env = os.environ.get("MXMOE_NVCC")
    if env:
        return env
    found = shutil.which("nvcc")
    if found:
        return found
    from torch.utils.cpp_extension import CUDA_HOME

    cand = Path(CUDA_HOME) / "bin" / "nvcc" if CUDA_HOME else None
    return str(cand) if cand is not None and cand.exists() else None


def _name(fmt: str, mode: str, op: str = "forward") -> str:
    """The build's NAME for (fmt, mode, op), the prefix of its C entries."""
    return f"g_{fmt}_{mode}" + ("" if op == "forward" else f"_{op}")


def symbol(fmt: str, mode: str, what: str = "forward", op: str = "forward") -> str:
    """A C entry of the build for (fmt, mode, op): ``g_<fmt>_<mode>[_dgrad]_<what>``
    (``what``: ``forward``, the launch; ``workspace_bytes``; ``last_error``)."""
    return f"{_name(fmt, mode, op)}_{what}"


def build_command(fmt: str, mode: str, out: str | os.PathLike, nvcc: str = "nvcc",
                  cutlass: str | os.PathLike = "CUTLASS", op: str = "forward",
                  source: str | os.PathLike | None = None) -> list[str]:
    """The nvcc command that builds the quantized-weight GEMM for element format ``fmt``
    ("e4m3" / "e5m2"), scale mode ``mode`` ("rceil" / "floor") and GEMM ``op`` ("forward":
    w quantized along K; "dgrad": w^T, along N) into the shared library ``out`` (sm_90a,
    the CUDA runtime linked statically) from ``source`` (default ``SOURCE``). ``cutlass``:
    the CUTLASS 4.2 root (``include/`` and ``tools/util/include/`` under it).

    Raises:
        ValueError: an unknown format, mode or op.
    """
    if fmt not in FORMATS or mode not in SCALE_MODES or op not in OPS:
        raise ValueError(f"the quantized-weight GEMM builds for formats {sorted(FORMATS)}, scale modes "
                         f"{sorted(SCALE_MODES)} and ops {sorted(OPS)}, got {fmt!r} / {mode!r} / {op!r}")
    settings = {"MODE": SCALE_MODES[mode], **OPS[op], "FMT": FORMATS[fmt], "NAME": _name(fmt, mode, op)}
    return [nvcc, "-std=c++17", "-O3", "-DNDEBUG", "-arch=sm_90a", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr",
            f"-I{Path(cutlass) / 'include'}", f"-I{Path(cutlass) / 'tools' / 'util' / 'include'}",
            *[f"-D{k}={v}" for k, v in settings.items()], "-shared", "-cudart", "static", "-o", str(out),
            str(SOURCE if source is None else source)]


def _cache_dir() -> Path:
    return Path(os.environ.get("MXMOE_CACHE_DIR") or Path.home() / ".cache" / "mxmoe")


def cached_path(fmt: str, mode: str, op: str = "forward") -> Path:
    """Where the build for (fmt, mode, op) is cached: ``MXMOE_CACHE_DIR`` (default
    ``~/.cache/mxmoe``), named by a hash of the source and the build settings (not of the
    nvcc and CUTLASS locations, nor of where the package lies, so a cache folder can be
    copied to another machine or checkout)."""
    cmd = build_command(fmt, mode, "OUT", op=op, source=SOURCE.name)
    digest = hashlib.sha256((SOURCE.read_text() + "\0".join(cmd)).encode()).hexdigest()[:16]
    return _cache_dir() / f"mx_grouped_gemm_{_name(fmt, mode, op)[2:]}_{digest}.so"


def _build(fmt: str, mode: str, op: str = "forward") -> Path:
    """The cached library for (fmt, mode, op), compiled now if missing (atomically renamed
    into the cache, so a crash leaves no partial file). Processes that need the same build
    at once (the ranks of one node) take turns on a lock file beside it: the first compiles,
    the others wait and then load its file, or, if its compile failed while they waited,
    raise its error instead of compiling again (its nvcc output is kept in ``<name>.failed``
    until a later build succeeds). Where the folder cannot be locked (no flock, a lock file
    that cannot be opened), each process compiles on its own."""
    path = cached_path(fmt, mode, op)
    if path.exists():
        return path
    if nvcc_path() is None or cutlass_dir() is None:
        return _compile(path, fmt, mode, op)  # raises, naming what is missing: no lock to wait for
    path.parent.mkdir(parents=True, exist_ok=True)
    failed = path.with_suffix(".failed")
    try:
        import fcntl

        fd = os.open(path.with_suffix(".lock"), os.O_CREAT | os.O_RDONLY, 0o666)  # flock needs no write access
    except (ImportError, OSError):
        return _compile(path, fmt, mode, op, failed)
    try:
        try:
            os.fchmod(fd, 0o666)  # the umask's 0644 would keep other users of a shared cache out
        except OSError:
            pass  # someone else's lock file: it is theirs to open for everyone
        waited_since = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waited_since = time.time()
            print(f"mxmoe: waiting for another process's build of the quantized-weight GEMM ({op}) for "
                  f"{fmt} / {mode} ({path})",
                  file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without flock
            return _compile(path, fmt, mode, op, failed)
        if path.exists():  # built by the process that held the lock
            return path
        if waited_since is not None and failed.exists() and failed.stat().st_mtime >= waited_since - 1:
            raise RuntimeError(f"another process's build failed ({failed}): {failed.read_text(errors='replace')}")
        return _compile(path, fmt, mode, op, failed)
    finally:
        os.close(fd)  # releases the lock


def _compile(path: Path, fmt: str, mode: str, op: str, failed: Path | None = None) -> Path:
    """Compile the build for (fmt, mode, op) into ``path`` (through a temporary file in its
    folder, renamed when complete); an nvcc failure is also written to ``failed`` (for the
    processes waiting on the lock), which a success removes."""
    nvcc, cutlass = nvcc_path(), cutlass_dir()
    if nvcc is None:
        raise RuntimeError("nvcc not found (MXMOE_NVCC, the PATH or $CUDA_HOME/bin; CUDA >= 12.8)")
    if cutlass is None or not (cutlass / "include" / "cutlass" / "cutlass.h").exists():
        where = f"looked in {cutlass}" if cutlass is not None else "no MXMOE_CUTLASS_DIR, no cutlass_library package"
        raise RuntimeError(f"CUTLASS 4.2 headers not found (MXMOE_CUTLASS_DIR or `pip install nvidia-cutlass==4.2.0`; "
                           f"{where})")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    print(f"mxmoe: building the quantized-weight GEMM ({op}) for {fmt} / {mode} with {nvcc} (about 2 minutes, "
          f"once: cached in {path})",
          file=sys.stderr, flush=True)
    try:
        extra = os.environ.get("MXMOE_NVCC_FLAGS", "").split()  # e.g. -L<dir of libcudart_static.a>
        res = subprocess.run(build_command(fmt, mode, tmp, nvcc, cutlass, op) + extra, capture_output=True, text=True,
                             errors="replace")
        if res.returncode != 0:
            msg = f"nvcc failed ({res.returncode}): {res.stderr.strip()[-2000:]}"
            if failed is not None:
                try:
                    failed.write_text(msg)
                except OSError:
                    pass
            raise RuntimeError(msg)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep other users of a shared cache out
        os.replace(tmp, path)
        if failed is not None:
            failed.unlink(missing_ok=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _load(path: str, fmt: str, mode: str, op: str = "forward") -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    fwd = getattr(lib, symbol(fmt, mode, "forward", op))  # AttributeError: a library built for other settings
    # groups, nout, k; problems, weights, tokens, outputs, workspace; workspace bytes, stream
    fwd.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 5 + [ctypes.c_longlong, ctypes.c_void_p]
    fwd.restype = ctypes.c_int
    ws = getattr(lib, symbol(fmt, mode, "workspace_bytes", op))
    ws.argtypes, ws.restype = [ctypes.c_int], ctypes.c_longlong
    err = getattr(lib, symbol(fmt, mode, "last_error", op))
    err.argtypes, err.restype = [], ctypes.c_char_p
    return lib


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside mxmoe and torch, for a warning issued
    by the function that calls this one (the calls arrive through autograd or not)."""
    import inspect

    inner = (str(Path(__file__).resolve().parents[1]), str(Path(torch.__file__).resolve().parent))
    frames = inspect.stack()[1:]
    for i, f in enumerate(frames):
        if not str(Path(f.filename).resolve()).startswith(inner):
            return i + 1
    return len(frames)


def _give_up(key: tuple[str, str, str], why: str) -> None:
    """The quantized-weight GEMM off for this (format, mode, op) in this process, with one warning."""
    _FAILED[key] = why
    warnings.warn(f"mxmoe: the quantized-weight grouped GEMM (the MXFP8 weight quantized inside CUTLASS's mainloop) "
                  f"is not available for the {key[2]} in {key[0]} / {key[1]} ({why}); the weight is quantized in a "
                  f"pass instead (the same values; MXMOE_GROUPED_WQ=0 turns it off without this warning)",
                  RuntimeWarning, stacklevel=_user_stacklevel())


def library(fmt: str, mode: str, op: str = "forward") -> ctypes.CDLL | None:
    """The loaded library for (fmt, mode, op): the one ``MXMOE_CUTLASS_WQ_LIB`` (forward) /
    ``MXMOE_CUTLASS_WQ_DGRAD_LIB`` (dgrad) names if set, else the cached build (compiled on
    first use; a cached file that does not load is deleted and built once more). None if
    that fails (warned once per format, mode and op; the caller quantizes the weight in a
    pass instead)."""
    key = (fmt, mode, op)
    if key in _FAILED:  # first: a library that failed at run time stays off
        return None
    if key in _LIBS:
        return _LIBS[key]
    try:
        env = os.environ.get(_LIB_ENV[op])
        if env:
            try:
                lib = _load(env, fmt, mode, op)
            except OSError as err:
                raise OSError(f"{_LIB_ENV[op]}={env}: {err}") from err
        else:
            path = _build(fmt, mode, op)
            try:
                lib = _load(str(path), fmt, mode, op)
            except (OSError, AttributeError):  # a damaged or foreign file in the cache: build it again
                path.unlink(missing_ok=True)
                lib = _load(str(_build(fmt, mode, op)), fmt, mode, op)
    except (OSError, RuntimeError, AttributeError) as err:
        _give_up(key, f"{type(err).__name__}: {err}")
        return None
    _LIBS[key] = lib
    return lib


def eligible(x_shape, w_shape, dtypes_bf16: bool, contiguous: bool, w_ptr: int, recipe, capability,
             capturing: bool, seen: bool, op: str = "forward") -> bool:
    """The rule of :func:`applies`, without a device (so that it can be tested anywhere):
    enabled, an MXFP8 recipe (E4M3 / E5M2 elements, blocks of 32, rceil / floor) whose
    build for ``op`` has not failed, bfloat16 contiguous tokens (x (T, K) for the forward,
    dout (T, N) for the dgrad; ``x_shape`` is (T, K) for both) and w (E, N, K) with w 16-byte
    aligned (TMA), T, K, N > 0 (an empty contraction would leave the kernel waiting for
    k-tiles), K and N multiples of 8, T <= ``MAX_TOKENS_PER_EXPERT`` * E (the dgrad:
    ``MAX_TOKENS_PER_EXPERT_DGRAD``), an sm90 device
    (``capability`` (9, 0): the binary is sm_90a), and not under CUDA-graph capture unless
    this shape ran once on this device (``seen``: its first call allocates)."""
    if not (enabled() and recipe.quantize and recipe.block_size == 32 and dtypes_bf16 and contiguous):
        return False
    fmt, mode = recipe.fmt.value, recipe.scale_mode.value
    if fmt not in FORMATS or mode not in SCALE_MODES or op not in OPS or (fmt, mode, op) in _FAILED:
        return False
    (T, K), (E, N, _) = x_shape, w_shape
    limit = MAX_TOKENS_PER_EXPERT_DGRAD if op == "dgrad" else MAX_TOKENS_PER_EXPERT
    if min(T, K, N, E) <= 0 or K % _ALIGN or N % _ALIGN or w_ptr % 16 or T > limit * E:
        return False
    return tuple(capability) == (9, 0) and (seen or not capturing)


def applies(x: Tensor, w: Tensor, offsets: Tensor, recipe, op: str = "forward") -> bool:
    """Whether the quantized-weight GEMM can run ``op`` of ``mx_grouped_mm``: the forward
    of x (T, K) and w (E, N, K), or the dgrad of dout (T, N) (``x`` then) and w (the rule:
    :func:`eligible`). Cheap: no build, no host synchronization."""
    if not (x.is_cuda and recipe.quantize):
        return False
    seen = _shape_key(x.device, recipe, op, w.shape, offsets.dtype) in _SHAPES
    return eligible((x.shape[0], w.shape[2]), tuple(w.shape), x.dtype == w.dtype == torch.bfloat16,
                    x.is_contiguous() and w.is_contiguous(), w.data_ptr(), recipe,
                    torch.cuda.get_device_capability(x.device), torch.cuda.is_current_stream_capturing(), seen, op)


def grouped_mm_nt_wq(xq: Tensor, w: Tensor, offsets: Tensor, recipe) -> Tensor | None:
    """The forward: out[t] = xq[t] @ Q(w[e])^T for the rows t of expert e, with Q the
    recipe's MX quantize-dequantize of w along K, done inside the GEMM; zero rows past
    offsets[-1].

    Args:
        xq: (T, K) bfloat16 contiguous, the tokens (already quantize-dequantized along K).
        w: (E, N, K) bfloat16 contiguous, the raw expert weights.
        offsets: (E,) int32 / int64 cumulative end rows on xq's device (non-decreasing,
            offsets[-1] <= T; not checked here: ``mx_grouped_mm`` documents the contract).
        recipe: an MXFP8 :class:`~mxmoe.recipe.Recipe` for which :func:`applies` held.

    Returns:
        (T, N) bfloat16 (float32 accumulation), bit-equal to
        ``grouped_mm_nt(xq, fake_quantize_operand(w, recipe, dim=2), offsets)``; None if
        the library is not available (the caller then quantizes the weight in a pass).

    A failure of the library at run time (its allocation, the launch) turns this GEMM off
    for the (format, mode, op) with one warning and returns None.
    """
    return _run("forward", xq, w, offsets, recipe)


def grouped_mm_nn_wq(dyq: Tensor, w: Tensor, offsets: Tensor, recipe) -> Tensor | None:
    """The dgrad: dx[t] = dyq[t] @ Q_N(w[e]) for the rows t of expert e, with Q_N the
    recipe's MX quantize-dequantize of w along N (blocks of 32 along N for each k), done
    inside the GEMM (the build with the transposed weight operand); zero rows past
    offsets[-1].

    Args:
        dyq: (T, N) bfloat16 contiguous, the output gradient (already quantize-dequantized
            along N).
        w: (E, N, K) bfloat16 contiguous, the raw expert weights.
        offsets: (E,) int32 / int64 cumulative end rows (as for :func:`grouped_mm_nt_wq`).
        recipe: an MXFP8 :class:`~mxmoe.recipe.Recipe` for which ``applies(dyq, w, offsets,
            recipe, "dgrad")`` held.

    Returns:
        (T, K) bfloat16 (float32 accumulation), bit-equal to
        ``grouped_mm_nn(dyq, fake_quantize_operand(w, recipe, dim=1), offsets)``; None if
        the library is not available.

    Failures: as :func:`grouped_mm_nt_wq` (the dgrad's build off, one warning, None).
    """
    return _run("dgrad", dyq, w, offsets, recipe)


def _run(op: str, a: Tensor, w: Tensor, offsets: Tensor, recipe) -> Tensor | None:
    """Launch ``op`` on tokens ``a`` (T, contraction) and w (E, N, K): the C entry's weight
    operand is Nout x Kc per expert (forward: w_e, N x K; dgrad: w_e^T, K x N, the same
    memory)."""
    fmt, mode = recipe.fmt.value, recipe.scale_mode.value
    lib = library(fmt, mode, op)
    if lib is None:
        return None
    from .grouped_zero_fill import zero_rows_past_end_
    from .group_tables import group_tables

    T = a.shape[0]
    E, N, K = w.shape
    # the weight as the kernel's (Nout, Kc) per expert: a view (group_tables reads the
    # shape and the base address only)
    w_op = w.transpose(1, 2) if op == "dgrad" else w
    nout, kc = w_op.shape[1], w_op.shape[2]
    with torch.cuda.device(a.device):  # the C entry and the table kernel use the current device
        dev = torch.cuda.current_device()
        wkey = (dev, fmt, mode, op, E)
        if wkey not in _WORKSPACE:
            _WORKSPACE[wkey] = int(getattr(lib, symbol(fmt, mode, "workspace_bytes", op))(E))
        # per call from this stream's allocator: launches on other streams never share it
        workspace = torch.empty(max(_WORKSPACE[wkey], 1), dtype=torch.uint8, device=a.device)
        out = torch.empty(T, nout, device=a.device, dtype=torch.bfloat16)
        ptrs = [t.data_ptr() for t in group_tables(offsets, w_op, a, out)]  # the C entry's order
        for attempt in range(2):
            rc = getattr(lib, symbol(fmt, mode, "forward", op))(E, nout, kc, *ptrs, workspace.data_ptr(),
                                                                _WORKSPACE[wkey],
                                                                torch.cuda.current_stream().cuda_stream)
            if rc != 1 or attempt or torch.cuda.is_current_stream_capturing():
                break
            torch.cuda.empty_cache()  # a shape's stride arrays come from cudaMalloc: free torch's cache, once
    if rc:
        what = {1: "allocation or copy failed", 2: "problem refused", 3: "initialize failed", 4: "launch failed",
                5: "workspace too small"}.get(rc, "unknown")
        if rc in (1, 4):  # the CUDA error behind it (the C entry records those two)
            what += f": {getattr(lib, symbol(fmt, mode, 'last_error', op))().decode()}"
        _give_up((fmt, mode, op), f"code {rc}, {what}, for E={E} N={N} K={K}")
        return None
    _SHAPES.add(_shape_key(a.device, recipe, op, w.shape, offsets.dtype))
    return zero_rows_past_end_(out, offsets)  # out: the fresh contiguous (T, N) CUDA output


def _shape_key(device: torch.device, recipe, op: str, w_shape, offsets_dtype: torch.dtype) -> tuple:
    """The key of _SHAPES: a (device, format, mode, op, weight operand shape, offsets dtype)
    whose first call has run: the C entry's allocations (per device, op and shape) and the
    argument tables' Triton kernel (compiled per offsets dtype; no other specialization:
    kernels/group_tables.py) are then in place for a CUDA-graph capture."""
    dev = device.index if device.index is not None else torch.cuda.current_device()
    return (dev, recipe.fmt.value, recipe.scale_mode.value, op, *tuple(w_shape), str(offsets_dtype))
