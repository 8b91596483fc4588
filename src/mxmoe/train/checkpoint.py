"""Atomic checkpoints, their one loader, and append-only metrics files.

A checkpoint is written to a temporary file in the same directory, flushed to disk, then
renamed over ``checkpoint.pt`` (``os.replace`` is atomic on POSIX and Windows): a crash at
any point leaves either the previous checkpoint or the new one, never a torn file.

:func:`load_checkpoint` reads one with ``torch.load(weights_only=True)``: a file that would
need the full pickle (one that could run code when loaded) is refused.

Content hash: :func:`save_checkpoint` stores, under ``"checksums"``, the SHA-256 of each
tensor (its dtype, shape and bytes) by its path in the state (``model/embed``,
``optimizer/state/0/exp_avg``) and one SHA-256 of every other value (step, settings,
hyperparameters) with its path. :func:`load_checkpoint` recomputes them and refuses a file
whose content differs (flipped bytes, a tensor or value edited after writing). A checkpoint
without ``"checksums"`` (written before they were stored) loads unchecked.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import stat
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch

CHECKPOINT_NAME = "checkpoint.pt"
CHECKSUMS_KEY = "checksums"
CHECKSUM_ALGORITHM = "sha256"
_OTHER_VALUES = "values other than tensors"  # the key of the one hash of all non-tensor leaves


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_regular_file(path: str | os.PathLike, what: str) -> None:
    """Refuse a path that exists but is not a regular file (following symlinks): reading a
    FIFO or a device may never end, and replacing one (``os.replace``) would swap a
    system file such as /dev/null for a plain file.

    Args:
        path: the path to read or replace; a missing path passes (the caller decides).
        what: what the file should be, for the message (e.g. "a checkpoint").

    Raises:
        ValueError: ``path`` exists and is a directory, FIFO, device or socket, naming it.
    """
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if not stat.S_ISREG(mode):
        raise ValueError(f"{str(path)!r} is {_file_kind(mode)}, not {what}; mxmoe reads and replaces only regular "
                         f"files: pass the path of a file")


# how torch's zip writer (PyTorchStreamWriter) says that a write to the file failed
_TORCH_WRITE_FAILED = re.compile(r"unexpected pos|file write failed|failed writing", re.IGNORECASE)


def atomic_write_bytes(path: Path, write) -> None:
    """Create ``path`` atomically: ``write(fileobj)`` fills a temp file beside it, which is
    fsynced and renamed over ``path``. The temp file is removed if ``write`` fails.

    Raises:
        OSError: the directory cannot be created or written, or the disk is full: re-raised
            with ``filename`` = ``path`` (the destination the user named, not the temp
            file's name) and the same errno and reason; ``path`` is left as it was.
        ValueError: ``path`` exists and is not a regular file (a directory, FIFO, device or
            socket: :func:`check_regular_file`), which is left as it is.
    """
    path = Path(path)
    check_regular_file(path, "a file mxmoe may replace")
    try:
        _atomic_write(path, write)
    except OSError as e:
        if isinstance(e.filename, (str, os.PathLike)) and Path(e.filename) == path:
            raise
        raise OSError(e.errno, e.strerror or " ".join(str(e).split()), str(path)) from e
    except RuntimeError as e:
        # torch.save's zip writer reports a failed write (disk full, I/O error) as a
        # RuntimeError ("unexpected pos 1024 vs 918", "file write failed") with no path
        if not _TORCH_WRITE_FAILED.search(str(e)):
            raise
        raise OSError(errno.EIO, "the write failed (disk full or an I/O error)", str(path)) from e


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual mode
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    h = hashlib.sha256(f"{t.dtype}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def state_checksums(state: Any) -> dict[str, Any]:
    """The content hashes of a checkpoint state (a dict of dicts, lists, tuples, tensors and
    plain values; ``"checksums"`` itself left out): ``{"algorithm": "sha256", "tensors":
    {path: hex digest of dtype, shape and bytes}, "values other than tensors": hex digest of
    every other leaf's path and repr}``. Paths join keys and indices with ``/``."""
    tensors: dict[str, str] = {}
    other = hashlib.sha256()

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            tensors[path] = _tensor_digest(obj)
            other.update(f"{path}:shape={tuple(obj.shape)}\n".encode())
        elif isinstance(obj, dict):
            for k, v in obj.items():
                if not (path == "" and k == CHECKSUMS_KEY):
                    walk(v, f"{path}/{k}" if path else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}/{i}")
        else:
            other.update(f"{path}={obj!r}\n".encode())

    walk(state, "")
    return {"algorithm": CHECKSUM_ALGORITHM, "tensors": tensors, _OTHER_VALUES: other.hexdigest()}


def save_checkpoint(out_dir: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` (torch-serializable) to ``out_dir/checkpoint.pt`` atomically, with its
    content hashes under ``"checksums"`` (:func:`state_checksums`; a ``"checksums"`` entry
    of ``state`` is replaced). Temp files of earlier writes that were killed (SIGKILL leaves
    them; a checkpoint can be gigabytes) are removed first: one run writes to a directory at
    a time."""
    path = Path(out_dir) / CHECKPOINT_NAME
    for stale in Path(out_dir).glob(f".{CHECKPOINT_NAME}.*.tmp"):
        stale.unlink(missing_ok=True)
    state = {**{k: v for k, v in state.items() if k != CHECKSUMS_KEY}, CHECKSUMS_KEY: state_checksums(state)}
    atomic_write_bytes(path, lambda f: torch.save(state, f))
    return path


def changed_tensors(stored: dict[str, str], now: dict[str, str]) -> list[str]:
    """The names whose digest in ``now`` (:func:`state_checksums`' ``"tensors"``) differs
    from ``stored``, a tensor present in only one of them included; sorted."""
    return sorted(k for k in set(now) | set(stored) if now.get(k) != stored.get(k))


def _verify_checksums(path: Path, ckpt: dict[str, Any]) -> None:
    """Raise a one-line ValueError naming ``path`` and the first part whose content hash
    differs from the one stored in it."""
    stored = ckpt.pop(CHECKSUMS_KEY)
    damaged = (f"{str(path)!r} is damaged: its content does not match the checksums stored in it "
               f"(flipped bytes, or edited after it was written)")
    if not isinstance(stored, dict) or stored.get("algorithm") != CHECKSUM_ALGORITHM \
            or not isinstance(stored.get("tensors"), dict):
        raise ValueError(f"{damaged}: its checksums entry is malformed; use an earlier checkpoint or start anew")
    now = state_checksums(ckpt)
    changed = changed_tensors(stored["tensors"], now["tensors"])
    if changed:
        raise ValueError(f"{damaged}: tensor {changed[0]} differs; use an earlier checkpoint or start anew")
    if now[_OTHER_VALUES] != stored.get(_OTHER_VALUES):
        raise ValueError(f"{damaged}: a value other than a tensor (step, settings, shapes) differs; use an earlier "
                         f"checkpoint or start anew")


# what torch's weights_only unpickler says when a file asks for a global it does not allow
# (a class, or a function that a ``__reduce__`` payload would call): "Unsupported global:
# GLOBAL io.open was not an allowed global", "unsupported GLOBAL os.system whose module os
# is blocked", "Trying to call reduce for unrecognized function"
_REFUSED_GLOBAL = re.compile(r"GLOBAL|allowed global|unrecognized function|Unsupported class", re.IGNORECASE)


def _weights_only_error(path: Path, message: str) -> ValueError:
    """A one-line ValueError for a file that ``torch.load(weights_only=True)`` stopped at:
    the refusal when it asks for a Python global (naming the first when torch says which),
    else (a byte the unpickler does not accept: not a torch checkpoint) "not readable"."""
    detail = " ".join(message.split("WeightsUnpickler error:", 1)[-1].split())
    if not _REFUSED_GLOBAL.search(message):
        return ValueError(f"{str(path)!r} is not a readable torch checkpoint (the weights_only unpickler stops: "
                          f"{detail[:200]})")
    found = re.search(r"GLOBAL ([\w.]+)", message)
    first = f" (the first: {found.group(1)})" if found else ""
    return ValueError(f"refusing to load {str(path)!r}: it contains Python objects other than tensors and plain "
                      f"data (weights_only){first}; mxmoe checkpoints hold only tensors, dicts, lists, tuples, "
                      f"strings, numbers, booleans and None, so this file was not written by mxmoe or was altered, "
                      f"and unpickling it could run code")


def _one_line(e: BaseException) -> str:
    """``Type: first sentence of the message`` on one line, at most 200 characters."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: " + text.split(". ", 1)[0][:200]


def resolve_checkpoint_path(path: str | os.PathLike) -> Path:
    """The checkpoint file that ``path`` names: ``path/checkpoint.pt`` for a run directory
    (existing, or missing and named without a file suffix such as ``.pt`` or
    ``.safetensors``), else ``path``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: an empty path (not taken for the current directory); the file is a
            directory (a ``checkpoint.pt`` that is a directory), a FIFO, a device or a socket.
    """
    if not str(path).strip():  # Path("") is the current directory: never read a checkpoint from it by accident
        raise ValueError("the checkpoint path is empty; pass a run directory, its checkpoint.pt or an mxmoe export")
    path = Path(path)
    if path.is_dir():
        inner = path / CHECKPOINT_NAME
        if inner.exists() or path.name != CHECKPOINT_NAME:
            path = inner
    elif not path.exists() and not path.suffix:
        path = path / CHECKPOINT_NAME
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}: it does not exist; pass a run directory, its "
                                f"{CHECKPOINT_NAME} or (to eval) an mxmoe export")
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a directory, not a checkpoint file; pass a run directory holding a "
                         f"{CHECKPOINT_NAME} file, or the file itself")
    check_regular_file(path, "a checkpoint file")
    return path


def check_training_checkpoint(path: Path, ckpt: dict[str, Any]) -> None:
    """Refuse (one-line ValueError naming ``path``) a loaded checkpoint that does not have
    the structure the trainer writes: ``model`` a dict of tensors by name, ``optimizer``
    a dict (a list of dicts, one per rank, for an expert-parallel run), ``train_config`` a
    dict with a ``model`` dict. Their values are checked against the model by the caller."""
    problems = []
    model = ckpt.get("model")
    if not isinstance(model, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in model.items()):
        problems.append("'model' is not a dict of tensors")
    opt = ckpt.get("optimizer")
    if not (isinstance(opt, dict) or isinstance(opt, list) and all(isinstance(o, dict) for o in opt)):
        problems.append("'optimizer' is not an optimizer state dict")
    cfg = ckpt.get("train_config")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        problems.append("'train_config' is not a dict of settings with a 'model' dict")
    if problems:
        raise ValueError(f"{str(path)!r} is not an mxmoe training checkpoint: {'; '.join(problems)}")


def load_checkpoint(path: str | os.PathLike, map_location="cpu", *, mmap: bool = False,
                    verify: bool = True) -> dict[str, Any]:
    """Load an mxmoe checkpoint without running any code from it: the one loader of
    ``mxmoe train --resume``, ``mxmoe eval``, ``mxmoe export`` and ``mxmoe compare``.

    The file is read with ``torch.load(weights_only=True)`` (PyTorch's restricted
    unpickler, see the ``torch.load`` documentation): it builds tensors, dicts (also
    ``collections.OrderedDict``), lists, tuples, sets, str, bytes, int, float, bool,
    None and a few torch types (dtypes, ``torch.Size``), and stops at the first other
    global (a class, or a function such as ``open`` or ``os.system`` that a
    ``__reduce__`` payload calls) before calling it. The trainer's checkpoints hold only
    those (the train config as :meth:`TrainConfig.to_dict`, the model and optimizer
    state dicts of tensors and numbers), so no global is allow-listed, and checkpoints
    written by earlier versions, the same structure, load as they are.

    Args:
        path: a run directory (its ``checkpoint.pt`` is read) or a checkpoint file (a
            path that does not exist is taken as a directory unless it ends in ``.pt``).
        map_location: where tensors go, as for :func:`torch.load` (default CPU, so that a
            checkpoint written on a GPU loads on any machine).
        mmap: memory-map the file instead of reading it (tensor storages are read when
            used; for reading the step of a large checkpoint).
        verify: check the content hashes stored in the file (every tensor is read and
            hashed: about a second per GB); False only to peek at a value such as the step.

    Returns:
        The saved dict: ``step`` (int) and, as :func:`save_checkpoint` is called by the
        trainer, ``model``, ``optimizer``, ``train_config`` and ``expert_parallel``
        (``"checksums"`` removed).

    Raises:
        FileNotFoundError: there is no checkpoint at ``path``.
        ValueError: the file holds other Python objects (refused, nothing of it is run);
            it is a directory; it is not a torch checkpoint (truncated, empty, another
            format); it is not a dict with an integer ``step`` >= 0; ``verify`` and its
            content differs from its stored checksums.
    """
    path = resolve_checkpoint_path(path)
    try:
        ckpt = torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:  # torch.load raises it for whatever the weights_only unpickler refuses
        raise _weights_only_error(path, str(e)) from None
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - torch raises several types for a file that is not a checkpoint
        raise ValueError(f"{str(path)!r} is not a readable torch checkpoint ({_one_line(e)})") from None
    if not isinstance(ckpt, dict) or "step" not in ckpt:
        raise ValueError(f"{str(path)!r} is not an mxmoe checkpoint (a {type(ckpt).__name__} without a 'step')")
    step = ckpt["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{str(path)!r} is not an mxmoe checkpoint (its step is {step!r}, not an integer >= 0)")
    if CHECKSUMS_KEY in ckpt:
        if verify:
            _verify_checksums(path, ckpt)
        else:
            del ckpt[CHECKSUMS_KEY]
    if verify:
        check_finite_state(path, ckpt.get("model"), ckpt.get("optimizer"))
    return ckpt


def nonfinite_state(model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> str | None:
    """The name of the first floating-point tensor in a model state dict or an optimizer
    state dict (``{"state": {index: {name: tensor}}, ...}``) holding a NaN or inf, or None
    when every one is finite (one host sync for all)."""
    named = [(k, t) for k, t in model_state.items() if t.is_floating_point()]
    for i, st in optimizer_state.get("state", {}).items():
        named += [(f"optimizer state {k} of parameter {i}", t) for k, t in st.items()
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not named:
        return None
    finite = torch.stack([torch.isfinite(t).all().to(named[0][1].device) for _, t in named])
    if bool(finite.all()):
        return None
    return named[int((~finite).nonzero()[0])][0]


def check_finite_state(path: Path, model_state: Any, optimizer_state: Any = None,
                       use: str = "resumed, evaluated or exported") -> None:
    """Refuse a checkpoint or export whose weights (or AdamW state) hold NaN or inf: mxmoe
    never writes one (the trainer's guard), but a file edited, or written by other code,
    could, and training or evaluating it only gives NaN.

    Args:
        path: the file or directory, for the message.
        model_state: the model state dict (name -> tensor); anything else is left to the
            loaders' structure checks.
        optimizer_state: an optimizer state dict, a list of them (one per rank), or None.
        use: what the file cannot be used for, for the message.

    Raises:
        ValueError: naming ``path``, the first non-finite tensor, and what to do.
    """
    if not isinstance(model_state, dict) or not all(isinstance(t, torch.Tensor) for t in model_state.values()):
        return  # the loaders refuse it with their own message
    optimizers = optimizer_state if isinstance(optimizer_state, list) else [optimizer_state]
    name = nonfinite_state(model_state, {})
    for opt in optimizers:
        if name is None and isinstance(opt, dict) and isinstance(opt.get("state"), dict):
            name = nonfinite_state({}, opt)
    if name is not None:
        raise ValueError(f"{str(path)!r} holds non-finite values ({name!r} has NaN or inf); it cannot be {use}: "
                         f"use an earlier checkpoint or train anew")


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    atomic_write_bytes(Path(path), lambda f: f.write(data))


class MetricsTrim(NamedTuple):
    """What :func:`truncate_metrics` did: ``kept`` lines; ``damaged``, the 1-based numbers
    of the lines dropped as damaged; ``past``, the number of valid lines dropped because
    their step is past the checkpoint's."""

    kept: int
    damaged: list[int]
    past: int

    def describe(self, name: str, last_step: int) -> str | None:
        """One line saying what was dropped, None when nothing was."""
        parts = []
        if self.damaged:
            shown = ", ".join(map(str, self.damaged[:5])) + (", ..." if len(self.damaged) > 5 else "")
            parts.append(f"{len(self.damaged)} damaged line{'s' * (len(self.damaged) > 1)} (line {shown}: "
                         f"torn, NUL bytes, not a JSON object or missing the fields of its kind)")
        if self.past:
            parts.append(f"{self.past} line{'s' * (self.past > 1)} past the checkpoint's step {last_step} "
                         f"(written again)")
        if not parts:
            return None
        return f"{name}: kept {self.kept} lines, dropped " + " and ".join(parts)


# the fields each kind of metrics line must hold as numbers (besides an integer "step")
METRICS_FIELDS = {"train": ("loss", "ms_per_step"), "eval": ("loss", "val_loss")}


def parse_metrics_line(raw: bytes) -> dict | None:
    """The JSON object of one metrics line (bytes, without its newline), None when the
    line is damaged: torn, NUL bytes inside, not UTF-8, not a JSON object, a ``kind``
    other than "train" or "eval", a ``step`` that is not an integer >= 0, or a field of
    its kind (:data:`METRICS_FIELDS`) missing or not a number. NUL bytes around a line
    (what a crash can leave in a file's last block) are removed first."""
    line = raw.strip(b"\0").strip()
    if b"\0" in line:
        return None
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(obj, dict) or obj.get("kind") not in METRICS_FIELDS:
        return None
    step = obj.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    numbers = (obj.get(k) for k in METRICS_FIELDS[obj["kind"]])
    return obj if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers) else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The valid lines of a metrics file, in order; damaged lines
    (:func:`parse_metrics_line`: torn by a crash, NUL bytes, not a JSON object, without
    the fields of their kind) are skipped wherever they are."""
    check_regular_file(path, "a metrics file")
    lines = []
    for raw in Path(path).read_bytes().split(b"\n"):
        record = parse_metrics_line(raw) if raw.strip() else None
        if record is not None:
            lines.append(record)
    return lines


def truncate_metrics(path: Path, last_step: int) -> MetricsTrim:
    """Rewrite a metrics JSONL file for a resume from ``last_step``: keep every valid line
    with ``step <= last_step`` (later lines would be written again); drop the damaged
    ones (torn by a crash, NUL bytes, not a JSON object) wherever they are, and the valid
    lines past ``last_step``. Blank lines are dropped silently. Atomic.

    Returns:
        :class:`MetricsTrim` (all zeros for a missing file).
    """
    path = Path(path)
    if not path.exists():
        return MetricsTrim(0, [], 0)
    check_regular_file(path, "a metrics file")
    kept, damaged, past = [], [], 0
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not raw.strip():
            continue
        record = parse_metrics_line(raw)
        if record is None:
            damaged.append(number)
        elif record.get("step", 0) > last_step:
            past += 1
        else:
            kept.append(raw.strip(b"\0").strip().decode("utf-8") + "\n")  # the line as written
    data = "".join(kept).encode()
    atomic_write_bytes(path, lambda f: f.write(data))
    return MetricsTrim(len(kept), damaged, past)


class MetricsWriter:
    """Append JSON objects, one per line, flushed after each line."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        check_regular_file(self.path, "a metrics file")  # appending to a FIFO would wait for a reader
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one JSON line and flush (a crash loses at most the line being written)."""
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Close the metrics file."""
        self._f.close()
