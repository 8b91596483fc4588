"""A model (arithmetic, no measurement) of one expert-parallel MoE layer for the DeepSeek-V3
shape at 8 to 1024 GPUs: bytes per all-to-all, their time on NVLink and InfiniBand, and the
expert GEMM time, to see where the design of docs/EXPERT_PARALLEL.md stops scaling.

    python3 benchmarks/ep_scaling_model.py [--tokens-per-gpu 8192] [--out DIR]

Writes ``<out>/ep_scaling_model.json`` (default benchmarks/results) and prints the table
docs/EXPERT_PARALLEL.md shows. Pure Python: every number follows from the constants below.

Shape (DeepSeek-V3, arXiv 2412.19437, section 4.2): hidden 7168, 256 routed experts of
width 2048 and 1 shared expert of width 2048, top-8, 61 layers of which 58 MoE.

Assumptions, each a constant:
- expert parallelism EP = min(GPUs, 256) (at most one expert per GPU), data parallel
  across EP groups beyond 256; 8 GPUs per node;
- tokens per GPU per step: ``--tokens-per-gpu`` (default 8192, e.g. 2 sequences of 4096);
- routing uniform over experts (the balanced case; skew only adds);
- one all-to-all carries T k (EP - 1) / EP rows per GPU off the GPU, of which a share
  (7 / (EP - 1) of them, within the node) over NVLink and the rest over InfiniBand, both
  links in parallel: time = max(NVLink bytes / NVLink bandwidth, IB bytes / IB bandwidth);
- bandwidths per GPU: DeepEP's measured all-to-all bandwidths on H800 (github.com/
  deepseek-ai/DeepEP README, normal kernels): 153-158 GB/s intranode (NVLink), 43-58 GB/s
  internode (RDMA); the model uses the low ends, 153 and 43;
- rows: bf16 2 * 7168 bytes, MXFP8 7168 codes + 224 E8M0 scales = 7392 bytes;
- per layer and step, four all-to-alls: dispatch and combine forward, their gradients
  backward; this design sends the forward dispatch as MXFP8 (--mx-dispatch) and the other
  three in bf16 (the MXFP8 combine gradient is exact only with w2 frozen);
- padded dispatch (no host sync): every GPU sends each peer C = T min(k, L) rows with the
  worst-case capacity, bytes x EP min(k, L) / k against the routed rows;
- compute: the expert GEMMs of the layer, forward (3 GEMMs, 6 H F flops per row) and
  backward (twice that), for the T k routed rows and the T shared-expert rows, at an
  achieved 450 TFLOP/s per H200 (57% of its ~790 TFLOP/s dense bf16 peak; the MXFP8 recipe
  runs its GEMMs on bf16 tensor cores on Hopper, after quantize-dequantize). Attention and
  the rest of the block are not counted (they would only lower the communication share).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HIDDEN, EXPERTS, EXPERT_WIDTH, SHARED_WIDTH, TOP_K = 7168, 256, 2048, 2048, 8
LAYERS, MOE_LAYERS = 61, 58
GPUS_PER_NODE = 8
NVLINK_GBPS, IB_GBPS = 153.0, 43.0  # DeepEP measured, low ends (GB/s per GPU)
ACHIEVED_TFLOPS = 450.0
BF16_ROW = 2 * HIDDEN
MX_ROW = HIDDEN + HIDDEN // 32  # 7168 + 224
GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
EXCHANGES = ("dispatch", "combine", "combine.grad", "dispatch.grad")


def layer_model(gpus: int, tokens: int) -> dict:
    """One MoE layer on one GPU: bytes and milliseconds (module docstring)."""
    ep = min(gpus, EXPERTS)
    local = EXPERTS // ep
    rows = tokens * TOP_K
    remote_rows = rows * (ep - 1) / ep
    in_node_peers = min(ep, GPUS_PER_NODE) - 1
    nvl_share = in_node_peers / (ep - 1) if ep > 1 else 0.0

    def seconds(row_bytes: float, padding: float = 1.0) -> float:
        b = remote_rows * row_bytes * padding
        return max(b * nvl_share / (NVLINK_GBPS * 1e9), b * (1 - nvl_share) / (IB_GBPS * 1e9))

    padding = ep * min(TOP_K, local) / TOP_K  # worst-case capacity against routed rows
    row_bytes = {"dispatch": MX_ROW, "combine": BF16_ROW, "combine.grad": BF16_ROW, "dispatch.grad": BF16_ROW}
    comm_s = sum(seconds(row_bytes[x]) for x in EXCHANGES)
    comm_bf16_s = 4 * seconds(BF16_ROW)
    comm_padded_s = sum(seconds(row_bytes[x], padding) for x in EXCHANGES)
    flops = 3 * 6 * HIDDEN * (rows * EXPERT_WIDTH + tokens * SHARED_WIDTH)  # forward + 2x backward
    compute_s = flops / (ACHIEVED_TFLOPS * 1e12)
    return {
        "gpus": gpus, "ep": ep, "dp": gpus // ep, "nodes_per_ep_group": -(-ep // GPUS_PER_NODE),
        "experts_per_gpu": local, "tokens_per_gpu": tokens,
        "a2a_mb_bf16": remote_rows * BF16_ROW / 1e6, "a2a_mb_mxfp8": remote_rows * MX_ROW / 1e6,
        "nvlink_share": nvl_share,
        "a2a_ms_bf16": seconds(BF16_ROW) * 1e3, "a2a_ms_mxfp8": seconds(MX_ROW) * 1e3,
        "padding_factor_worst_case": padding,
        "layer_comm_ms": comm_s * 1e3, "layer_comm_ms_all_bf16": comm_bf16_s * 1e3,
        "layer_comm_ms_padded_worst_case": comm_padded_s * 1e3,
        "layer_compute_ms": compute_s * 1e3, "comm_over_compute": comm_s / compute_s,
        "moe_ms_per_step_no_overlap": MOE_LAYERS * (comm_s + compute_s) * 1e3,
        "moe_ms_per_step_full_overlap": MOE_LAYERS * max(comm_s, compute_s) * 1e3,
    }


def table(rows: list[dict]) -> str:
    head = ["GPUs", "EP x DP", "nodes/EP", "a2a MB bf16", "a2a MB MXFP8", "a2a ms bf16", "a2a ms MXFP8",
            "4 a2a ms", "padded x", "padded 4 a2a ms", "GEMM ms", "comm/GEMM"]
    body = [[str(r["gpus"]), f"{r['ep']}x{r['dp']}", str(r["nodes_per_ep_group"]), f"{r['a2a_mb_bf16']:.0f}",
             f"{r['a2a_mb_mxfp8']:.0f}", f"{r['a2a_ms_bf16']:.2f}", f"{r['a2a_ms_mxfp8']:.2f}",
             f"{r['layer_comm_ms']:.2f}", f"{r['padding_factor_worst_case']:.0f}",
             f"{r['layer_comm_ms_padded_worst_case']:.1f}", f"{r['layer_compute_ms']:.2f}",
             f"{r['comm_over_compute']:.2f}"] for r in rows]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens-per-gpu", type=int, default=8192, help="tokens per GPU per step (default 8192)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                   help="folder of ep_scaling_model.json (default benchmarks/results)")
    args = p.parse_args(argv)
    if args.tokens_per_gpu < 1:
        p.error(f"--tokens-per-gpu must be >= 1, got {args.tokens_per_gpu}")
    rows = [layer_model(g, args.tokens_per_gpu) for g in GPU_COUNTS]
    print(f"DeepSeek-V3 MoE layer per GPU, {args.tokens_per_gpu} tokens per GPU; per layer: one all-to-all "
          f"(MB, ms), the four of a training step (MXFP8 forward dispatch, three bf16), the worst-case padded "
          f"dispatch, expert GEMMs at {ACHIEVED_TFLOPS:.0f} TFLOP/s")
    print(table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    constants = {k: v for k, v in globals().items() if k.isupper()}
    (out / "ep_scaling_model.json").write_text(json.dumps({"constants": constants, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
