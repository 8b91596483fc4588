"""Benchmark the Triton MXFP8 grouped GEMM (design (b) of issue 4: FP8 tiles and E8M0 scales
loaded in the main loop) against bf16 ``torch._grouped_mm`` in the same process.

For each shape (T, K, N, E) and routing (near-uniform, and skewed: a quarter of the experts
get 70% of the tokens), and each GEMM of the expert layer:

    fwd    out (T, N)    = x (T, K) w[e]^T           x, w blocked along K
    dgrad  dx (T, K)     = dy (T, N) w[e]            dy, w^T blocked along N
    wgrad  dw (E, N, K)  = dy_e^T x_e                per-expert padded tokens, blocked along tokens

it prints and records: the bf16 ``torch._grouped_mm`` TFLOP/s (bf16 operands in their
natural layouts), ours with the supergrouped tile order, row-major (supergrouping off) and
spread (a naive launch order), ours / bf16, and a correctness check of ours (float32
output) against ``torch._grouped_mm`` on the same dequantized operands: the largest
|ours - ref| / (2 gamma_K S + 2^-8 |ref| if ref is bf16), S = |A| |B| from a bf16 grouped
GEMM (x 1.05 for its own rounding), which is <= 1 when the two differ only by float32
accumulation order. TFLOP/s count 2 T N K (valid tokens, no padding) for all three.

A short sweep of launch settings (time-boxed) runs first on the first shape; the fastest
setting per kernel is used for the table and printed as the TUNING line for
mxmoe.kernels.grouped_gemm. The whole run is designed to finish in under 4 minutes on an
H200 (--budget seconds, default 220: cases left when it runs out are recorded as skipped).

    PYTHONPATH=src python3 benchmarks/grouped_gemm_tile.py --out DIR   # writes DIR/grouped_gemm_tile.json
    PYTHONPATH=src python3 benchmarks/grouped_gemm_tile.py --smoke     # CPU, Triton interpreter, tiny shapes

The commit is read from the environment variable COMMIT (else ``git rev-parse``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPES = [(32768, 4096, 2048, 16), (65536, 7168, 2048, 64), (16384, 2048, 1408, 64)]
SMOKE_SHAPES = [(200, 64, 96, 4), (160, 96, 64, 8)]
HOT_FRACTION_EXPERTS, HOT_FRACTION_TOKENS = 0.25, 0.70


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--out", type=Path, default=None, help="directory for grouped_gemm_tile.json (default: print only)")
    g.add_argument("--smoke", action="store_true", help="CPU check of the script: Triton interpreter, tiny shapes")
    g.add_argument("--budget", type=float, default=220.0, help="seconds for the whole run (default 220)")
    g.add_argument("--sweep-budget", type=float, default=90.0, help="seconds for the launch-setting sweep (default 90)")
    g.add_argument("--no-sweep", action="store_true", help="use mxmoe.kernels.grouped_gemm.TUNING as is")
    g.add_argument("--rep-ms", type=float, default=60.0, help="do_bench measuring time per timing, ms (default 60)")
    g.add_argument("--seed", type=int, default=0, help="routing and data seed")
    return p.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402

from mxmoe.kernels import grouped_gemm as gg  # noqa: E402
from mxmoe.kernels import quantize as kq  # noqa: E402

DEV = torch.device("cpu" if ARGS.smoke else "cuda")
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def bench_ms(fn) -> float:
    """Median milliseconds (one timed call under the interpreter)."""
    if ARGS.smoke:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=ARGS.rep_ms, return_mode="median")


# ---- routing and operands -----------------------------------------------------------------

def group_sizes(T: int, E: int, skewed: bool, gen: torch.Generator) -> list[int]:
    """E token counts summing to T: multinomial over equal probabilities, or with a quarter
    of the experts (random ones) drawing 70% of the tokens."""
    probs = torch.full((E,), 1.0 / E, dtype=torch.float64)
    if skewed:
        n_hot = max(1, round(E * HOT_FRACTION_EXPERTS))
        hot = torch.randperm(E, generator=gen)[:n_hot]
        probs = torch.full((E,), (1 - HOT_FRACTION_TOKENS) / (E - n_hot), dtype=torch.float64)
        probs[hot] = HOT_FRACTION_TOKENS / n_hot
    experts = torch.multinomial(probs, T, replacement=True, generator=gen)
    return torch.bincount(experts, minlength=E).tolist()


def make_case(T: int, K: int, N: int, E: int, skewed: bool, seed: int) -> dict:
    """Quantized operands of the three GEMMs (our kernels' inputs) and their dequantized
    bf16 copies (the baseline's inputs)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = group_sizes(T, E, skewed, gen)
    offsets = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEV)
    torch.manual_seed(seed)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16) * 0.02)
    dy = (torch.randn(T, N, device=DEV, dtype=torch.bfloat16) * 1e-3)
    c = {"sizes": sizes, "offsets": offsets, "x_bf16": x, "w_bf16": w, "dy_bf16": dy}
    c["x_q"], c["x_s"] = kq.quantize_rowwise(x)  # (T, K), along K
    c["w_q"], c["w_s"] = kq.quantize_rowwise(w)  # (E, N, K), along K
    c["dy_q"], c["dy_s"] = kq.quantize_rowwise(dy)  # (T, N), along N
    c["wt_q"], c["wt_s"] = kq.quantize_colwise(w)  # (E, K, N), along N
    c["dyt_q"], c["dyt_s"], c["poffs"] = kq.quantize_grouped_colwise(dy, offsets)  # (N, Lp)
    c["xt_q"], c["xt_s"], _ = kq.quantize_grouped_colwise(x, offsets)  # (K, Lp)
    return c


