"""``--resume`` rewrites metrics.jsonl: every valid line up to the checkpoint's step is
kept wherever a damaged line sits, damaged lines (torn, NUL bytes, not a JSON object) and
lines past the checkpoint are dropped, and the run says what it dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mxmoe.cli import main
from mxmoe.train.checkpoint import truncate_metrics

FLAGS = ["--width", "64", "--layers", "1", "--heads", "2", "--experts", "4", "--top-k", "2", "--expert-width", "64",
         "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--warmup-steps", "1", "--device", "cpu",
         "--no-progress", "--recipe", "bf16", "--dtype", "float32", "--eval-interval", "100"]


def line(step: int, kind: str = "train") -> bytes:
    extra = {"ms_per_step": 10.0} if kind == "train" else {"val_loss": 5.1 - step / 10}
    return json.dumps({"kind": kind, "step": step, "loss": 5.0 - step / 10, **extra}).encode()


# each kind of damage, as the bytes of one line (no newline)
DAMAGE = {
    "torn": line(3)[:17],
    "nul bytes": b"\0" * 40,
    "nul inside": line(3)[:10] + b"\0\0" + line(3)[10:],
    "not utf-8": b"\xff\xfe" + line(3),
    "a json list": b"[1, 2, 3]",
    "a json string": b'"step"',
    "a non-integer step": b'{"kind": "train", "step": "3"}',
    "two lines glued": line(3)[:-1] + line(4),
    # well-formed JSON without what its kind holds (a resume must not trip on it later)
    "no kind": b'{"step": 3}',
    "an unknown kind": b'{"kind": "note", "step": 3, "loss": 1.0}',
    "a train line without its loss": b'{"kind": "train", "step": 3, "ms_per_step": 10.0}',
    "a string loss": b'{"kind": "train", "step": 3, "loss": "abc", "ms_per_step": 10.0}',
    "an eval line without val_loss": b'{"kind": "eval", "step": 3, "loss": 1.0}',
    "a negative step": b'{"kind": "train", "step": -1, "loss": 1.0, "ms_per_step": 10.0}',
}


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_truncate_keeps_valid_lines_around_damage(tmp_path, damage, where):
    good = [line(0, "eval"), line(1), line(2), line(3), line(4), line(5), line(6)]
    at = {"first": 0, "middle": 3, "last": len(good)}[where]
    lines = good[:at] + [DAMAGE[damage]] + good[at:]
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\n".join(lines) + (b"" if where == "last" else b"\n"))
    trim = truncate_metrics(path, last_step=4)
    assert path.read_bytes() == b"\n".join(good[:5]) + b"\n"  # steps 0..4 kept byte for byte
    assert trim.kept == 5 and trim.damaged == [at + 1] and trim.past == 2
    msg = trim.describe("metrics.jsonl", 4)
    assert msg == (f"metrics.jsonl: kept 5 lines, dropped 1 damaged line (line {at + 1}: torn, NUL bytes, not a "
                   f"JSON object or missing the fields of its kind) and 2 lines past the checkpoint's step 4 (written again)")


def test_nul_padding_around_a_valid_line_is_removed_and_the_line_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(line(1) + b"\n" + b"\0" * 100 + line(2) + b"\n\n" + line(3) + b"\0\0\n")
    trim = truncate_metrics(path, last_step=9)
    assert path.read_bytes() == b"\n".join([line(1), line(2), line(3)]) + b"\n"
    assert trim == (3, [], 0) and trim.describe("m", 9) is None
    assert truncate_metrics(tmp_path / "missing.jsonl", 1) == (0, [], 0)


def test_resume_keeps_the_metrics_around_a_damaged_line_and_says_so(tmp_path, capsys):
    """A run of 4 steps (checkpoint at 4) then resumed to 6, with a torn line and NULs
    planted at step 2 of its metrics: steps 1, 3 and 4 stay, 2 is gone, 5 and 6 follow."""
    root = Path(__file__).resolve().parents[2] / "src" / "mxmoe"
    data = tmp_path / "corpus.txt"
    data.write_bytes(b"\n".join(p.read_bytes() for p in sorted(root.rglob("*.py"))))
    out = tmp_path / "run"
    common = ["train", *FLAGS, "--data", str(data), "--out-dir", str(out)]
    assert main([*common, "--steps", "4"]) == 0
    path = out / "metrics.jsonl"
    lines = path.read_bytes().split(b"\n")
    steps = [json.loads(s)["step"] if s else None for s in lines]
    i = steps.index(2)  # the train line of step 2 (evaluations: steps 0 and 4 only)
    lines[i] = b"\0" * 8 + lines[i][:20]
    path.write_bytes(b"\n".join(lines))
    capsys.readouterr()
    assert main([*common, "--steps", "6", "--resume"]) == 0
    said = capsys.readouterr().out
    assert f"metrics.jsonl: kept {len([s for s in lines if s]) - 1} lines, dropped 1 damaged line (line {i + 1}" in said
    got = [json.loads(s) for s in path.read_text().splitlines()]
    assert [m["step"] for m in got if m["kind"] == "train"] == [1, 3, 4, 5, 6]
