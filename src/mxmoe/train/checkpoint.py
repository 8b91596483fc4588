"""Atomic checkpoints and append-only metrics files.

A checkpoint is written to a temporary file in the same directory, flushed to disk, then
renamed over ``checkpoint.pt`` (``os.replace`` is atomic on POSIX and Windows): a crash at
any point leaves either the previous checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"


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


def atomic_write_bytes(path: Path, write) -> None:
    """Create ``path`` atomically: ``write(fileobj)`` fills a temp file beside it, which is
    fsynced and renamed over ``path``. The temp file is removed if ``write`` fails."""
    path = Path(path)
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


def save_checkpoint(out_dir: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` (torch-serializable) to ``out_dir/checkpoint.pt`` atomically. Temp
    files of earlier writes that were killed (SIGKILL leaves them; a checkpoint can be
    gigabytes) are removed first: one run writes to a directory at a time."""
    path = Path(out_dir) / CHECKPOINT_NAME
    for stale in Path(out_dir).glob(f".{CHECKPOINT_NAME}.*.tmp"):
        stale.unlink(missing_ok=True)
    atomic_write_bytes(path, lambda f: torch.save(state, f))
    return path


def load_checkpoint(out_dir: Path, map_location="cpu") -> dict[str, Any]:
    """Load ``out_dir/checkpoint.pt``.

    Raises:
        FileNotFoundError: there is no checkpoint in ``out_dir``.
    """
    path = Path(out_dir) / CHECKPOINT_NAME
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}; run without --resume to start a new run (with "
                                f"--overwrite if the directory holds a run stopped before its first checkpoint)")
    return torch.load(path, map_location=map_location, weights_only=False)


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    atomic_write_bytes(Path(path), lambda f: f.write(data))


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only the lines of a metrics JSONL file with ``step <= last_step`` (after a
    resume from ``last_step``, later lines would be written again). Atomic."""
    path = Path(path)
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= last_step:
                kept.append(line + "\n")
        except json.JSONDecodeError:
            break  # a torn last line from a crash: drop it and what follows
    data = "".join(kept).encode()
    atomic_write_bytes(path, lambda f: f.write(data))


class MetricsWriter:
    """Append JSON objects, one per line, flushed after each line."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one JSON line and flush (a crash loses at most the line being written)."""
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Close the metrics file."""
        self._f.close()
