"""Where the CUDA row + column quantizer's scale bytes go, checked on a CPU machine.

The host code (``kernels.cuda_quantize.rowcol``: buffers, grids, block sizes, the
compile-time settings) runs for real; ``torch.cuda._compile_kernel`` is replaced by a fake
whose kernels follow the index arithmetic of ``cuda_rowcol.cu`` in NumPy: the main
kernel's scale stores (scratch arrays, or straight to their places) and ``mx_scales_out``
at the block size the host launches. The source lines this emulation
follows are asserted to be in the ``.cu`` file, so an edit there fails here until the
emulation follows it. Every scale byte a tile produces carries a unique id; each byte of
the final scales must be written exactly once, with its id, and nothing unwritten
(scratch or shared memory) may reach them. The bytes themselves (numerics) are checked on
the GPU by ``benchmarks/check_kernels_cuda.py``.
"""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
import torch

from mxmoe.kernels import cuda_quantize as cq
from mxmoe.kernels import quantize as kq

TILE = 128
POISON = -1  # a shared-memory or scratch byte nothing wrote
BIG = 1 << 40  # column-scale ids start here

# the lines of cuda_rowcol.cu that the emulation below follows (whitespace-normalized)
FOLLOWED = [
    "const i64 tile_r = ((i64)bz * gridDim.y + ty) * gridDim.x + tx, tile_c = ((i64)bz * gridDim.x + tx) * gridDim.y + ty;",
    "if (i < TR) reinterpret_cast<u32*>(s_row)[tile_r * TR + i] = reinterpret_cast<const u32*>(sr)[i];",
    "else reinterpret_cast<u32*>(s_col)[tile_c * TC + i - TR] = reinterpret_cast<const u32*>(sc)[i - TR];",
    "sr[r * 4 + blk] = (u8)sb;",
    "sc[2 * p * 4 + g] = (u8)sb_lo;",
    "const int n = min(4, ((is_row ? cols : rows) + 31) / 32);",
    "u8* dst = is_row ? s_row + ((i64)bz * R + r0 + j) * (C / 32) + c0 / 32 : s_col + ((i64)bz * C + c0 + j) * (R / 32) + r0 / 32;",
    "const int nxc = (ntx + 31) / 32, nyc = (nty + CJ - 1) / CJ;",
    "const bool rows_job = job < nty * nxc;",
    "const int a = rows_job ? job / nxc : job / nyc;",
    "const int b0 = rows_job ? 32 * (job % nxc) : CJ * (job % nyc);",
    "const int nt = min(rows_job ? 32 : CJ, (rows_job ? ntx : nty) - b0);",
    "constexpr int G = SNT / 128, PER = 32 / G;",
    "const int w = tid % 128, grp = tid / 128;",
    "const u32* first = (rows_job ? scr_r : scr_c)"
    " + 128 * (rows_job ? ((i64)bz * nty + a) * ntx + b0 : ((i64)bz * ntx + a) * nty + b0) + w;",
    "if (grp + G * k < nt) v[k] = __ldcg(first + 128 * (grp + G * k));",
    "if (grp + G * k < nt) buf[w * 33 + grp + G * k] = v[k];",
    "const int n_lines = min(128, rows_job ? R - a * TR : C - a * TC);",
    "const int line_bytes = rows_job ? C / 32 : R / 32;",
    "for (int idx = tid; idx < n_lines * nt; idx += SNT) {",
    "const int l = idx / nt, i = idx % nt;",
    "const i64 line = rows_job ? (i64)bz * R + a * TR + l : (i64)bz * C + a * TC + l;",
    "u8* dst = (rows_job ? s_row : s_col) + line * line_bytes + 4 * (b0 + i);",
    "const int n = min(4, line_bytes - 4 * (b0 + i));",
]


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"//[^\n]*", "", text))


def test_the_emulated_lines_are_in_the_source():
    src = _norm(cq._SOURCE_PATH.read_text())
    missing = [line for line in FOLLOWED if _norm(line) not in src]
    assert not missing, f"cuda_rowcol.cu changed; update this emulation: {missing}"


