"""Test session setup: without a GPU, Triton kernels run in the Triton interpreter
(TRITON_INTERPRET must be set before triton is imported). Shared fixtures: ``corpus``."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A text file of mxmoe's own Python sources (a corpus for tiny training runs, nothing
    downloaded); one per test session."""
    root = Path(__file__).resolve().parents[1] / "src" / "mxmoe"
    data = tmp_path_factory.mktemp("data") / "corpus.txt"
    data.write_bytes(b"\n".join(p.read_bytes() for p in sorted(root.rglob("*.py"))))
    return data
