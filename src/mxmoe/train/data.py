"""Corpora as flat token streams, a deterministic train/validation split, and batches.

Sources (``load_corpus``):
- default (no path): the source files of this Python's standard library, ``.py`` files
  under ``sysconfig.get_paths()["stdlib"]``, skipping ``site-packages`` / ``dist-packages``
  and test folders (``test``, ``tests``, ``idle_test``); byte-level tokens, vocabulary 256.
  Nothing is downloaded.
- a text file: its bytes.
- a directory: the bytes of every file under it that looks like text (no NUL byte in its
  first 8 KiB), in sorted path order.
- a flat uint16 token file (``.bin``, as written by nanoGPT-style preprocessors, or
  ``.u16``): token ids, vocabulary max id + 1.

Split: documents (files) are assigned to validation by a hash of their relative path
(about ``val_fraction`` of them), so the split is the same on every run and machine with
the same files; a single file is split by position (its last ``val_fraction``).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
TOKEN_FILE_SUFFIXES = {".bin", ".u16"}
DOC_SEPARATOR = b"\n\n"
BYTE_VOCAB = 256


@dataclass
class Corpus:
    """A tokenized corpus split into train and validation streams.

    Attributes:
        train, val: 1-D CPU tensors of token ids, uint8 for bytes or int32 for uint16 ids.
        vocab_size: ids are in [0, vocab_size).
        source: description of where the tokens came from.
    """

    train: Tensor
    val: Tensor
    vocab_size: int
    source: str

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the token streams (train, then val, with their dtypes and
        lengths): equal for the same tokens however the path was spelled, different for
        other tokens. About 30 ms for the 12M-token default corpus."""
        h = hashlib.sha256()
        for t in (self.train, self.val):
            t = t.contiguous().reshape(-1)
            h.update(f"{t.dtype}:{t.numel()};".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()

    def describe(self) -> str:
        """One line: source, train / val token counts, vocabulary size."""
        return (f"{self.source}: {self.train.numel():,} train / {self.val.numel():,} val tokens, "
                f"vocab {self.vocab_size}")


def _is_val_doc(rel_path: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "little")
    return h / 2**64 < val_fraction


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library root and its ``.py`` files (sorted), tests and site-packages out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return root, files


def _looks_like_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def _split_documents(root: Path, files: list[Path], val_fraction: float) -> tuple[bytes, bytes]:
    train, val = [], []
    for path in files:
        rel = path.relative_to(root).as_posix()
        (val if _is_val_doc(rel, val_fraction) else train).append(path.read_bytes())
    if not val:  # tiny corpora: move the last document to validation
        val.append(train.pop())
    if not train:
        raise ValueError(f"{root} holds too few documents to split into train and validation")
    return DOC_SEPARATOR.join(train), DOC_SEPARATOR.join(val)


def _bytes_to_tensor(b: bytes) -> Tensor:
    return torch.from_numpy(np.frombuffer(b, dtype=np.uint8).copy())


def load_corpus(path: str | os.PathLike | None = None, val_fraction: float = 0.05) -> Corpus:
    """Load and split a corpus (see the module docstring for the sources).

    Args:
        path: None for the Python standard library, else a text file, a directory of
            text files or a ``.bin`` / ``.u16`` uint16 token file.
        val_fraction: share of documents (or of a single file's tokens) for validation,
            in (0, 0.5].

    Returns:
        :class:`Corpus` with CPU token tensors (uint8 for bytes, int32 for uint16 ids).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the corpus is empty or too small to split, or val_fraction is out of range.
    """
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction <= 0.5:
        raise ValueError(f"val_fraction must be a number in (0, 0.5], got {val_fraction!r}")
    if path is not None and not str(path).strip():  # Path("") is the current directory
        raise ValueError("the data path is empty; pass a text file, a directory of text files or a uint16 .bin "
                         "token file, or leave --data out for the Python standard library")
    if path is None:
        root, files = stdlib_files()
        if not files:
            raise ValueError(f"no .py files found under the standard library at {root}")
        train, val = _split_documents(root, files, val_fraction)
        return Corpus(_bytes_to_tensor(train), _bytes_to_tensor(val), BYTE_VOCAB,
                      f"Python {sysconfig.get_python_version()} stdlib ({len(files)} files at {root})")
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data path {str(p)!r} does not exist; pass a text file, a directory "
                                f"of text files or a uint16 .bin token file")
    if not p.is_dir() and not p.is_file():  # a FIFO, a device, a socket: reading it may never end
        raise ValueError(f"data path {str(p)!r} is not a regular file or a directory; pass a text file, a "
                         f"directory of text files or a uint16 .bin token file")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and _looks_like_text(f))
        if not files:
            raise ValueError(f"directory {str(p)!r} holds no text files")
        train, val = _split_documents(p, files, val_fraction)
        return Corpus(_bytes_to_tensor(train), _bytes_to_tensor(val), BYTE_VOCAB, f"{len(files)} files under {p}")
    if p.suffix in TOKEN_FILE_SUFFIXES:
        if p.stat().st_size % 2:
            raise ValueError(f"token file {str(p)!r} has an odd number of bytes ({p.stat().st_size}); "
                             f"a uint16 token file holds 2 bytes per token")
        ids = np.fromfile(p, dtype=np.uint16)
        if ids.size < 2:
            raise ValueError(f"token file {str(p)!r} holds {ids.size} tokens")
        tokens = torch.from_numpy(ids.astype(np.int32))
        vocab = int(tokens.max()) + 1
        kind = "uint16 tokens"
    else:
        tokens = _bytes_to_tensor(p.read_bytes())
        vocab = BYTE_VOCAB
        kind = "bytes"
    n_val = max(int(tokens.numel() * val_fraction), 1)
    if tokens.numel() - n_val < 2:
        raise ValueError(f"{str(p)!r} is too small to split: {tokens.numel()} tokens")
    return Corpus(tokens[:-n_val], tokens[-n_val:], vocab, f"{p} ({kind})")


def random_batch(tokens: Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``batch_size`` random windows of ``seq_len + 1`` tokens -> (inputs, targets), int64
    (batch_size, seq_len) each, on the CPU.

    Raises:
        ValueError: the stream is shorter than seq_len + 1 tokens.
    """
    n = tokens.numel()
    if n < seq_len + 1:
        raise ValueError(f"the token stream has {n} tokens, fewer than seq_len + 1 = {seq_len + 1}; use a longer "
                         f"corpus or a smaller seq_len")
    starts = torch.randint(0, n - seq_len, (batch_size,), generator=generator)
    windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()]).to(torch.int64)
    return windows[:, :-1], windows[:, 1:]


def eval_batches(tokens: Tensor, batch_size: int, seq_len: int, n_batches: int) -> list[tuple[Tensor, Tensor]]:
    """A fixed set of evaluation batches: windows at evenly spaced positions of the stream
    (the same on every call), at most ``n_batches`` batches."""
    n = tokens.numel()
    if n < seq_len + 1:
        raise ValueError(f"the validation stream has {n} tokens, fewer than seq_len + 1 = {seq_len + 1}; use a "
                         f"longer corpus or a smaller seq_len")
    count = batch_size * n_batches
    starts = torch.linspace(0, n - seq_len - 1, count).long()
    windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()]).to(torch.int64)
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]
