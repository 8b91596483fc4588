"""The shared harness of the benchmark scripts: timing, environment record, tables, JSON.

Every script in ``benchmarks/`` times its subject and a baseline in the same process with
:func:`bench`, prints one Markdown table (:func:`standard_table` or :func:`format_table`)
and writes ``<results dir>/<subject>.json`` (:func:`write_results`) holding the
:func:`environment` record, the settings and every row.

Timing (:func:`bench`), in the style of ``triton.testing.do_bench``: one untimed call
(compilation, allocation), an estimate of the call's time from 5 calls, ``warmup_ms`` of
warm-up calls, then ``rep_ms`` of timed calls (at least 5); the result is the median in
seconds. Two modes:

- ``"eager"``: each call bracketed by a pair of CUDA events (host launch cost that the GPU
  waits for is included, as in ``do_bench``);
- ``"graph"``: the calls captured once into a CUDA graph (several per graph, so that a
  replay takes about a millisecond or more), each replay bracketed by CUDA events, the
  replay time divided by the calls in it: the device time alone, as the trainer runs its
  step (it replays the step from a CUDA graph). A function that cannot be captured is
  timed eagerly instead, with a note on stdout and in :data:`NOTES`.

Inputs that fit in the L2 cache (60 MB on the H200) would be read from the cache on every
call after the first; :func:`rotating` makes enough copies of such an input set that the
calls cycle through more than 3 times the L2 size, and :func:`bench` takes the copies as
``arg_sets`` (one per call, in turn).

With ``--smoke`` (CPU, tiny shapes) :func:`bench` runs the function once and returns the
wall time of that call: the tables then check that every code path runs, they are not
measurements (the table title says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DEFAULT_RESULTS_DIR = BENCH_DIR / "results"
TIMING_MODES = ("eager", "graph")
# MoE layer shapes of real models: name -> (D model width, F expert width, E experts, top-k, T tokens)
MOE_MODELS = {
    "qwen3-235b-a22b": (4096, 1536, 128, 8, 16384),
    "deepseek-v3": (7168, 2048, 256, 8, 16384),
    "mixtral-8x7b": (4096, 14336, 8, 2, 8192),
}
QUICK_MOE_MODELS = ("qwen3-235b-a22b",)  # what --quick runs


def add_models_arg(p: argparse.ArgumentParser) -> None:
    """``--models``: a comma-separated subset of :data:`MOE_MODELS`."""
    p.add_argument("--models", default=None, help=f"comma-separated, from {', '.join(MOE_MODELS)} "
                                                  f"(default: all; --quick: {', '.join(QUICK_MOE_MODELS)})")


def selected_models(p: argparse.ArgumentParser, args: argparse.Namespace,
                    smoke_model: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The shapes ``--models`` / ``--quick`` / ``--smoke`` select (``p.error`` on an unknown name)."""
    if args.smoke:
        return dict(smoke_model)
    names = args.models.split(",") if args.models else list(QUICK_MOE_MODELS if args.quick else MOE_MODELS)
    unknown = [n for n in names if n not in MOE_MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; use {', '.join(MOE_MODELS)}")
    return {n: MOE_MODELS[n] for n in names}
NOTES: list[str] = []  # fallbacks that happened during the run (graph capture failed, ...)


# ---- command line -------------------------------------------------------------------------

def interpret_triton_if_smoke(argv: Sequence[str] | None = None) -> bool:
    """Set ``TRITON_INTERPRET=1`` when ``--smoke`` is on the command line, so that the Triton
    kernels run on CPU tensors in the interpreter. Call it before anything imports triton
    (the scripts call it before importing mxmoe). Returns whether ``--smoke`` was given."""
    smoke = "--smoke" in (sys.argv[1:] if argv is None else argv)
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return smoke


def add_common_args(p: argparse.ArgumentParser, timing: str | None = "eager") -> None:
    """The flags every benchmark script takes: ``--smoke``, ``--quick``, ``--results-dir``,
    ``--no-json``, and for scripts timed by :func:`bench` ``--timing``, ``--warmup-ms``,
    ``--rep-ms``.

    Args:
        p: the script's parser.
        timing: the script's default timing mode ("eager" or "graph"); None for a script
            that times whole training steps with its own clock (no timing flags).

    Raises:
        ValueError: unknown timing mode.
    """
    if timing is not None and timing not in TIMING_MODES:
        raise ValueError(f"unknown timing mode {timing!r}; use one of {TIMING_MODES} or None")
    g = p.add_argument_group("harness")
    g.add_argument("--smoke", action="store_true",
                   help="run every code path once at tiny shapes on the CPU (Triton interpreter); no timing claims")
    g.add_argument("--quick", action="store_true",
                   help="fewer shapes and repetitions (what benchmarks/run_h200.sh runs)")
    g.add_argument("--results-dir", default=None,
                   help=f"where <subject>.json goes (default: {DEFAULT_RESULTS_DIR.relative_to(REPO_ROOT)}/; "
                        "with --smoke nothing is written unless this is given)")
    g.add_argument("--no-json", action="store_true", help="write no JSON file")
    if timing is None:
        p.set_defaults(timing=None, warmup_ms=None, rep_ms=None)
        return
    g.add_argument("--timing", default=timing, choices=TIMING_MODES,
                   help="eager: CUDA events around each call; graph: CUDA-graph replay, device time only "
                        "(default: %(default)s)")
    g.add_argument("--warmup-ms", type=float, default=25.0, help="warm-up time per measurement (default: %(default)s)")
    g.add_argument("--rep-ms", type=float, default=100.0,
                   help="timed time per measurement; --quick halves it (default: %(default)s)")


def device_for(args: argparse.Namespace) -> torch.device:
    """The CPU under ``--smoke``, else the current CUDA device; exits with status 2 and a
    message when there is no CUDA device."""
    if args.smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: the benchmarks time GPU kernels; run with --smoke to check the script "
                         "on the CPU")
    return torch.device("cuda", torch.cuda.current_device())


