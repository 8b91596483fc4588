"""mxmoe train / compare with --hf-config: a transformers MoE model trained from scratch by
mxmoe's trainer (same metrics, checkpoints, resume and reports as mxmoe's own model)."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import config

from mxmoe.cli import main
from mxmoe.train.checkpoint import load_checkpoint

SIZES = ["--layers", "2", "--width", "64", "--heads", "4", "--experts", "8", "--top-k", "2", "--expert-width", "64"]
RUN = ["--batch-size", "4", "--seq-len", "32", "--eval-interval", "3", "--eval-batches", "1", "--ckpt-interval", "3",
       "--warmup-steps", "2", "--no-progress"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(3000)))
    return path


def _steps(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(line).get("kind") == "train"]


def test_train_a_model_type_and_resume(tmp_path, text_file):
    out = tmp_path / "run"
    flags = ["train", "--hf-config", "qwen3_moe", *SIZES, *RUN, "--data", str(text_file), "--out-dir", str(out)]
    assert main([*flags, "--steps", "4"]) == 0
    assert main([*flags, "--steps", "6", "--resume"]) == 0
    steps = _steps(out)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert steps[-1]["loss"] < steps[0]["loss"]
    saved = json.loads((out / "config.json").read_text())
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**saved["train"]["model"]["hf_config"])
    assert hf.model_type == "qwen3_moe" and hf.hidden_size == 64 and hf.num_experts == 8 and hf.vocab_size == 256
    state = load_checkpoint(out)["model"]
    assert "model.model.layers.0.mlp.experts.gate_up_proj" in state  # the transformers keys, under "model."
    assert state["model.model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16


def test_train_a_config_json(tmp_path, text_file):
    cfg = config("mixtral")
    cfg.save_pretrained(tmp_path / "mixtral")
    out = tmp_path / "run"
    assert main(["train", "--hf-config", str(tmp_path / "mixtral" / "config.json"), *RUN, "--data", str(text_file),
                 "--out-dir", str(out), "--steps", "3", "--recipe", "mxfp8-floor"]) == 0
    saved = json.loads((out / "config.json").read_text())["train"]["model"]
    assert saved["hf_config"]["model_type"] == "mixtral" and saved["n_experts"] == 8 and saved["d_model"] == 64


@pytest.mark.slow
def test_compare_accepts_hf_config(tmp_path, text_file):
    out = tmp_path / "cmp"
    assert main(["compare", "--hf-config", "qwen3_moe", *SIZES, *RUN, "--data", str(text_file), "--out-dir",
                 str(out), "--steps", "3", "--recipes", "bf16,mxfp8"]) == 0
    assert (out / "report.md").is_file() and (out / "mxfp8" / "metrics.jsonl").is_file()


@pytest.mark.parametrize("flags,message", [
    (["--hf-config", "no_such_model"], "neither a config.json nor a transformers model type"),
    (["--hf-config", "missing/config.json"], "no such config file"),
    (["--hf-config", "qwen3_moe", "--mx-dispatch"], "--mx-dispatch sets mxmoe's own model"),
    (["--hf-config", "qwen3_moe", "--moe-every", "2"], "--moe-every sets mxmoe's own model"),
    (["--hf-config", "llama"], "llama is not an MoE model"),
    (["--hf-config", "qwen3_moe", "--expert-parallel", "2"], r"a transformers model \(--hf-config\) trains in one"),
    (["--hf-config", "jetmoe"], "jetmoe: this family's MoE experts do not go through"),
])
def test_refused_flags(flags, message, tmp_path, text_file, capsys):
    assert main(["train", *flags, *RUN, "--data", str(text_file), "--out-dir", str(tmp_path / "r"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_export_refuses_a_transformers_run(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert main(["train", "--hf-config", "qwen3_moe", *SIZES, *RUN, "--data", str(text_file), "--out-dir", str(out),
                 "--steps", "1"]) == 0
    assert main(["eval", str(out), "--data", str(text_file)]) == 0  # evaluation builds the same model
    assert main(["export", str(out), str(tmp_path / "m.safetensors")]) == 2
    assert "use save_pretrained" in capsys.readouterr().err


# config.json files transformers or the model would fail on: refused in one line, nothing written
BAD_CONFIGS = {
    "not JSON": ("{bad", "is not a JSON file"),
    "not UTF-8": (b"\xff\xfe{}", "is not a JSON file"),
    "a list as model_type": ('{"model_type": ["qwen3_moe"]}', "is not a transformers config.json"),
    "a string width": ('{"model_type": "qwen3_moe", "hidden_size": "abc"}', "transformers refuses this qwen3_moe"),
    "KV heads not dividing the heads": ('{"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 2, '
                                        '"num_key_value_heads": 3, "head_dim": 32}', "is not a multiple of"),
    "an odd head dimension": ('{"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 2, '
                              '"num_key_value_heads": 2, "head_dim": 21}',
                              "head_dim 21 is odd; rotary embeddings need an even one: use an even head_dim in the config"
                              "|transformers refuses this qwen3_moe"),  # newer transformers check it
}
# values transformers' config accepts (some versions) but its model cannot be built or trained
# with: refused by building the model on the meta device, or by the epsilon check
_SMALL = ('"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, '
          '"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, '
          '"num_key_value_heads": 2, "vocab_size": 256')
_CANNOT_BUILD = "transformers cannot build a qwen3_moe model|transformers refuses this qwen3_moe"
for _name, (_value, _message) in {
        "zero KV heads": ('"num_key_value_heads": 0', "has num_key_value_heads 0; it must be a positive integer"),
        "head_dim 0": ('"head_dim": 0', "has head_dim 0; it must be a positive integer"),
        "decoder_sparse_step 0": ('"decoder_sparse_step": 0', "has decoder_sparse_step 0; it must be a positive"),
        "a negative width": ('"hidden_size": -64', "has hidden_size -64; it must be a positive integer"),
        "an unknown activation": ('"hidden_act": "bogus"', _CANNOT_BUILD)}.items():
    BAD_CONFIGS[_name] = ("{" + _SMALL + ", " + _value + "}", f"{_message}|transformers refuses this qwen3_moe")
BAD_CONFIGS["a negative epsilon"] = ("{" + _SMALL + ', "rms_norm_eps": -1}',
                                     "rms_norm_eps -1; a normalization epsilon|transformers refuses this qwen3_moe")


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_bad_config_files_are_refused_before_writing(case, tmp_path, text_file, capsys):
    content, message = BAD_CONFIGS[case]
    path = tmp_path / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    rc = main(["train", "--hf-config", str(path), *RUN, "--data", str(text_file), "--out-dir", str(tmp_path / "r"),
               "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(message, err) and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


def test_heads_that_do_not_split_the_width_are_refused(tmp_path, text_file, capsys):
    sizes = [s if s != "4" or i != 5 else "3" for i, s in enumerate(SIZES)]  # --heads 3 on width 64
    assert sizes[4:6] == ["--heads", "3"]
    rc = main(["train", "--hf-config", "qwen3_moe", *sizes, *RUN, "--data", str(text_file), "--out-dir",
               str(tmp_path / "r"), "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and ("attention heads" in err or "head dimension" in err), err
    assert not (tmp_path / "r").exists()


def test_a_directory_without_a_config_json_is_named(tmp_path, text_file, capsys):
    (tmp_path / "empty").mkdir()
    rc = main(["train", "--hf-config", str(tmp_path / "empty"), *RUN, "--data", str(text_file), "--out-dir",
               str(tmp_path / "r"), "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "is a directory without a config.json" in err and err.count("\n") == 1, err
