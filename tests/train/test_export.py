"""mxmoe export (MXFP8 / bf16 safetensors) and mxmoe eval: the round trip on the CPU."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import mxmoe
from mxmoe.cli import main
from mxmoe.models import ModelConfig
from mxmoe.train import TrainConfig, train
from mxmoe.train.export import evaluate_source, export_checkpoint, load_export, quantized_weight_keys

# Export changes only the bf16 rounding of the weights the recipe keeps in high precision
# (router, norms; embedding and LM head already enter the model in bf16): the validation
# loss of an export stays within this relative distance of the checkpoint's.
EXPORT_VAL_LOSS_RTOL = 5e-3


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A tiny finished mxfp8 run covering every kind of weight: a dense block (moe_every=2),
    an MoE block with a shared expert, and an expert width (48) that is not a multiple of
    32 (its w2 blocks are zero padded along K)."""
    root = Path(__file__).resolve().parents[2] / "src" / "mxmoe"
    data = tmp_path_factory.mktemp("data") / "corpus.txt"
    data.write_bytes(b"\n".join(p.read_bytes() for p in sorted(root.rglob("*.py"))))
    out = tmp_path_factory.mktemp("run")
    model = ModelConfig(d_model=64, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_expert=48, moe_every=2,
                        d_ff_dense=96, shared_expert=32, max_seq_len=32)
    train(TrainConfig(batch_size=4, seq_len=32, steps=8, eval_interval=4, eval_batches=2, warmup_steps=2,
                      out_dir=str(out), data=str(data), progress=False, model=model))
    return out


def metrics_val_loss(run: Path) -> float:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m["kind"] == "eval"][-1]["val_loss"]


def test_quantized_keys_are_every_matrix_but_embedding_lm_head_and_router(run_dir):
    state = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)["model"]
    cfg = TrainConfig.from_dict(torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)["train_config"]).model
    matrices = {k for k, v in state.items() if v.dim() >= 2 and "router" not in k and k not in ("embed", "lm_head")}
    assert set(quantized_weight_keys(cfg)) == matrices
    assert "blocks.0.ffn.w13" in matrices and "blocks.1.ffn.shared.w2" in matrices
    assert quantized_weight_keys(ModelConfig(quantized=("experts",), n_layers=1)) == [
        "blocks.0.ffn.experts.w13", "blocks.0.ffn.experts.w2"]
    assert quantized_weight_keys(ModelConfig(quantized=("lm_head",), n_layers=1)) == ["lm_head"]


def test_mxfp8_export_round_trip_is_bit_exact(run_dir, tmp_path):
    ckpt = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    state = ckpt["model"]
    path = tmp_path / "model.safetensors"
    meta = export_checkpoint(run_dir, path, "mxfp8")
    qkeys = quantized_weight_keys(TrainConfig.from_dict(ckpt["train_config"]).model)
    with safe_open(path, framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
        file_meta = json.loads(f.metadata()["mxmoe"])
    assert file_meta == meta and meta["format"] == "mxfp8" and meta["scale_mode"] == "rceil"
    assert meta["block_size"] == 32 and meta["step"] == 8 and meta["model"]["d_expert"] == 48
    expected_names = {k + s for k in qkeys for s in (".e4m3", ".e8m0")} | (set(state) - set(qkeys))
    assert set(stored) == expected_names
    for key in qkeys:
        w = state[key]
        q, s = stored[key + ".e4m3"], stored[key + ".e8m0"]
        K = w.shape[-1]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8
        assert q.shape == (*w.shape[:-1], math.ceil(K / 32) * 32) and s.shape == (*w.shape[:-1], math.ceil(K / 32))
        mx = mxmoe.quantize_mx(w, "e4m3", dim=-1, pad=True)  # the library's own quantizer, rceil
        assert torch.equal(q.view(torch.uint8), mx.qdata.view(torch.uint8))
        assert torch.equal(s, mx.scale.view(torch.uint8))
    assert any(state[k].shape[-1] % 32 for k in qkeys)  # the padded case is covered
    for key in set(state) - set(qkeys):
        assert stored[key].dtype == torch.bfloat16 and torch.equal(stored[key], state[key].to(torch.bfloat16))
    loaded = load_export(path)
    assert loaded.kind == "mxfp8" and loaded.step == 8 and set(loaded.state) == set(state)
    for key in qkeys:  # dequantized weights: exactly the recipe's forward operand
        assert torch.equal(loaded.state[key], mxmoe.quantize_mx(state[key], "e4m3", dim=-1, pad=True).dequantize())
    for key in set(state) - set(qkeys):
        assert torch.equal(loaded.state[key], state[key].to(torch.bfloat16).float())
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_eval_of_checkpoint_equals_the_runs_own_val_loss_and_exports_stay_close(run_dir, tmp_path, capsys):
    ref = metrics_val_loss(run_dir)
    assert evaluate_source(run_dir).val_loss == ref  # same split, batches and model: the same number
    assert evaluate_source(run_dir / "checkpoint.pt").val_loss == ref
    for fmt in ("mxfp8", "bf16"):
        path = tmp_path / f"{fmt}.safetensors"
        assert main(["export", str(run_dir), str(path), "--format", fmt]) == 0
        r = evaluate_source(path)
        assert r.kind == fmt and r.recipe == "mxfp8" and r.batches == 2
        assert r.val_loss == pytest.approx(ref, rel=EXPORT_VAL_LOSS_RTOL)
        assert r.val_loss != ref  # the bf16 rounding of the unquantized weights does show
        assert main(["eval", str(path)]) == 0
        assert f"val loss {r.val_loss:.6f}" in capsys.readouterr().out
    floor = export_checkpoint(run_dir, tmp_path / "floor.safetensors", scale_mode="floor")
    assert floor["scale_mode"] == "floor"
    w = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)["model"]["blocks.1.ffn.experts.w13"]
    got = load_export(tmp_path / "floor.safetensors").state["blocks.1.ffn.experts.w13"]
    assert torch.equal(got, mxmoe.quantize_mx(w, "e4m3", dim=-1, scale_mode="floor").dequantize())


