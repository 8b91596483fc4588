"""mxmoe compare / report (the report's numbers and targets, reuse across commands) and
the named presets."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch

from mxmoe.cli import build_parser, config_from_args, main
from mxmoe.cli.presets import PRESETS, apply_preset, explicit_dests
from mxmoe.models import ModelConfig, MoETransformer
from mxmoe.train import TrainConfig, train
from mxmoe.train.compare import (
    PEAK_BF16_TFLOPS, SPEED_TARGET_RATIO, VAL_LOSS_GAP_TARGET_PCT, build_report, mfu, moving_average,
    parse_recipes, peak_tflops_for, plan_runs, recipe_config, run_compare, summarize_run,
)
from mxmoe.train.compare import read_metrics as library_read_metrics

TINY_FLAGS = ["--layers", "2", "--width", "64", "--heads", "2", "--experts", "4", "--top-k", "2",
              "--expert-width", "64", "--batch-size", "4", "--seq-len", "32", "--no-progress"]
RUN_FLAGS = ["--steps", "6", "--eval-interval", "3", "--eval-batches", "1", "--ckpt-interval", "3",
             "--warmup-steps", "2"]
README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def text_file(corpus) -> Path:
    """mxmoe's own sources as a corpus (the session's ``corpus`` fixture)."""
    return corpus


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def table_rows(report: str) -> dict[str, list[str]]:
    """The rows of the report's main table, by recipe."""
    rows = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 10 and cells[0] not in ("recipe", "---"):
            rows[cells[0]] = cells
    return rows


# ---- synthetic runs: the report's arithmetic -----------------------------------------

def fake_run(root: Path, recipe: str, *, val: float, ms: float, mem: float, steps: int = 40, device: str = "cpu",
             device_name: str | None = None, lr: float = 1e-3, finished: bool = True,
             flops_per_token: float = 1.5e8) -> Path:
    """A run directory as the worker leaves it, with chosen final val loss, step time and
    peak memory (train loss falls linearly to val + 0.1)."""
    d = root / recipe
    d.mkdir(parents=True)
    cfg = TrainConfig(recipe=recipe, steps=steps, lr=lr, out_dir=str(d), batch_size=8, seq_len=64)
    last = steps if finished else steps // 2
    lines = [{"kind": "eval", "step": 0, "loss": 5.5, "val_loss": 5.5}]
    for s in range(1, last + 1):
        lines.append({"kind": "train", "step": s, "loss": 5.5 - (5.4 - val) * s / steps, "ms_per_step":
                      10 * ms if s <= 5 else ms, "mem_gib": mem * min(1.0, s / 3), "tokens_per_s": 0.0})
        if s % 10 == 0:
            lines.append({"kind": "eval", "step": s, "loss": 0.0, "val_loss": val + (steps - s) * 0.01})
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (d / "config.json").write_text(json.dumps({
        "train": cfg.to_dict(), "params": {"total": 4_000_000, "active": 2_000_000}, "corpus": "synthetic",
        "device": device, "torch": "2.13.0", "flops_per_token": flops_per_token}))
    if finished:
        (d / "result.json").write_text(json.dumps({"train": cfg.to_dict(), "device": device,
                                                   "device_name": device_name, "rss_before_model_gib": None}))
    return d


