"""The default activation dtype follows what the machine computes fast: bfloat16 on CUDA
and on CPUs with native bf16 (AVX512-BF16 or AMX), float32 on other CPUs; the first line
of `mxmoe train` says which and why; --dtype overrides; --resume keeps the run's dtype."""

from __future__ import annotations

import json

import pytest
import torch

from mxmoe.cli import build_parser, config_from_args, main
from mxmoe.train.trainer import default_activation_dtype

FLAGS = ["--width", "64", "--layers", "1", "--heads", "2", "--experts", "4", "--top-k", "2", "--expert-width", "64",
         "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--warmup-steps", "1", "--device", "cpu",
         "--no-progress", "--recipe", "bf16", "--steps", "1"]

# (AVX512-BF16, AMX) -> the dtype auto picks on the CPU
CPUS = {"AVX2 only": (False, False, "float32"), "AVX512-BF16": (True, False, "bfloat16"),
        "AMX": (False, True, "bfloat16"), "both": (True, True, "bfloat16")}


def fake_cpu(monkeypatch, bf16: bool, amx: bool, capability: str = "AVX512", isa: str | None = None) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)


# (ATen capability, ONEDNN_MAX_CPU_ISA) on a CPU with AVX512-BF16 -> the dtype auto picks
SWITCHES = {"ATen at avx2": ("AVX2", None, "float32"), "oneDNN at AVX2": ("AVX512", "AVX2", "float32"),
            "oneDNN at AVX512_CORE": ("AVX512", "avx512_core", "float32"),
            "oneDNN at AVX512_CORE_BF16": ("AVX512", "AVX512_CORE_BF16", "bfloat16"),
            "oneDNN at AMX": ("AVX512", "AVX512_CORE_AMX", "bfloat16"), "oneDNN ALL": ("AVX512", "ALL", "bfloat16")}


@pytest.mark.parametrize("case", SWITCHES)
def test_bf16_switched_off_for_torch_counts_as_absent(monkeypatch, case):
    capability, isa, want = SWITCHES[case]
    fake_cpu(monkeypatch, True, False, capability, isa)
    dtype, why = default_activation_dtype(torch.device("cpu"))
    assert dtype == want
    assert ("switched off" in why) == (want == "float32")


@pytest.mark.parametrize("cpu", CPUS)
def test_the_cpu_default_follows_native_bf16(monkeypatch, cpu):
    bf16, amx, want = CPUS[cpu]
    fake_cpu(monkeypatch, bf16, amx)
    dtype, why = default_activation_dtype(torch.device("cpu"))
    assert dtype == want
    assert ("no native bf16" in why) == (want == "float32") and "torch capability" in why
    args = build_parser().parse_args(["train", *FLAGS])
    assert config_from_args(args, 256).model.dtype == want
    args = build_parser().parse_args(["train", *FLAGS, "--dtype", "float16"])  # the flag overrides
    assert config_from_args(args, 256).model.dtype == "float16"


def test_cuda_defaults_to_bf16():
    assert default_activation_dtype(torch.device("cuda"))[0] == "bfloat16"


def test_the_first_line_says_which_and_why_and_resume_keeps_the_dtype(monkeypatch, tmp_path, corpus, capsys):
    fake_cpu(monkeypatch, False, False)
    out = tmp_path / "r"
    assert main(["train", *FLAGS, "--data", str(corpus), "--out-dir", str(out)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("activation dtype float32: this CPU has no native bf16") and "--dtype overrides" in first
    assert json.loads((out / "config.json").read_text())["train"]["model"]["dtype"] == "float32"
    fake_cpu(monkeypatch, True, True)  # resumed on a machine whose default differs: the run's dtype
    assert main(["train", *FLAGS, "--data", str(corpus), "--out-dir", str(out), "--resume", "--steps", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "activation dtype float32: the resumed run's (--dtype overrides)"
    assert main(["train", *FLAGS, "--data", str(corpus), "--out-dir", str(tmp_path / "g"), "--dtype", "float32"]) == 0
    assert not capsys.readouterr().out.startswith("activation dtype")  # given: no note
