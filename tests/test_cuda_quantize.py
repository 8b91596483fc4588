"""The CUDA row + column quantizer (kernels/cuda_rowcol.cu) on a CPU machine: when it is
chosen, its settings, and that its source compiles for sm90 (where nvcc is installed).

Its bytes are checked on the GPU by benchmarks/check_kernels_cuda.py (every format, scale
mode, tile edge and layout against the reference; results/h200_cuda_rowcol/)."""

from __future__ import annotations

import itertools
import shutil
import subprocess

import pytest
import torch

from mxmoe.kernels import cuda_quantize as cq
from mxmoe.kernels import quantize as kq

CFG = dict(kq.TUNING["rowcol_cuda"])


def test_default_settings_are_valid():
    assert cq._settings_ok(CFG)


@pytest.mark.parametrize("bad", [{"threads": 96}, {"threads": 512}, {"rb": 3}, {"gb": 8}, {"rb": 0}])
def test_settings_out_of_range_are_refused(bad):
    assert not cq._settings_ok({**CFG, **bad})


def test_source_defines_the_settings_first():
    text = cq.source("e5m2", "floor", {**CFG, "threads": 128, "rb": 4, "gb": 2, "scratch": False})
    head = text.splitlines()[:6]
    assert head == ["#define NT 128", "#define RB 4", "#define GB 2", "#define ELEM 1", "#define MODE 0",
                    "#define SCRATCH 0"]
    assert "mx_rowcol_bf16" in text and "mx_scales_out" in text


def test_not_taken_for_cpu_tensors_or_when_disabled():
    x = torch.zeros(1, 64, 64, dtype=torch.bfloat16)
    assert not cq.applies(x, "e4m3", "rceil", CFG)
    assert not cq.applies(x, "e4m3", "rceil", {**CFG, "enabled": False})


def test_shared_memory_fits_sm90():
    assert cq.SMEM_BYTES <= 227 * 1024


def test_rowcol_on_cpu_takes_triton_with_the_reference_bytes(monkeypatch):
    """Under the interpreter the op never reaches the CUDA kernel (it would raise here)."""
    from mxmoe import quantize_mx

    def boom(*a, **k):
        raise AssertionError("the CUDA kernel was called for a CPU tensor")

    monkeypatch.setattr(cq, "rowcol", boom)
    if not kq.interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by the test suite's conftest)")
    x = (torch.randn(64, 96) * 4).to(torch.bfloat16)
    q_row, s_row, q_col, s_col = kq.quantize_rowcol(x)
    ref = quantize_mx(x, "e4m3", scale_mode="rceil", backend="reference")
    assert torch.equal(q_row.view(torch.uint8), ref.qdata.view(torch.uint8))
    assert torch.equal(s_row.view(torch.uint8), ref.scale.view(torch.uint8))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed (the GPU check compiles it with NVRTC)")
@pytest.mark.parametrize("fmt,mode,scratch", list(itertools.product(("e4m3", "e5m2"), ("floor", "rceil"), (0, 1))))
def test_source_compiles_for_sm90(tmp_path, fmt, mode, scratch):
    src = tmp_path / "k.cu"
    src.write_text(cq.source(fmt, mode, {**CFG, "scratch": bool(scratch)}))
    out = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), str(src)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
