"""Where the time of the CUDA row + column quantizer goes, by leave-one-stage-out variants.

Each variant is ``src/mxmoe/kernels/cuda_rowcol.cu`` with its source edited as text and
run through the library's own launch code (``kernels.cuda_quantize.rowcol``, NVRTC) at the
library's launch settings (or each ``--cfg``). Variants:
- ``as is``: must equal the library's bytes (checked);
- ``no quantize``: phases 2-3 left out: the tile read, the codes and scales written from
  shared memory (the memory traffic alone, garbage bytes);
- ``no code stores``: the code stores of phase 4 left out;
- ``no scale stores``: the scale stores of the main kernel left out (the second pass,
  with ``scratch``, still runs);
- ``no scales pass``: as is, without the second kernel (``mx_scales_out``) of
  ``scratch: true`` (what that pass costs).
Times are CUDA-graph replays at (16384, 8192) and (131072, 7168) bf16, against a device
copy in the same process.

Usage (repo root, GPU): PYTHONPATH=src python3 benchmarks/rowcol_cuda_variants.py
    [--cfg '{"threads": 128, "rb": 4, "gb": 2, "scratch": true}']
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from mxmoe.kernels import cuda_quantize as cq
from mxmoe.kernels import quantize as kq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quantize import bench, copy_bandwidth  # noqa: E402


def variants(src: str) -> dict[str, str]:
    p2, p4 = src.index("    // phase 2"), src.index("    // phase 4")
    c0 = src.index("    for (int i = threadIdx.x; i < TR * NCH")
    sc0 = src.index("    // ... and the scales")
    sc1 = src.rindex("}\n\n//", 0, src.index("mx_scales_out("))  # the end of the main kernel
    return {
        "as is": src,
        "no quantize": src[:p2] + src[p4:],
        "no code stores": src[:c0] + src[sc0:],
        "no scale stores": src[:sc0] + src[sc1:],
        "no scales pass": src,  # as is, without the second kernel (mx_scales_out) of scratch: true
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cfg", action="append", default=None, help="launch settings (JSON), repeatable")
    ap.add_argument("--only", action="append", default=None, help="run only this variant (repeatable)")
    ap.add_argument("--pass-alone", action="store_true", help="also time the scales pass (mx_scales_out) by itself")
    args = ap.parse_args()
    cfgs = [json.loads(c) for c in args.cfg] if args.cfg else [dict(kq.TUNING["rowcol_cuda"])]
    print(torch.cuda.get_device_name(), torch.__version__, "commit", os.environ.get("COMMIT", "unknown"))
    original = cq.source
    for M, K in ((16384, 8192), (131072, 7168)):
        x = torch.randn(1, M, K, device="cuda", dtype=torch.bfloat16)
        nbytes = 4 * M * K + 2 * (M * K // 32)
        copy_bw = copy_bandwidth(2 * M * K)
        want = [t.view(torch.uint8) for t in kq.quantize_rowcol(x)]
        for cfg in cfgs:
            cfg = {"enabled": True, **cfg}
            assert cq._settings_ok(cfg), cfg
            for name in variants(original("e4m3", "rceil", cfg)):
                if args.only and name not in args.only:
                    continue
                cq.source = lambda fmt, mode, c, name=name: variants(original(fmt, mode, c))[name]
                cq._KERNELS.clear()
                if name == "no scales pass":
                    main_k, _ = cq._compiled("e4m3", "rceil", cfg, torch.cuda.current_device())
                    key = cq._key("e4m3", "rceil", cfg, torch.cuda.current_device())
                    cq._KERNELS[key] = (main_k, lambda **kw: None)
                out = cq.rowcol(x, "e4m3", "rceil", cfg)
                torch.cuda.synchronize()
                exact = all(torch.equal(out[k], w) for k, w in zip(("q_row", "s_row", "q_col", "s_col"), want))
                t = bench(lambda: cq.rowcol(x, "e4m3", "rceil", cfg))
                print(f"({M}, {K}) {json.dumps({k_: v for k_, v in cfg.items() if k_ != 'enabled'})} {name:16s} "
                      f"{t * 1e6:8.1f} us {100 * nbytes / t / copy_bw:5.1f}% of copy  same bytes: {exact}", flush=True)
            if args.pass_alone and cfg.get("scratch"):  # the second kernel by itself (garbage scratch bytes)
                cq.source = original
                cq._KERNELS.clear()
                _, scales = cq._compiled("e4m3", "rceil", cfg, torch.cuda.current_device())
                nty, ntx = -(-M // cq.TILE), -(-K // cq.TILE)
                scr = torch.zeros(2, nty * ntx * cq.TILE, dtype=torch.int32, device="cuda")
                s_row = torch.empty(M, K // 32, dtype=torch.uint8, device="cuda")
                s_col = torch.empty(K, M // 32, dtype=torch.uint8, device="cuda")
                jobs = nty * -(-ntx // 32) + ntx * -(-nty // cfg.get("cj", 32))
                t = bench(lambda: scales(grid=(jobs, 1, 1), block=(cfg.get("scale_threads", 128), 1, 1),
                                         args=[scr[0], scr[1], M, K, s_row, s_col]))
                moved = 4 * (M * K // 32)
                print(f"({M}, {K}) {json.dumps({k_: v for k_, v in cfg.items() if k_ != 'enabled'})} "
                      f"{'scales pass alone':16s} {t * 1e6:8.1f} us {moved / t / 1e12:5.2f} TB/s", flush=True)
        cq.source = original
        cq._KERNELS.clear()
        del x, want
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
