"""``--resume`` compares the corpus by its tokens (a hash stored in the checkpoint), not
by how --data is spelled: the same file by another path (relative, a symlink, a copy)
resumes; another file with the same name is refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from mxmoe.cli import main
from mxmoe.train.checkpoint import CHECKSUMS_KEY, load_checkpoint, save_checkpoint
from mxmoe.train.data import load_corpus
from mxmoe.train.trainer import DATA_HASH_KEY



def test_the_checkpoint_holds_the_corpus_hash(tiny_run, corpus):
    assert load_checkpoint(tiny_run)[DATA_HASH_KEY] == load_corpus(corpus).fingerprint()


@pytest.mark.parametrize("spelling", ["relative", "with ..", "a symlink", "a copy"])
def test_the_same_tokens_by_another_path_resume(tiny_run, tiny_flags, corpus, tmp_path, monkeypatch, spelling):
    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    if spelling == "relative":
        monkeypatch.chdir(corpus.parent)
        data = corpus.name
    elif spelling == "with ..":
        data = str(corpus.parent / ".." / corpus.parent.name / corpus.name)
    elif spelling == "a symlink":
        data = str(tmp_path / "link.txt")
        Path(data).symlink_to(corpus)
    else:
        data = str(tmp_path / "copy.txt")
        shutil.copy(corpus, data)
    assert main(["train", *tiny_flags, "--data", data, "--steps", "3", "--out-dir", str(run), "--resume"]) == 0
    assert load_checkpoint(run)["step"] == 3


@pytest.mark.parametrize("change", ["one byte", "another file"])
def test_other_tokens_under_the_same_name_are_refused(tiny_run, tiny_flags, corpus, tmp_path, capsys, change):
    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    data = tmp_path / corpus.name
    raw = bytearray(corpus.read_bytes())
    if change == "one byte":
        raw[len(raw) // 2] ^= 0x01
    else:
        raw = raw[: len(raw) // 2]
    data.write_bytes(bytes(raw))
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    rc = main(["train", *tiny_flags, "--data", str(data), "--steps", "3", "--out-dir", str(run), "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert f"--data {str(data)!r} holds other tokens than the corpus the checkpoint in" in err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_a_checkpoint_without_the_hash_compares_the_text(tiny_run, tiny_flags, corpus, tmp_path, capsys):
    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    ckpt = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True)
    del ckpt[DATA_HASH_KEY], ckpt[CHECKSUMS_KEY]
    save_checkpoint(run, ckpt)
    link = tmp_path / "link.txt"
    link.symlink_to(corpus)
    rc = main(["train", *tiny_flags, "--data", str(link), "--steps", "3", "--out-dir", str(run), "--resume"])
    assert rc == 2 and "data (--data): checkpoint" in capsys.readouterr().err
    assert main(["train", *tiny_flags, "--data", str(corpus), "--steps", "3", "--out-dir", str(run), "--resume"]) == 0
