"""CUTLASS's sm90 mixed-input grouped GEMM and design (g), the MXFP8 weight quantization
inside it: does a register-operand (RS) mainloop that converts (or quantizes) the weight
tile in registers run at the bf16 GEMM's speed? (issue 4, benchmarks/NOTES.md sessions 13
and 14; every measured variant; the library runs one of them, q9x: mxmoe.kernels.cutlass_wq)

The grouped GEMMs are CUTLASS 4.2 ptr-array kernels (``src/mxmoe/kernels/cutlass_wq.cu``,
built by ``cutlass_mixed/build.sh`` into one shared library), per expert g:
out[rows of g] (S_g x N) = x_g (S_g x K) . W_g^T, W_g the (N x K) weight as the register
operand A and the S_g tokens as B. Variants (the library's function prefixes):

- ``v0*``: bf16 W and bf16 x, CUTLASS's TMA warp-specialized cooperative kernel: the
  skeleton ``torch._grouped_mm`` runs on sm90, with the operands' roles swapped;
- ``m1*``: float8_e4m3 W converted to bf16 in registers (no scale);
- ``m2*``: float8_e4m3 W times a bf16 scale per 64 elements along K (the mixed-input
  kernel's chunk must be a multiple of its K tile, and the K tile at least 64: MXFP8's
  32-element blocks are out of its reach, so this is a timing proxy for them, not MXFP8);
- ``q3*``, ``q4*``, ``q6*``, ``q7*``, ``q8*``: the raw bf16 W, quantized to MXFP8 (E4M3,
  rceil) and dequantized in registers inside the mainloop (design (g), the arithmetic and
  load order of cutlass_wq.cu's QDQ / EARLY): no pass over the weight. Checked bit for bit against
  design (a) (the quantize passes, then the bf16 GEMM), and timed per call as the forward
  runs it: the x pass, then this GEMM. ``q0*`` / ``q5*``: the same kernel with the raw
  weight into the MMA (no quantization / only the block amax and scales): timing
  references that split design (g)'s time, not results (compared with the GEMM on the raw
  weight). ``q4e`` / ``q4f`` / ``q4g``: q4c built for E5M2 / rceil, E4M3 / floor and E5M2 /
  floor (FORMAT_VARIANTS): checked in the exactness section only, not timed. Session 14:
  ``*l`` / ``*k`` / ``q4m``: our consumer loop (LOOP 2 / 4: a pair of k-blocks or a whole
  k-tile quantized while the previous ones' wgmmas run; q4m with 2-CTA clusters); ``q9*``:
  QDQ 5 (QDQ 2 with one slow / fast branch per warp), ``q9e`` / ``q9g`` its E5M2 builds;
  ``*w`` / ``*x`` / ``q9y``: 128 x 320 tiles (two m64n160 wgmmas per k-block; one token
  tile for up to 320 tokens of an expert), ``*x`` with LOOP 4, ``q9y`` with LOOP 2;
  ``q9xe`` / ``q9xf`` / ``q9xg``: q9x's E5M2 / floor builds (exactness only).

For each shape of issue 4 and each variant: the GEMM alone (operands prepared), against
``torch._grouped_mm`` on bf16 operands in the same process; the bf16 variant's and the
e4m3 variants' outputs are checked against design (a)'s GEMM on the same values (v0:
the dequantized operands; m1: the codes as bf16; m2: codes times the chunk scales).
Timing by CUDA-graph replay where the launch can be captured, else eagerly. The per-call
figure of design (g) includes four small torch launches that build the token and output
pointer arrays (the library builds them in one: mxmoe.kernels.group_tables), so it slightly understates
the kernel. The one-hot check multiplies by the identity: a NaN anywhere in a weight row
makes that row's whole output NaN (0 * NaN), so for the rows with a non-finite block it
shows only that the row holds one. Exits 1 if any check fails.

    bash benchmarks/cutlass_mixed/build.sh /tmp/cm.so     # nvcc 13, CUTLASS 4.2 headers
    PYTHONPATH=src:benchmarks python3 benchmarks/cutlass_mixed.py --lib /tmp/cm.so --out r.json

Writes JSON with the GPU name, versions and the commit (env COMMIT).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

import torch

CHUNK = 64


# design (g) variants built for another element format / scale mode (build.sh's FMT and MODE
# columns): checked in the exactness section only, against design (a) under that recipe
FORMAT_VARIANTS = {"q4e": ("e5m2", "rceil"), "q4f": ("e4m3", "floor"), "q4g": ("e5m2", "floor"),
                   "q9e": ("e5m2", "rceil"), "q9g": ("e5m2", "floor"),
                   "q9xe": ("e5m2", "rceil"), "q9xf": ("e4m3", "floor"), "q9xg": ("e5m2", "floor")}


def is_design_g(name: str) -> bool:
    """The exact design (g) variants: q-prefixed, except the timing references q0 and q5."""
    return name.startswith("q") and not name.startswith(("q0", "q5"))


def variants(lib: ctypes.CDLL, names: list[str]) -> list[str]:
    """The variant prefixes among ``names`` that the library defines."""
    out = []
    for n in names:
        try:
            getattr(lib, n + "_run")
            out.append(n)
        except AttributeError:
            pass
    return out


def pointer_arrays(base: torch.Tensor, starts: torch.Tensor, row_elems: int) -> torch.Tensor:
    """int64 device addresses base + starts * row_elems * element size (one per group)."""
    return base.data_ptr() + starts.to(torch.int64) * (row_elems * base.element_size())


def problem_table(offs: torch.Tensor, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped problems (E, 3) int32 (N, tokens of expert e, K), contiguous, and each
    expert's first token row (E,) int64, from cumulative int32 offsets; on the device."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    problems = torch.stack([torch.full_like(offs, N), sizes, torch.full_like(offs, K)], 1)
    return problems.to(torch.int32).contiguous(), (offs - sizes).to(torch.int64)


def launch(lib, n: str, problems: torch.Tensor, pa: torch.Tensor, pb: torch.Tensor, ps: torch.Tensor,
           pd: torch.Tensor) -> None:
    """One launch of variant ``n`` on the current stream: the problem table and the
    per-group pointer arrays of the weight, tokens, scales and output.

    Raises:
        RuntimeError: CUTLASS refused the arguments or the launch (its status code).
    """
    res = getattr(lib, n + "_run")(problems.data_ptr(), pa.data_ptr(), pb.data_ptr(), ps.data_ptr(), pd.data_ptr(),
                                   CHUNK, torch.cuda.current_stream().cuda_stream)
    if res:
        raise RuntimeError(f"{n}: CUTLASS returned {res}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", required=True, help="the shared library cutlass_mixed/build.sh made")
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--variants", default="v0a,m1a,m2b,q3c,q4a,q4c,q4t,q4p,q0c,q5c,q6c,q7c,q8c,q4l,q4k,q3k,q4m,q0k,q9c,q9k,q0w,q4w,q9w,q3w,q9x,q0x,q4x,q3x,q9y,q4e,q4f,q4g,q9e,q9g,q9xe,q9xf,q9xg")
    ap.add_argument("--shapes", default="all", help="'all', 'none' (only the exactness checks) or case "
                    "indices, e.g. '2' (0-2: the issue's shapes, 3: skewed)")
    ap.add_argument("--no-exact", action="store_true", help="skip the exactness checks (profiling runs)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark runs on the H200", file=sys.stderr)
        return 2
    from grouped_gemm import SHAPES, SKEWED, group_sizes
    from quantize import bench

    from mxmoe.kernels.quantize import quantize_rowwise
    from mxmoe.ops.gemm import grouped_mm_nt
    from mxmoe.ops.grouped_mm import mx_grouped_mm
    from mxmoe.ops.quantize import fake_quantize
    from mxmoe.recipe import get_recipe

    lib = ctypes.CDLL(args.lib)
    names = variants(lib, args.variants.split(","))
    for n in names:
        getattr(lib, n + "_run").argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int, ctypes.c_void_p]
        getattr(lib, n + "_setup").argtypes = [ctypes.c_int] * 4
    import triton

    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"),
            "variants": names, "chunk": CHUNK}
    print(json.dumps(info), flush=True)
    recipe = get_recipe("mxfp8")
    rows = []
    cases = [(s, False) for s in SHAPES] + [(SKEWED, True)]
    if args.shapes == "none":
        cases = []
    elif args.shapes != "all":
        cases = [cases[int(i)] for i in args.shapes.split(",")]
    for (T, K, N, E), skewed in cases:
        sizes = group_sizes(T, E, skewed)
        dev = torch.device("cuda")
        offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
        problems, starts = problem_table(offs, N, K)
        x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(E, N, K, device=dev) * 0.02).to(torch.bfloat16)
        xq = fake_quantize(x, recipe, dim=1, out_dtype=torch.bfloat16)
        wq = fake_quantize(w, recipe, dim=2, out_dtype=torch.bfloat16)
        codes, _ = quantize_rowwise(w)  # (E, N, K) float8_e4m3fn
        codes = codes.contiguous()
        # a bf16 power-of-two scale per 64 elements along K, (E, K / 64, N) (N contiguous)
        sexp = torch.randint(-3, 3, (E, K // CHUNK, N), device=dev, dtype=torch.int16)
        scale = ((sexp + 127) << 7).view(torch.bfloat16).contiguous()
        flop = 2.0 * T * K * N
        r = {"shape": [T, K, N, E], "skewed": skewed, "sizes": [min(sizes), max(sizes)]}
        t = {"bf16 torch._grouped_mm": bench(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), rep=100,
                                             warmup=25),
             "mx fwd (a), per call": bench(lambda: mx_grouped_mm(x, w, offs, recipe), rep=100, warmup=25),
             "(a) GEMM on dequantized operands": bench(lambda: grouped_mm_nt(xq, wq, offs), rep=100, warmup=25)}
        ref_a = grouped_mm_nt(xq, wq, offs)
        experts = torch.arange(E, device=dev)
        checks = {}
        for n in names:
            if n in FORMAT_VARIANTS:
                continue
            wop = w if n.startswith("q") else codes if n.startswith("m") else wq
            out = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
            pa = pointer_arrays(wop, experts, N * K)
            ps = pointer_arrays(scale, experts, K // CHUNK * N)
            rc = getattr(lib, n + "_setup")(E, N, K, CHUNK)

            def run(n=n, pa=pa, ps=ps, pb=pointer_arrays(xq, starts, K), pd=pointer_arrays(out, starts, N)):
                launch(lib, n, problems, pa, pb, ps, pd)

            try:
                if rc:
                    raise RuntimeError(f"{n}: setup returned {rc}")
                run()
                torch.cuda.synchronize()
                if n.startswith("v0") or is_design_g(n):
                    want = ref_a
                elif n.startswith(("q0", "q5")):
                    want = grouped_mm_nt(xq, w, offs)
                elif n.startswith("m1"):
                    want = grouped_mm_nt(xq, codes.to(torch.bfloat16), offs)
                else:
                    wsc = codes.to(torch.float32).view(E, N, K // CHUNK, CHUNK) * \
                        scale.float().transpose(1, 2).unsqueeze(-1)
                    want = grouped_mm_nt(xq, wsc.view(E, N, K).to(torch.bfloat16), offs)
                same = (out.view(torch.int16) == want.view(torch.int16)).float().mean().item()
                err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
                checks[n] = {"bit_equal_fraction": round(same, 6), "max_rel_err": err}
                t[f"{n} GEMM"] = bench(run, rep=100, warmup=25)
                if is_design_g(n):
                    def per_call(n=n, pa=pa, ps=ps):  # the forward as it would run: x pass, then the GEMM
                        xq2 = fake_quantize(x, recipe, dim=1, out_dtype=torch.bfloat16)
                        out2 = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
                        launch(lib, n, problems, pa, pointer_arrays(xq2, starts, K), ps, pointer_arrays(out2, starts, N))
                        return out2

                    o2 = per_call()
                    torch.cuda.synchronize()
                    checks[n]["per_call_bit_equal"] = bool((o2.view(torch.int16) == ref_a.view(torch.int16)).all())
                    t[f"{n} per call (x pass + GEMM)"] = bench(per_call, rep=100, warmup=25)
            except Exception as e:  # noqa: BLE001 - report the variant's failure, go on
                checks[n] = {"error": f"{type(e).__name__}: {e}"}
        base = t["bf16 torch._grouped_mm"]
        r["us"] = {k: round(v * 1e6, 1) for k, v in t.items()}
        r["x bf16"] = {k: round(base / v, 3) for k, v in t.items()}
        r["TFLOP/s"] = {k: round(flop / v / 1e12, 1) for k, v in t.items()}
        r["checks"] = checks
        rows.append(r)
        label = f"T={T} K={K} N={N} E={E}" + (" skewed" if skewed else "")
        print(f"\n{label}  (sizes {min(sizes)}..{max(sizes)})")
        print(f"  {'what':44s} {'us':>9s} {'TFLOP/s':>8s} {'x bf16':>7s}")
        for k in t:
            print(f"  {k:44s} {r['us'][k]:9.1f} {r['TFLOP/s'][k]:8.1f} {r['x bf16'][k]:7.3f}")
        for n, c in checks.items():
            print(f"  check {n}: {c}")
        sys.stdout.flush()
    exact = {} if args.no_exact else exactness(lib, [n for n in names if is_design_g(n)], recipe)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"info": info, "rows": rows, "exactness": exact}, f, indent=1)
    failed = [f"{r['shape']} {n}: {c}" for r in rows for n, c in r["checks"].items()
              if "error" in c or (is_design_g(n) or n.startswith("v0")) and not (
                  c["bit_equal_fraction"] == 1.0 and c.get("per_call_bit_equal", True))]
    failed += [f"exactness {n} {k}: {v}" for n, r in exact.items() for k, v in r.items()
               if k != "one-hot differing values" and v is not True]
    for f in failed:
        print(f"FAIL {f}")
    return 1 if failed else 0


def run_grouped(lib, n: str, xq: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out (T, N) of design (g) variant ``n`` (the raw bf16 w) on prepared xq; rows past
    offsets[-1] zeros."""
    T, K = xq.shape
    E, N, _ = w.shape
    problems, starts = problem_table(offs, N, K)
    out = torch.zeros(T, N, device=xq.device, dtype=torch.bfloat16)
    pa = pointer_arrays(w, torch.arange(E, device=xq.device), N * K)
    rc = getattr(lib, n + "_setup")(E, N, K, CHUNK)
    if rc:
        raise RuntimeError(f"{n}: setup returned {rc}")
    launch(lib, n, problems, pa, pointer_arrays(xq, starts, K), pa, pointer_arrays(out, starts, N))  # no scales
    torch.cuda.synchronize()
    return out