def dq(q, s):
    return kq.dequantize_rowwise(q, s, torch.bfloat16)


# ---- the GEMMs ------------------------------------------------------------------------------

def grouped_mm(a, b, offs, out_dtype=None):
    """torch._grouped_mm (a loop where it does not run, e.g. the CPU in --smoke)."""
    if not ARGS.smoke:
        if out_dtype is None:
            return torch._grouped_mm(a, b, offs=offs)
        return torch._grouped_mm(a, b, offs=offs, out_dtype=out_dtype)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    dt = out_dtype or a.dtype
    if a.dim() == 2 and b.dim() == 3:  # (T, K) x (E, K, N)
        out = torch.zeros(a.shape[0], b.shape[2], dtype=dt)
        for e, (s, t) in enumerate(zip(starts, ends)):
            out[s:t] = (a[s:t].float() @ b[e].float()).to(dt)
        return out
    out = torch.zeros(len(ends), a.shape[0], b.shape[1], dtype=dt)  # (N, L) x (L, K)
    for e, (s, t) in enumerate(zip(starts, ends)):
        out[e] = (a[:, s:t].float() @ b[s:t].float()).to(dt)
    return out


def gemm_jobs(c: dict) -> dict:
    """Per GEMM: the bf16 baseline (natural bf16 layouts), ours (order, config, out_dtype),
    and the reference on our dequantized operands with its |A||B| bound operands."""
    offs, poffs = c["offsets"], c["poffs"]
    jobs = {}
    jobs["fwd"] = dict(
        base=lambda: grouped_mm(c["x_bf16"], c["w_bf16"].transpose(-2, -1), offs),
        ours=lambda order, cfg, od=torch.bfloat16: gg.triton_mx_grouped_mm_nt(
            c["x_q"], c["x_s"], c["w_q"], c["w_s"], offs, out_dtype=od, order=order, config=cfg),
        ref=lambda: (dq(c["x_q"], c["x_s"]), dq(c["w_q"], c["w_s"]).transpose(-2, -1), offs),
        K=c["x_q"].shape[1],
    )
    jobs["dgrad"] = dict(
        base=lambda: grouped_mm(c["dy_bf16"], c["w_bf16"], offs),
        ours=lambda order, cfg, od=torch.bfloat16: gg.triton_mx_grouped_mm_nn(
            c["dy_q"], c["dy_s"], c["wt_q"], c["wt_s"], offs, out_dtype=od, order=order, config=cfg),
        ref=lambda: (dq(c["dy_q"], c["dy_s"]), dq(c["wt_q"], c["wt_s"]).transpose(-2, -1), offs),
        K=c["dy_q"].shape[1],
    )
    jobs["wgrad"] = dict(
        base=lambda: grouped_mm(c["dy_bf16"].t(), c["x_bf16"], offs),
        ours=lambda order, cfg, od=torch.float32: gg.triton_mx_grouped_mm_tn(
            c["dyt_q"], c["dyt_s"], c["xt_q"], c["xt_s"], poffs, out_dtype=od, order=order, config=cfg),
        ref=lambda: (dq(c["dyt_q"], c["dyt_s"]), dq(c["xt_q"], c["xt_s"]).t(), poffs),
        K=32 * math.ceil(max(c["sizes"]) / 32),
    )
    return jobs