def rep_ms(args: argparse.Namespace) -> float:
    """The timed milliseconds per measurement: ``--rep-ms``, halved by ``--quick``."""
    return args.rep_ms / 2 if args.quick else args.rep_ms


# ---- environment --------------------------------------------------------------------------

def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str:
    """``$COMMIT`` if set, else ``git rev-parse --short HEAD`` of the repository, else
    "unknown" (the working tree copied to a GPU machine may come without ``.git``, or with
    the ``.git`` of an older commit: the caller names the commit it copied)."""
    if os.environ.get("COMMIT", "").strip():
        return os.environ["COMMIT"].strip()
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def environment() -> dict[str, Any]:
    """The run's environment: GPU name and count, CUDA version, Python, torch, triton,
    transformers and sonic-moe versions (None when not installed), the git commit and the
    UTC time. Reads package metadata only (imports nothing new)."""
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "sonic-moe": _version("sonic-moe"),
        "commit": git_commit(),
        "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def environment_line(env: dict[str, Any]) -> str:
    """One line for the top of a table: GPU, versions, commit."""
    parts = [env["gpu"], f"torch {env['torch']}", f"triton {env['triton']}"]
    if env.get("transformers"):
        parts.append(f"transformers {env['transformers']}")
    if env.get("sonic-moe"):
        parts.append(f"sonic-moe {env['sonic-moe']}")
    parts.append(f"commit {env['commit']}")
    return " | ".join(parts)


# ---- timing -------------------------------------------------------------------------------

def l2_bytes() -> int:
    """The current CUDA device's L2 cache size in bytes (50 MB where torch does not say;
    the H200 has 60 MB)."""
    if not torch.cuda.is_available():
        return 50 * 2**20
    return int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)) \
        or 50 * 2**20