def exactness(lib, names: list[str], recipe) -> dict:
    """The design (g) variants against design (a) (under the variant's format and scale
    mode, FORMAT_VARIANTS): the quantized weight value for value through
    one-hot tokens (blocks of every binade, E4M3 subnormal codes and their ties, ties at the
    grid, the subnormal-scale block, near the bf16 maximum,
    non-finite blocks), then ragged groups bit for bit (K % 64 != 0, N not a multiple of
    the tile; empty groups last, in case the grouped scheduler cannot take them)."""
    from wq_kernels_bench import special_weight

    from mxmoe.ops.gemm import grouped_mm_nt
    from mxmoe.ops.quantize import fake_quantize
    from mxmoe.recipe import get_recipe

    bf = torch.bfloat16
    res = {}
    w, bad = special_weight("cuda")
    K = w.shape[2]
    x = torch.eye(K, device="cuda", dtype=bf)
    offs = torch.tensor([K], device="cuda", dtype=torch.int32)
    cases = [(4000, 1408, 64, [162, 0, 2577, 446, 0, 83]), (3000, 2880, 256, [3000]),
             (2000, 1416, 264, [257, 1000, 700]), (700, 40, 96, [300, 300, 100]),
             (5000, 2048, 200, [0] * 30 + [1200, 33, 0, 64])]
    cases.sort(key=lambda c: 0 in c[3])
    for n in names:
        r = {}
        rec = get_recipe(recipe, fmt=FORMAT_VARIANTS[n][0], scale_mode=FORMAT_VARIANTS[n][1]) \
            if n in FORMAT_VARIANTS else recipe
        ref = fake_quantize(w, rec, dim=2, out_dtype=bf)[0].t()
        try:
            out = run_grouped(lib, n, x, w, offs)
            o, rr = out[:, ~bad], ref[:, ~bad]
            same = bool(((o == rr) | (o.isnan() & rr.isnan())).all())
            nan_ok = bool(out[:, bad].isnan().all()) and bool(o.isfinite().all())
            r["one-hot value for value"] = same and nan_ok
            r["one-hot differing values"] = int((o != rr).sum())
        except Exception as e:  # noqa: BLE001
            r["one-hot"] = f"{type(e).__name__}: {e}"
        for (T, Kc, Nc, sizes) in cases:
            key = f"T={T} K={Kc} N={Nc} groups={sizes if len(sizes) < 8 else len(sizes)}"
            try:
                xx = torch.randn(T, Kc, device="cuda", dtype=bf)
                ww = (torch.randn(len(sizes), Nc, Kc, device="cuda") * 0.02).to(bf)
                oo = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
                xq = fake_quantize(xx, rec, dim=1, out_dtype=bf)
                want = grouped_mm_nt(xq, fake_quantize(ww, rec, dim=2, out_dtype=bf), oo)
                got = run_grouped(lib, n, xq, ww, oo)
                end = int(oo[-1])
                r[key] = bool((got[:end].view(torch.int16) == want[:end].view(torch.int16)).all())
            except Exception as e:  # noqa: BLE001
                r[key] = f"{type(e).__name__}: {e}"
        res[n] = r
        print(f"exactness {n}: {r}", flush=True)
    return res


if __name__ == "__main__":
    sys.exit(main())
