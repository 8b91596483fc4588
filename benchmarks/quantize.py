"""The MX quantizers of the MXFP8 recipe against a device-to-device copy of the same bytes.

What is timed (bf16 input, E4M3 elements, rceil scales, blocks of 32; the Triton kernels
that ``backend="auto"`` picks on CUDA):

- ``quantize_mx`` rows: x (T, C) -> codes + scales, blocks along C (the forward operand);
- ``quantize_mx`` cols: the same with blocks along T (dim 0);
- ``fake_quantize_rowcol``: both dequantized copies of x (T, C) from one read (the
  activation operands of ``mx_linear``'s forward and wgrad), and of a 3-D float32 master
  weight (E, N, K) (the weight copies ``weight_copy_cache`` makes once per step);
- ``fake_quantize_grouped_tokens``: the wgrad operand of the grouped GEMM, x (T, C) blocked
  along each expert's own tokens and zero padded per expert, over E in {8, 64, 128, 256}
  experts and 64, 512 and 4096 tokens per expert, balanced and skewed routing (a quarter of
  the experts take 70% of the tokens, three experts none).

Baseline: ``dst.copy_(src)`` of a buffer whose copy reads and writes as many bytes as the
kernel does ((bytes read + bytes written) / 2), timed the same way in the same process.
"% of copy" = copy time / kernel time: the kernel's bandwidth as a fraction of the copy's.
Inputs under 3 x the L2 size rotate over several copies (:func:`harness.rotating`).
Default timing: CUDA-graph replay (the trainer replays its step from a graph; eager
launches of these ops cost more host time than GPU time at the small shapes).

    PYTHONPATH=src python3 benchmarks/quantize.py [--quick] [--timing eager] [--results-dir DIR]
    PYTHONPATH=src python3 benchmarks/quantize.py --smoke          # CPU, Triton interpreter
"""

from __future__ import annotations

import argparse
import sys

import harness

SMOKE = harness.interpret_triton_if_smoke()

import torch  # noqa: E402

from mxmoe.ops.quantize import fake_quantize_grouped_tokens, fake_quantize_rowcol, quantize_mx  # noqa: E402
from mxmoe.recipe import get_recipe  # noqa: E402

SUBJECT = "quantize"
BLOCK = 32
SHAPES_2D = [(16384, 4096), (16384, 7168), (131072, 4096)]  # (T, C): activations, and the top-8 rows of Qwen3
SHAPES_3D = [(128, 3072, 4096), (8, 28672, 4096)]  # (E, N, K): Qwen3-235B-A22B and Mixtral-8x7B w13
GROUPED_C = 4096
GROUPED_E = (8, 64, 128, 256, 384)
GROUPED_TOKENS = (64, 512, 4096)
SKEWED_TOKENS = 512