class Memory:
    """Shadow memory: each byte an int64 id (POISON where nothing wrote), and write counts."""

    def __init__(self):
        self.bytes: dict[int, np.ndarray] = {}
        self.writes: dict[int, np.ndarray] = {}

    def of(self, t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        key = t.data_ptr()
        if key not in self.bytes:
            self.bytes[key] = np.full(t.numel() * t.element_size(), POISON, dtype=np.int64)
            self.writes[key] = np.zeros(t.numel() * t.element_size(), dtype=np.int64)
        return self.bytes[key], self.writes[key]

    def store(self, t: torch.Tensor, offsets: np.ndarray, values: np.ndarray) -> None:
        mem, count = self.of(t)
        assert offsets.min(initial=0) >= 0 and offsets.max(initial=-1) < mem.size, "store outside the tensor"
        mem[offsets] = values
        np.add.at(count, offsets, 1)


def _defines(text: str) -> dict[str, int]:
    """The first ``#define NAME int`` of each name (cuda_quantize.source's settings come
    first, before the .cu file's own constants)."""
    out: dict[str, int] = {}
    for m in re.finditer(r"^#define (\w+) (-?\d+)$", text, re.M):
        out.setdefault(m.group(1), int(m.group(2)))
    return out


def _row_id(bz, row, blk, R, C):
    return 1 + (bz * R + row) * (C // 32) + blk


def _col_id(bz, col, blk, R, C):
    return BIG + 1 + (bz * C + col) * (R // 32) + blk


def _main(mem: Memory, d: dict, grid, block, args) -> None:
    """mx_rowcol_bf16's scale stores: sr (TR, 4) and sc (TC, 4) bytes of each tile, then
    SCRATCH 1: both as 128 words into the scratch arrays; SCRATCH 0: straight out."""
    _, _, _, R, C, B, _, s_row, _, s_col = args
    ntx, nty, nb = grid
    assert block == (d["NT"], 1, 1) and nb == B
    for bz in range(B):
        for ty in range(nty):
            for tx in range(ntx):
                r0, c0 = ty * TILE, tx * TILE
                rows, cols = min(TILE, R - r0), min(TILE, C - c0)
                sr = np.full((TILE, 4), POISON, dtype=np.int64)
                sc = np.full((TILE, 4), POISON, dtype=np.int64)
                for blk in range(-(-cols // 32)):
                    sr[:rows, blk] = _row_id(bz, r0 + np.arange(rows), c0 // 32 + blk, R, C)
                for g in range(-(-rows // 32)):
                    sc[:cols, g] = _col_id(bz, c0 + np.arange(cols), r0 // 32 + g, R, C)
                if d["SCRATCH"] == 1:
                    tile_r = (bz * nty + ty) * ntx + tx
                    tile_c = (bz * ntx + tx) * nty + ty
                    words = np.arange(TILE)[:, None] * 4 + np.arange(4)
                    mem.store(s_row, (tile_r * TILE * 4 + words).ravel(), sr.ravel())
                    mem.store(s_col, (tile_c * TILE * 4 + words).ravel(), sc.ravel())
                else:
                    for is_row, n_lines, other, src, dst in ((True, rows, cols, sr, s_row),
                                                             (False, cols, rows, sc, s_col)):
                        n = min(4, (other + 31) // 32)
                        j = np.arange(n_lines)[:, None]
                        start = ((bz * R + r0 + j) * (C // 32) + c0 // 32 if is_row
                                 else (bz * C + c0 + j) * (R // 32) + r0 // 32)
                        mem.store(dst, (start + np.arange(n)).ravel(), src[:n_lines, :n].ravel())


def _scales(mem: Memory, d: dict, grid, block, args) -> None:
    """mx_scales_out at the launched block size (threads beyond it do not exist)."""
    scr_r, scr_c, R, C, s_row, s_col = args
    nthreads, snt, cj = block[0], d["SNT"], d["CJ"]
    nty, ntx = -(-R // TILE), -(-C // TILE)
    nxc, nyc = (ntx + 31) // 32, (nty + cj - 1) // cj
    G, PER = snt // 128, 32 // (snt // 128)
    tid = np.arange(nthreads)
    w, grp = tid % 128, tid // 128
    words_r, _ = mem.of(scr_r)
    words_c, _ = mem.of(scr_c)
    for bz in range(grid[2]):
        for job0 in range(grid[0]):
            rows_job = job0 < nty * nxc
            job = job0 if rows_job else job0 - nty * nxc
            a = job // nxc if rows_job else job // nyc
            b0 = 32 * (job % nxc) if rows_job else cj * (job % nyc)
            nt = min(32 if rows_job else cj, (ntx if rows_job else nty) - b0)
            words = (words_r if rows_job else words_c).reshape(-1, 4)
            first = 128 * ((bz * nty + a) * ntx + b0 if rows_job else (bz * ntx + a) * nty + b0) + w
            buf = np.full((128, 33, 4), POISON, dtype=np.int64)
            for k in range(PER):
                i = grp + G * k
                ok = i < nt
                buf[w[ok], i[ok]] = words[first[ok] + 128 * i[ok]]
            n_lines = min(128, R - a * TILE if rows_job else C - a * TILE)
            line_bytes = C // 32 if rows_job else R // 32
            idx = np.arange(n_lines * nt)
            idx = idx[idx % snt < nthreads]  # idx = tid + SNT * step, for the threads that exist
            l, i = idx // nt, idx % nt
            line = (bz * R if rows_job else bz * C) + a * TILE + l
            dst = line * line_bytes + 4 * (b0 + i)
            n = np.minimum(4, line_bytes - 4 * (b0 + i))
            for b in range(4):
                m = b < n
                mem.store(s_row if rows_job else s_col, dst[m] + b, buf[l[m], i[m], b])


class FakeKernel:
    def __init__(self, mem: Memory, text: str, name: str):
        self.mem, self.defines, self.name = mem, _defines(text), name

    def set_shared_memory_config(self, nbytes: int) -> None:
        assert nbytes <= 227 * 1024

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        (_main if self.name == "mx_rowcol_bf16" else _scales)(self.mem, self.defines, grid, block, args)


@contextlib.contextmanager
def fake_cuda(monkeypatch, mem: Memory):
    monkeypatch.setattr(torch.cuda, "_compile_kernel", lambda text, name, compute_capability=None:
                        FakeKernel(mem, text, name), raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cq, "_KERNELS", {})
    monkeypatch.setattr(cq, "_FAILED", {})
    yield


def _expected(B, R, C):
    rows = _row_id(np.arange(B)[:, None, None], np.arange(R)[None, :, None], np.arange(C // 32)[None, None, :], R, C)
    cols = _col_id(np.arange(B)[:, None, None], np.arange(C)[None, :, None], np.arange(R // 32)[None, None, :], R, C)
    return rows.ravel(), cols.ravel()


SHAPES = [(1, 32, 64), (2, 160, 2880), (1, 4160, 4192), (3, 224, 320), (1, 96, 4128), (2, 8224, 96)]
SETTINGS = [{}, {"scale_threads": 128, "scale_min_blocks": 1}, {"scale_threads": 512, "scale_min_blocks": 4},
            {"cj": 8}, {"cj": 16, "scale_threads": 512, "scale_min_blocks": 2}, {"scratch": False}]


@pytest.mark.parametrize("extra", SETTINGS, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()) or "default")
@pytest.mark.parametrize("B,R,C", SHAPES)
def test_every_scale_byte_lands_once_in_its_place(monkeypatch, B, R, C, extra):
    cfg = {**kq.TUNING["rowcol_cuda"], **extra}
    assert cq._settings_ok(cfg)
    mem = Memory()
    with fake_cuda(monkeypatch, mem):
        out = cq.rowcol(torch.zeros(B, R, C, dtype=torch.bfloat16), "e4m3", "rceil", cfg)
    for key, want in zip(("s_row", "s_col"), _expected(B, R, C)):
        got, count = mem.of(out[key])
        assert np.array_equal(count, np.ones_like(count)), f"{key}: bytes written {set(count.tolist())} times"
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{key}: {bad.size} wrong bytes, first at {bad[0]}: {got[bad[0]]} != {want[bad[0]]}"


def test_the_emulation_catches_a_launch_that_does_not_match_the_compiled_kernel(monkeypatch):
    """The check can fail: the scales pass launched at 128 threads for a kernel compiled
    for 256 loads only every other tile of each job."""
    cfg = {**kq.TUNING["rowcol_cuda"], "scale_threads": 256, "scale_min_blocks": 8}
    mem = Memory()
    with fake_cuda(monkeypatch, mem):
        fake = torch.cuda._compile_kernel

        def narrow(text, name, compute_capability=None):
            k = fake(text, name)
            if name == "mx_scales_out":
                call = k.__call__
                return lambda grid, block, args, shared_mem=0, stream=None: call(grid, (128, 1, 1), args)
            return k

        monkeypatch.setattr(torch.cuda, "_compile_kernel", narrow, raising=False)
        out = cq.rowcol(torch.zeros(1, 256, 4096, dtype=torch.bfloat16), "e4m3", "rceil", cfg)
    got, _ = mem.of(out["s_row"])
    assert (got != _expected(1, 256, 4096)[0]).any()
