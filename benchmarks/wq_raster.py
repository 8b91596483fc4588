"""Experiment (issue 4, session 16): the tile order of design (g)'s persistent grouped
scheduler. CUTLASS's grouped scheduler walks the output tiles along M (the weight's rows) by
default, one tile wide; ``raster_order`` AlongN walks the token tiles first (the tiles that
quantize the same weight rows run back to back) and ``max_swizzle_size`` groups tiles into
squares of 2, 4 or 8 (the issue's "expert-wise supergrouping": operands kept in L2; but the
grouped scheduler, given no host-side problem shapes as here, keeps swizzle 1: session 16
measured the sizes to have no effect). The measurement builds of
``src/mxmoe/kernels/cutlass_wq.cu`` (``RASTER=2``: ``fill_args`` reads ``MXMOE_WQ_RASTER``, m /
n / h, and ``MXMOE_WQ_SWIZZLE``, an integer; they export ``NAME_raster_from_env``) are given by
``MXMOE_CUTLASS_WQ_LIB`` / ``MXMOE_CUTLASS_WQ_DGRAD_LIB`` (the script refuses others); design
(g) is forced at every shape, each setting's output is compared bit for bit with the build's
own order (no variables set: CUTLASS's, AlongM), and the forward and dgrad are timed per call
(CUDA-graph replay) against bf16 ``torch._grouped_mm`` in the same process. The builds, on a
machine with nvcc and CUTLASS 4.2's headers (``--build-command fwd.so dgrad.so`` prints them),
then on the H200:

    PYTHONPATH=src:benchmarks MXMOE_CUTLASS_WQ_LIB=<fwd.so> MXMOE_CUTLASS_WQ_DGRAD_LIB=<dgrad.so> \\
        python3 benchmarks/wq_raster.py --settings m1,n1 --out r.json

(session 16's run, ``results/h200_design_g/wq_raster_7e20d68.*``, used a build of 7e20d68's
source with the same ``fill_args`` lines, before they became ``RASTER=2``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default="m1,n1,m2,n2,m4,n4,m8,n8",
                    help="raster order (m / n / h) and swizzle size, comma separated")
    ap.add_argument("--shapes", default="0,1,2,3", help="indices into the issue's cases (3: skewed)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--build-command", nargs=2, metavar=("FWD_SO", "DGRAD_SO"),
                    help="print the nvcc commands of the two measurement builds (E4M3 / rceil) and exit")
    args = ap.parse_args()
    from mxmoe.kernels import cutlass_wq

    if args.build_command:
        where = cutlass_wq.cutlass_dir() or "$MXMOE_CUTLASS_DIR"  # a placeholder where none is found
        for op, out in zip(("forward", "dgrad"), args.build_command):
            print(" ".join(cutlass_wq.build_command("e4m3", "rceil", out, op=op, cutlass=where, macros={"RASTER": 2})))
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: this experiment runs on the H200", file=sys.stderr)
        return 2
    import ctypes

    for op, var in (("forward", "MXMOE_CUTLASS_WQ_LIB"), ("dgrad", "MXMOE_CUTLASS_WQ_DGRAD_LIB")):
        lib = os.environ.get(var)
        try:
            ok = lib is not None and hasattr(ctypes.CDLL(lib), cutlass_wq.symbol("e4m3", "rceil", "raster_from_env", op))
        except OSError:
            ok = False
        if not ok:
            what = "is not set" if lib is None else f"={lib} is not a measurement build"
            print(f"{var} {what} (RASTER=2; --build-command prints how to make one)", file=sys.stderr)
            return 2
    from grouped_gemm import SHAPES, SKEWED, issue_case
    from quantize import bench

    from mxmoe.ops.grouped_mm import mx_grouped_mm, mx_grouped_mm_dgrad
    from mxmoe.recipe import get_recipe

    cutlass_wq.MAX_TOKENS_PER_EXPERT = cutlass_wq.MAX_TOKENS_PER_EXPERT_DGRAD = 10 ** 9  # design (g) at every shape
    r = get_recipe("mxfp8")
    dev = torch.device("cuda")
    cases = [(s, False) for s in SHAPES] + [(SKEWED, True)]
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    rows = []
    for i in [int(s) for s in args.shapes.split(",")]:
        (T, K, N, E), skewed = cases[i]
        _, offs, x, w, dy = issue_case(T, K, N, E, skewed, dev)
        for var in ("MXMOE_WQ_RASTER", "MXMOE_WQ_SWIZZLE"):
            os.environ.pop(var, None)
        ref = (mx_grouped_mm(x, w, offs, r), mx_grouped_mm_dgrad(dy, w, offs, r))
        t = {"fwd bf16": bench(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)),
             "dgrad bf16": bench(lambda: torch._grouped_mm(dy, w, offs=offs)),
             "fwd default": bench(lambda: mx_grouped_mm(x, w, offs, r)),
             "dgrad default": bench(lambda: mx_grouped_mm_dgrad(dy, w, offs, r))}
        equal = {}
        for s in settings:
            os.environ["MXMOE_WQ_RASTER"], os.environ["MXMOE_WQ_SWIZZLE"] = s[0], s[1:]
            out = (mx_grouped_mm(x, w, offs, r), mx_grouped_mm_dgrad(dy, w, offs, r))
            equal[s] = all(bool((a.view(torch.int16) == b.view(torch.int16)).all()) for a, b in zip(out, ref))
            t[f"fwd {s}"] = bench(lambda: mx_grouped_mm(x, w, offs, r))
            t[f"dgrad {s}"] = bench(lambda: mx_grouped_mm_dgrad(dy, w, offs, r))
        ratios = {k: t[f"{k.split()[0]} bf16"] / v for k, v in t.items() if "bf16" not in k}
        row = {"shape": [T, K, N, E], "skewed": skewed, "equal to the default order": equal,
               "us": {k: round(v * 1e6, 1) for k, v in t.items()}, "x bf16": {k: round(v, 3) for k, v in ratios.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("COMMIT", "unknown"),
            "date": time.strftime("%Y-%m-%d"), "lib": os.environ.get("MXMOE_CUTLASS_WQ_LIB"),
            "dgrad lib": os.environ.get("MXMOE_CUTLASS_WQ_DGRAD_LIB")}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
    return 0 if all(all(r["equal to the default order"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
