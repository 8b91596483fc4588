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


# ---- design (g) (src/mxmoe/kernels/cutlass_wq.cu): its arithmetic, emulated ----
# The kernel runs only on sm90 (benchmarks/cutlass_mixed.py checks it bit for bit against
# design (a) on the H200). Here its per-element steps are emulated in torch with the
# constants read out of the CUDA source, and compared with mxmoe's reference quantizer for
# blocks of every scale exponent: a changed constant, clamp, threshold or NaN rule in the
# source fails these tests (each was tried by editing a copy of the source).
CUTLASS_SRC = Path(__file__).resolve().parents[1] / "src" / "mxmoe" / "kernels" / "cutlass_wq.cu"
FMTS = {"e4m3": 0, "e5m2": 1}


def _src() -> str:
    return CUTLASS_SRC.read_text()


def _body(name: str) -> str:
    """The text of the __device__ function ``name`` (its braces matched)."""
    src = _src()
    m = re.search(r"__device__ __forceinline__ [\w:<>]+ " + name + r"\(", src)
    assert m, f"no __device__ function {name} in {CUTLASS_SRC.name}"
    i = src.index("{", m.end())
    depth = 0
    for j in range(i, len(src)):
        depth += {"{": 1, "}": -1}.get(src[j], 0)
        if depth == 0:
            return src[i:j + 1]
    raise AssertionError(f"unbalanced braces in {name}")


def _const(name: str, fmt: str) -> int:
    """The value of ``constexpr ... name = FMT == 0 ? a : b;`` for the format."""
    m = re.search(r"\b" + name + r" = FMT == 0 \? (-?(?:0x)?[0-9a-fA-F]+)u? : (-?(?:0x)?[0-9a-fA-F]+)u?;", _src())
    assert m, f"no constant {name}"
    return int(m.group(1 + FMTS[fmt]), 0)


