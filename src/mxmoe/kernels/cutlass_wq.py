"""Design (g) on sm90: the MXFP8 weight quantization inside CUTLASS's grouped GEMM (forward, dgrad).

``mx_grouped_mm``'s forward on the H200 normally quantizes the weight in a pass of its own
(design (a): quantize-dequantize along K, then a bf16 ``torch._grouped_mm``). When there are
few tokens per expert that pass costs more than the GEMM: at (T, K, N, E) = (16384, 2048,
1408, 64) the weight is 5.5x the tokens. Design (g) reads the raw bf16 weight in the GEMM
and quantizes each weight tile to MXFP8 in registers, between the tensor-core
instructions, inside CUTLASS 4.2's sm90 mixed-input (register-operand) mainloop:
``cutlass_wq.cu`` (VARIANT 3), the block rules of docs/NUMERICS.md in integer and bf16x2
arithmetic, bit-equal to design (a) (checked on the H200 for E4M3 / E5M2, rceil / floor:
``benchmarks/cutlass_mixed.py``; its arithmetic is emulated against the reference on the
CPU: tests/test_wq_prototypes.py). Tiles of 128 weight rows x 320 tokens (two m64n160
wgmmas per k-block), so that an expert of up to 320 tokens is one tile and its weight is
quantized once.

Measured on the H200 (benchmarks/results/h200_design_g/, session 14): ``mx_grouped_mm``'s
forward per call (the x pass, then this GEMM) at 0.89-0.90x bf16 ``torch._grouped_mm`` at
(16384, 2048, 1408, 64) (0e51edc, daef1e9; the kernel alone in the benchmark harness 0.92x),
against 0.59-0.60x for design (a); at 1024 tokens per expert about even with (a)
(0.77-0.78x), at 2048 slower (0.75 against 0.85). :func:`applies` therefore takes it up to
``MAX_TOKENS_PER_EXPERT`` tokens per expert on average.

The dgrad (dx_e = dout_e w_e, w quantized along N) is the same kernel built with ``WT``:
the weight operand is w_e^T (K x N, its memory K-contiguous), loaded into shared memory as
it lies and into the registers with ldmatrix.trans, quantized along N the same way
(:func:`grouped_mm_nn_wq`; session 15): bit-equal to design (a), 0.915-0.924x bf16 per call
at (16384, 2048, 1408, 64) against (a)'s 0.58x. Its build walks the tiles of one block of
weight rows back to back (``RASTER``; session 16): at 1024 tokens per expert 0.848-0.851x
against (a)'s 0.82-0.85x (CUTLASS's default order: 0.82x), at 2048 0.80 against 0.88-0.91x,
so :func:`applies` takes it up to ``MAX_TOKENS_PER_EXPERT_DGRAD`` tokens per expert.

The kernel is compiled at first use, once per (element format, scale mode), with ``nvcc``
(CUDA >= 12.8: ``MXMOE_NVCC``, ``nvcc`` on the PATH or ``$CUDA_HOME/bin``) and CUTLASS 4.2's
headers (``MXMOE_CUTLASS_DIR``, a CUTLASS checkout with ``include/`` and
``tools/util/include/``, else the ``cutlass_library`` package of the ``nvidia-cutlass`` wheel),
~2 minutes (processes needing it at once take turns on a lock file: one compiles), into
``MXMOE_CACHE_DIR`` (default ``~/.cache/mxmoe``), named by a hash of the
source and the build settings (:func:`cached_path`; a filled cache folder can be copied to
another machine); ``MXMOE_NVCC_FLAGS`` adds flags (not hashed: e.g. ``-L<dir>`` where nvcc
does not find ``libcudart_static.a``, as with the CUDA wheels); ``MXMOE_CUTLASS_WQ_LIB``
names one library built before (:func:`build_command`) instead (the forward's; the dgrad's is
``MXMOE_CUTLASS_WQ_DGRAD_LIB``, design (b)'s ``MXMOE_CUTLASS_W8_LIB``). Without a toolkit,
headers or an sm90 GPU, or when the build fails (a warning says why, once), design (a)
runs: the same values. ``MXMOE_GROUPED_WQ=0`` turns design (g) off. The wgrad stays design
(a)'s.

Design (b) in CUTLASS (VARIANT 4, op "w8"; session 15): the weight's MXFP8 copy from the
library's quantizers (:func:`weight_copy_w8`: FP8 codes, E8M0 scales packed two per uint16)
converted in the same mainloop (:func:`grouped_mm_w8`). Bit-equal to design (a) on the H200,
its GEMM 0.99-1.09x bf16; per call (with its weight pass) within a few percent of design (a)
(2.5% ahead at (65536, 7168, 2048, 64), 1-2% behind at E = 16) and far behind design (g)
where that runs, below 0.85x wherever (a) and (g) are: ``mx_grouped_mm`` does not call it
(benchmarks/cutlass_w8.py).

Untested on anything but the H200 (sm90a code: it does not run on sm100).
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

SOURCE = Path(__file__).with_name("cutlass_wq.cu")
# the build of cutlass_wq.cu the library runs (benchmarks/cutlass_mixed.py's q9x family):
# 128 x 320 x 64 tiles, 3 stages, no cluster, QDQ 5 arithmetic, our k-tile consumer loop
BUILD = {"VARIANT": 3, "TM": 128, "TN": 320, "TK": 64, "CM": 1, "STAGES": 3, "QDQ": 5, "PINGPONG": 0,
         "EARLY": 1, "LOOP": 4}
FORMATS = {"e4m3": 0, "e5m2": 1}
# the GEMMs of mx_grouped_mm design (g) builds, and their macros: the dgrad's weight operand
# is w_e^T (WT: M-major in memory, ldmatrix.trans)
# "w8": design (b) in CUTLASS (VARIANT 4): the weight's MXFP8 copy from a quantize pass
# (:func:`weight_copy_w8`), codes converted with their E8M0 scales in the mainloop; one
# build per element format serves forward and dgrad (the pass decides the scale mode)
# (the dgrad's tile order: the token tiles of a block of weight rows back to back, RASTER)
OPS = {"forward": {}, "dgrad": {"WT": 1, "RASTER": 1},
       "w8": {"VARIANT": 4, "TN": 256, "CM": 2, "STAGES": 4, "LOOP": 0, "QDQ": 0, "EARLY": 0, "MODE": 0}}
_LIB_ENV = {"forward": "MXMOE_CUTLASS_WQ_LIB", "dgrad": "MXMOE_CUTLASS_WQ_DGRAD_LIB", "w8": "MXMOE_CUTLASS_W8_LIB"}
_ENTRY = {"forward": "forward", "dgrad": "forward", "w8": "forward_scaled"}  # the launch entry's suffix
SCALE_MODES = {"rceil": 0, "floor": 1}
# design (g) for at most this many tokens per expert on average (measured: 256 per expert
# 0.90x against (a)'s 0.60x; 1024 about even; 2048 slower)
MAX_TOKENS_PER_EXPERT = 640
# the dgrad's bound (session 16, its tile order walking the token tiles first): (g) 0.848-0.851x
# against (a)'s 0.82-0.85x at 1024 tokens per expert, 0.80x against 0.88-0.91x at 2048;
# 1152 = 1024 x 9/8 lies between (a bound, not a measured crossover)
MAX_TOKENS_PER_EXPERT_DGRAD = 1152
_ALIGN = 8  # K and N multiples of 8 bf16 (TMA's 16-byte rows of x and w, and of the output)

_LIBS: dict[tuple[str, str, str], ctypes.CDLL] = {}  # (format, mode, op)
_FAILED: dict[tuple[str, str, str], str] = {}
_SHAPES: set[tuple] = set()  # _shape_key()s whose first call (the C entry's allocations) has run
_WORKSPACE: dict[tuple, int] = {}  # (device, format, mode, op, E): workspace bytes


def enabled() -> bool:
    """False when ``MXMOE_GROUPED_WQ=0`` turns design (g) off."""
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
    """The build's NAME for (fmt, mode, op), the prefix of its C entries (w8: no mode)."""
    if op == "w8":
        return f"g_{fmt}_w8"
    return f"g_{fmt}_{mode}" + ("" if op == "forward" else f"_{op}")


