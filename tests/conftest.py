"""Test session setup: without a GPU, Triton kernels run in the Triton interpreter
(TRITON_INTERPRET must be set before triton is imported). Shared fixtures: ``corpus``,
``tiny_flags``, ``tiny_run`` and ``group`` (a one-rank gloo process group)."""

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


# a model and run small enough for many `mxmoe train` calls on a 2-core CPU
TINY_FLAGS = ("--width", "64", "--layers", "1", "--heads", "2", "--experts", "4", "--top-k", "2", "--expert-width",
              "64", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--warmup-steps", "1", "--device",
              "cpu", "--no-progress", "--recipe", "bf16", "--dtype", "float32")


@pytest.fixture(scope="session")
def tiny_flags() -> list[str]:
    """`mxmoe train` flags of a tiny model and run on the CPU (bf16 recipe, float32
    activations), without --data, --steps and --out-dir."""
    return list(TINY_FLAGS)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, corpus, tiny_flags) -> Path:
    """The out-dir of a finished 2-step ``tiny_flags`` run on ``corpus`` (one per session:
    copy it before changing anything in it)."""
    from mxmoe.cli import main

    out = tmp_path_factory.mktemp("tiny_run") / "r"
    assert main(["train", *tiny_flags, "--data", str(corpus), "--steps", "2", "--out-dir", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo process group in this process (the default group, so collectives
    take ``group=None``; an all-to-all is then the identity), for checks of the
    expert-parallel pieces that need no second process."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield None
    if owned:
        dist.destroy_process_group()