def _int(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    assert m, f"pattern {pattern!r} not found"
    return int(m.group(1), 0)


def _scale_exp(amax16: torch.Tensor, fmt: str, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """scale_exp of the source: (e, non-finite) for sign-cleared bf16 amax bit patterns."""
    body = _body("scale_exp")
    emax = _const("kEmax", fmt)
    a = amax16.to(torch.int64)
    nf = a >= _int(r"nf = amax16 >= (0x[0-9a-fA-F]+)u;", body)
    if mode == "floor":
        c = _int(r"int e = int\(amax16 >> 7\) - \((\d+) \+ kEmax\);", body)
        e = (a >> 7) - (c + emax)
    else:
        c = _int(r"int e = int\(amax16 >> 7\) - \((\d+) \+ kEmax\) \+", body)
        thr = _int(r"\(\(amax16 & 0x7Fu\) > (0x[0-9a-fA-F]+)u \? 1 : 0\)", body)
        e = (a >> 7) - (c + emax) + ((a & 0x7F) > thr).to(torch.int64)
    m = re.search(r"e = min\(max\(e, (-?\d+)\), (-?\d+)\);", body)
    assert m, "no clamp in scale_exp"
    e = e.clamp(int(m.group(1)), int(m.group(2)))
    assert "return nf ? 0 : e;" in body
    return torch.where(nf, 0, e), nf


def _bf16(bits: torch.Tensor) -> torch.Tensor:
    """16-bit patterns (int64) as bf16 values in float64."""
    return bits.to(torch.int16).view(torch.bfloat16).to(torch.float64)


def _rn_bf16(v: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to bf16 (nearest even, subnormals kept), as float64."""
    return v.to(torch.bfloat16).to(torch.float64)


def _codes(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """cvt.rn.satfinite to the format, the codes' values as float64 (NaN stays NaN)."""
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    top = 448.0 if fmt == "e4m3" else 57344.0
    return v.to(torch.float32).clamp(-top, top).to(dt).to(torch.float64)


def _cases(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax16, x) pairs: amax of every exponent field with mantissas 0, 0x60, 0x61, 0x7F,
    and inf / NaN; x: a spread of bf16 patterns no larger than amax (both signs, zeros),
    and the format's subnormal grid points and their ties at that scale."""
    ea = torch.arange(0, 255)
    amax = ((ea[:, None] << 7) + torch.tensor([0x00, 0x60, 0x61, 0x7F])[None]).flatten()
    amax = torch.cat([amax, torch.tensor([0x7F80, 0x7FC0])])
    spread = torch.arange(0, 0x7F80, 37)
    xs = []
    for a in amax.tolist():
        lim = min(a, 0x7F7F)
        x = spread[spread <= lim]
        ax = torch.tensor([a]).to(torch.int16).view(torch.bfloat16).float()
        grid = (ax * torch.arange(1, 64, dtype=torch.float32) * 2.0 ** -(18 if fmt == "e4m3" else 25))
        gbits = grid.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0x7FFF
        x = torch.cat([x, gbits[gbits <= lim], torch.tensor([lim])])
        x = torch.cat([x, x | 0x8000])
        xs.append(torch.stack([torch.full_like(x, a), x], 1))
    pairs = torch.cat(xs)
    return pairs[:, 0], pairs[:, 1]


def _reference(amax16: torch.Tensor, x16: torch.Tensor, fmt: str, mode: str) -> torch.Tensor:
    """The reference's dequantized values (as bf16, float64) of x in a block whose amax is
    amax16 (mxmoe.numerics.reference, blocks of 32: the amax, then x, then zeros)."""
    from mxmoe.numerics.formats import ElemFormat, ScaleMode
    from mxmoe.numerics.reference import torch_dequantize_blocks, torch_quantize_blocks

    n = amax16.numel()
    blk = torch.zeros(1, n, 32, 1, dtype=torch.bfloat16)
    blk[0, :, 0, 0] = amax16.to(torch.int16).view(torch.bfloat16)
    blk[0, :, 1, 0] = x16.to(torch.int16).view(torch.bfloat16)
    codes, sb = torch_quantize_blocks(blk, ElemFormat(fmt), ScaleMode(mode))
    return torch_dequantize_blocks(codes, sb, ElemFormat(fmt))[0, :, 1, 0].to(torch.bfloat16).to(torch.float64)


def _ftz(v: torch.Tensor) -> torch.Tensor:
    """The worst case for a bf16x2 multiply's subnormal results: flushed to zero (the
    kernel's fast paths must not produce any; kFastMin exists for that)."""
    return torch.where(v.abs() < 2.0 ** -126, v * 0.0, v)


def _same(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Equal bf16 values with equal signs of zero, or both NaN."""
    gb = got.to(torch.bfloat16).view(torch.int16)
    wb = want.to(torch.bfloat16).view(torch.int16)
    return (gb == wb) | (got.isnan() & want.isnan())


def _qdq2(amax16, x16, fmt, mode, path):
    """QDQ 2 (row_scale, qdq_pair2) for one value: (values, where to compare); path "slow"
    (the float32 decode, taken per row) or "kernel" (the kernel's own choice per row).
    QDQ 5 (the same steps, one branch per warp): path "fast" (decode_bf16, where no row of
    the warp needs the slow path) or "slow5" (decode_slow for every row of a warp that has
    one slow row, non-finite blocks included)."""
    rs = _body("row_scale")
    e, nf = _scale_exp(amax16, fmt, mode)
    c_inv = _int(r"r\.inv2 = \(uint32_t\((\d+) - e\) << 7\) \* 0x10001u;", rs)
    c_sc = _int(r"r\.sc2 = nf \? 0x7FC07FC0u : \(uint32_t\((\d+) \+ e\) << 7\) \* 0x10001u;", rs)
    assert "r.slow = e < kFastMin && !nf;" in rs
    inv = _bf16((c_inv - e) << 7)
    v = _rn_bf16(_bf16(x16) * inv)
    y = _codes(v, fmt)
    sc_fast = torch.where(nf, torch.nan, _bf16((c_sc + e) << 7))
    fast = _ftz(_rn_bf16(_rn_bf16(y) * sc_fast))
    slow = _rn_bf16((y.to(torch.float32) * _sc32(e, nf)).to(torch.float64))
    if path == "slow":  # QDQ 2 takes it per row, never for a non-finite block
        return slow, ~nf
    if path == "fast":  # QDQ 5, a warp whose rows all have e >= kFastMin or are non-finite
        return fast, (e >= _const("kFastMin", fmt)) | nf
    if path == "slow5":  # QDQ 5, every row of a warp with one slow row
        return slow, torch.ones_like(nf)
    return torch.where((e < _const("kFastMin", fmt)) & ~nf, slow, fast), torch.ones_like(nf)


def _sc32(e: torch.Tensor, nf: torch.Tensor, fn: str = "row_scale") -> torch.Tensor:
    """The float32 2^e of ``fn`` (row_scale / row_scale4): subnormal below its threshold,
    NaN for a non-finite block where the source says so."""
    body = _body(fn)
    c = _int(r"uint32_t s = uint32_t\(e \+ (\d+)\) << 23;", body)
    lo = _int(r"if \(e < (-\d+)\) s = 0x400000u;", body)
    bits = (e + c) << 23
    bits = torch.where(e < lo, 0x400000, bits)
    bits = torch.where(nf & ("if (nf) s = 0x7FC00000u;" in body), 0x7FC00000, bits)
    return bits.to(torch.int32).view(torch.float32)


def _qdq4(amax16, x16, fmt, mode, path):
    """QDQ 4 (row_scale4, encode_pair, decode_fast / decode_slow) for one value: (values,
    where to compare: the fast path only where the kernel may take it, the slow one
    everywhere)."""
    rs = _body("row_scale4")
    e, nf = _scale_exp(amax16, fmt, mode)
    c_inv = _int(r"r\.inv2 = \(uint32_t\((\d+) - e\) << 7\) \* 0x10001u;", rs)
    c_sc = _int(r"r\.sc2 = nf \? 0x7FC07FC0u : \(uint32_t\(\((\d+) - kBias \+ e\) & 0xFF\) << 7\) \* 0x10001u;", rs)
    assert "r.slow = !nf && (e < kFastMin || e > kBias);" in rs
    bias, shift, mask = _const("kBias", fmt), _const("kShift", fmt), _const("kMagMask", fmt) & 0xFFFF
    v = _rn_bf16(_bf16(x16) * _bf16((c_inv - e) << 7))
    y = _codes(v, fmt)
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    code = y.to(dt).view(torch.uint8).to(torch.int64)
    df = _body("decode_fast")
    assert "__byte_perm(uint32_t(h), 0u, 0x1404)" in df and "return p | (y8 & 0x80008000u);" in df
    y8 = code << 8
    mag = (y8 >> shift) & mask
    sc2 = torch.where(nf, torch.nan, _bf16(((c_sc - bias + e) & 0xFF) << 7))
    p = _ftz(_rn_bf16(_bf16(mag) * sc2))
    fast = torch.where((y8 & 0x8000) != 0, -p, p)
    fast = torch.where(p.isnan(), p, fast)
    slow = _rn_bf16((y.to(torch.float32) * _sc32(e, nf, "row_scale4")).to(torch.float64))
    if path == "fast":
        return fast, (e >= _const("kFastMin", fmt)) & (e <= bias) | nf
    return slow, torch.ones_like(nf)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_design_g_scale_exponent_matches_the_reference_for_every_bf16_amax(fmt, mode):
    """Every sign-cleared bf16 bit pattern as a block amax: scale_exp (as written in the
    source) gives the E8M0 byte of mxmoe's reference rule (float32 amax * float32(1 / max)
    in rceil mode), 255 for the non-finite patterns; QDQ 1's float32 rule (block_scale,
    its constant kInvMaxBits) too."""
    from mxmoe.numerics.formats import ElemFormat, ScaleMode
    from mxmoe.numerics.reference import torch_mx_scale_bits

    pat = torch.arange(0, 0x8000, dtype=torch.int32)
    amax = (pat << 16).view(torch.float32)
    want = torch_mx_scale_bits(amax, ElemFormat(fmt), ScaleMode(mode)).to(torch.int64)
    e, nf = _scale_exp(pat, fmt, mode)
    got = torch.where(nf, 255, e + 127)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} amax patterns differ, first {[hex(int(p)) for p in pat[bad[:5]]]}"
    if mode == "rceil":  # block_scale's float32 rule, with the source's constant
        d = amax * torch.tensor(_const("kInvMaxBits", fmt), dtype=torch.int32).view(torch.float32)
        db = d.view(torch.int32).to(torch.int64)
        dexp, dman = (db >> 23) & 0xFF, db & 0x7FFFFF
        e1 = torch.where(dexp == 0, torch.where(dman > 0x400000, -126, -127), dexp - 127 + (dman != 0).long())
        got1 = torch.where(nf, 255, e1.clamp(-127, 127) + 127)
        assert torch.equal(got1[~nf], want[~nf])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("qdq", [2, 4, 5])
def test_design_g_quantize_dequantize_matches_the_reference(fmt, mode, qdq):
    """QDQ 2, QDQ 4 and QDQ 5 as written in the source, emulated value by value, against the
    reference quantizer for blocks of every scale exponent (-127 .. 127), non-finite blocks,
    E4M3/E5M2 subnormal codes and their ties, saturation (floor mode), both signs of zero.
    Both paths of each: the fast one wherever the kernel may take it, the float32 one for
    every row (QDQ 4 and QDQ 5 send a whole warp down it when one of its rows needs it)."""
    amax, x = _cases(fmt)
    want = _reference(amax, x, fmt, mode)
    if qdq == 5:  # its warp-wide branch, as written in the source
        src = _src()
        assert "rs[2].slow = __any_sync(0xFFFFFFFFu, rs[0].slow || rs[1].slow);" in src
        body = src[src.index("#elif QDQ == 4 || QDQ == 5\n"):]
        body = body[:body.index("#elif QDQ == 2")]
        assert "if (rs[2].slow) {\n      for (int i = 0; i < 4; ++i) q[i] = mxq::decode_slow(h[i], rs[i & 1].sc);" in body
        assert "QDQ == 4 ? mxq::decode_fast(h[i], rs[i & 1].sc2) : mxq::decode_bf16(h[i], rs[i & 1].sc2);" in body
    paths = {2: ("kernel", "slow"), 4: ("fast", "slow"), 5: ("fast", "slow5")}[qdq]
    for path in paths:
        got, where = (_qdq4 if qdq == 4 else _qdq2)(amax, x, fmt, mode, path)
        bad = ~_same(got, want) & where
        assert not bad.any(), (f"QDQ {qdq} {path}: {int(bad.sum())} of {x.numel()} values differ, first amax "
                               f"{hex(int(amax[bad][0]))} x {hex(int(x[bad][0]))}: {got[bad][0]} vs {want[bad][0]}")


@pytest.mark.parametrize("fmt, bias", [("e4m3", 7), ("e5m2", 15)])
def test_design_g_code_bits_in_bf16_positions_read_as_value_times_power_of_two(fmt, bias):
    """QDQ 4's decode (decode_fast): a code byte at bits 8..15, shifted right by kShift and
    masked with kMagMask (the source's constants), read as a bf16 magnitude, is |code value|
    * 2^-(127 - bias) for every finite code, subnormal codes included; the sign is bit 15."""
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    assert _const("kBias", fmt) == bias
    codes = torch.arange(256, dtype=torch.int64)
    val = codes.to(torch.uint8).view(dt).to(torch.float64)
    finite = val.isfinite()
    y8 = codes << 8
    mag = _bf16((y8 >> _const("kShift", fmt)) & (_const("kMagMask", fmt) & 0xFFFF))
    got = torch.where((y8 & 0x8000) != 0, -mag, mag) * 2.0 ** (127 - bias)
    assert torch.equal(got[finite], val[finite])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_design_b_cutlass_decode_matches_the_reference_for_every_scale_and_code(fmt):
    """Design (b) in CUTLASS (cutlass_wq.cu VARIANT 4): e8m0_row_scale and the decode as
    written in the source, for every E8M0 scale byte (0..255, 255 = NaN) and every code of
    the format, against the reference dequantization (code value * 2^(s - 127), rounded to
    bf16 as design (a)'s pass writes it). Both paths: the bf16x2 one wherever the kernel may
    take it (subnormal results of its multiply modelled as flushed), the float32 one for
    every row (a warp with one slow row takes it for all its rows, non-finite ones included);
    and the k-block's byte of the packed pair (low for k-blocks 0-1, high for 2-3)."""
    from mxmoe.numerics.formats import ElemFormat
    from mxmoe.numerics.reference import torch_dequantize_blocks

    body = _body("e8m0_row_scale")
    assert "const bool nf = s == 0xFFu;" in body
    assert "r.sc2 = nf ? 0x7FC07FC0u : (s << 7) * 0x10001u;" in body
    assert "uint32_t b = s << 23;" in body and "if (s == 0u) b = 0x400000u;" in body
    assert "if (nf) b = 0x7FC00000u;" in body
    kfast = _const("kFastMin", fmt)
    c = _int(r"r\.slow = int\(s\) - (\d+) < kFastMin && !nf;", body)
    src = _src()
    spec = src[src.index("#else  // VARIANT 4"):]
    # which register holds which row and k (the fragment layout) is checked on the H200
    # only (benchmarks/cutlass_w8.py); here the source lines that encode it are pinned
    assert "const int shift = (k_block & 2) ? 8 : 0;" in spec
    assert "const mxq::RowScale r0 = mxq::e8m0_row_scale((uint32_t(scales(0)) >> shift) & 0xFFu);" in spec
    assert "const mxq::RowScale r1 = mxq::e8m0_row_scale((uint32_t(scales(2)) >> shift) & 0xFFu);" in spec
    assert "raw_pointer_cast(tCrA_load.data())) + 4 * k_block;" in spec
    assert "raw_pointer_cast(tCrA_mma.data())) + 4 * k_block;" in spec
    assert "if (__any_sync(0xFFFFFFFFu, r0.slow || r1.slow)) {" in spec
    assert "q[i] = mxq::decode_slow(h[i], (i & 1) ? r1.sc : r0.sc);" in spec
    assert "q[i] = mxq::decode_bf16(h[i], (i & 1) ? r1.sc2 : r0.sc2);" in spec
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    s = torch.arange(256, dtype=torch.int64)[:, None].expand(256, 256)
    code = torch.arange(256, dtype=torch.int64)[None, :].expand(256, 256)
    y = code.to(torch.uint8).view(dt).to(torch.float64)
    want = torch_dequantize_blocks(code.reshape(1, -1, 1, 1).to(torch.uint8).view(dt), s.reshape(1, -1, 1, 1).to(torch.uint8),
                                   ElemFormat(fmt)).reshape(256, 256).to(torch.float64)
    want = _rn_bf16(want)
    nf = s == 255
    sc2 = torch.where(nf, torch.nan, _bf16((s << 7) & 0xFFFF))
    fast = _ftz(_rn_bf16(_rn_bf16(y) * sc2))
    bits = torch.where(s == 0, 0x400000, s << 23)
    bits = torch.where(nf, 0x7FC00000, bits)
    slow = _rn_bf16((y.to(torch.float32) * bits.to(torch.int32).view(torch.float32)).to(torch.float64))
    slow_row = (s - c < kfast) & ~nf
    for got, where, what in ((fast, ~slow_row, "bf16x2 path"), (slow, torch.ones_like(nf), "float32 path")):
        bad = ~_same(got, want) & where
        assert not bad.any(), (f"{what}: {int(bad.sum())} (scale, code) pairs differ, first scale "
                               f"{int(s[bad][0])} code {hex(int(code[bad][0]))}: {got[bad][0]} vs {want[bad][0]}")
