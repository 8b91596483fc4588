"""The CUDA row + column quantizer (kernels/cuda_rowcol.cu) on a CPU machine: when it is
chosen, its settings, and that its source compiles for sm90 (where nvcc is installed).

Its bytes are checked on the GPU by benchmarks/check_kernels_cuda.py (every format, scale
mode, tile edge and layout against the reference; results/h200_cuda_rowcol/)."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess

import pytest
import torch

from mxmoe.kernels import cuda_quantize as cq
from mxmoe.kernels import quantize as kq

CFG = dict(kq.TUNING["rowcol_cuda"])


def test_default_settings_are_valid():
    assert cq._settings_ok(CFG)


@pytest.mark.parametrize("bad", [{"threads": 96}, {"threads": 512}, {"rb": 3}, {"gb": 8}, {"rb": 0},
                                 {"scratch": "fused"}, {"scratch": 1}, {"col_policy": 4}, {"col_policy": -1},
                                 {"col_policy": True}, {"cj": 12}, {"cj": 16.0}, {"threads": 256.0},
                                 {"scale_threads": 64}, {"scale_threads": 1024}, {"scale_min_blocks": 0},
                                 {"scale_min_blocks": 14}, {"scale_threads": 256, "scale_min_blocks": 9},
                                 {"scale_threads": 512, "scale_min_blocks": 5}])
def test_settings_out_of_range_are_refused(bad):
    assert not cq._settings_ok({**CFG, **bad})


def test_source_defines_the_settings_first():
    text = cq.source("e5m2", "floor", {"threads": 128, "rb": 4, "gb": 2, "scratch": False, "col_policy": 2, "cj": 16,
                                       "scale_threads": 512, "scale_min_blocks": 4})
    head = text.splitlines()[:10]
    assert head == ["#define NT 128", "#define RB 4", "#define GB 2", "#define ELEM 1", "#define MODE 0",
                    "#define SCRATCH 0", "#define CPOL 2", "#define CJ 16", "#define SNT 512", "#define SMINB 4"]
    assert "mx_rowcol_bf16" in text and "mx_scales_out" in text


def test_optional_settings_default_to_the_plain_kernel():
    """Settings written before col_policy, cj and the scales pass's launch shape existed
    still compile to the kernel they named (no L2 policy, 32-tile jobs, 128 threads)."""
    text = cq.source("e4m3", "rceil", {"threads": 256, "rb": 2, "gb": 1, "scratch": True})
    assert text.splitlines()[6:10] == ["#define CPOL 0", "#define CJ 32", "#define SNT 128", "#define SMINB 1"]


def test_settings_name_their_compiled_kernel():
    """The compile cache key holds every setting: two settings never share a kernel."""
    a = cq._key("e4m3", "rceil", CFG, 0)
    for k, v in (("col_policy", 0), ("scale_threads", 128), ("cj", 16), ("scale_min_blocks", 2)):
        assert cq._key("e4m3", "rceil", {**CFG, k: v}, 0) != a


def test_not_taken_for_cpu_tensors_or_when_disabled():
    x = torch.zeros(1, 64, 64, dtype=torch.bfloat16)
    assert not cq.applies(x, "e4m3", "rceil", CFG)
    assert not cq.applies(x, "e4m3", "rceil", {**CFG, "enabled": False})


@pytest.mark.parametrize("shape,strides,ptr,ok", [
    ((1, 4096, 2880), (4096 * 2880, 2880, 1), 0, True),
    ((3, 224, 320), (224 * 320, 320, 1), 256, True),
    ((1, 96, 2880), (96 * 2944, 2944, 1), 0, True),         # row stride wider than the row
    ((3, 64, 128), (2 * 64 * 128, 128, 1), 0, True),        # every other expert
    ((1, 64, 96), (64 * 136, 136, 1), 2, False),            # start not 16-byte aligned
    ((1, 64, 96), (64 * 100, 100, 1), 0, False),            # row stride not a multiple of 8 elements
    ((2, 64, 96), (64 * 96 + 4, 96, 1), 0, False),          # matrix stride not a multiple of 8
    ((1, 64, 96), (96, 1, 64), 0, False),                   # not unit stride along C
    ((1, 48, 96), (48 * 96, 96, 1), 0, False),              # R not a multiple of 32
    ((1, 64, 80), (64 * 80, 80, 1), 0, False),              # C not a multiple of 32
    ((65536, 32, 32), (1024, 32, 1), 0, False),             # grid z
    ((1, 128 * 65536, 32), (128 * 65536 * 32, 32, 1), 0, False),  # grid y
    ((1, 32, 2**31), (2**31 * 32, 2**31, 1), 0, False),     # int32 sizes
])
def test_layout_rules(shape, strides, ptr, ok):
    assert cq._layout_ok(shape, strides, ptr) is ok


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


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="nvcc not installed (the GPU check compiles it with NVRTC)")


def _nvcc(tmp_path, fmt: str, mode: str, cfg: dict, *flags: str,
          out: str = "k.cubin") -> subprocess.CompletedProcess:
    """Compile the kernel source for these settings for sm_90 with nvcc (-cubin unless
    flags say otherwise); asserts success and returns the run (ptxas -v reports in stderr)."""
    src = tmp_path / "k.cu"
    src.write_text(cq.source(fmt, mode, cfg))
    run = subprocess.run(["nvcc", "-arch=sm_90", *(flags or ("-cubin",)), "-o", str(tmp_path / out), str(src)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run


@needs_nvcc
@pytest.mark.parametrize("fmt,mode,scratch", list(itertools.product(("e4m3", "e5m2"), ("floor", "rceil"), (0, 1))))
def test_source_compiles_for_sm90(tmp_path, fmt, mode, scratch):
    _nvcc(tmp_path, fmt, mode, {**CFG, "scratch": bool(scratch)})


@needs_nvcc
@pytest.mark.parametrize("extra", [{"col_policy": p} for p in range(4)]
                         + [{"scale_threads": 128, "scale_min_blocks": 1},
                            {"scale_threads": 512, "scale_min_blocks": 4}, {"cj": 8}, {"cj": 16}])
def test_variants_compile_for_sm90(tmp_path, extra):
    _nvcc(tmp_path, "e4m3", "rceil", {**CFG, **extra})


@needs_nvcc
def test_default_settings_do_not_spill(tmp_path):
    """The scales pass's register cap (256 threads x 8 blocks per SM: 32 registers) and the
    main kernel fit without local-memory spills (ptxas -v of nvcc for sm_90; NVRTC uses
    the same ptxas)."""
    out = _nvcc(tmp_path, "e4m3", "rceil", CFG, "-cubin", "-Xptxas", "-v")
    spills = [line for line in out.stderr.splitlines() if "spill" in line]
    assert len(spills) == 2 and all("0 bytes spill stores, 0 bytes spill loads" in line for line in spills), out.stderr


@needs_nvcc
@pytest.mark.parametrize("policy", range(4))
def test_column_stores_carry_the_l2_policy(tmp_path, policy):
    """col_policy reaches the PTX: the column code stores carry a cache policy made by
    createpolicy (none at 0), the row code stores never do."""
    _nvcc(tmp_path, "e4m3", "rceil", {**CFG, "col_policy": policy}, "-ptx", out="k.ptx")
    ptx = (tmp_path / "k.ptx").read_text()
    hinted = ptx.count("st.global.L2::cache_hint.v4.b32")
    want = {0: None, 1: "L2::evict_first.b64 %rd\\d+, 1.0;", 2: "L2::evict_last.b64 %rd\\d+, 1.0;",
            3: "L2::evict_last.b64 %rd\\d+, 0.5;"}[policy]
    if want is None:
        assert hinted == 0 and "createpolicy" not in ptx
    else:
        assert hinted >= 1 and ptx.count("st.global.v4.b32") >= 1  # column stores hinted, row stores plain
        policies = re.findall(r"createpolicy\.fractional\.(\S+ %rd\d+, [\d.]+;)", ptx)
        assert len(policies) == 1 and re.fullmatch(want, policies[0]), policies