def check(job: dict, cfg) -> dict:
    """ours (float32 out) vs torch._grouped_mm on the same dequantized operands."""
    a, b, offs = job["ref"]()
    ours = job["ours"](gg.TileOrder.SUPERGROUPED, cfg, torch.float32).float()
    try:
        ref = grouped_mm(a, b, offs, out_dtype=torch.float32).float()
        ref_dtype = "float32"
    except (RuntimeError, TypeError):
        ref = grouped_mm(a, b, offs).float()
        ref_dtype = "bfloat16"
    S = grouped_mm(a.abs(), b.abs(), offs).float() * 1.05
    del a, b
    K = job["K"]
    gamma = K * 2.0 ** -24 / (1 - K * 2.0 ** -24)
    bound = 2 * gamma * S
    if ref_dtype == "bfloat16":
        bound += 2.0 ** -8 * ref.abs()
    err = (ours - ref).abs()
    ratio = (err / bound.clamp_min(torch.finfo(torch.float32).tiny)).max().item()
    rel = (err.norm() / ref.norm().clamp_min(1e-30)).item()
    ok = bool(torch.isfinite(ours).all().item()) and ratio <= 1.0
    return {"ref_dtype": ref_dtype, "max_err_over_bound": ratio, "rel_fro_err": rel, "ok": ok}


# ---- sweep ----------------------------------------------------------------------------------

def sweep_candidates(kind: str) -> list:
    G = gg.GemmConfig
    if ARGS.smoke:
        return [gg.INTERPRETER_CONFIG, dataclasses.replace(gg.INTERPRETER_CONFIG, block_k=32, scale_gather=True)]
    base = gg.TUNING[kind]
    cands = [
        base,
        G(128, 128, 64, 8, 4, 4),
        G(128, 128, 64, 8, 8, 4),
        G(128, 256, 64, 8, 8, 3),
        G(256, 128, 64, 8, 8, 3),
        G(128, 128, 128, 8, 8, 4),
        dataclasses.replace(base, dequant="cvt_bf16"),
        dataclasses.replace(base, dequant="bits"),
        dataclasses.replace(base, scale_gather=True),
        dataclasses.replace(base, persistent=True),
        G(64, 128, 128, 8, 4, 4),
    ]
    seen, out = set(), []
    for cnd in cands:
        if cnd not in seen:
            seen.add(cnd)
            out.append(cnd)
    return out


def sweep(jobs: dict, deadline: float) -> tuple[dict, list]:
    best, rows = {}, []
    for kind, job in (("nt", jobs["fwd"]), ("tn", jobs["wgrad"])):
        best_ms = math.inf
        best[kind] = gg.TUNING[kind] if not ARGS.smoke else gg.INTERPRETER_CONFIG
        for cfg in sweep_candidates(kind):
            if time.perf_counter() > deadline:
                rows.append({"kind": kind, "config": dataclasses.asdict(cfg), "ms": None, "note": "sweep budget spent"})
                continue
            try:
                ms = bench_ms(lambda: job["ours"](gg.TileOrder.SUPERGROUPED, cfg))
                note = ""
            except Exception as exc:  # compile failures (shared memory, registers) are results too
                ms, note = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            rows.append({"kind": kind, "config": dataclasses.asdict(cfg), "ms": ms, "note": note})
            print(f"  sweep {kind} {cfg}: " + (f"{ms:.3f} ms" if ms is not None else note), flush=True)
            if ms is not None and ms < best_ms:
                best_ms, best[kind] = ms, cfg
    return best, rows


# ---- main -----------------------------------------------------------------------------------