def symbol(fmt: str, mode: str, what: str = "forward", op: str = "forward") -> str:
    """A C entry of the build for (fmt, mode, op): ``g_<fmt>_<mode>[_dgrad]_<what>``, for w8
    ``g_<fmt>_w8_<what>`` (``what``: the launch, ``_ENTRY[op]`` (forward, or forward_scaled
    for w8), workspace_bytes, last_error)."""
    return f"{_name(fmt, mode, op)}_{what}"


def build_command(fmt: str, mode: str, out: str | os.PathLike, nvcc: str = "nvcc",
                  cutlass: str | os.PathLike = "CUTLASS", op: str = "forward",
                  source: str | os.PathLike | None = None, macros: dict[str, int] | None = None) -> list[str]:
    """The nvcc command that builds the library's design (g) for element format ``fmt``
    ("e4m3" / "e5m2"), scale mode ``mode`` ("rceil" / "floor") and GEMM ``op`` ("forward":
    w along K; "dgrad": w^T, along N) into the shared library ``out`` (sm_90a, the CUDA
    runtime linked statically) from ``source`` (default ``SOURCE``: the package's ``cutlass_wq.cu``).
    ``macros`` overrides or adds compile-time settings of the op's (a measurement build, e.g.
    ``{"RASTER": 2}`` for benchmarks/wq_raster.py; the library's builds take none).

    Raises:
        ValueError: an unknown format, mode or op.
    """
    if fmt not in FORMATS or mode not in SCALE_MODES or op not in OPS:
        raise ValueError(f"design (g) builds for formats {sorted(FORMATS)}, scale modes {sorted(SCALE_MODES)} and "
                         f"ops {sorted(OPS)}, got {fmt!r} / {mode!r} / {op!r}")
    settings = {**BUILD, "MODE": SCALE_MODES[mode], **OPS[op], **(macros or {}), "FMT": FORMATS[fmt],
                "NAME": _name(fmt, mode, op)}
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
    return _cache_dir() / f"cutlass_wq_{_name(fmt, mode, op)[2:]}_{digest}.so"


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
            print(f"mxmoe: waiting for another process's build of design (g) ({op}) for {fmt} / {mode} ({path})",
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
    print(f"mxmoe: building design (g) ({op}) for {fmt} / {mode} with {nvcc} (about 2 minutes, once: cached in {path})",
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
    fwd = getattr(lib, symbol(fmt, mode, _ENTRY[op], op))  # AttributeError: a library built for other settings
    n_ptrs = 6 if op == "w8" else 5  # problems, weights, tokens, [scales,] outputs, workspace
    fwd.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * n_ptrs + [ctypes.c_longlong, ctypes.c_void_p]
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
    """Design (g) off for this (format, mode, op) in this process, with one warning."""
    _FAILED[key] = why
    if key[2] == "w8":  # not dispatched: its caller gets None
        warnings.warn(f"mxmoe: design (b) in CUTLASS (w8) is not available for {key[0]} ({why}); grouped_mm_w8 "
                      f"returns None", RuntimeWarning, stacklevel=_user_stacklevel())
        return
    warnings.warn(f"mxmoe: design (g) (the weight quantized inside the grouped GEMM) is not available for the "
                  f"{key[2]} in {key[0]} / {key[1]} ({why}); it quantizes the weight in a pass instead (design (a), "
                  f"the same values; MXMOE_GROUPED_WQ=0 turns design (g) off without this warning)", RuntimeWarning,
                  stacklevel=_user_stacklevel())


def _key(fmt: str, mode: str, op: str) -> tuple[str, str, str]:
    """The key of a build in _LIBS / _FAILED: w8's one build serves both scale modes."""
    return (fmt, "*" if op == "w8" else mode, op)


def library(fmt: str, mode: str, op: str = "forward") -> ctypes.CDLL | None:
    """The loaded design (g) library for (fmt, mode, op): ``MXMOE_CUTLASS_WQ_LIB`` (forward)
    / ``MXMOE_CUTLASS_WQ_DGRAD_LIB`` (dgrad) / ``MXMOE_CUTLASS_W8_LIB`` (w8, design (b)) if
    set, else the cached build (compiled on first use; a cached file that does not load is
    deleted and built once more). None if that fails (warned once per format, mode and op,
    once per format for w8; design (a) runs instead)."""
    key = _key(fmt, mode, op)
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
    if fmt not in FORMATS or mode not in SCALE_MODES or op not in OPS or _key(fmt, mode, op) in _FAILED:
        return False
    (T, K), (E, N, _) = x_shape, w_shape
    limit = MAX_TOKENS_PER_EXPERT_DGRAD if op == "dgrad" else MAX_TOKENS_PER_EXPERT
    if min(T, K, N, E) <= 0 or K % _ALIGN or N % _ALIGN or w_ptr % 16 or T > limit * E:
        return False
    return tuple(capability) == (9, 0) and (seen or not capturing)


def applies(x: Tensor, w: Tensor, offsets: Tensor, recipe, op: str = "forward") -> bool:
    """Whether design (g) can run ``op`` of ``mx_grouped_mm``: the forward of x (T, K) and w
    (E, N, K), or the dgrad of dout (T, N) (``x`` then) and w (the rule: :func:`eligible`).
    Cheap: no build, no host synchronization."""
    if not (x.is_cuda and recipe.quantize):
        return False
    seen = _shape_key(x.device, recipe, op, w.shape, offsets.dtype) in _SHAPES
    return eligible((x.shape[0], w.shape[2]), tuple(w.shape), x.dtype == w.dtype == torch.bfloat16,
                    x.is_contiguous() and w.is_contiguous(), w.data_ptr(), recipe,
                    torch.cuda.get_device_capability(x.device), torch.cuda.is_current_stream_capturing(), seen, op)


def grouped_mm_nt_wq(xq: Tensor, w: Tensor, offsets: Tensor, recipe) -> Tensor | None:
    """out[t] = xq[t] @ Q(w[e])^T for the rows t of expert e, with Q the recipe's MX
    quantize-dequantize of w along K, done inside the GEMM (design (g)); zero rows past
    offsets[-1].

    Args:
        xq: (T, K) bfloat16 contiguous, the tokens (already quantize-dequantized along K).
        w: (E, N, K) bfloat16 contiguous, the raw expert weights.
        offsets: (E,) int32 / int64 cumulative end rows on xq's device (non-decreasing,
            offsets[-1] <= T; not checked here: ``mx_grouped_mm`` documents the contract).
        recipe: an MXFP8 :class:`~mxmoe.recipe.Recipe` for which :func:`applies` held.

    Returns:
        (T, N) bfloat16 (float32 accumulation), bit-equal to design (a)'s
        ``grouped_mm_nt(xq, fake_quantize(w, recipe, dim=2), offsets)``; None if the library
        is not available (design (a) should run).

    A failure of the library at run time (its allocation, the launch) turns design (g) off
    for the (format, mode) with one warning and returns None.
    """
    return _run("forward", xq, w, offsets, recipe)


def weight_copy_w8(w: Tensor, recipe, op: str) -> tuple[Tensor, Tensor]:
    """Design (b)'s weight operand for ``op`` ("forward": blocks along K; "dgrad": along N,
    the codes transposed): codes (E, Nout, Kc) FP8 (K-major for the GEMM: Nout = N, Kc = K
    for the forward, Nout = K, Kc = N for the dgrad) and scales (E, Kc / 64, Nout) uint16,
    each the E8M0 bytes of a row's two 32-element blocks of one 64-element k-tile (the first
    in the low byte). The library's quantizers (``quantize_rowwise`` / ``quantize_colwise``),
    so the codes and scales are those of design (a)'s pass, bit for bit.

    Args:
        w: (E, N, K) float (bf16 on the GPU), any layout.
        recipe: an MXFP8 :class:`~mxmoe.recipe.Recipe` (its element format and scale mode).
        op: "forward" or "dgrad".

    Raises:
        ValueError: an unknown op, w not 3-D, or its contraction (K for the forward, N for
            the dgrad) not a positive multiple of 64.
    """
    from .quantize import quantize_colwise, quantize_rowwise

    if op not in ("forward", "dgrad"):
        raise ValueError(f"op must be 'forward' (blocks along K) or 'dgrad' (along N), got {op!r}")
    if w.dim() != 3:
        raise ValueError(f"w must be (E, N, K), got shape {tuple(w.shape)}")
    kc = w.shape[2] if op == "forward" else w.shape[1]
    if kc <= 0 or kc % 64:
        raise ValueError(f"the {op}'s contraction ({'K' if op == 'forward' else 'N'} = {kc}) must be a positive "
                         f"multiple of 64 (design (b) packs the scales of a 64-element k-tile in one uint16)")
    fmt, mode = recipe.fmt.value, recipe.scale_mode.value
    if op == "forward":
        codes, s = quantize_rowwise(w, fmt, mode)  # (E, N, K), (E, N, K / 32)
    else:
        codes, s = quantize_colwise(w, fmt, mode)  # (E, K, N), (E, K, N / 32)
    s16 = s.view(torch.uint8).view(torch.uint16)  # (E, Nout, Kc / 64): pairs of blocks, the first in the low byte
    return codes, s16.transpose(1, 2).contiguous()


def grouped_mm_w8(aq: Tensor, codes: Tensor, scales: Tensor, offsets: Tensor, recipe) -> Tensor | None:
    """out[t] = aq[t] @ dequantize(codes[e], scales[e])^T for the rows t of expert e
    (design (b) in CUTLASS: the FP8 codes and E8M0 scales of :func:`weight_copy_w8` read from
    memory and converted in registers); zero rows past offsets[-1]. aq (T, Kc) bfloat16
    contiguous; returns (T, Nout) bfloat16, or None if the library is not available.

    Raises:
        ValueError: operands not as :func:`weight_copy_w8` makes them for ``recipe`` and
            ``aq``: aq (T, Kc) bfloat16 contiguous, codes (E, Nout, Kc) contiguous in the
            recipe's FP8 dtype, scales (E, Kc / 64, Nout) uint16 contiguous, Kc a positive
            multiple of 64, Nout a multiple of 8, all on one CUDA device; or under CUDA-graph
            capture before the shape ran once (its first call allocates).
    """
    from .quantize import FP8_FORMATS

    fp8 = FP8_FORMATS.get(recipe.fmt.value, (None, None))[1]
    if codes.dim() != 3 or aq.dim() != 2:
        raise ValueError(f"expected aq (T, Kc) and codes (E, Nout, Kc), got {tuple(aq.shape)} and {tuple(codes.shape)}")
    E, nout, kc = codes.shape
    problems = []
    if aq.dtype != torch.bfloat16 or not aq.is_contiguous() or aq.shape[1] != kc:
        problems.append(f"aq must be bfloat16 contiguous (T, {kc}), got {aq.dtype} {tuple(aq.shape)}")
    if codes.dtype != fp8 or not codes.is_contiguous():
        problems.append(f"codes must be {fp8} contiguous for {recipe.fmt.value}, got {codes.dtype}")
    if scales.dtype != torch.uint16 or not scales.is_contiguous() or tuple(scales.shape) != (E, kc // 64, nout):
        problems.append(f"scales must be uint16 contiguous ({E}, {kc // 64}, {nout}), got {scales.dtype} "
                        f"{tuple(scales.shape)}")
    if kc <= 0 or kc % 64 or nout % 8:
        problems.append(f"Kc = {kc} must be a positive multiple of 64 and Nout = {nout} a multiple of 8")
    if not (aq.is_cuda and aq.device == codes.device == scales.device == offsets.device):
        problems.append("aq, codes, scales and offsets must be on one CUDA device")
    if problems:
        raise ValueError("grouped_mm_w8: " + "; ".join(problems))
    if aq.shape[0] == 0 or E == 0:
        return torch.zeros(aq.shape[0], nout, device=aq.device, dtype=torch.bfloat16)
    capturing = torch.cuda.is_current_stream_capturing()
    if capturing and _shape_key(aq.device, recipe, "w8", codes.shape, offsets.dtype) not in _SHAPES:
        raise ValueError("grouped_mm_w8: run this shape once before CUDA-graph capture (its first call allocates)")
    return _run("w8", aq, codes, offsets, recipe, scales)


def grouped_mm_nn_wq(dyq: Tensor, w: Tensor, offsets: Tensor, recipe) -> Tensor | None:
    """The dgrad: dx[t] = dyq[t] @ Q_N(w[e]) for the rows t of expert e, with Q_N the
    recipe's MX quantize-dequantize of w along N (blocks of 32 along N for each k), done
    inside the GEMM (design (g), the ``WT`` build); zero rows past offsets[-1].

    Args:
        dyq: (T, N) bfloat16 contiguous, the output gradient (already quantize-dequantized
            along N).
        w: (E, N, K) bfloat16 contiguous, the raw expert weights.
        offsets: (E,) int32 / int64 cumulative end rows (as for :func:`grouped_mm_nt_wq`).
        recipe: an MXFP8 :class:`~mxmoe.recipe.Recipe` for which ``applies(dyq, w, offsets,
            recipe, "dgrad")`` held.

    Returns:
        (T, K) bfloat16 (float32 accumulation), equal to design (a)'s
        ``grouped_mm_nn(dyq, fake_quantize(w, recipe, dim=1), offsets)`` (checked bit for bit
        on the H200: benchmarks/check_grouped_wq.py); None if the library is not available.

    Failures: as :func:`grouped_mm_nt_wq` (design (g)'s dgrad off, one warning, None).
    """
    return _run("dgrad", dyq, w, offsets, recipe)


def _run(op: str, a: Tensor, w: Tensor, offsets: Tensor, recipe, scales: Tensor | None = None) -> Tensor | None:
    """Launch ``op`` on tokens ``a`` (T, contraction) and w (E, N, K) (w8: the codes (E,
    Nout, Kc) and ``scales``): the C entry's weight operand is Nout x Kc per expert (forward:
    w_e, N x K; dgrad: w_e^T, K x N, the same memory)."""
    fmt, mode = recipe.fmt.value, recipe.scale_mode.value
    lib = library(fmt, mode, op)
    if lib is None:
        return None
    from ..ops.gemm import zero_rows_past_end
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
        ptrs = [t.data_ptr() for t in group_tables(offsets, w_op, a, out, scales)]  # the C entry's order
        for attempt in range(2):
            rc = getattr(lib, symbol(fmt, mode, _ENTRY[op], op))(E, nout, kc, *ptrs, workspace.data_ptr(),
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
        _give_up(_key(fmt, mode, op), f"code {rc}, {what}, for E={E} N={N} K={K}")
        return None
    _SHAPES.add(_shape_key(a.device, recipe, op, w.shape, offsets.dtype))
    return zero_rows_past_end(out, offsets)


def _shape_key(device: torch.device, recipe, op: str, w_shape, offsets_dtype: torch.dtype) -> tuple:
    """The key of _SHAPES: a (device, format, mode, op, weight operand shape, offsets dtype)
    whose first call has run: the C entry's allocations (per device, op and shape) and the
    argument tables' Triton kernel (compiled per offsets dtype; no other specialization:
    kernels/group_tables.py) are then in place for a CUDA-graph capture."""
    dev = device.index if device.index is not None else torch.cuda.current_device()
    return (dev, recipe.fmt.value, recipe.scale_mode.value, op, *tuple(w_shape), str(offsets_dtype))