def rotating(make: Callable[[], tuple], nbytes: int, smoke: bool = False, max_sets: int = 64) -> list[tuple]:
    """Argument sets for :func:`bench`: one from ``make()`` if it takes ``nbytes`` >= 3 x L2,
    else ``ceil(3 x L2 / nbytes)`` of them (at most ``max_sets``), so that a call never finds
    its inputs in the cache from the calls before it.

    Args:
        make: returns one argument tuple (fresh tensors each call).
        nbytes: bytes of the inputs one call reads.
        smoke: one set only (CPU).
        max_sets: cap on the copies.

    Raises:
        ValueError: ``nbytes`` is negative.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if smoke:
        return [make()]
    n = 1 if nbytes >= 3 * l2_bytes() else min(max_sets, math.ceil(3 * l2_bytes() / max(nbytes, 1)))
    return [make() for _ in range(n)]


def _median_event_ms(pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> float:
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs)


def _events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def bench(fn: Callable[..., Any], arg_sets: Sequence[tuple] | None = None, *, mode: str = "eager",
          warmup_ms: float = 25.0, rep_ms: float = 100.0, smoke: bool = False, label: str = "") -> float:
    """Median seconds of one call of ``fn`` (the module docstring says how).

    Args:
        fn: the work; called as ``fn(*arg_sets[i % len(arg_sets)])``.
        arg_sets: argument tuples cycled through (:func:`rotating`); default one empty tuple.
        mode: "eager" or "graph".
        warmup_ms, rep_ms: warm-up and timed milliseconds (at least 5 timed calls or replays).
        smoke: call once, return that call's wall time (not a measurement).
        label: names the measurement in a fallback note.

    Returns:
        Seconds per call (median).

    Raises:
        ValueError: unknown mode, or an empty ``arg_sets``.
    """
    if mode not in TIMING_MODES:
        raise ValueError(f"unknown timing mode {mode!r}; use one of {TIMING_MODES}")
    sets = list(arg_sets) if arg_sets is not None else [()]
    if not sets:
        raise ValueError("arg_sets is empty: give at least one argument tuple")
    if smoke:
        t0 = time.perf_counter()
        fn(*sets[0])
        return time.perf_counter() - t0
    fn(*sets[0])  # compile, allocate, build
    torch.cuda.synchronize()
    start, end = _events()
    start.record()
    for i in range(5):
        fn(*sets[i % len(sets)])
    end.record()
    torch.cuda.synchronize()
    est_ms = max(start.elapsed_time(end) / 5, 1e-3)
    if mode == "graph":
        try:
            return _bench_graph(fn, sets, est_ms, warmup_ms, rep_ms)
        except Exception as err:  # noqa: BLE001 - any capture failure: time eagerly, say so
            torch.cuda.synchronize()
            note = f"{label or getattr(fn, '__name__', 'fn')}: CUDA-graph capture failed " \
                   f"({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}); timed eagerly"
            NOTES.append(note)
            print(f"note: {note}", flush=True)
    for i in range(max(1, int(warmup_ms / est_ms))):
        fn(*sets[i % len(sets)])
    n_rep = max(5, min(10000, int(rep_ms / est_ms)))
    pairs = [_events() for _ in range(n_rep)]
    for i, (a, b) in enumerate(pairs):
        a.record()
        fn(*sets[i % len(sets)])
        b.record()
    return _median_event_ms(pairs) / 1e3


def _bench_graph(fn: Callable[..., Any], sets: list[tuple], est_ms: float, warmup_ms: float,
                 rep_ms: float) -> float:
    """Capture ``calls`` calls (a multiple of len(sets), about 1 ms of work or more, at most
    256 and at least one pass over the sets) into one CUDA graph; median replay time / calls."""
    per_pass = len(sets)
    passes = max(1, min(256 // per_pass or 1, math.ceil(1.0 / (est_ms * per_pass))))
    calls = passes * per_pass
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graphs asks
        for args in sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*sets[i % per_pass])
    replay_ms = est_ms * calls
    for _ in range(max(1, int(warmup_ms / replay_ms))):
        graph.replay()
    n_rep = max(5, min(1000, int(rep_ms / replay_ms)))
    pairs = [_events() for _ in range(n_rep)]
    for a, b in pairs:
        a.record()
        graph.replay()
        b.record()
    ms = _median_event_ms(pairs)
    del graph
    return ms / calls / 1e3


# ---- rows and tables ----------------------------------------------------------------------

@dataclass
class Row:
    """One measurement against its baseline.

    Attributes:
        case: what ran (e.g. "Qwen3-235B-A22B up, forward").
        shape: the operands' shapes, as text.
        us: microseconds per call (None: not run; ``note`` says why).
        baseline_us: the baseline's microseconds on the same work (None: none).
        flops: floating-point operations of one call (gives TFLOP/s), or
        nbytes: bytes read + written by one call (gives TB/s).
        note: anything the reader needs (which implementation ran, why a value is missing).
        extra: further figures for the JSON file.
    """

    case: str
    shape: str
    us: float | None
    baseline_us: float | None = None
    flops: float | None = None
    nbytes: float | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """baseline time / time: above 1 is faster than the baseline."""
        if self.us is None or self.baseline_us is None or self.us <= 0:
            return None
        return self.baseline_us / self.us

    @property
    def rate(self) -> float | None:
        """TFLOP/s when ``flops`` is set, else TB/s when ``nbytes`` is set, else None."""
        if self.us is None or self.us <= 0:
            return None
        if self.flops is not None:
            return self.flops / (self.us * 1e-6) / 1e12
        if self.nbytes is not None:
            return self.nbytes / (self.us * 1e-6) / 1e12
        return None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ratio"] = self.ratio
        d["rate"] = self.rate
        return d


def geomean(values: Iterable[float | None]) -> float | None:
    """Geometric mean of the positive values (None and non-positive ones skipped); None if
    there are none."""
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    """``value`` formatted with ``spec`` and ``suffix``; "-" for None."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A Markdown table (one header row, a separator, the body rows)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def standard_table(rows: Sequence[Row], baseline: str, rate_unit: str = "TFLOP/s", ratio: str = "x") -> str:
    """The table ``case | shape | us | <rate_unit> | baseline us | x baseline | note`` with a
    geometric-mean row of the ratios.

    Args:
        rows: the measurements.
        baseline: the baseline's name, for the column header (e.g. "bf16 torch._grouped_mm").
        rate_unit: "TFLOP/s" or "TB/s" (the rows carry ``flops`` or ``nbytes``).
        ratio: "x" prints baseline time / time as "0.87x"; "%" as "87%" (for "% of copy").

    Raises:
        ValueError: unknown ``ratio`` style.
    """
    if ratio not in ("x", "%"):
        raise ValueError(f"ratio must be 'x' or '%', got {ratio!r}")

    def show(r: float | None) -> str:
        if r is None:
            return "-"
        return f"{r:.3f}x" if ratio == "x" else f"{100 * r:.1f}%"

    head = ["case", "shape", "us", rate_unit, f"{baseline} us", f"{'x' if ratio == 'x' else '% of'} {baseline}",
            "note"]
    body = [[r.case, r.shape, fmt(r.us), fmt(r.rate, ".2f" if rate_unit == "TB/s" else ".0f"), fmt(r.baseline_us),
             show(r.ratio), r.note] for r in rows]
    body.append(["geometric mean", "", "", "", "", show(geomean(r.ratio for r in rows)), ""])
    return format_table(head, body)


