"""Design (g) in the library, on the H200: ``mx_grouped_mm``'s forward and dgrad through
``mxmoe.kernels.cutlass_wq`` (the weight quantized inside CUTLASS's grouped GEMM) against the
same op with it turned off (design (a): the weight quantize pass, then ``torch._grouped_mm``).

Checks, each bit for bit: outputs at the issue's edge cases (group sizes [162, 0, 2577, 446,
0, 83] with K = 1408, all tokens on one expert, 33 / 64 / 128 / 256 / 300 experts, K = 8 / 40
/ 1416 / 2880, N = 136, int64 offsets, rows past the last offset holding NaN, every expert
empty, E5M2 and floor recipes), the input and weight gradients of each (the dgrad design
(g)'s or (a)'s with the forward, the wgrad design (a)'s), a CUDA-graph replay of forward and
dgrad; and that design (g)'s forward and dgrad ran where they should and not where they
should not (N = 33, T = 0, float32 weights, a misaligned weight, more than 640 tokens per
expert for the forward, more than 1152 for the dgrad). Then the forward and the dgrad per
call at the issue's four shapes against bf16 ``torch._grouped_mm`` in the same process
(CUDA-graph replay). Exits 1 if a check fails.

    MXMOE_CACHE_DIR=<cache with the builds> PYTHONPATH=src:benchmarks python3 benchmarks/check_grouped_wq.py --out r.json

(without the builds in the cache the library builds the kernels first: nvcc and CUTLASS
4.2's headers, mxmoe/kernels/cutlass_wq.py).
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
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--timing-only", action="store_true", help="skip the checks")
    ap.add_argument("--max-tokens-per-expert", type=int, default=None,
                    help="override cutlass_wq.MAX_TOKENS_PER_EXPERT and MAX_TOKENS_PER_EXPERT_DGRAD for the timing "
                         "(to measure design (g) where "
                         "the rule would not take it)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check runs on the H200", file=sys.stderr)
        return 2
    import triton
    from grouped_gemm import SHAPES, SKEWED, issue_case
    from quantize import bench

    from mxmoe.kernels import cutlass_wq
    from mxmoe.ops.grouped_mm import mx_grouped_mm, mx_grouped_mm_dgrad
    from mxmoe.recipe import get_recipe

    dev = torch.device("cuda")
    calls = {"n": 0, "d": 0}

    def counted(fn, key):
        def wrapped(*a, **k):
            out = fn(*a, **k)
            calls[key] += out is not None  # None: the library was not available, design (a) ran
            return out
        return wrapped

    cutlass_wq.grouped_mm_nt_wq = counted(cutlass_wq.grouped_mm_nt_wq, "n")
    cutlass_wq.grouped_mm_nn_wq = counted(cutlass_wq.grouped_mm_nn_wq, "d")

    def run(x, w, offs, recipe, g: bool, grad: bool = False):
        os.environ["MXMOE_GROUPED_WQ"] = "1" if g else "0"
        before, before_d = calls["n"], calls["d"]
        xx = x.detach().requires_grad_(grad)  # no clone: a clone would realign a misaligned weight
        ww = w.detach().requires_grad_(grad)
        out = mx_grouped_mm(xx, ww, offs, recipe)
        grads = None
        if grad:
            dy = torch.randn_like(out, generator=torch.Generator(dev).manual_seed(1))
            out.backward(dy)
            grads = (xx.grad, ww.grad)
        torch.cuda.synchronize()
        return out, grads, (calls["n"] > before, calls["d"] > before_d)

    def same(a, b) -> bool:
        return a.shape == b.shape and bool((a.view(torch.int16) == b.view(torch.int16)).all())

    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"),
            "lib": os.environ.get("MXMOE_CUTLASS_WQ_LIB", "built by the library"),
            "dgrad lib": os.environ.get("MXMOE_CUTLASS_WQ_DGRAD_LIB", "built by the library")}
    print(json.dumps(info), flush=True)
    checks = {}
    gen = torch.Generator(dev).manual_seed(0)

    def maxdiff(a, b) -> float:
        return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0

    def case(name, sizes, K, N, recipe="mxfp8", wdtype=torch.bfloat16, pad=0, expect=True, grad=True,
             offs_dtype=torch.int32, misalign=False, expect_dgrad=None):
        expect_dgrad = expect if expect_dgrad is None else expect_dgrad
        r = get_recipe(recipe)
        E, T = len(sizes), sum(sizes) + pad
        x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
        if pad:
            x[T - pad:] = float("nan")  # rows past the last offset: never read
        w = (torch.randn(E, N, K, device=dev, generator=gen) * 0.05).to(wdtype)
        if misalign:  # contiguous, but 2 bytes past a 16-byte boundary
            buf = torch.empty(w.numel() + 1, device=dev, dtype=wdtype)
            buf[1:].copy_(w.flatten())
            w = buf[1:].view(E, N, K)
        offs = torch.tensor(sizes, device=dev).cumsum(0).to(offs_dtype)
        try:
            og, gg, ran = run(x, w, offs, r, True, grad)
            oa, ga, _ = run(x, w, offs, r, False, grad)
            ok = same(og, oa) and ran[0] == expect and not (pad and og[T - pad:].abs().sum().item() != 0)
            res = {"design_g_ran": ran[0], "expected": expect, "out equal": same(og, oa),
                   "out max abs diff": maxdiff(og[:T - pad], oa[:T - pad])}
            if grad:
                res.update({"dgrad (g) ran": ran[1], "dgrad expected": expect_dgrad, "dx equal": same(gg[0], ga[0]),
                            "dx max abs diff": maxdiff(gg[0], ga[0]),
                            "dw equal": same(gg[1].to(torch.bfloat16), ga[1].to(torch.bfloat16))})
                ok = ok and ran[1] == expect_dgrad and res["dx equal"] and res["dw equal"]
                ok = ok and not (pad and gg[0][T - pad:].abs().sum().item() != 0)
            checks[name] = {"ok": ok, **res}
        except Exception as e:  # noqa: BLE001 - report and go on
            checks[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(f"  {name:58s} {checks[name]}", flush=True)

    if args.timing_only:
        case = lambda *a, **k: None  # noqa: E731
    case("sizes [162,0,2577,446,0,83] K=1408 N=64", [162, 0, 2577, 446, 0, 83], 1408, 64)
    case("all tokens on one expert (E=8, 2048)", [0, 0, 2048, 0, 0, 0, 0, 0], 2048, 256)
    for E in (33, 64, 128, 256):
        case(f"E={E}, 200 tokens each, K=2048 N=1408", [200] * E, 2048, 1408)
    case("K=2880 N=256, ragged", [300, 17, 0, 900, 31], 2880, 256)
    case("rows past the last offset are NaN", [100, 0, 250], 1024, 128, pad=77)
    case("E5M2 recipe", [200, 0, 300, 57], 1408, 128, recipe=get_recipe("mxfp8", fmt="e5m2"))
    case("floor scales", [200, 0, 300, 57], 1408, 128, recipe="mxfp8-floor")
    case("E5M2 with floor scales", [200, 0, 300, 57], 1408, 128, recipe=get_recipe("mxfp8-floor", fmt="e5m2"))
    case("K=40 (one partial k-tile)", [100, 0, 257, 31], 40, 64)
    case("N=40 (the dgrad's partial k-tile)", [100, 0, 257, 31], 64, 40)
    case("K=8", [50, 70], 8, 16)
    case("N=8", [50, 70], 16, 8)
    case("K=1416 N=136 (a partial k-tile and tile)", [300, 17, 0, 333], 1416, 136)
    case("E=300 (tables past one block), 100 tokens each", [100] * 300, 512, 128)
    case("int64 offsets", [162, 0, 257, 446, 0, 83], 1408, 64, offs_dtype=torch.int64)
    case("every expert empty, T > 0 (rows all past the end)", [0, 0, 0, 0], 256, 64, pad=50)
    case("misaligned weight: design (a)", [100, 200], 256, 64, misalign=True, expect=False)
    case("N=33: design (a)", [100, 200], 256, 33, expect=False)
    case("T=0: design (a)", [0, 0, 0], 256, 64, expect=False)
    case("float32 weights: design (a)", [100, 200], 256, 64, wdtype=torch.float32, expect=False)
    case("1000 tokens per expert: forward (a), dgrad (g)", [1000, 1000], 256, 64, expect=False, expect_dgrad=True)
    case("1200 tokens per expert: design (a)", [1200, 1200], 256, 64, expect=False)

    # a CUDA-graph replay (the shape ran once before the capture)
    r = get_recipe("mxfp8")
    sizes = [250, 0, 310, 180]
    x = torch.randn(sum(sizes), 2048, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(4, 1408, 2048, device=dev) * 0.02).to(torch.bfloat16)
    dy = torch.randn(sum(sizes), 1408, device=dev, dtype=torch.bfloat16)
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    os.environ["MXMOE_GROUPED_WQ"] = "1"
    eager = mx_grouped_mm(x, w, offs, r)
    eager_dx = mx_grouped_mm_dgrad(dy, w, offs, r)
    g = torch.cuda.CUDAGraph()
    before, before_d = calls["n"], calls["d"]
    with torch.cuda.graph(g):
        static = mx_grouped_mm(x, w, offs, r)
        static_dx = mx_grouped_mm_dgrad(dy, w, offs, r)
    g.replay()
    torch.cuda.synchronize()
    checks["CUDA graph replay"] = {"ok": same(static, eager) and same(static_dx, eager_dx) and calls["n"] > before
                                   and calls["d"] > before_d}
    del g, static, static_dx
    print(f"  {'CUDA graph replay':58s} {checks['CUDA graph replay']}", flush=True)
    # a capture at a token count never run eagerly (768: a multiple of 16, 740 above is not),
    # same weight shape: design (g) runs in the graph, and its tables' kernel compiles no new
    # variant (it has no value specialization; before, a multiple of 16 was a new variant,
    # compiled inside the capture, which this setup allows; the quantizers' Triton kernels may
    # still compile there)
    name = "CUDA graph capture at a new T (768)"
    from mxmoe.kernels import group_tables

    def variants():
        try:
            return sum(len(c[0]) for c in group_tables._group_tables_kernel.device_caches.values())
        except (AttributeError, TypeError, IndexError):  # another Triton's cache layout
            return None

    try:
        compiled = variants()
        sizes2 = [256, 0, 320, 192]
        x2 = torch.randn(sum(sizes2), 2048, device=dev, dtype=torch.bfloat16)
        dy2 = torch.randn(sum(sizes2), 1408, device=dev, dtype=torch.bfloat16)
        offs2 = torch.tensor(sizes2, device=dev).cumsum(0).to(torch.int32)
        g = torch.cuda.CUDAGraph()
        before, before_d = calls["n"], calls["d"]
        with torch.cuda.graph(g):
            static = mx_grouped_mm(x2, w, offs2, r)
            static_dx = mx_grouped_mm_dgrad(dy2, w, offs2, r)
        ran = (calls["n"] > before, calls["d"] > before_d)
        g.replay()
        torch.cuda.synchronize()
        new = None if compiled is None else variants() - compiled
        checks[name] = {"ok": same(static, mx_grouped_mm(x2, w, offs2, r))
                        and same(static_dx, mx_grouped_mm_dgrad(dy2, w, offs2, r)) and all(ran) and not new,
                        "design (g) ran": ran, "tables kernel variants compiled in the capture": new}
        del g, static, static_dx
    except Exception as e:  # noqa: BLE001 - report and go on
        checks[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
    print(f"  {name:58s} {checks[name]}", flush=True)

    rows = []
    if args.max_tokens_per_expert is not None:
        cutlass_wq.MAX_TOKENS_PER_EXPERT = cutlass_wq.MAX_TOKENS_PER_EXPERT_DGRAD = args.max_tokens_per_expert
        info["max tokens per expert (overridden)"] = args.max_tokens_per_expert
    cases = [(s, False) for s in SHAPES] + [(SKEWED, True)]
    for (T, K, N, E), skewed in cases:
        sizes, offs, x, w, dy = issue_case(T, K, N, E, skewed, dev)
        t = {"fwd: bf16 torch._grouped_mm": bench(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)),
             "dgrad: bf16 torch._grouped_mm": bench(lambda: torch._grouped_mm(dy, w, offs=offs))}
        ran = {}
        for op, fn in (("fwd", lambda: mx_grouped_mm(x, w, offs, r)), ("dgrad", lambda: mx_grouped_mm_dgrad(dy, w, offs, r))):
            key = "n" if op == "fwd" else "d"
            for label, on in ((f"{op}: mx_grouped_mm, design (g) allowed", "1"), (f"{op}: mx_grouped_mm, design (a)", "0")):
                os.environ["MXMOE_GROUPED_WQ"] = on
                fn()  # a shape's first call runs outside the graph capture
                before = calls[key]
                t[label] = bench(fn)
                if on == "1":
                    ran[op] = calls[key] > before
        row = {"shape": [T, K, N, E], "skewed": skewed, "tokens per expert": [min(sizes), max(sizes)],
               "design (g) ran": ran, "us": {k: round(v * 1e6, 1) for k, v in t.items()},
               "x bf16": {k: round(t[k.split(":")[0] + ": bf16 torch._grouped_mm"] / v, 3) for k, v in t.items()}}
        rows.append(row)
        print(f"\nT={T} K={K} N={N} E={E}{' skewed' if skewed else ''} (design (g) ran: {ran})")
        for k in t:
            print(f"  {k:44s} {row['us'][k]:9.1f} us {row['x bf16'][k]:7.3f}x")
    os.environ["MXMOE_GROUPED_WQ"] = "1"
    return write_and_report(args.out, info, checks, rows)


def write_and_report(out: str | None, info: dict, checks: dict, rows: list) -> int:
    """Write the JSON result (if ``out``), print each failed check; exit status 1 if any."""
    if out:
        with open(out, "w") as f:
            json.dump({"info": info, "checks": checks, "rows": rows}, f, indent=1)
    failed = [k for k, v in checks.items() if not v["ok"]]
    for k in failed:
        print(f"FAIL {k}: {checks[k]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