def routed_sizes(E: int, tokens_per_expert: int, skewed: bool, seed: int = 0) -> list[int]:
    """Tokens of each of E experts, summing to E * tokens_per_expert: balanced (equal), or
    skewed (a quarter of the experts share 70% of the tokens, three experts get none when
    E >= 8, the rest share 30%; multinomial draws)."""
    T = E * tokens_per_expert
    if not skewed:
        return [tokens_per_expert] * E
    g = torch.Generator().manual_seed(seed)
    hot = max(E // 4, 1)
    p = torch.cat([torch.full((hot,), 0.7 / hot), torch.full((E - hot,), 0.3 / max(E - hot, 1))])
    if E >= 8:
        p[-3:] = 0
    p = p / p.sum()
    return torch.bincount(torch.multinomial(p, T, replacement=True, generator=g), minlength=E).tolist()


def padded_tokens(sizes: list[int]) -> int:
    """Rows of the padded per-expert token layout: each expert's count rounded up to 32."""
    return sum(-(-n // BLOCK) * BLOCK for n in sizes)


def copy_us(nbytes: float, args: argparse.Namespace, dev: torch.device) -> float:
    """Microseconds of ``dst.copy_(src)`` moving ``nbytes`` (read + written), same timing."""
    n = max(int(nbytes // 2), 1)
    sets = harness.rotating(lambda: (torch.empty(n, dtype=torch.uint8, device=dev),
                                     torch.empty(n, dtype=torch.uint8, device=dev)), 2 * n, args.smoke)
    return 1e6 * harness.bench(lambda src, dst: dst.copy_(src), sets, mode=args.timing, warmup_ms=args.warmup_ms,
                               rep_ms=harness.rep_ms(args), smoke=args.smoke, label="copy")


def measure(case: str, shape: str, fn, sets, nbytes: float, args, dev, note: str = "") -> harness.Row:
    us = 1e6 * harness.bench(fn, sets, mode=args.timing, warmup_ms=args.warmup_ms, rep_ms=harness.rep_ms(args),
                             smoke=args.smoke, label=case)
    row = harness.Row(case, shape, us, copy_us(nbytes, args, dev), nbytes=nbytes, note=note)
    print(f"  {case:44s} {shape:22s} {us:10.1f} us  {harness.fmt(row.rate, '.2f')} TB/s  "
          f"{harness.fmt(row.ratio and 100 * row.ratio, '.1f', '%')} of copy", flush=True)
    return row


def cases_2d(args, dev, recipe) -> list[harness.Row]:
    rows = []
    shapes = [(64, 96)] if args.smoke else SHAPES_2D[:1] if args.quick else SHAPES_2D
    for T, C in shapes:
        n = T * C
        sets = harness.rotating(lambda: (torch.randn(T, C, device=dev, dtype=torch.bfloat16),), 2 * n, args.smoke)
        shape = f"({T}, {C}) bf16"
        codes = n + n // BLOCK  # FP8 codes and E8M0 scales
        for case, dim in (("quantize_mx rows (blocks along C)", -1), ("quantize_mx cols (blocks along T)", 0)):
            rows.append(measure(case, shape, lambda x, d=dim: quantize_mx(x, dim=d, backend=recipe.backend), sets,
                                2 * n + codes, args, dev))
        rows.append(measure("fake_quantize_rowcol, 2-D", shape,
                            lambda x: fake_quantize_rowcol(x, recipe, torch.bfloat16), sets, 2 * n + 4 * n, args, dev,
                            "two bf16 copies written"))
        del sets
        harness.free_memory()
    return rows


def cases_3d(args, dev, recipe) -> list[harness.Row]:
    rows = []
    shapes = [(2, 64, 96)] if args.smoke else [] if args.quick else SHAPES_3D
    for E, N, K in shapes:
        n = E * N * K
        sets = harness.rotating(lambda: (torch.randn(E, N, K, device=dev),), 4 * n, args.smoke)
        rows.append(measure("fake_quantize_rowcol, 3-D weight", f"({E}, {N}, {K}) fp32",
                            lambda w: fake_quantize_rowcol(w, recipe, torch.bfloat16), sets, 4 * n + 4 * n, args, dev,
                            "float32 master weight -> two bf16 copies"))
        del sets
        harness.free_memory()
    return rows


def cases_grouped(args, dev, recipe) -> list[harness.Row]:
    if args.smoke:
        grid = [(4, 40, False), (8, 40, True)]
        C = 64
    elif args.quick:
        grid = [(8, 64, False), (8, 4096, False), (128, 64, False), (128, 4096, False), (128, SKEWED_TOKENS, True),
                (384, 512, False)]
        C = GROUPED_C
    else:
        grid = [(E, t, False) for E in GROUPED_E for t in GROUPED_TOKENS] + \
               [(E, SKEWED_TOKENS, True) for E in GROUPED_E]
        C = GROUPED_C
    rows = []
    for E, tpe, skewed in grid:
        sizes = routed_sizes(E, tpe, skewed, seed=E)
        T, Tp = sum(sizes), padded_tokens(sizes)
        offsets = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
        sets = harness.rotating(lambda: (torch.randn(T, C, device=dev, dtype=torch.bfloat16),), 2 * T * C,
                                args.smoke)
        routing = "skewed" if skewed else "balanced"
        rows.append(measure(f"grouped tokens, E={E}, {tpe}/expert, {routing}", f"({T}, {C}) bf16",
                            lambda x: fake_quantize_grouped_tokens(x, offsets, recipe, torch.bfloat16), sets,
                            2 * T * C + 2 * Tp * C, args, dev,
                            f"tokens per expert {min(sizes)}-{max(sizes)}, padded rows {Tp}"))
        del sets
        harness.free_memory()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(p, timing="graph")
    args = p.parse_args(argv)
    dev = harness.device_for(args)
    # under --smoke the Triton kernels run in the interpreter on CPU tensors ("auto" would
    # take the pure-torch reference on the CPU)
    recipe = get_recipe("mxfp8", backend="triton" if args.smoke else "auto")
    env = harness.environment()
    print(harness.title("MX quantizers against a device-to-device copy of the same bytes", env, args), flush=True)
    torch.manual_seed(0)
    rows = cases_2d(args, dev, recipe) + cases_3d(args, dev, recipe) + cases_grouped(args, dev, recipe)
    print()
    print(harness.standard_table(rows, "copy", rate_unit="TB/s", ratio="%"))
    harness.write_results(SUBJECT, args, env, rows, {"baseline": "device-to-device copy of the same bytes",
                                                     "ratio": "copy time / kernel time (fraction of copy bandwidth)"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
