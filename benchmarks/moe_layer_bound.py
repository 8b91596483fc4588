"""A bound (arithmetic on measured figures, nothing run) of how fast an exact MXFP8 MoE layer
can be on the H200 against SonicMoE bf16, and of the activation memory it keeps.

    python3 benchmarks/moe_layer_bound.py [--layer-results F] [--quantize-results F] [--out DIR]

Reads the committed measurements (``benchmarks/results/moe_layer.json``: per-variant ms and
per-stage GPU kernel ms from ``moe_layer.py --breakdown``; ``benchmarks/results/quantize.json``:
the device-copy bandwidth, same GPU) and writes ``<out>/moe_layer_bound.json`` (default
benchmarks/results) with the table docs/BENCHMARKS.md shows.

The layer bounded: mxmoe's fused MXFP8 expert op with every operand exactly quantized in a
pass of its own and the GEMMs on those bf16 operands (the design the H200 measurements
favour: Hopper has no block-scaled MMA, and every in-GEMM quantization tried ran slower,
docs/DESIGNS.md), but each pass at the measured copy bandwidth and with the fusions that
need no new GEMM kernel (gathers inside the quantizers, both weight blockings from one
read, the row quantization of dy and dh in the kernels that write them). Time =

    GEMMs (as measured in the mxmoe MXFP8 row: torch._grouped_mm on bf16 operands)
    + routing, combine and casts (SonicMoE's measured non-GEMM kernels: the least seen)
    + activation bytes / copy bandwidth
    + weight bytes / (copy bandwidth x micro-batches per optimizer step)

with bf16 parameters (as SonicMoE and the HF block run). Bytes per pass (T tokens, A = T k
routed rows, D, F, E; bf16 2 bytes, MXFP8 1 + 1/32; x read once from DRAM where gathered):
see :func:`activation_bytes`. Weights: read 2 bytes per element, write both blockings
(bf16 copies 4 bytes; FP8 copies, for a GEMM that reads FP8, 2 x (1 + 1/32)).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MXFP8 = 1 + 1 / 32  # bytes per element of codes + E8M0 scales
BF16 = 2
MXFP8_ROW = "mxmoe mxfp8 (bf16 params)"
SONIC_ROW = "SonicMoE bf16"
GEMM_STAGE = "GEMM"


def activation_bytes(T: int, A: int, D: int, F: int) -> dict[str, float]:
    """Bytes each activation pass of one forward + backward reads and writes (the fused
    passes named in the module docstring)."""
    return {
        "x: gather + rows along D (forward operand)": BF16 * T * D + BF16 * A * D,
        "SwiGLU + act rows along F, h saved as MXFP8": BF16 * A * 2 * F + BF16 * A * F + MXFP8 * A * 2 * F,
        "combine (nothing of y kept)": BF16 * A * D + BF16 * T * D,
        "combine backward + dy rows along D (raw and quantized)": BF16 * T * D + 2 * BF16 * A * D,
        "dy, act token-blocked (w2 wgrad operands)": 2 * BF16 * A * D + 2 * BF16 * A * F,
        "SwiGLU backward + dh rows along 2F (raw and quantized)": MXFP8 * A * 2 * F + BF16 * A * F
        + 2 * BF16 * A * 2 * F + BF16 * A * F,
        "dh token-blocked (w13 wgrad operand)": 2 * BF16 * A * 2 * F,
        "x gathered, token-blocked (w13 wgrad operand)": BF16 * T * D + BF16 * A * D,
        "dx: sum of each token's k rows": BF16 * A * D + BF16 * T * D,
    }


def weight_bytes(E: int, D: int, F: int, fp8_copies: bool) -> float:
    """Read the bf16 weights (w13 and w2: 3 E D F elements) once, write both blockings."""
    n = 3 * E * D * F
    return n * (BF16 + (2 * MXFP8 if fp8_copies else 2 * BF16))


def saved_bytes(T: int, A: int, D: int, F: int, E: int, y_saved: bool, x_rows_saved: bool) -> float:
    """Activation bytes the fused op and combine keep for backward beyond the layer's input x
    (which the router keeps anyway): h as MXFP8 (2F per routed row) and int64 routing
    indices (3 per routed row); at 4b9fbd8 also y as MXFP8 for the router-score gradient
    (D per routed row; now the expert op's backward gives that gradient, as SonicMoE's dgrad
    epilogue does) and x token-blocked as MXFP8 (D per padded routed row, A + 32 E rows;
    now made in the backward)."""
    Ap = A + 32 * E
    return MXFP8 * A * 2 * F + (MXFP8 * A * D if y_saved else 0) + (MXFP8 * Ap * D if x_rows_saved else 0) + 24 * A


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layer-results", type=Path, default=RESULTS / "moe_layer.json")
    p.add_argument("--quantize-results", type=Path, default=RESULTS / "quantize.json")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per optimizer step, second column")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    layer = json.loads(args.layer_results.read_text())
    quant = json.loads(args.quantize_results.read_text())
    copy = next(r for r in quant["rows"] if r.get("nbytes") and r.get("baseline_us"))
    bw = copy["nbytes"] / (copy["baseline_us"] * 1e-6)  # bytes/s of dst.copy_(src), same GPU
    M = args.micro_batches
    out_rows = []
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s ({args.quantize_results.name}, {quant['env']['commit']}); "
          f"layer figures from {args.layer_results.name} ({layer['env']['commit']}, {layer['env']['gpu']})")
    header = ["shape", "SonicMoE ms", "mxfp8 ms (today)", "GEMM ms", "other ms (SonicMoE's)", "activation passes ms",
              "weights ms (bf16 / FP8 copies)", "bound ms, 1 micro-batch (bf16 / FP8 copies)",
              f"bound ms, {M} micro-batches", "x SonicMoE at the bound (1 / {M})".replace("{M}", str(M)),
              "saved MB: SonicMoE / mxmoe at 4b9fbd8 (measured) / now (model)"]
    body = []
    for name, shape in layer["models"].items():
        D, F, E, k, T = (shape[c] for c in "DFEkT")
        A = T * k
        variants = layer["variants"][name]
        mx, sonic = variants.get(MXFP8_ROW, {}), variants.get(SONIC_ROW, {})
        if not (mx.get("stages_ms") and sonic.get("stages_ms")):
            continue
        gemm = mx["stages_ms"][GEMM_STAGE]
        other = sum(v for s, v in sonic["stages_ms"].items() if s not in (GEMM_STAGE, "top kernels"))
        acts = activation_bytes(T, A, D, F)
        act_ms = 1e3 * sum(acts.values()) / bw
        w_bf16, w_fp8 = (1e3 * weight_bytes(E, D, F, fp8) / bw for fp8 in (False, True))
        one = gemm + other + act_ms + w_bf16
        one_fp8 = gemm + other + act_ms + w_fp8
        many = gemm + other + act_ms + w_bf16 / M
        saved = [sonic.get("act_MB"), mx.get("act_MB"), saved_bytes(T, A, D, F, E, False, False) / 1e6]
        row = {"shape": name, "D": D, "F": F, "E": E, "k": k, "T": T, "sonic_ms": sonic["ms"], "mxfp8_ms": mx["ms"],
               "mxfp8_quantize_ms": mx["stages_ms"].get("quantize"), "gemm_ms": gemm, "other_ms": other,
               "activation_pass_ms": act_ms, "activation_pass_GB": {k_: v / 1e9 for k_, v in acts.items()},
               "weights_ms_bf16_copies": w_bf16, "weights_ms_fp8_copies": w_fp8, "bound_ms_1": one,
               "bound_ms_1_fp8": one_fp8, f"bound_ms_{M}": many, "x_sonic_bound_1": sonic["ms"] / one,
               "x_sonic_bound_1_fp8": sonic["ms"] / one_fp8, f"x_sonic_bound_{M}": sonic["ms"] / many,
               "saved_MB_sonic": saved[0], "saved_MB_measured_before": saved[1], "saved_MB_model_now": saved[2]}
        out_rows.append(row)
        body.append([name, f"{sonic['ms']:.1f}", f"{mx['ms']:.1f}", f"{gemm:.1f}", f"{other:.1f}", f"{act_ms:.1f}",
                     f"{w_bf16:.1f} / {w_fp8:.1f}", f"{one:.1f} / {one_fp8:.1f}", f"{many:.1f}",
                     f"{sonic['ms'] / one:.2f}x ({sonic['ms'] / one_fp8:.2f}x FP8) / {sonic['ms'] / many:.2f}x",
                     " / ".join(f"{v:.0f}" if v is not None else "-" for v in saved)])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for b in body:
        print("| " + " | ".join(b) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    dest = args.out / "moe_layer_bound.json"
    dest.write_text(json.dumps({
        "subject": "moe_layer_bound", "kind": "model: arithmetic on measured figures, nothing run",
        "inputs": {"layer": {"file": args.layer_results.name, "env": layer["env"]},
                   "quantize": {"file": args.quantize_results.name, "env": quant["env"]}},
        "copy_bandwidth_TBps": bw / 1e12, "micro_batches": M, "rows": out_rows}, indent=2) + "\n")
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