def versions() -> dict:
    commit = os.environ.get("COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {
        "gpu": "cpu (interpreter smoke run)" if ARGS.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "commit": commit,
        "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def main() -> None:
    shapes = SMOKE_SHAPES if ARGS.smoke else SHAPES
    deadline = T0 + ARGS.budget
    result = {**versions(), "budget_s": ARGS.budget, "cases": []}
    print(f"{result['gpu']} | torch {result['torch']} | triton {result['triton']} | commit {result['commit']}")
    cases = [(s, skewed) for s in shapes for skewed in (False, True)]

    tuned = {"nt": gg.TUNING["nt"], "tn": gg.TUNING["tn"]}
    if not ARGS.no_sweep:
        T, K, N, E = shapes[0]
        c = make_case(T, K, N, E, False, ARGS.seed)
        print(f"sweep on T={T} K={K} N={N} E={E} (budget {ARGS.sweep_budget:.0f} s)")
        tuned, rows = sweep(gemm_jobs(c), min(deadline, time.perf_counter() + ARGS.sweep_budget))
        result["sweep"] = rows
        del c
    result["tuning"] = {k: dataclasses.asdict(v) for k, v in tuned.items()}
    print("TUNING = " + repr({k: v for k, v in tuned.items()}))

    header = (f"{'T':>6} {'K':>5} {'N':>5} {'E':>3} {'routing':>7} {'gemm':>5} | {'bf16':>7} | {'super':>7} "
              f"{'rowmaj':>7} {'spread':>7} TFLOP/s | {'x bf16':>6} | {'super/row':>9} | check")
    print(header)
    print("-" * len(header))
    ratios = []
    for (T, K, N, E), skewed in cases:
        routing = "skewed" if skewed else "uniform"
        if time.perf_counter() > deadline - 5:
            result["cases"].append({"T": T, "K": K, "N": N, "E": E, "routing": routing, "skipped": "budget spent"})
            print(f"{T:>6} {K:>5} {N:>5} {E:>3} {routing:>7}  skipped: budget spent")
            continue
        c = make_case(T, K, N, E, skewed, ARGS.seed + 1)
        flops = 2.0 * T * N * K
        for name, job in gemm_jobs(c).items():
            cfg = tuned["tn" if name == "wgrad" else "nt"]
            row = {"T": T, "K": K, "N": N, "E": E, "routing": routing, "gemm": name,
                   "max_group": max(c["sizes"]), "empty_groups": sum(s == 0 for s in c["sizes"]),
                   "config": dataclasses.asdict(cfg)}
            try:
                base_ms = bench_ms(job["base"])
                ms = {o.value: bench_ms(lambda o=o: job["ours"](o, cfg)) for o in gg.TileOrder}
                row["check"] = check(job, cfg)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"{T:>6} {K:>5} {N:>5} {E:>3} {routing:>7} {name:>5} | error {row['error']}")
                result["cases"].append(row)
                continue
            tf = {o: flops / (m * 1e-3) / 1e12 for o, m in ms.items()}
            base_tf = flops / (base_ms * 1e-3) / 1e12
            row.update({"bf16_ms": base_ms, "bf16_tflops": base_tf, "ours_ms": ms, "ours_tflops": tf,
                        "ratio_vs_bf16": tf["supergrouped"] / base_tf,
                        "supergrouping_speedup": ms["row_major"] / ms["supergrouped"]})
            ratios.append(row["ratio_vs_bf16"])
            chk = row["check"]
            print(f"{T:>6} {K:>5} {N:>5} {E:>3} {routing:>7} {name:>5} | {base_tf:7.1f} | {tf['supergrouped']:7.1f} "
                  f"{tf['row_major']:7.1f} {tf['spread']:7.1f}         | {row['ratio_vs_bf16']:6.3f} | "
                  f"{row['supergrouping_speedup']:9.3f} | {'ok' if chk['ok'] else 'FAIL'} "
                  f"(err/bound {chk['max_err_over_bound']:.3f})", flush=True)
            result["cases"].append(row)
        del c
        if not ARGS.smoke:
            torch.cuda.empty_cache()
    if ratios:
        result["geomean_ratio_vs_bf16"] = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        print(f"geometric mean of ours (supergrouped) / bf16: {result['geomean_ratio_vs_bf16']:.3f}")
    result["wall_s"] = elapsed()
    print(f"wall {result['wall_s']:.1f} s")
    if ARGS.out:
        ARGS.out.mkdir(parents=True, exist_ok=True)
        path = ARGS.out / ("grouped_gemm_tile_smoke.json" if ARGS.smoke else "grouped_gemm_tile.json")
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    if any(not r.get("check", {}).get("ok", True) for r in result["cases"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