def test_report_says_which_targets_are_missed_and_by_how_much(tmp_path):
    fake_run(tmp_path, "bf16", val=2.0, ms=100.0, mem=1.0)
    fake_run(tmp_path, "mxfp8", val=2.05, ms=200.0, mem=1.2)
    text = build_report(tmp_path).read_text()
    rows = table_rows(text)
    assert list(rows) == ["bf16", "mxfp8"]
    gap = 100 * (2.05 - 2.0) / 2.0
    tok_b, tok_m = 8 * 64 / 0.1, 8 * 64 / 0.2  # warm-up steps (10x slower) are left out of the mean
    assert rows["mxfp8"][2] == "2.0500" and rows["mxfp8"][3] == f"{gap:+.2f}%"
    assert rows["mxfp8"][5] == f"{tok_m:,.0f}" and rows["mxfp8"][6] == "200.0" and rows["mxfp8"][7] == "1.200"
    assert rows["mxfp8"][9] == f"{tok_m / tok_b:.3f}x" and rows["bf16"][9] == "1.000x"
    assert rows["mxfp8"][8] == "n/a"  # CPU: no peak, no MFU
    assert f"missed by {gap - VAL_LOSS_GAP_TARGET_PCT:.2f} percentage points" in text
    assert f"missed by {SPEED_TARGET_RATIO - tok_m / tok_b:.3f}x: {tok_m / tok_b:.3f}x of bf16" in text
    assert "missed by 0.200 GiB (+20.0%" in text
    assert "0 of 3 targets met" in text
    assert (tmp_path / "metrics-mxfp8.jsonl").read_bytes() == (tmp_path / "mxfp8" / "metrics.jsonl").read_bytes()
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "peak resident set size" in text and "max_memory_allocated" not in text
    assert "quantized recipes are emulated" in text  # the CPU speed ratio is not about MXFP8 hardware


def test_step_time_is_the_median_and_few_timed_steps_are_flagged(tmp_path):
    """One slow step among few timed ones (a page-in, another process's burst) moved the
    mean, and so the speedup, by a factor: the step time is the median of the timed steps,
    and a report whose runs have fewer than MIN_TIMED_STEPS timed steps says so."""
    from mxmoe.train.compare import MIN_TIMED_STEPS, WARMUP_STEPS_SKIPPED, summarize_run

    fake_run(tmp_path / "a", "bf16", val=2.0, ms=100.0, mem=1.0)
    fake_run(tmp_path / "a", "mxfp8", val=2.0, ms=100.0, mem=1.0)
    m = tmp_path / "a" / "bf16" / "metrics.jsonl"
    lines = [json.loads(x) for x in m.read_text().splitlines()]
    slow = next(x for x in lines if x["kind"] == "train" and x["step"] == WARMUP_STEPS_SKIPPED + 3)
    slow["ms_per_step"] = 6500.0
    m.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = summarize_run(tmp_path / "a" / "bf16")
    assert run.ms_per_step == 100.0 and run.timed_steps == 40 - WARMUP_STEPS_SKIPPED
    text = build_report(tmp_path / "a").read_text()
    assert table_rows(text)["mxfp8"][9] == "1.000x" and "too few steps" not in text
    # fake runs evaluate every 10 steps and finish on an evaluation: 10 steps = 5 timed, 20 = 15
    assert WARMUP_STEPS_SKIPPED + MIN_TIMED_STEPS in (15,)
    fake_run(tmp_path / "b", "bf16", val=2.0, ms=100.0, mem=1.0, steps=10)
    fake_run(tmp_path / "b", "mxfp8", val=2.0, ms=100.0, mem=1.0, steps=20)
    text = build_report(tmp_path / "b").read_text()
    assert f"**Speed from too few steps:** bf16 {10 - WARMUP_STEPS_SKIPPED} timed step(s)" in text
    assert "mxfp8 15" not in text
    speed = [line for line in text.splitlines() if line.startswith("| mxfp8 | tokens/s")]
    assert len(speed) == 1 and "(unreliable: too few timed steps)" in speed[0]
    assert "unreliable" not in build_report(tmp_path / "a").read_text()


def test_report_targets_met_and_equal_memory_is_a_miss(tmp_path):
    fake_run(tmp_path, "bf16", val=2.0, ms=100.0, mem=1.0)
    fake_run(tmp_path, "mxfp8", val=2.0 * 1.009, ms=100 / 0.96, mem=0.9)
    fake_run(tmp_path, "mxfp8-floor", val=1.9, ms=90.0, mem=1.0)
    text = build_report(tmp_path).read_text()
    assert list(table_rows(text)) == ["bf16", "mxfp8", "mxfp8-floor"]
    targets = [line for line in text.splitlines() if line.startswith("| mxfp8 |") and line.count("|") == 5]
    assert len(targets) == 3 and all(line.endswith("| met |") for line in targets)
    assert "5 of 6 targets met" in text
    assert "missed by 0.000 GiB (+0.0%: equal to bf16's)" in text


