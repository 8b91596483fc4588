"""Sharded checkpoints of 2-D mesh runs (FSDP2 x expert parallel) through
``torch.distributed.checkpoint`` (DCP): saved by every rank, resumable on any mesh.

Layout, in the run directory::

    checkpoint.dcp/
        latest.json           which step directory is the checkpoint, its step, settings,
                              corpus hash, mesh, and the SHA-256 of every file in it
        step-00000006/        one DCP checkpoint: .metadata and one __<rank>_0.distcp per rank

What is stored (:func:`sharded_state`): the model's parameters by name and, per parameter,
AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``, tensors only. Non-expert tensors are the
FSDP2 DTensors (``Shard(0)`` over the world); each expert weight, and its AdamW moments,
is stored as the whole (E, ...) tensor, ``Shard(0)`` in expert order over the ranks
(:func:`~mxmoe.distributed.mesh.global_expert_view`). DCP records each shard's offsets in
the global tensor, so a checkpoint written on one mesh loads on any other mesh (and on
one process, mesh 1x1): each rank reads the parts of the global tensors it holds there.
The learning rate, betas and weight decay are the run's settings, not stored.

Guarantees, against the single-file checkpoints of :mod:`mxmoe.train.checkpoint`:

- **Atomic:** every rank writes into ``checkpoint.dcp/.step-N.tmp``; after all have
  finished (a barrier), rank 0 hashes the files, renames the directory to ``step-N`` and
  replaces ``latest.json`` atomically (temp file, fsync, ``os.replace``); only then is the
  previous step directory removed. A crash at any point leaves ``latest.json`` naming a
  complete checkpoint (the old one or the new one). Temp directories of killed runs are
  removed at the next save.
- **Checksums:** ``latest.json`` holds the SHA-256 of every file of the step directory;
  :func:`read_sharded_checkpoint` refuses a directory whose files differ, are missing or
  are extra. Every rank hashes every file (about a second per GB per rank), where the
  single-file loader reads its one file once.
- **Non-finite guard:** the trainer refuses to write a checkpoint whose parameters or
  AdamW state hold NaN or inf on any rank (as for single-file checkpoints).
- **No code from the file:** ``latest.json`` is JSON; DCP's ``.metadata`` is a pickle, read
  here by an unpickler that allows only the classes of DCP's metadata
  (:class:`SafeFileSystemReader`, refusing any other global before calling it); tensor
  data is read by DCP with ``torch.load(weights_only=True)``; the default load planner
  is used, and a checkpoint holding non-tensor entries (which DCP would unpickle with
  ``weights_only=False``) is refused.

``mxmoe eval`` and ``mxmoe export`` read the whole model of a sharded checkpoint in one
process (:func:`read_whole_model_state`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

from ..distributed.ep import expert_parameter_names
from ..distributed.mesh import ExpertParallelMesh, global_expert_view, local_tensor
from .checkpoint import _fsync_dir, atomic_write_bytes, check_regular_file

SHARDED_CHECKPOINT_DIR = "checkpoint.dcp"
LATEST_NAME = "latest.json"
FORMAT = "mxmoe-dcp-1"

# the globals a DCP .metadata pickle names (torch 2.11 - 2.13): its dataclasses, enums, and
# torch's dtypes, layouts, memory formats and Size; nothing else is looked up
_DCP_METADATA_MODULES = {m.__name__: m for m in (dcp_metadata, dcp_filesystem, dcp_planner)}
_TORCH_TYPES = (torch.dtype, torch.layout, torch.memory_format)


def _layout_by_name(name: str) -> torch.layout:
    """The torch layout named ``name`` (what ``torch.serialization._get_layout`` returns),
    without torch's private function."""
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if name not in layouts:
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return layouts[name]


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickler of DCP metadata: classes defined in DCP's metadata modules, ``torch.Size``,
    torch dtypes / layouts (also by name) / memory formats, ``collections.OrderedDict``,
    ``pathlib.PosixPath`` (a path object, no file access); any other global
    raises before it is called."""

    def find_class(self, module: str, name: str):
        if module in _DCP_METADATA_MODULES and not name.startswith("__"):
            obj = getattr(_DCP_METADATA_MODULES[module], name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        if module == "torch":
            if name == "Size":
                return torch.Size
            obj = getattr(torch, name, None)
            if isinstance(obj, _TORCH_TYPES):
                return obj
        if module == "torch.serialization" and name == "_get_layout":  # a layout by its name ("torch.strided")
            return _layout_by_name
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath"):  # the checkpoint id DCP records
            return getattr(pathlib, name)
        if module == "collections" and name == "OrderedDict":
            from collections import OrderedDict

            return OrderedDict
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a DCP metadata file")


class SafeFileSystemReader(FileSystemReader):
    """:class:`torch.distributed.checkpoint.FileSystemReader` whose ``.metadata`` is read by
    :class:`_MetadataUnpickler` (DCP's own reader calls ``pickle.load``, which runs whatever
    the file asks for).

    Raises (from ``read_metadata``):
        ValueError: the metadata names another global, or holds non-tensor entries.
    """

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except (pickle.UnpicklingError, AttributeError, EOFError, ValueError, TypeError) as e:
            raise ValueError(f"refusing {str(path)!r}: not a DCP metadata file of tensors ({e})") from None
        byte_entries = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
        if byte_entries:
            raise ValueError(f"refusing {str(path)!r}: it holds non-tensor entries {byte_entries[:3]}, which DCP "
                             f"would unpickle; mxmoe's sharded checkpoints hold tensors only")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def sharded_state(model: nn.Module, opt: torch.optim.Optimizer, mesh: ExpertParallelMesh,
                  n_experts: int) -> dict[str, dict[str, Any]]:
    """The state a sharded checkpoint stores, as views of this rank's tensors (saving reads
    them, loading writes into them).

    Returns:
        ``{"model": {name: tensor}, "optimizer": {name: {"exp_avg", "exp_avg_sq", "step"}}}``
        by parameter name; expert tensors as :func:`global_expert_view`. AdamW state that
        does not exist yet (before the first step) is created as zeros, which is what
        AdamW's first step creates, so that a load has tensors to write into.
    """
    experts = set(expert_parameter_names(model))

    def view(name: str, t: Tensor) -> Tensor:
        return global_expert_view(t, mesh, n_experts) if name in experts else t

    model_state, optim_state = {}, {}
    for name, p in model.named_parameters():
        model_state[name] = view(name, p.detach())
        st = opt.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        optim_state[name] = {"exp_avg": view(name, st["exp_avg"]), "exp_avg_sq": view(name, st["exp_avg_sq"]),
                             "step": st["step"]}
    return {"model": model_state, "optimizer": optim_state}


def local_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """This rank's local shards of the model state dict and the optimizer state dict (the
    form :func:`~mxmoe.train.checkpoint.nonfinite_state` reads)."""
    model_state = {k: local_tensor(v) for k, v in model.state_dict().items()}
    opt_state = {"state": {i: {k: local_tensor(v) for k, v in st.items()}
                           for i, st in opt.state_dict()["state"].items()}}
    return model_state, opt_state


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _file_hashes(directory: Path) -> dict[str, str]:
    return {p.name: _sha256(p) for p in sorted(directory.iterdir()) if p.is_file()}


def save_sharded_checkpoint(out_dir: Path, state: dict[str, Any], info: dict[str, Any], step: int) -> Path:
    """Write a sharded checkpoint of ``step`` (every rank calls it, collectively).

    Args:
        out_dir: the run directory (shared by the ranks: one machine or a shared file system).
        state: :func:`sharded_state`. info: JSON-ready values stored in ``latest.json``
            (settings, corpus hash, mesh). step: the optimizer step.

    Returns:
        The step directory, once it is complete and named by ``latest.json``.
    """
    root = Path(out_dir) / SHARDED_CHECKPOINT_DIR
    tmp = root / f".step-{step:08d}.tmp"
    final = root / f"step-{step:08d}"
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".step-*.tmp"):  # killed writes
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True))
    dist.barrier()  # every rank's files are written and synced
    if rank == 0:
        files = _file_hashes(tmp)
        if final.exists():  # a checkpoint of this step from a run resumed before it (not named by latest.json)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        latest = {"format": FORMAT, "step": step, "dir": final.name, "files": files, **info}
        data = (json.dumps(latest, indent=2, sort_keys=True) + "\n").encode()
        atomic_write_bytes(root / LATEST_NAME, lambda f: f.write(data))
        for old in root.glob("step-*"):  # only now: latest.json names the new one
            if old.name != final.name:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()  # the checkpoint is named before any rank goes on
    return final


def _read_latest(root: Path) -> dict[str, Any]:
    path = root / LATEST_NAME
    check_regular_file(path, "a sharded checkpoint index")  # a FIFO would be read forever
    try:
        latest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not readable JSON ({type(e).__name__}); the sharded checkpoint cannot "
                         f"be resumed") from None
    if not isinstance(latest, dict) or latest.get("format") != FORMAT or not isinstance(latest.get("step"), int) \
            or isinstance(latest.get("step"), bool) or latest["step"] < 0 or not isinstance(latest.get("dir"), str) \
            or not isinstance(latest.get("files"), dict):
        raise ValueError(f"{str(path)!r} is not an mxmoe sharded checkpoint index (format {FORMAT!r} with a step "
                         f">= 0, dir and files)")
    return latest


def has_sharded_checkpoint(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds a sharded checkpoint (its ``latest.json``)."""
    return (Path(out_dir) / SHARDED_CHECKPOINT_DIR / LATEST_NAME).exists()


