"""Launch settings of the wgrad operand pass (``fake_quantize_grouped_colwise_pair``: dy and x
quantized along each expert's tokens, dequantized, in the padded token layout, one launch).

At (16384, 2048, 1408, 64) the wgrad of design (a) sits at the 0.85x target (0.855x at
b2a7089, 0.8497x at 1fc2ef5) and the pass is 66 us of its 326 us, about 3.4 TB/s counted on
the unpadded tokens; TUNING["grouped_tok"] was swept once, at 16384 x 8192 with 64 experts.
This sweeps block_g (32-token blocks per program), block_c (columns per program) and warps
at the issue's shapes, times the pass and the whole wgrad (pass + torch._grouped_mm) by
CUDA-graph replay against bf16 ``torch._grouped_mm`` in the same process, and checks that
every setting gives the default setting's bits.

    PYTHONPATH=src:benchmarks python3 benchmarks/wgrad_pair_sweep.py [--out sweep.json]

The commit is read from the environment variable COMMIT. Needs a CUDA GPU (exits with
status 2 without one).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

from grouped_gemm import SHAPES, SKEWED, group_sizes

# block_g, block_c, num_warps; 4 warps was 1.1-40x slower at (16384, 2048, 1408, 64) in the
# first run (3eb0657, results/h200_designs/wgrad_pair_sweep_3eb0657.log), which ran out of
# its time limit after two shapes, so only 8 warps are swept now
SETTINGS = list(itertools.product((4, 8, 16), (32, 64, 128), (8,)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON result file")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        print("wgrad_pair_sweep.py times GPU kernels; no CUDA GPU here", file=sys.stderr)
        return 2
    import triton
    from quantize import bench

    from mxmoe.kernels import quantize as kq
    from mxmoe.ops.gemm import grouped_mm_tn
    from mxmoe.ops.quantize import fake_quantize_grouped_tokens_pair
    from mxmoe.recipe import get_recipe

    recipe = get_recipe("mxfp8")
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"),
            "timing": "CUDA-graph replay", "default": dict(kq.TUNING["grouped_tok"])}
    print(json.dumps(info), flush=True)
    default = dict(kq.TUNING["grouped_tok"])
    rows = []
    for (T, K, N, E), skewed in [(SHAPES[2], False), (SHAPES[0], False), (SKEWED, True), (SHAPES[1], False)]:
        offs = torch.tensor(group_sizes(T, E, skewed), device="cuda").cumsum(0).to(torch.int32)
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
        bf16 = bench(lambda: torch._grouped_mm(dy.t(), x, offs=offs), graph=True)

        def pair():
            return fake_quantize_grouped_tokens_pair(dy, x, offs, recipe, out_dtype=torch.bfloat16)

        def wgrad():
            a, b, po = pair()
            return grouped_mm_tn(a, b, po, nonempty_groups=True)

        kq.TUNING["grouped_tok"] = dict(default)
        ref = [t.clone() for t in pair()]
        name = f"T={T} K={K} N={N} E={E}{' skewed' if skewed else ''}"
        print(f"\n{name}: bf16 wgrad {bf16 * 1e6:.1f} us", flush=True)
        res = []
        for g, c, w in SETTINGS:
            kq.TUNING["grouped_tok"] = {"block_g": g, "block_c": c, "num_warps": w}
            try:
                same = all(torch.equal(p, q) for p, q in zip(pair(), ref))
                t_pair = bench(pair, rep=40, graph=True)
                t_wgrad = bench(wgrad, rep=40, graph=True)
            except Exception as e:  # noqa: BLE001 - a setting that does not launch
                print(f"  g={g} c={c} w={w}: {type(e).__name__}: {str(e)[:120]}")
                continue
            ratio = bf16 / t_wgrad
            mark = " (default)" if (g, c, w) == (default["block_g"], default["block_c"], default["num_warps"]) else ""
            print(f"  g={g:2d} c={c:3d} w={w}: pass {t_pair * 1e6:7.1f} us, wgrad {t_wgrad * 1e6:7.1f} us = "
                  f"{ratio:.3f}x bf16, bits {'same' if same else 'DIFFER'}{mark}", flush=True)
            res.append({"block_g": g, "block_c": c, "num_warps": w, "pass_us": t_pair * 1e6,
                        "wgrad_us": t_wgrad * 1e6, "ratio": ratio, "same_bits": same})
        rows.append({"T": T, "K": K, "N": N, "E": E, "skewed": skewed, "bf16_us": bf16 * 1e6, "settings": res})
        del x, dy, ref
        torch.cuda.empty_cache()
    kq.TUNING["grouped_tok"] = default
    if args.out:
        args.out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
