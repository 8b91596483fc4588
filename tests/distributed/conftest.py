"""Fixtures of the multi-process checks."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """A text corpus: mxmoe's own sources (the same bytes on every rank and in one process)."""
    text = b"\n".join(p.read_bytes() for p in sorted((ROOT / "src" / "mxmoe").rglob("*.py")))
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(text)
    return path
