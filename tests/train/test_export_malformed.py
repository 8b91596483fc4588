"""A malformed mxmoe export (metadata fields or tensors missing or of the wrong kind) is
refused by ``mxmoe eval`` with one line naming the file, exit status 2, no traceback."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from mxmoe.cli import main

FLAGS = ["--width", "64", "--layers", "1", "--heads", "2", "--experts", "4", "--top-k", "2", "--expert-width", "64",
         "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--warmup-steps", "1", "--device", "cpu",
         "--no-progress", "--recipe", "bf16", "--dtype", "float32", "--steps", "2"]


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    root = Path(__file__).resolve().parents[2] / "src" / "mxmoe"
    tmp = tmp_path_factory.mktemp("e")
    data = tmp / "corpus.txt"
    data.write_bytes(b"\n".join(p.read_bytes() for p in sorted(root.rglob("*.py"))))
    assert main(["train", *FLAGS, "--data", str(data), "--out-dir", str(tmp / "r")]) == 0
    assert main(["export", str(tmp / "r"), str(tmp / "e.safetensors")]) == 0
    return tmp / "e.safetensors"


def rewrite(src: Path, dst: Path, edit) -> None:
    """``src`` with its "mxmoe" metadata edited by ``edit`` (tensors unchanged)."""
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = json.loads(header["__metadata__"]["mxmoe"])
    edit(meta)
    header["__metadata__"]["mxmoe"] = json.dumps(meta)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    dst.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])


def _first(meta) -> str:
    return next(iter(meta["quantized"]))


EDITS = {
    "no quantized": (lambda m: m.pop("quantized"), "KeyError: no 'quantized'"),
    "quantized a list": (lambda m: m.update(quantized=[1]), "AttributeError"),
    "a quantized weight without tensors": (lambda m: m["quantized"].update(nope=[2, 2]), "KeyError: no 'nope.e4m3'"),
    "a wrong shape": (lambda m: m["quantized"].update({_first(m): [1, 1]}), "MXTensor orig_size 1 does not fit"),
    "a wrong leading shape": (lambda m: m["quantized"].update({_first(m): [1, m["quantized"][_first(m)][-1]]}),
                              "dequantizes to"),
    "no settings": (lambda m: m.pop("train"), "KeyError: no 'train'"),
    "block size 0": (lambda m: m.update(block_size=0), "MXTensor block_size must be a positive int"),
    "unknown element format": (lambda m: m.update(elem_format="e9m9"), "ValueError"),
    "unknown scale mode": (lambda m: m.update(scale_mode="zzz"), "unknown scale mode 'zzz'"),
    "a text step": (lambda m: m.update(step="x"), "step 'x' is not an integer >= 0"),
    "settings of another model": (lambda m: m["train"]["model"].update(d_model=128),
                                  "holds weights that do not fit the model of its own settings"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_a_malformed_export_is_refused_in_one_line(export, tmp_path, capsys, edit):
    fn, message = EDITS[edit]
    bad = tmp_path / "bad.safetensors"
    rewrite(export, bad, fn)
    rc = main(["eval", str(bad), "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"mxmoe eval: error: {str(bad)!r}") and message in err, err


def test_the_export_itself_evaluates(export):
    assert main(["eval", str(export), "--device", "cpu"]) == 0
