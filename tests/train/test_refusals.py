"""Inputs of ``mxmoe train`` and ``mxmoe export`` that are refused with one line naming
the value (by its flag) and what would work, before any file is written: an empty
--out-dir, a seed out of range, a huge vocabulary, model sizes out of range (zero, 2**70,
or more than the machine's memory), --quant-backend triton off CUDA, an export onto its
own checkpoint or onto a directory path, and a second run into an --out-dir in use."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mxmoe.cli import main
from mxmoe.train.trainer import LOCK_NAME, MAX_SEED, out_dir_lock

FLAGS = ["--width", "64", "--layers", "1", "--heads", "2", "--experts", "4", "--top-k", "2", "--expert-width", "64",
         "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--warmup-steps", "1", "--device", "cpu",
         "--no-progress", "--dtype", "float32"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("run") / "r"
    assert main(["train", *FLAGS, "--recipe", "bf16", "--data", str(corpus), "--steps", "2", "--out-dir", str(out)]) == 0
    return out


# (extra flags, message): each refused `mxmoe train` input
TRAIN_REFUSALS = {
    "empty out-dir": (["--out-dir", ""], "--out-dir must name a directory, got ''; pass e.g. --out-dir"),
    "blank out-dir": (["--out-dir", "  "], "--out-dir must name a directory, got '  '"),
    "seed 2**70": (["--seed", str(2**70)], f"--seed must be an integer in [0, {MAX_SEED}], got {2**70}"),
    "lr 0": (["--lr", "0"], "--lr must be a positive number, got 0"),
    "lr nan": (["--lr", "nan"], "--lr must be a positive number, got nan"),
    "steps 0": (["--steps", "0"], "--steps must be an integer in [1, "),
    "seed 2**32": (["--seed", str(2**32)], f"seed must be an integer in [0, {MAX_SEED}]"),
    "negative seed": (["--seed", "-1"], f"seed must be an integer in [0, {MAX_SEED}], got -1"),
    "huge vocab": (["--vocab-size", str(10**11)], "--vocab-size 100,000,000,000 exceeds 1,048,576"),
    "more than memory": (["--width", "8192", "--heads", "64", "--layers", "32", "--experts", "64", "--expert-width",
                          "8192"], "the model has 420,928,299,008 parameters: their float32 weights, gradients and "
                                   "AdamW state need 6,272.3 GiB, more than the"),
    "triton on the cpu": (["--quant-backend", "triton", "--recipe", "mxfp8"],
                          "--quant-backend triton runs the Triton kernels, which need a CUDA device; this run is on cpu"),
    "max-bad-steps 0": (["--max-bad-steps", "0"], "--max-bad-steps must be an integer in [1, 1,099,511,627,776] (2**40), got 0"),
    "top-k over experts": (["--top-k", "5"], "--top-k=5 exceeds --experts=4; use --top-k <= --experts"),
    "moe-every over layers": (["--moe-every", "2"], "--moe-every=2 exceeds --layers=1: no block would have an MoE"),
    "tokens per step": (["--batch-size", str(2**27)], "--batch-size x --seq-len = 4,294,967,296 tokens per step"),
    "empty hf-config": (["--hf-config", ""], "--hf-config is empty; pass a transformers config.json path or a model"),
    "blank hf-config": (["--hf-config", " "], "--hf-config is empty"),
    "nothing to quantize": (["--recipe", "mxfp8", "--quantize", ""], "recipe 'mxfp8' would quantize no GEMM: the "
                                                                    "list of quantized GEMMs is empty (--quantize '')"),
    "resume and overwrite": (["--resume", "--overwrite"], "--resume continues the run in --out-dir and --overwrite "
                                                           "starts it anew; pass one of them"),
    "decay past 1 / lr": (["--weight-decay", "1e30"], "--lr=0.003 x --weight-decay=1e+30 = 3e+27 > 1: AdamW's decoupled"),
}
# every model size flag, at zero and at 2**70 (which must not hang building the model)
SIZE_FLAGS = ["--width", "--layers", "--heads", "--experts", "--expert-width", "--dense-width", "--moe-every",
              "--shared-expert", "--vocab-size", "--seq-len", "--batch-size", "--steps"]
for _flag in SIZE_FLAGS:
    _named = _flag  # the flag the user typed, never the config field (steps, d_model)
    TRAIN_REFUSALS[f"{_flag} 2**70"] = ([_flag, str(2**70)], _named)
    if _flag != "--shared-expert":  # 0 is "no shared expert"
        TRAIN_REFUSALS[f"{_flag} 0"] = ([_flag, "0"], _named)


@pytest.mark.parametrize("case", TRAIN_REFUSALS)
def test_train_refuses_in_one_line_before_writing(corpus, tmp_path, capsys, monkeypatch, case):
    monkeypatch.chdir(tmp_path)  # an empty --out-dir would write here
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    flags, message = TRAIN_REFUSALS[case]
    if "--out-dir" not in flags:
        flags = [*flags, "--out-dir", str(tmp_path / "out")]
    recipe = [] if "--recipe" in flags else ["--recipe", "bf16"]
    rc = main(["train", *FLAGS, *recipe, "--data", str(corpus), "--steps", "2", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and message in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written anywhere


@pytest.mark.parametrize("dst", ["own checkpoint", "own checkpoint by another path", "directory path"])
def test_export_refuses_to_overwrite_its_source_or_write_a_directory_path(run_dir, tmp_path, capsys, dst):
    run = tmp_path / "r"
    shutil.copytree(run_dir, run)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    target = {"own checkpoint": str(run / "checkpoint.pt"),
              "own checkpoint by another path": str(run / ".." / "r" / "checkpoint.pt"),
              "directory path": str(tmp_path / "exports") + "/"}[dst]
    rc = main(["export", str(run), target])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    if dst == "directory path":
        assert "names a directory; pass a file name such as" in err and not (tmp_path / "exports").exists()
    else:
        assert "is the checkpoint being exported: writing there would replace the training checkpoint" in err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_a_second_run_into_an_out_dir_in_use_is_refused(corpus, tmp_path, capsys):
    """A process holding the out-dir lock (as a running `mxmoe train` does): a run into the
    same directory is refused in one line naming the holder, with nothing written; once
    the holder is gone, the run goes ahead."""
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from mxmoe.train.trainer import out_dir_lock\n"
        f"with out_dir_lock(Path({str(out)!r})):\n"
        "    print('locked', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        rc = main(["train", *FLAGS, "--recipe", "bf16", "--data", str(corpus), "--steps", "2", "--out-dir", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1
        assert f"is in use by another mxmoe run (pid {holder.pid}, lock" in err
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    finally:
        holder.kill()
        holder.wait()
    assert main(["train", *FLAGS, "--recipe", "bf16", "--data", str(corpus), "--steps", "2", "--out-dir", str(out)]) == 0


def test_the_lock_is_released_and_taken_again(tmp_path):
    with out_dir_lock(tmp_path / "o"), pytest.raises(ValueError, match=f"pid {os.getpid()}"), \
            out_dir_lock(tmp_path / "o"):
        pass
    with out_dir_lock(tmp_path / "o"):
        pass


# ---- inputs found by the second adversarial pass ----------------------------------------

@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_data_path_is_refused(tmp_path, capsys, monkeypatch, value):
    """--data "" would read the current directory (Path("") is ".")."""
    monkeypatch.chdir(tmp_path)
    rc = main(["train", *FLAGS, "--recipe", "bf16", "--data", value, "--steps", "1", "--out-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "the data path is empty" in err and err.count("\n") == 1, err


def test_load_corpus_names_a_bad_val_fraction():
    from mxmoe.train.data import load_corpus

    with pytest.raises(ValueError, match=r"val_fraction must be a number in \(0, 0.5\], got '0.1'"):
        load_corpus(None, val_fraction="0.1")


@pytest.mark.parametrize("kind", ["fifo", "character device"])
def test_data_that_is_not_a_regular_file_is_refused_without_reading(tmp_path, capsys, kind):
    """A FIFO or a device as --data would be read forever (load_corpus reads the whole file)."""
    if kind == "fifo":
        data = tmp_path / "fifo"
        os.mkfifo(data)
    else:
        data = Path("/dev/zero")
        if not data.exists():
            pytest.skip("no /dev/zero")
    rc = main(["train", *FLAGS, "--recipe", "bf16", "--data", str(data), "--steps", "1", "--out-dir",
               str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "is not a regular file or a directory" in err and err.count("\n") == 1, err


def test_an_evaluation_set_past_the_bound_is_refused(corpus, run_dir, tmp_path, capsys):
    rc = main(["train", *FLAGS, "--recipe", "bf16", "--data", str(corpus), "--eval-batches", str(2**40),
               "--out-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "tokens per evaluation set exceeds 134,217,728" in err and "--eval-batches" in err, err
    assert main(["eval", str(run_dir), "--device", "cpu", "--batch-size", str(2**70)]) == 2
    assert "tokens exceeds 134,217,728" in capsys.readouterr().err


# where a non-finite value can sit in a checkpoint that the checksums cannot catch (they
# are computed over the bad values): a weight, or AdamW's state
NONFINITE_PLACES = {
    "a NaN weight": (lambda st: st["model"]["embed"].__setitem__((0, 0), float("nan")), "'embed'"),
    "an inf weight": (lambda st: st["model"]["embed"].__setitem__((0, 1), float("-inf")), "'embed'"),
    "a NaN AdamW moment": (lambda st: next(iter(st["optimizer"]["state"].values()))["exp_avg"].view(-1)
                           .__setitem__(0, float("nan")), "'optimizer state exp_avg of parameter"),
}


@pytest.mark.parametrize("place", NONFINITE_PLACES)
def test_a_checkpoint_with_nonfinite_values_is_refused_by_every_loader(corpus, run_dir, tmp_path, capsys, place):
    """Checksums that match but a NaN or inf (written by other code or edited): resume,
    eval and export refuse it in one line naming the file and the tensor."""

    from mxmoe.train.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint

    poison, name = NONFINITE_PLACES[place]
    bad = tmp_path / "bad"
    shutil.copytree(run_dir, bad)
    state = load_checkpoint(bad, verify=False)
    poison(state)
    save_checkpoint(bad, state)  # checksums of the bad values: they match
    before = (bad / CHECKPOINT_NAME).read_bytes()
    for argv in (["train", *FLAGS, "--recipe", "bf16", "--data", str(corpus), "--steps", "3", "--out-dir", str(bad),
                  "--resume"], ["eval", str(bad), "--device", "cpu"], ["export", str(bad), str(tmp_path / "x.st")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"{str(bad / CHECKPOINT_NAME)!r} holds non-finite values ({name}" in err, err
        assert err.count("\n") == 1
    assert not (tmp_path / "x.st").exists()
    assert (bad / CHECKPOINT_NAME).read_bytes() == before  # left as it was


def _poisoned_export(src: Path, dst: Path, how: str) -> None:
    import json as _json

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    tensors = load_file(src)
    with safe_open(src, "pt") as f:
        meta = f.metadata()
    quantized = list(_json.loads(meta["mxmoe"])["quantized"])[0]
    if how == "a NaN bf16 weight":
        tensors["embed"][0, 0] = float("nan")
    elif how == "NaN E4M3 codes":
        tensors[quantized + ".e4m3"].view(torch.uint8)[0, 0] = 0x7F  # E4M3's NaN
    else:  # an E8M0 scale byte of 255: the block is NaN
        tensors[quantized + ".e8m0"][0, 0] = 255
    from mxmoe.train.checkpoint import state_checksums

    info = _json.loads(meta["mxmoe"])
    info["checksums"] = state_checksums(tensors)["tensors"]  # checksums of the bad values: they match
    save_file(tensors, dst, metadata={**meta, "mxmoe": _json.dumps(info)})


@pytest.mark.parametrize("how", ["a NaN bf16 weight", "NaN E4M3 codes", "an E8M0 scale of 255"])
def test_an_export_with_nonfinite_values_is_refused_by_eval(run_dir, tmp_path, capsys, how):
    good = tmp_path / "good.safetensors"
    assert main(["export", str(run_dir), str(good)]) == 0
    bad = tmp_path / "bad.safetensors"
    _poisoned_export(good, bad, how)
    capsys.readouterr()
    assert main(["eval", str(bad), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"{str(bad)!r} holds non-finite values (" in err and "it cannot be evaluated" in err, err
    assert err.count("\n") == 1


def test_overwrite_removes_the_old_runs_checkpoint(corpus, run_dir, tmp_path, monkeypatch, capsys):
    """A run started with --overwrite and stopped before its first checkpoint leaves no
    checkpoint of the old run behind (a resume or an eval would read the old weights)."""
    from mxmoe.train import trainer

    out = tmp_path / "r"
    shutil.copytree(run_dir, out)

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "save_checkpoint", interrupted)
    rc = main(["train", *FLAGS, "--recipe", "bf16", "--data", str(corpus), "--steps", "2", "--lr", "0.01",
               "--out-dir", str(out), "--overwrite"])
    assert rc == 130
    assert not (out / "checkpoint.pt").exists()
    assert "no checkpoint was written yet" in capsys.readouterr().err


# one value of the wrong type for every TrainConfig field (what a caller building the
# config in Python, or a hand-edited config.json, can pass); each must be refused by
# validate() with a ValueError naming the field, never a TypeError from deep inside
def _wrong_type(name: str, default):
    if name == "model":
        return {}
    if isinstance(default, bool):
        return 1
    if isinstance(default, (int, float)):
        return str(default)
    return 7  # the str fields (recipe, quant_backend, out_dir, data, device)


def test_every_trainconfig_field_of_the_wrong_type_is_refused_by_name():
    import dataclasses

    from mxmoe.train import TrainConfig

    for f in dataclasses.fields(TrainConfig):
        default = getattr(TrainConfig(), f.name)
        cfg = dataclasses.replace(TrainConfig(), **{f.name: _wrong_type(f.name, default)})
        with pytest.raises(ValueError, match=rf"\b{f.name}\b") as e:
            cfg.validate()
        assert "\n" not in str(e.value), f.name


def test_config_dicts_of_the_wrong_shape_are_refused():
    from mxmoe.models import ModelConfig
    from mxmoe.train import TrainConfig

    assert TrainConfig.from_dict({}) == TrainConfig()  # every key optional
    for bad in ([], "x", None):
        with pytest.raises(TypeError, match="TrainConfig.from_dict takes a dict"):
            TrainConfig.from_dict(bad)
        with pytest.raises(TypeError, match="ModelConfig.from_dict takes a dict"):
            ModelConfig.from_dict(bad)
    with pytest.raises(TypeError, match="ModelConfig.from_dict takes a dict"):
        TrainConfig.from_dict({"model": []})
    # a string is not split into letters
    with pytest.raises(ValueError, match=r"quantized must be a tuple of names .* got 'experts'; e.g. "):
        ModelConfig(quantized="experts")
    assert ModelConfig(quantized=["experts"]).quantized == ("experts",)
    with pytest.raises(ValueError, match=r"quantized has unknown entries \[1\]"):
        ModelConfig(quantized=[1])


def test_every_modelconfig_field_of_the_wrong_type_is_refused_by_name():
    import dataclasses

    from mxmoe.models import ModelConfig

    for f in dataclasses.fields(ModelConfig):
        default = getattr(ModelConfig(), f.name)
        bad = "x" if f.name == "hf_config" else _wrong_type(f.name, default) if f.name != "quantized" else 5
        with pytest.raises(ValueError, match=rf"\b{f.name}\b"):
            ModelConfig(**{f.name: bad})


# every file mxmoe reads or replaces, as a FIFO (reading one waits for a writer forever;
# replacing one would swap it for a plain file), and as a character device for the
# replaced ones: refused in one line naming the path, the path left as it was
def _run_with(name: str):
    return lambda run, corpus, out: run / name


FIFO_CASES = {
    "eval of a FIFO checkpoint.pt": (_run_with("checkpoint.pt"), lambda run, c, o: ["eval", str(run), "--device", "cpu"]),
    "export of a FIFO checkpoint.pt": (_run_with("checkpoint.pt"),
                                       lambda run, c, o: ["export", str(run), str(o / "x.safetensors")]),
    "resume from a FIFO checkpoint.pt": (_run_with("checkpoint.pt"), lambda run, c, o: [
        "train", *FLAGS, "--recipe", "bf16", "--data", str(c), "--steps", "3", "--out-dir", str(run), "--resume"]),
    "resume with a FIFO metrics.jsonl": (_run_with("metrics.jsonl"), lambda run, c, o: [
        "train", *FLAGS, "--recipe", "bf16", "--data", str(c), "--steps", "3", "--out-dir", str(run), "--resume"]),
    "eval of a FIFO .safetensors": (lambda run, c, o: o / "f.safetensors",
                                    lambda run, c, o: ["eval", str(o / "f.safetensors"), "--device", "cpu"]),
    "export onto a FIFO": (lambda run, c, o: o / "f.safetensors",
                           lambda run, c, o: ["export", str(run), str(o / "f.safetensors")]),
}


@pytest.mark.parametrize("case", FIFO_CASES)
def test_a_fifo_where_a_file_goes_is_refused_without_waiting(corpus, run_dir, tmp_path, case):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    where, argv = FIFO_CASES[case]
    fifo = where(run, corpus, tmp_path)
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    code = ("import sys; from mxmoe.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, *argv(run, corpus, tmp_path)], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr
    assert f"{str(fifo)!r} is a FIFO (named pipe)" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # left as it was


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.json", ".mxmoe.lock", "notes.txt"])
def test_export_never_replaces_a_file_that_is_not_an_export(run_dir, tmp_path, capsys, name):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    target = run / name
    if not target.exists():
        target.write_text("my notes")
    before = target.read_bytes()
    assert main(["export", str(run), str(target)]) == 2
    err = capsys.readouterr().err
    assert f"{str(target)!r} exists and is not an mxmoe export" in err and err.count("\n") == 1, err
    assert target.read_bytes() == before
    # an earlier export is replaced
    assert main(["export", str(run), str(tmp_path / "a.safetensors")]) == 0
    assert main(["export", str(run), str(tmp_path / "a.safetensors"), "--format", "bf16"]) == 0


def test_the_atomic_writer_never_replaces_a_device(tmp_path):
    """/dev/null-like files: os.replace would swap the device for a plain file."""
    from mxmoe.train.checkpoint import atomic_write_bytes

    with pytest.raises(ValueError, match=r"'/dev/null' is a character device, not a file mxmoe may replace"):
        atomic_write_bytes(Path("/dev/null"), lambda f: f.write(b"x"))
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"is a FIFO \(named pipe\), not a file mxmoe may replace"):
        atomic_write_bytes(fifo, lambda f: f.write(b"x"))
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_compare_refuses_the_triton_backend_off_cuda_before_training(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "cmp"
    assert main(["compare", *FLAGS, "--data", str(corpus), "--steps", "2", "--quant-backend", "triton",
                 "--out-dir", str(out)]) == 2
    assert "--quant-backend triton runs the Triton kernels, which need a CUDA device" in capsys.readouterr().err
    assert not (out / "bf16").exists()  # nothing trained first


def test_resume_without_a_checkpoint_says_how_to_start(corpus, tmp_path, capsys):
    assert main(["train", *FLAGS, "--data", str(corpus), "--steps", "2", "--out-dir", str(tmp_path / "new"),
                 "--resume"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint at" in err and "train without --resume" in err and err.count("\n") == 1, err


def test_an_export_whose_bytes_changed_is_refused(run_dir, tmp_path, capsys):
    """A flipped bit anywhere in a tensor of an export (the checksums in its metadata)."""
    good = tmp_path / "good.safetensors"
    assert main(["export", str(run_dir), str(good)]) == 0
    data = good.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    for offset in (header, header + (len(data) - header) // 2, len(data) - 1):
        bad = tmp_path / f"flip{offset}.safetensors"
        flipped = bytearray(data)
        flipped[offset] ^= 0x01
        bad.write_bytes(bytes(flipped))
        capsys.readouterr()
        assert main(["eval", str(bad), "--device", "cpu"]) == 2, offset
        err = capsys.readouterr().err
        assert f"{str(bad)!r} is damaged: its tensors do not match the checksums" in err and err.count("\n") == 1
    assert main(["eval", str(good), "--device", "cpu"]) == 0


@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_corpus_shorter_than_a_sequence_names_the_flag(tmp_path, capsys, command):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("abc")
    assert main([command, *FLAGS, "--data", str(tiny), "--steps", "2", "--out-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "fewer than --seq-len + 1 = 33; use a longer corpus or a smaller --seq-len" in err, err
    assert err.count("\n") == 1
