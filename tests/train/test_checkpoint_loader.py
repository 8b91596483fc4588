"""One loader, one error style: ``train --resume``, ``eval`` and ``export`` read a
checkpoint through :func:`mxmoe.train.trainer.load_training_checkpoint`, so every kind
of bad checkpoint (truncated, empty, foreign, a directory, the wrong structure, settings
or weights) gets the same one-line error from all three, exit status 2, no traceback,
and leaves the run directory as it was."""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from mxmoe.cli import main
from mxmoe.train.checkpoint import CHECKPOINT_NAME, CHECKSUMS_KEY, save_checkpoint



def _edit(path: Path, fn) -> None:
    """Rewrite the checkpoint with ``fn`` applied (checksums recomputed: a well-formed file)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    ckpt.pop(CHECKSUMS_KEY)
    fn(ckpt)
    save_checkpoint(path.parent, ckpt)


def _safetensors(path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2)}, str(path))


# each kind of bad checkpoint.pt: (how to make it from a good one, the start of the message)
VARIANTS = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "is not a readable torch checkpoint"),
    "truncated to 100 bytes": (lambda p: p.write_bytes(p.read_bytes()[:100]), "is not a readable torch checkpoint"),
    "empty": (lambda p: p.write_bytes(b""), "is not a readable torch checkpoint"),
    "text": (lambda p: p.write_text("hello"), "is not a readable torch checkpoint"),
    "a directory": (lambda p: (p.unlink(), p.mkdir()), "is a directory, not a checkpoint file"),
    "a foreign zip": (lambda p: zipfile.ZipFile(p, "w").close(), "is not a readable torch checkpoint"),
    "numpy": (lambda p: np.save(p.with_suffix(".npy"), np.ones(3)) or p.with_suffix(".npy").replace(p),
              "is not a readable torch checkpoint"),
    "a torch list": (lambda p: torch.save([1, 2], p), "is not an mxmoe checkpoint (a list without a 'step')"),
    "no step": (lambda p: torch.save({"model": {}}, p), "is not an mxmoe checkpoint (a dict without a 'step')"),
    "a step only": (lambda p: torch.save({"step": 1}, p), "is not an mxmoe training checkpoint: 'model' is not"),
    "a text step": (lambda p: _edit(p, lambda c: c.update(step="two")), "its step is 'two', not an integer >= 0"),
    "a negative step": (lambda p: _edit(p, lambda c: c.update(step=-1)), "its step is -1, not an integer >= 0"),
    "no optimizer": (lambda p: _edit(p, lambda c: c.pop("optimizer")), "'optimizer' is not an optimizer state dict"),
    "settings without a model": (lambda p: _edit(p, lambda c: c.update(train_config={"x": 1})),
                                 "'train_config' is not a dict of settings with a 'model' dict"),
    "settings of the wrong type": (lambda p: _edit(p, lambda c: c["train_config"]["model"].update(d_model="wide")),
                                   "holds settings this mxmoe cannot use"),
    "weights of another model": (lambda p: _edit(p, lambda c: c.update(model={"x": torch.ones(1)})),
                                 "holds weights that do not fit the model of its own settings: missing ['embed'"),
    "a weight of another shape": (lambda p: _edit(p, lambda c: c["model"].update(embed=torch.ones(3, 3))),
                                  "embed is (3, 3), the model's (256, 64)"),
    "a non-tensor weight": (lambda p: _edit(p, lambda c: c["model"].update(embed=[1.0])),
                            "'model' is not a dict of tensors"),
}
if os.geteuid() != 0:  # root reads any file
    VARIANTS["unreadable"] = (lambda p: p.chmod(0), "is not a readable torch checkpoint")


def run(command: str, run: Path, corpus: Path, tmp_path: Path, flags: list[str]) -> int:
    if command == "train --resume":
        return main(["train", *flags, "--data", str(corpus), "--steps", "4", "--out-dir", str(run), "--resume"])
    if command == "eval":
        return main(["eval", str(run), "--device", "cpu"])
    return main(["export", str(run), str(tmp_path / "o.safetensors")])


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_command_gives_the_same_one_line_error(tiny_run, tiny_flags, corpus, tmp_path, capsys, variant):
    make, expected = VARIANTS[variant]
    bad = tmp_path / "bad"
    shutil.copytree(tiny_run, bad)
    make(bad / CHECKPOINT_NAME)
    before = {p.name: p.read_bytes() for p in bad.iterdir() if p.is_file()}
    messages = {}
    for command in ("train --resume", "eval", "export"):
        rc = run(command, bad, corpus, tmp_path, tiny_flags)
        err = capsys.readouterr().err
        prefix = f"mxmoe {command.split()[0]}: error: "
        assert rc == 2, (command, err)
        assert err.startswith(prefix) and err.count("\n") == 1 and "Traceback" not in err, (command, err)
        messages[command] = err[len(prefix):]
        assert expected in messages[command], (command, err)
        assert str(bad / CHECKPOINT_NAME) in messages[command]
    assert len(set(messages.values())) == 1, messages
    assert {p.name: p.read_bytes() for p in bad.iterdir() if p.is_file()} == before
    assert not (tmp_path / "o.safetensors").exists()


def test_a_good_checkpoint_still_resumes_evaluates_and_exports(tiny_run, tiny_flags, corpus, tmp_path):
    good = tmp_path / "good"
    shutil.copytree(tiny_run, good)
    for command in ("eval", "export", "train --resume"):
        assert run(command, good, corpus, tmp_path, tiny_flags) == 0, command


@pytest.mark.parametrize("damage", ["a moment of another shape", "a parameter group dropped"])
def test_optimizer_state_that_does_not_fit_is_refused_in_one_line(tiny_run, tiny_flags, corpus, tmp_path, capsys,
                                                                  damage):
    """Checksums recomputed over a wrong optimizer state: resume refuses it naming the file
    (torch would load it and fail inside the optimizer step)."""
    from mxmoe.train.checkpoint import load_checkpoint

    bad = tmp_path / "bad"
    shutil.copytree(tiny_run, bad)
    state = load_checkpoint(bad, verify=False)
    if damage == "a moment of another shape":
        first = next(iter(state["optimizer"]["state"]))
        state["optimizer"]["state"][first]["exp_avg"] = torch.zeros(3)
    else:
        state["optimizer"]["param_groups"] = state["optimizer"]["param_groups"][:1]
    save_checkpoint(bad, state)
    rc = main(["train", *tiny_flags, "--data", str(corpus), "--steps", "4", "--out-dir", str(bad), "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and str(bad / CHECKPOINT_NAME) in err and "optimizer" in err, err
