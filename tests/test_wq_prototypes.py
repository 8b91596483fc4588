"""CPU checks of the host-side logic of the in-GEMM weight quantization prototypes
(benchmarks/gluon_wq.py, design (d), whose tile_table all three use; gluon_wq_tma.py,
design (e); cuda_wq_cluster.py, design (f)).

Their kernels run only on sm90 (benchmarks/wq_kernels_bench.py checks them on the H200);
what runs on the host is the tile / chunk schedule, computed with torch ops on the device
(no host sync), and the generated PTX / CUDA text. A wrong schedule would drop or double
output rows silently on the GPU, so every row of every expert must be covered exactly once.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

gluon_wq = pytest.importorskip("gluon_wq")
gluon_wq_tma = pytest.importorskip("gluon_wq_tma")
cuda_wq_cluster = pytest.importorskip("cuda_wq_cluster")

GROUPS = [[162, 0, 2577, 446, 0, 83], [0, 0, 0], [300, 513], [256] * 4, [257, 320, 321, 640, 1, 0], [1000], [5]]


@pytest.mark.parametrize("cum, T", [([5, 2, 12], 12), ([300, 900, 2000], 1000), ([-4, 40, 30, 50], 60)])
def test_tile_table_clamps_and_orders_offsets(cum, T):
    """Offsets past T are clamped to T and a decreasing one counts as an empty expert: the
    kernels never read or write outside [0, T)."""
    offs = torch.tensor(cum, dtype=torch.int32)
    ends = torch.cummax(offs.to(torch.int64).clamp(0, T), 0).values.tolist()
    starts = [0] + ends[:-1]
    for equal in (False, True):
        e, r0, r1, n0 = gluon_wq.tile_table(offs, T, 64, 256, 64, equal=equal)
        cov = _coverage(T, 128, (e, r0, r1, n0), 64)[:, :64]
        want = torch.zeros(T, dtype=torch.int32)
        want[:ends[-1]] = 1
        assert torch.equal(cov[:, 0], want)
        for i in range(e.numel()):
            if int(e[i]) >= 0:
                assert starts[int(e[i])] <= int(r0[i]) < int(r1[i]) <= ends[int(e[i])]


def _coverage(T, N, rows, width):
    e, r0, r1, n0 = rows
    cov = torch.zeros(T, N, dtype=torch.int32)
    for i in range(e.numel()):
        if int(e[i]) >= 0:
            a, b = int(r0[i]), int(r1[i])
            assert a < b, "an entry with no rows"
            cov[a:b, int(n0[i]):int(n0[i]) + width] += 1
    return cov


@pytest.mark.parametrize("sizes", GROUPS)
@pytest.mark.parametrize("rows, cols, equal", [(256, 1, False), (256, 128, False), (128, 128, False), (256, 256, True),
                                               (320, 256, True)])
@pytest.mark.parametrize("order", ["weight", "token"])
def test_tile_table_covers_each_row_once(sizes, rows, cols, equal, order):
    T = sum(sizes) + 7  # rows past the last offset exist and stay uncovered
    N = 600  # the last weight tile partly past N
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    e, r0, r1, n0 = gluon_wq.tile_table(offs, T, N, rows, cols, order, equal)
    assert e.numel() == (T // rows + len(sizes)) * -(-N // cols)
    starts = [0] + offs.tolist()[:-1]
    ends = offs.tolist()
    for i in range(e.numel()):
        if int(e[i]) >= 0:
            k = int(e[i])
            assert starts[k] <= int(r0[i]) < int(r1[i]) <= ends[k], "a tile leaves its expert"
            assert int(r1[i]) - int(r0[i]) <= rows
    cov = _coverage(T, N + cols, (e, r0, r1, n0), cols)[:, :N]
    end = sum(sizes)
    assert bool((cov[:end] == 1).all()) and bool((cov[end:] == 0).all())


def test_chunks_are_near_equal():
    # 300 tokens: one chunk at 320 (not 256 + 44); 641: three of 214 / 214 / 213
    offs = torch.tensor([300, 941], dtype=torch.int32)
    e, r0, r1, _ = gluon_wq.tile_table(offs, 941, 256, 320, 256, equal=True)
    lens = sorted((int(b) - int(a)) for k, a, b in zip(e, r0, r1) if int(k) >= 0)
    assert lens == [213, 214, 214, 300]
    e, r0, r1, _ = gluon_wq.tile_table(offs, 941, 256, 256, 256)  # fixed tiles: 256 + 44, 256 + 256 + 129
    lens = sorted((int(b) - int(a)) for k, a, b in zip(e, r0, r1) if int(k) >= 0)
    assert lens == [44, 129, 256, 256, 256]


def test_tile_table_refuses_an_unknown_order():
    with pytest.raises(ValueError, match="order"):
        gluon_wq.tile_table(torch.tensor([4], dtype=torch.int32), 4, 8, 256, 128, "rows")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_block_asm_text(fmt, mode):
    text = gluon_wq_tma.qdq_block_asm(fmt, mode)
    assert f"cvt.rn.satfinite.{fmt}x2.f32" in text and f"cvt.rn.f16x2.{fmt}x2" in text
    for i in range(32):  # results $0..$15, operands $16..$31
        assert re.search(rf"\${i}\b", text), i
    assert ("mul.f32 d, d," in text) == (mode == "rceil")  # rceil divides the amax by the format's max
    src = cuda_wq_cluster.kernel_source(fmt, mode, 3, False, 320, True)
    assert "$" not in src and "@" not in src.replace("@P1", "")  # every placeholder filled
    assert "m64n64k16" in src and "m64n256k16" in src


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="fmt must be"):
        gluon_wq_tma.qdq_block_asm("e2m1", "rceil")
    with pytest.raises(ValueError, match="tokens must be"):
        cuda_wq_cluster.kernel_source("e4m3", "rceil", 3, False, 288, True)
    x, w = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(1, 8, 64, dtype=torch.bfloat16)
    offs = torch.tensor([4], dtype=torch.int32)
    f = cuda_wq_cluster.cuda_grouped_mm_wq_fwd
    with pytest.raises(TypeError, match="bfloat16"):
        f(x.float(), w, offs)
    with pytest.raises(TypeError, match="int32"):
        f(x, w, offs.float())
    with pytest.raises(ValueError, match="shape \\(E,\\)"):
        f(x, w, torch.tensor([2, 4], dtype=torch.int32))  # more offsets than experts
    with pytest.raises(ValueError, match="multiple of 8"):
        f(x[:, :60], w[:, :, :60], offs)
    with pytest.raises(ValueError, match="CUDA"):  # CPU tensors: the kernels would read host pointers
        f(x, w, offs)
    for stages in (1, 0, True, 2.0):  # the ring needs two stages; 1 would deadlock, 0 divide by zero
        with pytest.raises(ValueError, match="stages must be"):
            f(x, w, offs, stages=stages)
        with pytest.raises(ValueError, match="stages must be"):  # designs (d) and (e) share the checks
            gluon_wq.check_wq_args(x, w, offs, stages, "design (e)", tma=True)
    with pytest.raises(ValueError, match="tokens must be"):
        f(x, w, offs, tokens=300)


@pytest.mark.parametrize("design", ["d", "e", "f"])
def test_every_design_refuses_offsets_that_do_not_fit(design):
    """The kind of the bug design (f) had: offsets on another device (the kernel would read
    host pointers) or with more entries than experts (it would read past w). Every design's
    wrapper refuses both before it touches a kernel."""
    fwd = {"d": gluon_wq.gluon_grouped_mm_wq_fwd, "e": gluon_wq_tma.gluon_grouped_mm_wq_tma_fwd,
           "f": cuda_wq_cluster.cuda_grouped_mm_wq_fwd}[design]
    if design in "de" and gluon_wq.gluon is None:
        pytest.skip("no Gluon in this Triton")
    x, w = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(1, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shape \\(E,\\)"):
        fwd(x, w, torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="CUDA"):
        fwd(x, w, torch.tensor([4], dtype=torch.int32))
    with pytest.raises(TypeError, match="int32"):
        fwd(x, w, torch.tensor([4.0]))


# ---- design (g) (benchmarks/cutlass_mixed/grouped_mixed.cu): the integer scale exponent ----
CUTLASS_SRC = Path(__file__).resolve().parents[1] / "benchmarks" / "cutlass_mixed" / "grouped_mixed.cu"


def _integer_scale_exp(amax16: torch.Tensor, emax: int, mode: str) -> torch.Tensor:
    """The rule of grouped_mixed.cu's scale_exp (QDQ 2) for sign-cleared bf16 amax bit
    patterns: e = EA - 127 - emax (+ 1 in rceil mode when the mantissa is above 0x60, the
    mantissa of 1.75), clamped to [-127, 127]."""
    a = amax16.to(torch.int64)
    e = (a >> 7) - (127 + emax)
    if mode == "rceil":
        e = e + ((a & 0x7F) > 0x60).to(torch.int64)
    return e.clamp(-127, 127)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_design_g_integer_scale_matches_the_reference_for_every_bf16_amax(fmt, mode):
    """Every sign-cleared bf16 bit pattern as a block amax: the kernel's integer exponent
    gives the E8M0 byte of mxmoe's reference rule (float32 amax * float32(1 / max) in rceil
    mode), NaN (255) for the non-finite patterns."""
    from mxmoe.numerics.formats import ElemFormat, ScaleMode
    from mxmoe.numerics.reference import torch_mx_scale_bits

    fmt_e, mode_e = ElemFormat(fmt), ScaleMode(mode)
    pat = torch.arange(0, 0x8000, dtype=torch.int32)
    amax = (pat << 16).view(torch.float32)
    want = torch_mx_scale_bits(amax, fmt_e, mode_e).to(torch.int64)
    e = _integer_scale_exp(pat, fmt_e.spec.emax_elem, mode)
    got = torch.where(pat >= 0x7F80, torch.full_like(e, 255), e + 127)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} amax patterns differ, first {[hex(int(p)) for p in pat[bad[:5]]]}"


def test_design_g_source_carries_the_checked_rule():
    """The CUDA source holds the rule the test above checks (a change to one without the
    other fails here)."""
    src = CUTLASS_SRC.read_text()
    assert "int(amax16 >> 7) - (127 + kEmax) + ((amax16 & 0x7Fu) > 0x60u ? 1 : 0)" in src
    assert "int(amax16 >> 7) - (127 + kEmax);" in src
    assert "e = min(max(e, -127), 127);" in src


@pytest.mark.parametrize("fmt, shift, mask, bias", [("e4m3", 4, 0x07F0, 7), ("e5m2", 3, 0x0FE0, 15)])
def test_design_g_code_bits_in_bf16_positions_read_as_value_times_power_of_two(fmt, shift, mask, bias):
    """QDQ 4's decode (grouped_mixed.cu decode_fast): a code byte placed at bits 8..15,
    shifted right by ``shift`` and masked, read as a bf16 magnitude, is |code value| *
    2^-(127 - bias) for every finite code, subnormal codes included; the sign is bit 15."""
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    codes = torch.arange(256, dtype=torch.int32)
    val = codes.to(torch.uint8).view(dt).to(torch.float64)
    finite = val.isfinite()
    y8 = codes << 8
    mag = ((y8 >> shift) & mask).to(torch.int16).view(torch.bfloat16).to(torch.float64)
    got = torch.where((y8 & 0x8000) != 0, -mag, mag) * 2.0 ** (127 - bias)
    assert torch.equal(got[finite], val[finite])
    src = CUTLASS_SRC.read_text()
    assert f"kShift = FMT == 0 ? 4 : 3" in src and "kMagMask = FMT == 0 ? 0x07F007F0u : 0x0FE00FE0u" in src
    assert "kBias = FMT == 0 ? 7 : 15" in src and "__byte_perm(uint32_t(h), 0u, 0x1404)" in src
    assert "(254 - kBias + e)" in src  # the bf16 exponent field of 2^(127 - bias + e)