def test_eval_overrides(run_dir):
    r = evaluate_source(run_dir, recipe="bf16", n_batches=1, batch_size=2, seq_len=16)
    assert (r.recipe, r.batches, r.batch_size, r.seq_len) == ("bf16", 1, 2, 16) and math.isfinite(r.val_loss)


def test_export_write_is_atomic(run_dir, tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    export_checkpoint(run_dir, path, "bf16")
    before = path.read_bytes()

    def crash(*args):
        raise OSError("killed before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="killed before the rename"):
        export_checkpoint(run_dir, path, "mxfp8")
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


@pytest.mark.parametrize("argv,message", [
    (["export", "{tmp}/missing", "{tmp}/o.safetensors"], "does not exist"),
    (["export", "{run}", "{tmp}"], "is a directory"),
    (["export", "{tmp}/junk.bin", "{tmp}/o.safetensors"], "is not a readable torch checkpoint"),
    (["eval", "{tmp}/missing.safetensors"], "does not exist"),
    (["eval", ""], "the checkpoint path is empty"),
    (["export", "{run}", "{tmp}/o.safetensors", "--format", "bf16", "--scale-mode", "floor"],
     "--format bf16 stores no scales"),
    (["eval", "  "], "the checkpoint path is empty"),
    (["export", "", "{tmp}/o.safetensors"], "the checkpoint path is empty"),
    (["eval", "{tmp}/nonexistent_run"], "an mxmoe export\n"),  # no --resume advice outside train
    (["eval", "{run}", "--data", "/nonexistent/corpus.txt"], "does not exist"),
    (["eval", "{run}", "--eval-batches", "0"], "--eval-batches must be a positive integer, got 0"),
    (["eval", "{run}", "--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
    (["eval", "{run}", "--seq-len", "64"], "--seq-len 64 exceeds the longest sequence the model was built for, 32"),
    (["eval", "{run}", "--data", "{tmp}/tiny.txt"], "fewer than --seq-len + 1 = 33"),
    (["eval", "{tmp}/empty.safetensors"], "is not a readable safetensors file"),
    (["eval", "{tmp}/foreign.safetensors"], "not written by mxmoe export"),
    (["eval", "{tmp}/junk.bin"], "is not a readable torch checkpoint"),
    (["eval", "{run}", "--device", "tpu"], "unknown device 'tpu'"),
])
def test_export_and_eval_refuse_bad_input_with_a_message(run_dir, tmp_path, capsys, argv, message):
    (tmp_path / "junk.bin").write_bytes(b"not a checkpoint at all")
    (tmp_path / "tiny.txt").write_text("abc " * 5)
    (tmp_path / "empty.safetensors").write_bytes(b"")
    save_file({"x": torch.zeros(2)}, str(tmp_path / "foreign.safetensors"))
    argv = [a.format(tmp=tmp_path, run=run_dir) for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


def test_eval_refuses_the_triton_backend_off_cuda(run_dir, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["eval", str(run_dir), "--quant-backend", "triton", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--quant-backend triton runs the Triton kernels, which need a CUDA device" in err and "backend=" not in err


def test_export_of_an_export_says_what_it_reads(run_dir, tmp_path, capsys):
    first = tmp_path / "a.safetensors"
    assert main(["export", str(run_dir), str(first)]) == 0
    assert main(["export", str(first), str(tmp_path / "b.safetensors")]) == 2
    assert "is already an mxmoe export; mxmoe export reads a training checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["export", "a", "b", "--format", "fp4"], "invalid choice: 'fp4'"),
    (["export", "a", "b", "--scale-mode", "ceil"], "invalid choice: 'ceil'"),
    (["eval", "a", "--recipe", "fp4"], "invalid choice: 'fp4'"),
    (["export", "a"], "the following arguments are required: OUT"),
])
def test_export_and_eval_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