def test_report_mfu_from_the_gpu_name_or_the_given_peak(tmp_path):
    fpt = 1.4e8
    fake_run(tmp_path, "bf16", val=2.0, ms=10.0, mem=1.0, device="cuda:0", device_name="NVIDIA H200",
             flops_per_token=fpt)
    tok = 8 * 64 / 0.01
    rows = table_rows(build_report(tmp_path).read_text())
    assert rows["bf16"][8] == f"{100 * fpt * tok / 989e12:.2f}%"
    rows = table_rows(build_report(tmp_path, peak_tflops=100.0).read_text())
    assert rows["bf16"][8] == f"{100 * fpt * tok / 100e12:.2f}%"
    text = (tmp_path / "report.md").read_text()
    assert "max_memory_allocated" in text and "Not checked" in text  # no quantized recipe: no targets


def test_peak_table_and_mfu():
    assert peak_tflops_for("NVIDIA H200") == 989.0 and peak_tflops_for("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops_for("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops_for("NVIDIA GeForce RTX 4090") is None and peak_tflops_for(None) is None
    assert mfu(1e9, 1e5, None) is None
    assert mfu(1e9, 1e5, 1000.0) == pytest.approx(1e14 / 1e15)
    assert [k for k, _ in PEAK_BF16_TFLOPS].index("H100 PCIe") < [k for k, _ in PEAK_BF16_TFLOPS].index("H100")


def test_flops_per_token_counts_matmuls_and_attention():
    """The FLOPs MFU uses, counted here independently from the shapes."""
    cfg = ModelConfig(d_model=64, n_layers=3, n_heads=2, n_experts=4, top_k=2, d_expert=32, moe_every=3,
                      d_ff_dense=96, shared_expert=16, max_seq_len=128)
    model = MoETransformer(cfg, "bf16")
    D, S, V = 64, 128, 256
    attn = 4 * D * D
    moe = D * 4 + 2 * 3 * D * 32 + 3 * D * 16  # router, top-2 experts, shared expert
    dense = 3 * D * 96
    norms = 2 * D * 3 + D
    matmul = 3 * attn + 2 * dense + moe + V * D + norms  # + LM head; norms are counted as parameters
    assert model.flops_per_token(S) == 6 * matmul + 6 * 3 * S * D


def test_moving_average():
    assert moving_average([(1, 1.0), (2, 3.0), (3, 5.0), (4, 7.0)], 2) == [(1, 1.0), (2, 2.0), (3, 4.0), (4, 6.0)]


def test_report_lists_unfinished_runs_and_refuses_them_when_asked_for(tmp_path):
    fake_run(tmp_path, "bf16", val=2.0, ms=100.0, mem=1.0)
    fake_run(tmp_path, "mxfp8", val=2.0, ms=100.0, mem=1.0, finished=False)
    text = build_report(tmp_path).read_text()
    assert list(table_rows(text)) == ["bf16"] and "mxfp8 (step 20 of 40" in text
    with pytest.raises(ValueError, match="not finished \\(step 20 of 40\\)"):
        build_report(tmp_path, ("bf16", "mxfp8"))


def test_report_warns_when_runs_differ(tmp_path):
    fake_run(tmp_path, "bf16", val=2.0, ms=100.0, mem=1.0)
    fake_run(tmp_path, "mxfp8", val=2.0, ms=100.0, mem=1.0, lr=3e-3, device="cuda:0", device_name="NVIDIA H200")
    text = build_report(tmp_path).read_text()
    assert "differ in settings** (lr)" in text and "different devices" in text


def test_report_command_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "no finished run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path), "--peak-tflops", "-3"])
    assert "positive number of TFLOP/s" in capsys.readouterr().err


def _edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    path.write_text(json.dumps(fn(d)))


# damage of the kind the second adversarial pass found: fields of the wrong kind or missing
DAMAGED_RUNS = {
    "config.json without the recipe": lambda d: _edit_json(d / "bf16" / "config.json",
                                                           lambda c: {"train": {"steps": 40}}),
    "config.json without flops_per_token": lambda d: _edit_json(d / "bf16" / "config.json",
                                                                lambda c: {k: v for k, v in c.items()
                                                                           if k != "flops_per_token"}),
    "a number as device": lambda d: _edit_json(d / "mxfp8" / "result.json", lambda r: {**r, "device": 5}),
    "result.json a list": lambda d: (d / "mxfp8" / "result.json").write_text("[1, 2, 3]"),
    "result.json of strings": lambda d: _edit_json(d / "mxfp8" / "result.json", lambda r: {k: "x" for k in r}),
    "a text rss": lambda d: _edit_json(d / "mxfp8" / "result.json", lambda r: {**r, "rss_before_model_gib": "1.0"}),
    "metrics without mem_gib": lambda d: (d / "bf16" / "metrics.jsonl").write_text("".join(
        json.dumps({k: v for k, v in json.loads(line).items() if k != "mem_gib"}) + "\n"
        for line in (d / "bf16" / "metrics.jsonl").read_text().splitlines())),
}


@pytest.mark.parametrize("damage", DAMAGED_RUNS)
def test_report_of_damaged_runs_is_one_line(tmp_path, capsys, damage):
    fake_run(tmp_path, "bf16", val=2.0, ms=100.0, mem=1.0)
    fake_run(tmp_path, "mxfp8", val=2.01, ms=90.0, mem=0.8)
    DAMAGED_RUNS[damage](tmp_path)
    rc = main(["report", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc in (0, 2) and "Traceback" not in err  # read around the damage, or refused in one line
    if rc == 2:
        assert err.startswith("mxmoe report: error: ") and err.count("\n") == 1, err
    if damage in ("result.json of strings", "a text rss"):  # the file is named, not a format error
        assert rc == 2 and "mxfp8/result.json' is damaged" in err, err


def test_report_of_an_empty_directory_name_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the current directory's runs
    assert main(["report", ""]) == 2
    assert "the compare directory is empty; pass the --out-dir of mxmoe compare" in capsys.readouterr().err


@pytest.mark.parametrize("text,message", [
    ("bf16,fp4", "unknown recipe(s) ['fp4']"),
    ("", "empty entry"),
    ("bf16,,mxfp8", "empty entry"),
    ("mxfp8,bf16,mxfp8", "['mxfp8'] named more than once"),
])
def test_parse_recipes_refuses_bad_lists(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_recipes(text)


def test_plan_reuse_needs_the_same_settings(tmp_path):
    cfg = TrainConfig(steps=40, batch_size=8, seq_len=64, lr=1e-3)
    fake_run(tmp_path, "bf16", val=2.0, ms=100.0, mem=1.0)
    fake_run(tmp_path, "mxfp8", val=2.0, ms=100.0, mem=1.0, finished=False)
    (tmp_path / "mxfp8" / "checkpoint.pt").write_bytes(b"")
    plans = plan_runs(cfg, ("bf16", "mxfp8", "mxfp8-floor"), tmp_path, reuse=True)
    assert [(p.recipe, p.action) for p in plans] == [("bf16", "reuse"), ("mxfp8", "resume"), ("mxfp8-floor", "train")]
    assert all(p.cfg.out_dir == str(tmp_path / p.recipe) and p.cfg.recipe == p.recipe for p in plans)
    with pytest.raises(ValueError, match="already holds a bf16 run: pass --reuse.*--overwrite"):
        plan_runs(cfg, ("bf16",), tmp_path, reuse=False)  # a new comparison over a finished run
    assert [p.action for p in plan_runs(dataclasses.replace(cfg, overwrite=True), ("bf16",), tmp_path,
                                        reuse=False)] == ["train"]
    with pytest.raises(ValueError, match="other settings than asked for: lr=0.001 \\(asked 0.003\\)"):
        plan_runs(dataclasses.replace(cfg, lr=3e-3), ("bf16",), tmp_path, reuse=True)
    for steps in (20, 80):  # a shorter or extended run has another lr schedule
        with pytest.raises(ValueError, match=f"steps=40 \\(asked {steps}\\)"):
            plan_runs(dataclasses.replace(cfg, steps=steps), ("mxfp8",), tmp_path, reuse=True)


# ---- real comparisons -----------------------------------------------------------------

def test_compare_in_separate_commands_then_reuse(tmp_path, text_file, capsys):
    """bf16 and mxfp8 trained by two commands, reported together by a third that trains
    nothing; each recipe's run is the run `mxmoe train` makes with the same flags."""
    out = tmp_path / "cmp"
    flags = [*TINY_FLAGS, *RUN_FLAGS, "--data", str(text_file), "--out-dir", str(out)]
    assert main(["compare", *flags, "--recipes", "bf16"]) == 0
    assert "Not checked" in (out / "report.md").read_text()
    assert main(["compare", *flags, "--recipes", "mxfp8"]) == 0
    before = {p: p.read_bytes() for p in (out / "bf16").iterdir()} | {p: p.read_bytes() for p in (out / "mxfp8").iterdir()}
    capsys.readouterr()
    assert main(["compare", *flags, "--recipes", "bf16,mxfp8", "--reuse"]) == 0
    printed = capsys.readouterr().out
    assert "reusing the finished run of bf16" in printed and "reusing the finished run of mxfp8" in printed
    assert {p: p.read_bytes() for p in before} == before  # nothing trained again
    report = (out / "report.md").read_text()
    rows = table_rows(report)
    for recipe in ("bf16", "mxfp8"):
        lines = read_metrics(out / recipe / "metrics.jsonl")
        assert rows[recipe][1] == f"{[m for m in lines if m['kind'] == 'train'][-1]['loss']:.4f}"
        assert rows[recipe][2] == f"{[m for m in lines if m['kind'] == 'eval'][-1]['val_loss']:.4f}"
        assert (out / f"metrics-{recipe}.jsonl").read_bytes() == (out / recipe / "metrics.jsonl").read_bytes()
        assert float(rows[recipe][7]) > 0.05  # a real peak RSS of its own process
    assert len([line for line in report.splitlines() if line.startswith("| mxfp8 | ")]) == 4  # row + 3 targets
    # the recipe's run is exactly `train` with the same settings
    args = build_parser().parse_args(["train", *flags, "--recipe", "mxfp8"])
    cfg = config_from_args(args, 256)
    direct = tmp_path / "direct"
    train(dataclasses.replace(cfg, out_dir=str(direct)))
    losses = lambda p: [(m["step"], m["loss"]) for m in read_metrics(p)]
    assert losses(out / "mxfp8" / "metrics.jsonl") == losses(direct / "metrics.jsonl")


def test_compare_reuse_resumes_an_interrupted_recipe_exactly(tmp_path, text_file):
    from test_training import _train_until

    args = build_parser().parse_args(["train", *TINY_FLAGS, *RUN_FLAGS, "--data", str(text_file)])
    cfg = config_from_args(args, 256)
    out = tmp_path / "cmp"
    _train_until(recipe_config(cfg, "mxfp8", out), stop_after=4)  # killed after step 4; checkpoint at 3
    assert [p.action for p in plan_runs(cfg, ("mxfp8",), out, reuse=True)] == ["resume"]
    run_compare(cfg, ("mxfp8",), out, reuse=True)
    ref = tmp_path / "ref"
    train(dataclasses.replace(cfg, recipe="mxfp8", out_dir=str(ref)))
    got = [(m["step"], m["loss"]) for m in read_metrics(out / "mxfp8" / "metrics.jsonl") if m["kind"] == "train"]
    want = [(m["step"], m["loss"]) for m in read_metrics(ref / "metrics.jsonl") if m["kind"] == "train"]
    assert got == want and len(got) == 6
    assert (out / "mxfp8" / "result.json").exists() and (out / "report.md").exists()
    # killed after its last checkpoint but before result.json: resuming only records the result
    from mxmoe.train import worker

    (out / "mxfp8" / "result.json").unlink()
    metrics = (out / "mxfp8" / "metrics.jsonl").read_bytes()
    assert [p.action for p in plan_runs(cfg, ("mxfp8",), out, reuse=True)] == ["resume"]
    assert worker.main([json.dumps(recipe_config(cfg, "mxfp8", out).to_dict()), "--resume"]) == 0
    assert (out / "mxfp8" / "metrics.jsonl").read_bytes() == metrics
    kind = "cuda_max_memory_allocated" if torch.cuda.is_available() else "process_peak_rss"  # device "auto"
    assert json.loads((out / "mxfp8" / "result.json").read_text())["memory_kind"] == kind


@pytest.mark.parametrize("flags,message", [
    (["--experts", "0"], "--experts must be a positive integer"),
    (["--top-k", "5"], "--top-k=5 exceeds --experts=4"),
    (["--data", "/nonexistent/corpus.txt"], "does not exist"),
    (["--seq-len", "1000000"], "fewer than --seq-len + 1"),
    (["--lr", "0"], "lr must be a positive number"),
])
def test_compare_bad_flags_stop_before_any_run(tmp_path, text_file, capsys, flags, message):
    out = tmp_path / "cmp"
    rc = main(["compare", *TINY_FLAGS, "--data", str(text_file), "--out-dir", str(out), *flags])
    assert rc == 2 and message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("flags,message", [
    (["--recipes", "bf16,fp4"], "unknown recipe(s) ['fp4']"),
    (["--recipes", "bf16,bf16"], "named more than once"),
    (["--recipes", ","], "empty entry"),
    (["--preset", "h100000"], "invalid choice: 'h100000'"),
])
def test_compare_argparse_errors(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        main(["compare", "--out-dir", str(tmp_path / "cmp"), *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "cmp").exists()


# ---- presets --------------------------------------------------------------------------

def preset_args(argv: list[str]):
    args = build_parser().parse_args(argv)
    overridden = apply_preset(args, explicit_dests(build_parser(), argv))
    return args, overridden


def test_h200_preset_is_the_issues_model():
    args, _ = preset_args(["train", "--preset", "h200"])
    cfg = config_from_args(args, 256)
    m = cfg.model
    with torch.device("meta"):
        params = MoETransformer(m, "bf16").num_params()
    assert 100e6 <= params["total"] <= 300e6
    assert 8 <= m.n_layers <= 12 and 16 <= m.n_experts <= 64 and 2 <= m.top_k <= 8 and 512 <= m.d_model <= 1024
    assert cfg.steps >= 2000 and cfg.eval_interval >= 100
    # the README states the parameter counts this preset really has
    text = README.read_text()
    assert f"{params['total'] / 1e6:.1f}M parameters" in text and f"{params['active'] / 1e6:.1f}M active" in text


def test_fine_grained_preset_is_many_narrow_top8_experts_and_documented():
    """h200-fine: 64-128 experts of width 256-512, top-8, the h200 run settings; docs/TRAINING.md
    states the parameter counts it really has."""
    args, _ = preset_args(["train", "--preset", "h200-fine"])
    cfg = config_from_args(args, 256)
    m = cfg.model
    with torch.device("meta"):
        params = MoETransformer(m, "bf16").num_params()
    assert 64 <= m.n_experts <= 128 and 256 <= m.d_expert <= 512 and m.top_k == 8
    assert {k: v for k, v in PRESETS["h200-fine"].items() if k not in ("experts", "top_k", "expert_width")} == \
        {k: v for k, v in PRESETS["h200"].items() if k not in ("experts", "top_k", "expert_width")}
    text = (README.parent / "docs" / "TRAINING.md").read_text()
    assert "`h200-fine`" in text
    assert f"{params['total'] / 1e6:.1f}M parameters, {params['active'] / 1e6:.1f}M active" in text


def test_explicit_flags_override_the_preset_even_at_their_default_value():
    args, overridden = preset_args(["compare", "--preset", "h200", "--steps", "300", "--layers", "4"])
    assert (args.steps, args.layers) == (300, 4)  # 4 is also the default of --layers: still given
    assert (args.width, args.experts, args.batch_size) == (512, 32, 32)
    assert overridden == ["layers", "steps"]
    args, overridden = preset_args(["train", "--steps", "7"])  # no preset: nothing changes
    assert overridden == [] and args.steps == 7 and args.width == ModelConfig().d_model
    assert set(PRESETS["h200"]) <= set(vars(build_parser().parse_args(["train"])))


def test_unknown_preset_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--preset", "tiny-gpu"])
    assert e.value.code == 2 and "invalid choice: 'tiny-gpu'" in capsys.readouterr().err


def test_preset_train_run_uses_explicit_overrides(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--preset", "h200", *TINY_FLAGS, "--steps", "2", "--eval-batches", "1",
               "--ckpt-interval", "0", "--data", str(text_file), "--out-dir", str(out)])
    assert rc == 0
    t = json.loads((out / "config.json").read_text())["train"]
    assert (t["lr"], t["warmup_steps"], t["eval_interval"]) == (1e-3, 100, 250)  # from the preset
    assert (t["model"]["d_model"], t["steps"], t["batch_size"]) == (64, 2, 4)  # given
    assert "preset h200 (overridden by flags:" in capsys.readouterr().out
    assert math.isfinite(read_metrics(out / "metrics.jsonl")[-1]["val_loss"])


def test_compare_refuses_expert_parallel(tmp_path, text_file):
    """compare runs each recipe in one process: --expert-parallel is refused before any work."""
    out = tmp_path / "cmp"
    assert main(["compare", *TINY_FLAGS, "--data", str(text_file), "--out-dir", str(out), "--recipes", "bf16",
                 "--expert-parallel", "2"]) == 2
    assert not out.exists()


@pytest.mark.parametrize("graphs,line", [((True, True), "replayed from a CUDA graph after the first step"),
                                         ((False, None), "launched eagerly from Python"),
                                         ((True, False), "speeds are not comparable")])
def test_report_says_how_gpu_steps_ran(tmp_path, graphs, line):
    """GPU runs: the report states whether the steps were replayed from a CUDA graph (a run
    from before the option has no cuda_graph in its config and stepped eagerly)."""
    for recipe, graph in zip(("bf16", "mxfp8"), graphs):
        d = fake_run(tmp_path, recipe, val=2.0, ms=10.0, mem=1.0, device="cuda:0", device_name="NVIDIA H200")
        config = json.loads((d / "config.json").read_text())
        if graph is None:
            del config["train"]["cuda_graph"]
        else:
            config["train"]["cuda_graph"] = graph
        (d / "config.json").write_text(json.dumps(config))
    assert line in build_report(tmp_path).read_text()


def test_report_says_eager_after_a_failed_capture(tmp_path):
    """A run asked for CUDA graphs (config.json) whose capture failed went on eagerly: its
    metrics say so step by step, and the report must not claim graph replays (config.json's
    setting alone would claim them)."""
    for recipe in ("bf16", "mxfp8"):
        d = fake_run(tmp_path, recipe, val=2.0, ms=10.0, mem=1.0, device="cuda:0", device_name="NVIDIA H200")
        config = json.loads((d / "config.json").read_text())
        config["train"]["cuda_graph"] = True
        (d / "config.json").write_text(json.dumps(config))
        if recipe == "mxfp8":  # capture failed at step 2: eager from then on
            lines = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
            for m in lines:
                if m["kind"] == "train":
                    m["cuda_graph"] = m["step"] < 2
            (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    text = build_report(tmp_path).read_text()
    assert "replayed from a CUDA graph for bf16; launched eagerly for mxfp8" in text
    assert "replayed from a CUDA graph after the first step" not in text


def test_reuse_of_cpu_runs_ignores_gpu_only_settings(tmp_path):
    """A CPU run made without (or with another) --no-cuda-graph is reused: the setting does
    nothing on the CPU. On a GPU it is compared: graphed and eager steps differ in speed."""
    cfg = TrainConfig(steps=40, batch_size=8, seq_len=64, lr=1e-3)
    for device in ("cpu", "cuda:0"):
        root = tmp_path / device.replace(":", "")
        d = fake_run(root, "bf16", val=2.0, ms=100.0, mem=1.0, device=device)
        config = json.loads((d / "config.json").read_text())
        del config["train"]["cuda_graph"]  # a run from before the option: it stepped eagerly
        (d / "config.json").write_text(json.dumps(config))
        for graph in (True, False):
            run_cfg = dataclasses.replace(cfg, cuda_graph=graph)
            if device == "cpu" or not graph:
                assert [p.action for p in plan_runs(run_cfg, ("bf16",), root, reuse=True)] == ["reuse"]
            else:
                with pytest.raises(ValueError, match="cuda_graph=False \\(asked True\\)"):
                    plan_runs(run_cfg, ("bf16",), root, reuse=True)
    fake_run(tmp_path / "mixed", "mxfp8", val=2.0, ms=100.0, mem=1.0)
    d = fake_run(tmp_path / "mixed", "bf16", val=2.0, ms=100.0, mem=1.0)
    config = json.loads((d / "config.json").read_text())
    config["train"]["cuda_graph"] = False
    (d / "config.json").write_text(json.dumps(config))
    assert "differ in settings" not in build_report(tmp_path / "mixed").read_text()


def test_report_says_the_cpu_speed_ratio_is_an_emulation_only_on_the_cpu(tmp_path):
    for recipe in ("bf16", "mxfp8"):
        fake_run(tmp_path / "gpu", recipe, val=2.0, ms=10.0, mem=1.0, device="cuda:0", device_name="NVIDIA H200")
        fake_run(tmp_path / "cpu", recipe, val=2.0, ms=10.0, mem=1.0)
    assert "emulated" not in build_report(tmp_path / "gpu").read_text()
    assert "quantized recipes are emulated" in build_report(tmp_path / "cpu").read_text()


# ---- damaged inputs of mxmoe report: damaged metrics lines are skipped wherever they are and
# the report reads every valid line; a damaged config.json is refused in one line naming it

DAMAGE = {
    "torn": b'{"kind": "train", "st',
    "nul bytes": b"\0" * 30,
    "nul inside": b'{"kind": "train", "step": 3\0, "loss": 1.0}',
    "not utf-8": b"\xff\xfe{}",
    "a json list": b"[1, 2]",
    "a train line without loss": b'{"kind": "train", "step": 3, "ms_per_step": 1.0}',
    "an eval line without val_loss": b'{"kind": "eval", "step": 3}',
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_metrics_lines_are_skipped_wherever_they_are(tmp_path, damage):
    run = fake_run(tmp_path, "bf16", val=2.0, ms=100.0, mem=1.0)
    path = run / "metrics.jsonl"
    good = path.read_bytes().split(b"\n")[:-1]
    want = library_read_metrics(path)
    damaged = good[:3] + [DAMAGE[damage]] + good[3:20] + [DAMAGE[damage]] + good[20:]
    path.write_bytes(b"\n".join(damaged) + b"\n")
    assert library_read_metrics(path) == want  # every valid line, the ones after the damage included
    s = summarize_run(run)
    assert s.finished and s.train_curve[-1][0] == 40
    fake_run(tmp_path, "mxfp8", val=2.05, ms=200.0, mem=1.2)
    assert "| bf16 |" in build_report(tmp_path).read_text()


@pytest.mark.parametrize("config", [b"", b"{not json", b"\xff\xfe", b"[1]", b'{"train": 5}', b'{"train": {}}'])
def test_a_damaged_config_is_refused_in_one_line(tmp_path, capsys, config):
    run = fake_run(tmp_path, "bf16", val=2.0, ms=100.0, mem=1.0)
    (run / "config.json").write_bytes(config)
    rc = main(["report", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{str(run / 'config.json')!r} is damaged or not an mxmoe run's config" in err


@pytest.mark.parametrize("checkpoint_first", [False, True])
def test_interrupt_message_says_how_to_go_on(tmp_path, text_file, capsys, monkeypatch, checkpoint_first):
    """Ctrl-C ends `mxmoe train` with 130 and a line that names what works next: --resume
    when a checkpoint exists, --overwrite when the run stopped before its first one."""
    import mxmoe.cli as cli

    out = tmp_path / "run"
    flags = ["train", *TINY_FLAGS, "--steps", "2", "--eval-batches", "1", "--data", str(text_file),
             "--out-dir", str(out)]
    if checkpoint_first:
        assert main(flags) == 0  # leaves a checkpoint
        flags = [*flags, "--resume"]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "train", interrupted)
    capsys.readouterr()
    assert main(flags) == 130
    err = capsys.readouterr().err
    assert ("--resume" in err) == checkpoint_first and ("--overwrite" in err) != checkpoint_first, err
