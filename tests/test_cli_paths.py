"""Paths that cannot be used (not a directory, a file where a directory must go, a full
disk) end every command in one line naming the path, exit status 2, no traceback."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from mxmoe.cli import main
from mxmoe.train import checkpoint

FLAGS = ["--width", "64", "--layers", "1", "--heads", "2", "--experts", "4", "--top-k", "2", "--expert-width", "64",
         "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--warmup-steps", "1", "--device", "cpu",
         "--no-progress", "--recipe", "bf16", "--dtype", "float32", "--steps", "2"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("run") / "r"
    assert main(["train", *FLAGS, "--data", str(corpus), "--out-dir", str(out)]) == 0
    return out


def _disk_full(monkeypatch):
    def full(path, write):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint, "atomic_write_bytes", full)
    from mxmoe.train import export

    monkeypatch.setattr(export, "atomic_write_bytes", full)


CASES = {
    "train into a path under a file": lambda c, r, t, m: ["train", *FLAGS, "--data", str(c), "--out-dir",
                                                          str(t / "afile" / "x")],
    "export under a file": lambda c, r, t, m: ["export", str(r), str(t / "afile" / "o.safetensors")],
    "train on a full disk": lambda c, r, t, m: (_disk_full(m), ["train", *FLAGS, "--data", str(c), "--out-dir",
                                                                str(t / "full")])[1],
    "export on a full disk": lambda c, r, t, m: (_disk_full(m), ["export", str(r), str(t / "o.safetensors")])[1],
}


@pytest.mark.parametrize("case", CASES)
def test_an_unusable_path_is_one_line(corpus, run_dir, tmp_path, capsys, monkeypatch, case):
    (tmp_path / "afile").write_text("x")
    argv = CASES[case](corpus, run_dir, tmp_path, monkeypatch)
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"mxmoe {argv[0]}: error: cannot use '{tmp_path}"), err
    assert ("Not a directory" in err or "File exists" in err) if "file" in case else "No space left on device" in err
