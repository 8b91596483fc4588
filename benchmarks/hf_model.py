"""Training steps of a transformers Qwen3-MoE model: transformers' own experts backend
against mxmoe's MXFP8 conversion, in one process.

The model (issue 30's speed target): ``Qwen3MoeForCausalLM`` built from a config, vocab
32000, hidden 1024, 12 layers, 16 query heads / 4 KV heads of dim 64, 64 experts of width
512, top-8 (softmax router, top-k renormalized), every layer MoE, untied LM head: 1.31B
parameters; batch 8 x 2048 tokens; AdamW (``fused=True``), lr 3e-4; random tokens.

Each case builds the model from the same seed, then:

- ``grouped_mm``: transformers as it is (``experts_implementation="grouped_mm"``, SDPA
  attention), the baseline;
- ``mxfp8`` (or ``mxfp8-floor``, ``mxmoe_bf16``): ``mxmoe.convert_to_mxfp8(model, recipe)``:
  attention projections as MXLinear, the experts through mxmoe's backend (the fused MXFP8
  expert op for bf16 activations); router, embeddings, norms and LM head unchanged.

Parameters are bf16 (mxmoe's layers take bf16 parameters; the optimizer then updates bf16
weights, as the issue's baseline does). ``--fp32-autocast`` keeps float32 parameters and
runs forward and backward under ``torch.autocast(bfloat16)`` instead, in every case.

``--warmup`` untimed steps, then ``--steps`` steps timed together between two
synchronizations: ms/step, tokens/s, the peak memory (``max_memory_allocated``), the last
loss (checked finite), and the ratios to the first case (tokens/s: x baseline; peak: the
fraction of the baseline's). The issue's targets: tokens/s >= 1.25x, peak <= 0.85x.

    PYTHONPATH=src python3 benchmarks/hf_model.py [--quick] [--cases grouped_mm,mxfp8] [--fp32-autocast]
    PYTHONPATH=src python3 benchmarks/hf_model.py --smoke          # CPU, a tiny config, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time

import harness

SMOKE = harness.interpret_triton_if_smoke()

import torch

SUBJECT = "hf_model"
CASES = ("grouped_mm", "mxfp8", "mxfp8-floor", "mxmoe_bf16")
"""Case names: transformers' ``grouped_mm`` backend, or an mxmoe experts backend name
(:data:`mxmoe.integrations.transformers.BACKENDS`) converted with its recipe."""

FULL = {"vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 64, "num_experts": 64, "moe_intermediate_size": 512,
        "num_experts_per_tok": 8, "batch_size": 8, "seq_len": 2048}
SMOKE_SHAPE = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "moe_intermediate_size": 64,
               "num_experts_per_tok": 2, "batch_size": 2, "seq_len": 32}
LR = 3e-4


def build_model(shape: dict, dev: torch.device, dtype: torch.dtype):
    """``Qwen3MoeForCausalLM`` of ``shape`` (seed 0), on ``dev`` with ``dtype`` parameters."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model_keys = {k: v for k, v in shape.items() if k not in ("batch_size", "seq_len")}
    cfg = Qwen3MoeConfig(**model_keys, intermediate_size=4 * shape["moe_intermediate_size"],
                         max_position_embeddings=shape["seq_len"], norm_topk_prob=True, tie_word_embeddings=False,
                         decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3MoeForCausalLM(cfg)
    return model.to(dtype)


def run_case(case: str, shape: dict, args, dev: torch.device) -> dict:
    """Warm-up and timed steps of one case; returns its figures."""
    import mxmoe
    from mxmoe.integrations.transformers import BACKENDS

    dtype = torch.float32 if args.fp32_autocast else torch.bfloat16
    model = build_model(shape, dev, dtype)
    if case != "grouped_mm":
        mxmoe.convert_to_mxfp8(model, BACKENDS[case])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)
    autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if args.fp32_autocast
                else contextlib.nullcontext())
    g = torch.Generator().manual_seed(1)
    n_batches = 2
    batches = [torch.randint(0, shape["vocab_size"], (shape["batch_size"], shape["seq_len"]), generator=g).to(dev)
               for _ in range(n_batches)]

    def step(ids: torch.Tensor) -> torch.Tensor:
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    for i in range(args.warmup):
        step(batches[i % n_batches])
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(batches[i % n_batches])
    last = loss.item()  # synchronizes
    dt = (time.perf_counter() - t0) / args.steps
    tokens = shape["batch_size"] * shape["seq_len"]
    result = {"ms_per_step": dt * 1e3, "tokens_per_s": tokens / dt, "last_loss": last,
              "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
              "params_B": sum(p.numel() for p in model.parameters()) / 1e9,
              "experts_implementation": model.config._experts_implementation,
              "parameters": "float32 + bf16 autocast" if args.fp32_autocast else "bfloat16"}
    if not math.isfinite(last):
        raise FloatingPointError(f"{case}: loss {last} after {args.warmup + args.steps} steps")
    return result  # the model and optimizer go with this frame; main frees the cached memory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(p, timing=None)
    p.add_argument("--cases", default="grouped_mm,mxfp8",
                   help=f"comma-separated, from {', '.join(CASES)}; the first is the baseline (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per case (default: 20; --quick: 8)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: 8)")
    p.add_argument("--fp32-autocast", action="store_true",
                   help="float32 parameters and bf16 autocast in every case (default: bf16 parameters)")
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        p.error(f"unknown case(s) {bad or args.cases!r}; use {', '.join(CASES)}")
    if args.smoke:
        args.steps, args.warmup = 1, 1
    if args.steps is None:
        args.steps = 8 if args.quick else 20
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit('hf_model.py needs transformers: pip install -e ".[hf]"') from None
    dev = harness.device_for(args)
    env = harness.environment()
    print(harness.title("train steps of a transformers Qwen3-MoE model: grouped_mm against mxmoe", env, args,
                        timing="timing: wall clock over the timed steps, between two synchronizations"), flush=True)
    shape = dict(SMOKE_SHAPE if args.smoke else FULL)
    if args.batch_size:
        shape["batch_size"] = args.batch_size
    params = "float32 parameters + bf16 autocast" if args.fp32_autocast else "bf16 parameters"
    print(f"model and batch: {shape}; {params}; fused AdamW; {args.warmup} warm-up + {args.steps} timed steps "
          f"per case", flush=True)
    res = {}
    for case in cases:
        res[case] = run_case(case, shape, args, dev)
        harness.free_memory()
        r = res[case]
        print(f"  {case:12s} {r['ms_per_step']:9.2f} ms/step  {r['tokens_per_s']:12,.0f} tokens/s  "
              f"peak {harness.fmt(r['peak_mem_gib'], '.2f')} GiB  loss {r['last_loss']:.4f}", flush=True)
    base = res[cases[0]]
    rows, body = [], []
    for case in cases:
        r = res[case]
        speed = r["tokens_per_s"] / base["tokens_per_s"]
        mem = (r["peak_mem_gib"] / base["peak_mem_gib"]) if base["peak_mem_gib"] else None
        r.update(speed_ratio=speed, peak_mem_ratio=mem)
        body.append([case, f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s']:,.0f}", f"{speed:.3f}x",
                     harness.fmt(r["peak_mem_gib"], ".2f"), harness.fmt(mem, ".3f", "x"), f"{r['last_loss']:.4f}",
                     f"{r['params_B']:.2f}"])
        rows.append(harness.Row(case, f"{shape['batch_size']} x {shape['seq_len']} tokens", r["ms_per_step"] * 1e3,
                                base["ms_per_step"] * 1e3, note=f"experts {r['experts_implementation']}, {params}",
                                extra=r))
    print()
    print(harness.format_table(["case", "ms/step", "tokens/s", f"x {cases[0]}", "peak GiB", f"peak / {cases[0]}",
                                "last loss", "params (B)"], body))
    harness.write_results(SUBJECT, args, env, rows, {"baseline": f"{cases[0]}, same model, seed and batches",
                                                     "model": shape, "parameters": params,
                                                     "targets": {"speed_ratio": 1.25, "peak_mem_ratio": 0.85}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