def title(subject: str, env: dict[str, Any], args: argparse.Namespace, timing: str | None = None) -> str:
    """The heading printed above a script's tables: subject, environment, timing (``timing``,
    or the :func:`bench` settings of the flags), and a warning under ``--smoke``."""
    if args.smoke:
        mode = "smoke run on the CPU: one untimed call per path, NOT measurements"
    else:
        mode = timing or f"timing: {args.timing}, median of {rep_ms(args):g} ms after {args.warmup_ms:g} ms warm-up"
        mode += " (--quick)" if args.quick else ""
    return f"## {subject}\n{environment_line(env)}\n{mode}\n"


# ---- results ------------------------------------------------------------------------------

def results_path(subject: str, args: argparse.Namespace) -> Path | None:
    """``<--results-dir or benchmarks/results>/<subject>.json``; None under ``--no-json``,
    and under ``--smoke`` without ``--results-dir`` (a smoke run leaves no files behind)."""
    if args.no_json or (args.smoke and args.results_dir is None):
        return None
    return Path(args.results_dir or DEFAULT_RESULTS_DIR) / f"{subject}.json"


def write_results(subject: str, args: argparse.Namespace, env: dict[str, Any], rows: Sequence[Row] = (),
                  extra: dict[str, Any] | None = None) -> Path | None:
    """Write the JSON result file (:func:`results_path`) and print its path.

    The file holds ``subject``, ``smoke``, ``env`` (:func:`environment`), ``settings`` (the
    parsed flags), ``rows`` (each :class:`Row` with its ratio and rate), ``geomean_ratio``,
    ``notes`` (timing fallbacks) and the script's ``extra`` fields.

    Returns:
        The path written, or None when nothing was written.
    """
    path = results_path(subject, args)
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"subject": subject, "smoke": bool(args.smoke), "env": env, "settings": vars(args),
           "rows": [r.to_dict() for r in rows], "geomean_ratio": geomean(r.ratio for r in rows),
           "notes": list(NOTES)}
    doc.update(extra or {})
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def free_memory() -> None:
    """Synchronize and return cached CUDA memory (between cases of different sizes)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
