"""One recipe of ``mxmoe compare`` in its own process (so that its peak memory is its own):

    python -m mxmoe.train.worker CONFIG_JSON [--resume]

CONFIG_JSON is a :meth:`TrainConfig.to_dict` as JSON text. The run trains as ``mxmoe
train`` would, into ``out_dir``; when it has finished, ``out_dir/result.json`` records the
settings, the device's name, what its memory figures measure and the versions. A
result.json from an earlier run in the same directory is removed first (and, unless
resuming, its checkpoint.pt), so its presence means the run in ``out_dir`` finished. Exit status: 0 done, 1 non-finite loss, 2 refused
(bad settings, missing data), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from .checkpoint import CHECKPOINT_NAME, load_checkpoint, write_json
from .compare import RESULT_NAME
from .cpu import set_threads_for_free_cores
from .data import load_corpus
from .trainer import TrainConfig, resolve_device, train

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss_gib() -> float | None:
    """This process's resident set size now (GiB), from /proc (None where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES / 2**30
    except (OSError, ValueError, IndexError):
        return None


def git_describe() -> str | None:
    """The commit the code came from: the ``COMMIT`` environment variable when set (a copy
    of the tree without its own history, e.g. on a remote GPU machine, says it this way),
    else ``git describe --tags --match "v*" --always --dirty`` of the source tree (release
    tags only: other tags, such as archive tags, would name code that is not running),
    None outside a checkout."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        out = subprocess.run(["git", "describe", "--tags", "--match", "v*", "--always", "--dirty"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def checkpoint_step(out_dir: Path) -> int | None:
    """Step of ``out_dir/checkpoint.pt`` (read through a memory map), None if there is none.

    Raises:
        ValueError: the file holds Python objects other than tensors and plain data
            (refused by :func:`~mxmoe.train.checkpoint.load_checkpoint`, nothing of it is
            run), or is not an mxmoe checkpoint.
    """
    path = Path(out_dir) / CHECKPOINT_NAME
    if not path.exists():
        return None
    return int(load_checkpoint(path, mmap=True, verify=False)["step"])  # the resume verifies it


def main(argv: list[str] | None = None) -> int:
    """Entry of one torchrun worker: train the JSON TrainConfig given as argument; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m mxmoe.train.worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="the run's TrainConfig.to_dict() as JSON text")
    ap.add_argument("--resume", action="store_true", help="continue from out_dir/checkpoint.pt")
    args = ap.parse_args(argv)
    cfg = TrainConfig.from_dict(json.loads(args.config))
    out = Path(cfg.out_dir)
    tag = f"mxmoe compare ({cfg.recipe})"
    try:
        device = resolve_device(cfg.device)
        if device.type == "cpu" and cfg.expert_parallel == 1:
            note = set_threads_for_free_cores()
            if note:
                print(f"{tag}: {note}", flush=True)
        (out / RESULT_NAME).unlink(missing_ok=True)
        if not args.resume:  # a new run: no checkpoint of an older one may be resumed into it later
            (out / CHECKPOINT_NAME).unlink(missing_ok=True)
        corpus = load_corpus(cfg.data)
        rss_before = current_rss_gib() if device.type == "cpu" else None
        step = checkpoint_step(out) if args.resume else None
        if step is not None and step > cfg.steps:
            raise ValueError(f"the checkpoint in {str(out)!r} is at step {step}, past --steps {cfg.steps}")
        if step != cfg.steps:  # a checkpoint at the last step: finished, only result.json was missing
            train(cfg, resume=args.resume, corpus=corpus)
    except (ValueError, FileNotFoundError) as e:
        print(f"{tag}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path that cannot be used: as `mxmoe train` says it
        where = f" {e.filename!r}" if e.filename else ""
        print(f"{tag}: error: cannot use{where}: {e.strerror or e}; check the path, its permissions and the free "
              f"space", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"{tag}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{tag}: interrupted", file=sys.stderr)
        return 130
    write_json(out / RESULT_NAME, {
        "train": cfg.to_dict(), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "memory_kind": "cuda_max_memory_allocated" if device.type == "cuda" else "process_peak_rss",
        "rss_before_model_gib": rss_before, "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
        "torch": torch.__version__, "git": git_describe(),
        "finished_unix_s": time.time(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
