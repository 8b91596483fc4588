"""Variants of the transposing quantization kernels: where the time goes, and launch settings.

Default: where the time of the row + column t8 kernel goes, by leave-one-stage-out variants.

Each variant is the library's ``_mx_tile_t8_kernel`` with its source edited as text (a
store left out, or the program ids remapped), written to a temporary module and launched
through the library's own launch code (``kernels.quantize.launch_tile``) with the kernel
swapped in. Times are CUDA-graph replays at the issue-3 shapes, against a device copy in
the same process. Variants that keep every store must equal the library's bytes; the
left-out ones show what a stage costs (the work feeding a left-out store is dropped by
the compiler with it).

``--t8 JSON`` instead times row + column and column-only codes under each listed t8 launch
setting, and ``--grouped JSON`` grouped column-wise codes under each grouped_t8 setting
(64 uneven experts), each checked against the library's bytes / the torch reference.

Usage (repo root, GPU): PYTHONPATH=src python3 benchmarks/quantize_variants.py [--out stages.json]
    [--t8 '[{"prefetch": 4}]'] [--grouped '[{"block_t": 128, "num_warps": 4}]']
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
import types

import torch
import triton
from triton.testing import do_bench_cudagraph

from mxmoe.kernels import quantize as kq
from mxmoe.kernels import triton_quantize as tk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quantize import copy_bandwidth  # noqa: E402  (benchmarks/quantize.py: a device copy in this process)

ROW_CODES = "    tl.store(q_p0 + k * Cp, codes, mask=row_ok & (cols < Cp))\n"
ROW_SCALES = "    _store_u8(s_p, sb, row_ok & (scols < Cp // 32), HW_ROUND == 2)\n"
COL_CODES = "        tl.store(q32 + cols[:, None] * (Rp // 4) + w, words, mask=c_ok[:, None] & (w < Rp // 4))\n"
COL_SCALES = "        tl.store(s_ptr + s_off, tl.trans(sb).to(tl.uint8), mask=c_ok[:, None] & (blk < Rp // 32)[None, :])\n"
# masks false at run time that the compiler cannot fold: the store instructions issue, no lane stores
OFF_RC = (ROW_CODES, ROW_CODES.replace("(cols < Cp)", "(cols < Cp - 2000000000)"))
OFF_RS = (ROW_SCALES, ROW_SCALES.replace("(scols < Cp // 32)", "(scols < Cp - 2000000000)"))
OFF_CC = (COL_CODES, COL_CODES.replace("(w < Rp // 4)", "(w < Rp - 2000000000)"))
OFF_CS = (COL_SCALES, COL_SCALES.replace("(blk < Rp // 32)[None, :]", "(blk < Rp - 2000000000)[None, :]"))
def variant(name: str, edits: list[tuple[str, str]]) -> types.ModuleType:
    src = inspect.getsource(tk)
    for old, new in edits:
        assert src.count(old) == 1, (name, old)
        src = src.replace(old, new)
    d = tempfile.mkdtemp(prefix="mxmoe_variant_")
    path = os.path.join(d, f"tq_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"tq_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def with_kernel(mod: types.ModuleType):
    shim = types.SimpleNamespace(**{k: getattr(tk, k) for k in dir(tk) if not k.startswith("__")})
    shim._mx_tile_t8_kernel = mod._mx_tile_t8_kernel
    return shim


def bench(fn) -> float:
    return do_bench_cudagraph(fn, rep=200, return_mode="median") / 1e3


def time_grouped(configs: list[dict], info: dict) -> int:
    """Time grouped column-wise codes (64 uneven experts, as in quantize.py) under each
    grouped_t8 launch setting, checking bytes against the torch reference."""
    from quantize import N_EXPERTS, uneven_sizes

    from mxmoe.numerics.grouped import torch_quantize_grouped_dim0
    base = dict(kq.TUNING["grouped_t8"])
    bad = 0
    for shape in ((16384, 8192), (131072, 7168)):
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        T, K = shape
        offsets = torch.tensor(uneven_sizes(T, N_EXPERTS, 0), device="cuda").cumsum(0).to(torch.int32)
        copy_bw = copy_bandwidth(2 * x.numel())
        rq, rs, _ = torch_quantize_grouped_dim0(x, offsets)
        ref = [rq.view(torch.uint8), rs.view(torch.uint8)]
        for cfg in [{}] + configs:
            kq.TUNING["grouped_t8"] = {**base, **cfg}
            try:
                fn = lambda: kq.quantize_grouped_colwise(x, offsets)  # noqa: E731
                q, s, _ = fn()
                Tp = q.shape[-1]
                same = torch.equal(q.view(torch.uint8), ref[0]) and torch.equal(s.view(torch.uint8), ref[1])
                t = bench(fn)
                nbytes = 2 * x.numel() + K * Tp + K * Tp // 32
                bad += not same
                print(f"{shape} grouped  {json.dumps(cfg):70s} {t * 1e6:8.1f} us {nbytes / t / copy_bw * 100:5.1f}% "
                      f"of copy{'' if same else '  MISMATCH'}", flush=True)
                info["rows"].append({"shape": list(shape), "kernel": "grouped colwise", "settings": cfg, "us": t * 1e6,
                                     "pct_copy": nbytes / t / copy_bw, "bytes_equal_reference": same})
            except Exception as e:  # noqa: BLE001 - report, count as a failure, go on
                bad += 1
                print(f"{shape} {json.dumps(cfg)} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            finally:
                kq.TUNING["grouped_t8"] = base
    return bad


def time_settings(configs: list[dict], info: dict) -> int:
    """Time row + column and column-only codes under each t8 launch setting (merged into
    the library's "t8" and "t8_colwise" settings), checking bytes against the library's
    default launch."""
    base, base_col = dict(kq.TUNING["t8"]), dict(kq.TUNING["t8_colwise"])
    bad = 0
    for shape in ((16384, 8192), (131072, 7168), (64, 2048, 7168)):
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        n = x.numel()
        copy_bw = copy_bandwidth(2 * n)
        refs = {"rowcol": [t.view(torch.uint8) for t in kq.quantize_rowcol(x)],
                "colwise": [t.view(torch.uint8) for t in kq.quantize_colwise(x)]}
        for cfg in [{}] + configs:
            kq.TUNING["t8"], kq.TUNING["t8_colwise"] = {**base, **cfg}, {**base_col, **cfg}
            try:
                for kind, fn, nbytes in (("rowcol", lambda: kq.quantize_rowcol(x), 4 * n + 2 * n // 32),
                                         ("colwise", lambda: kq.quantize_colwise(x), 3 * n + n // 32)):
                    same = all(torch.equal(a.view(torch.uint8), b) for a, b in zip(fn(), refs[kind]))
                    t = bench(fn)
                    bad += not same
                    print(f"{shape} {kind:8s} {json.dumps(cfg):70s} {t * 1e6:8.1f} us {nbytes / t / copy_bw * 100:5.1f}% "
                          f"of copy{'' if same else '  MISMATCH'}", flush=True)
                    info["rows"].append({"shape": list(shape), "kernel": kind, "settings": cfg, "us": t * 1e6,
                                         "pct_copy": nbytes / t / copy_bw, "bytes_equal_library": same})
            except Exception as e:  # noqa: BLE001 - report, count as a failure, go on
                bad += 1
                print(f"{shape} {json.dumps(cfg)} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            finally:
                kq.TUNING["t8"], kq.TUNING["t8_colwise"] = base, base_col
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--t8", default=None, help="JSON list of t8 launch settings to time instead of the stage variants")
    ap.add_argument("--grouped", default=None, help="JSON list of grouped_t8 launch settings to time")
    ap.add_argument("--once", action="store_true", help="run each variant once at the first shape (for ncu), no timing")
    args = ap.parse_args()
    commit = os.environ.get("COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                         text=True).stdout.strip()
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit, "tuning_t8": kq.TUNING["t8"], "tuning_t8_colwise": kq.TUNING["t8_colwise"],
            "rows": []}
    print(json.dumps({k: v for k, v in info.items() if k != "rows"}), flush=True)
    if args.t8 or args.grouped:
        bad = time_settings(json.loads(args.t8), info) if args.t8 else 0
        bad += time_grouped(json.loads(args.grouped), info) if args.grouped else 0
        if args.out:
            with open(args.out, "w") as f:
                json.dump(info, f, indent=1)
        print("FAIL: bytes differ or a setting failed" if bad else "all settings bit-equal")
        return 1 if bad else 0
    variants = {
        "library": None,
        "copy of library": variant("same", []),
        "no row-scale stores": variant("no_rs", [(ROW_SCALES, "")]),
        "no row-code stores": variant("no_rc", [(ROW_CODES, "")]),
        "no row stores": variant("no_r", [(ROW_SCALES, ""), (ROW_CODES, "")]),
        "no col-scale stores": variant("no_cs", [(COL_SCALES, "")]),
        "no col-code stores": variant("no_cc", [(COL_CODES, "")]),
        "row codes computed, store off": variant("off_rc", [OFF_RC]),
        "row scales computed, store off": variant("off_rs", [OFF_RS]),
        "col codes computed, store off": variant("off_cc", [OFF_CC]),
        "all stores off": variant("off_all", [OFF_RC, OFF_RS, OFF_CC, OFF_CS]),
        "row scales by tl.store": variant("tl_rs", [(ROW_SCALES, ROW_SCALES.replace("HW_ROUND == 2)", "False)"))]),
    }
    keeps_all = {"library", "copy of library"}
    if args.once:
        x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16)
        for name, mod in variants.items():
            old = kq.tk
            if mod is not None:
                kq.tk = with_kernel(mod)
            try:
                kq.quantize_rowcol(x)
                torch.cuda.synchronize()
            finally:
                kq.tk = old
            print("ran", name, flush=True)
        return 0
    for shape in ((16384, 8192), (131072, 7168)):
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        n = x.numel()
        copy_bw = copy_bandwidth(2 * n)
        nbytes = 2 * n + 2 * n + 2 * n // 32
        ref = [t.view(torch.uint8) for t in kq.quantize_rowcol(x)]
        for name, mod in variants.items():
            old = kq.tk
            if mod is not None:
                kq.tk = with_kernel(mod)
            try:
                out = [t.view(torch.uint8) for t in kq.quantize_rowcol(x)]
                same = all(torch.equal(a, b) for a, b in zip(out, ref))
                t = bench(lambda: kq.quantize_rowcol(x))
            finally:
                kq.tk = old
            pct = nbytes / t / copy_bw
            ok = "" if same or name not in keeps_all else "  MISMATCH"
            print(f"{shape} {name:36s} {t * 1e6:8.1f} us  {pct * 100:5.1f}% of copy (full row+col bytes){ok}",
                  flush=True)
            info["rows"].append({"shape": list(shape), "variant": name, "us": t * 1e6, "pct_copy_full_bytes": pct,
                                 "bytes_equal_library": same})
        for name, fn in (("column-only (library)", lambda: kq.quantize_colwise(x)),
                         ("row-wise only (library)", lambda: kq.quantize_rowwise(x))):
            t = bench(fn)
            print(f"{shape} {name:36s} {t * 1e6:8.1f} us", flush=True)
            info["rows"].append({"shape": list(shape), "variant": name, "us": t * 1e6})
    bad = [r for r in info["rows"] if r["variant"] in keeps_all and not r.get("bytes_equal_library", True)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
    print("FAIL: variants that keep every store differ from the library" if bad else "all full variants bit-equal")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