def read_sharded_checkpoint(out_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The step directory named by ``latest.json`` and the index, after checking every file
    against its SHA-256 (every rank may call it; it reads only).

    Raises:
        FileNotFoundError: no sharded checkpoint in ``out_dir``.
        ValueError: an unreadable index, a step directory outside the checkpoint, or files
            that differ from their checksums (or are missing or extra).
    """
    root = Path(out_dir) / SHARDED_CHECKPOINT_DIR
    if not (root / LATEST_NAME).exists():
        raise FileNotFoundError(f"no sharded checkpoint in {str(out_dir)!r} ({SHARDED_CHECKPOINT_DIR}/{LATEST_NAME} "
                                f"missing); train without --resume to start a run")
    latest = _read_latest(root)
    step_dir = root / latest["dir"]
    if Path(latest["dir"]).name != latest["dir"] or not step_dir.is_dir():
        raise ValueError(f"{str(root / LATEST_NAME)!r} names {latest['dir']!r}, which is not a step directory of "
                         f"{str(root)!r}")
    now = _file_hashes(step_dir)
    if now != latest["files"]:
        bad = sorted(set(now) ^ set(latest["files"])) or sorted(k for k in now if now[k] != latest["files"][k])
        raise ValueError(f"{str(step_dir)!r} is damaged: its files do not match the checksums in {LATEST_NAME} "
                         f"({', '.join(bad[:3])}); use an earlier checkpoint or start anew")
    return step_dir, latest


def load_sharded_checkpoint(step_dir: Path, state: dict[str, Any]) -> None:
    """Read a sharded checkpoint into ``state`` (:func:`sharded_state` of the new model and
    optimizer, on any mesh), in place; collective over the ranks.

    Raises:
        ValueError: the metadata is refused (:class:`SafeFileSystemReader`).
        RuntimeError: DCP's errors (a tensor missing, or of another global shape).
    """
    dcp.load(state, storage_reader=SafeFileSystemReader(step_dir))


def read_whole_model_state(step_dir: Path, shapes: dict[str, torch.Size]) -> dict[str, Tensor]:
    """The whole model of a sharded checkpoint as plain float32 CPU tensors, in one
    process, without a process group (DCP's no-distributed load): for ``mxmoe eval`` and
    ``mxmoe export``, which take the single-process state dict.

    Args:
        step_dir: from :func:`read_sharded_checkpoint` (checksums checked there).
        shapes: name -> whole shape of every tensor of the model's state dict (the
            model built on the meta device).

    Returns:
        ``{name: tensor}`` in the single-process format (expert weights (E, ...)).

    Raises:
        ValueError: the metadata is refused (:class:`SafeFileSystemReader`).
        RuntimeError: DCP's errors (a tensor missing, or of another shape).
    """
    state = {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items()}
    with warnings.catch_warnings():  # one process by design, which DCP warns about
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"model": state}, storage_reader=SafeFileSystemReader(step_dir), no_dist=not dist.is_initialized())
    return state

