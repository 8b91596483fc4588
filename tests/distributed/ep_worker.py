"""One rank of the expert-parallel checks (tests/distributed/test_expert_parallel.py starts
P of these).

Run as ``python tests/distributed/ep_worker.py TASK_JSON`` with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Every rank computes the single-process
reference itself (same seed, same data, one thread), runs the expert-parallel version
over gloo, and writes what it measured to ``OUT/rank{r}.json``: differences as numbers,
so that the tolerances live in the test file. Nothing is asserted here except crashes.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mxmoe.distributed import CommStats, ExpertParallelMoELayer, mx_row_bytes
from mxmoe.distributed.sync import all_reduce_grads, split_parameters
from mxmoe.models import ModelConfig, MoETransformer
from mxmoe.nn.moe import MoELayer
from mxmoe.recipe import get_recipe
from mxmoe.train import TrainConfig, load_checkpoint, train
from mxmoe.train.checkpoint import save_checkpoint
from ranks import interrupted_run, moe_layer, routed_inputs, worker_main

# layer shapes: D not a multiple of 32 (padded MX blocks), E divisible by 2 and 4
D, E, K, F, TOKENS_PER_RANK = 40, 8, 2, 24, 37
AUX_COEF, Z_COEF = 0.01, 0.001


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64 (0.0 when both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    return diff / scale if scale > 0 else diff


def make_layer(recipe: str, mx_dispatch: bool, shared: int, empty_last: int) -> MoELayer:
    # empty_last: the last experts always score lowest (feature 0 a large constant)
    keep_away = (slice(E - empty_last, None), -50.0) if empty_last else None
    return moe_layer(D, E, K, F, recipe, mx_dispatch, shared, keep_away)


def layer_inputs(P: int, empty_last: int) -> tuple[torch.Tensor, torch.Tensor]:
    return routed_inputs(P, TOKENS_PER_RANK, D, bool(empty_last))


def run_single(layer: MoELayer, x: torch.Tensor, G: torch.Tensor):
    """Single-process loss sum_t y_t . G_t / T + aux terms, and its gradients."""
    x = x.clone().requires_grad_()
    y, aux = layer(x)
    loss = (y.float() * G).sum() / x.shape[0] + AUX_COEF * aux.aux_loss + Z_COEF * aux.z_loss
    loss.backward()
    return y.detach(), x.grad, aux


def run_ep(ep: ExpertParallelMoELayer, x: torch.Tensor, G: torch.Tensor, rank: int, tokens_global: int):
    sl = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    x_r = x[sl].clone().requires_grad_()
    for p in ep.parameters():
        p.grad = None
    y, aux = ep(x_r)
    loss = (y.float() * G[sl]).sum() / tokens_global + AUX_COEF * aux.aux_loss + Z_COEF * aux.z_loss
    loss.backward()
    replicated, _ = split_parameters(ep)
    all_reduce_grads(replicated)
    shares = torch.stack([aux.aux_loss.detach(), aux.z_loss.detach()])
    dist.all_reduce(shares)
    grads = {n: p.grad.clone() for n, p in ep.named_parameters()}
    return y.detach(), x_r.grad, shares, aux.tokens_per_expert, grads


def layer_case(name: str, recipe: str, mx_dispatch: bool, shared: int = 0, empty_last: int = 0) -> dict:
    rank, P = dist.get_rank(), dist.get_world_size()
    L = E // P
    lo, hi = rank * L, (rank + 1) * L
    sl = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    x, G = layer_inputs(P, empty_last)
    ref_layer = make_layer(recipe, mx_dispatch, shared, empty_last)
    ep_base = copy.deepcopy(ref_layer)
    y_ref, dx_ref, aux_ref = run_single(ref_layer, x, G)
    stats = CommStats()
    ep = ExpertParallelMoELayer(ep_base, comm_stats=stats)
    y, dx, shares, counts, grads = run_ep(ep, x, G, rank, x.shape[0])
    summary = stats.summary()
    y2, dx2, shares2, _, grads2 = run_ep(ep, x, G, rank, x.shape[0])  # a second run: bit for bit the same?
    ref_grads = dict(ref_layer.named_parameters())
    out = {
        "y_equal": torch.equal(y, y_ref[sl]), "y_rel": rel_diff(y, y_ref[sl]),
        "dx_equal": torch.equal(dx, dx_ref[sl]), "dx_rel": rel_diff(dx, dx_ref[sl]),
        "aux_rel": rel_diff(shares[0], aux_ref.aux_loss), "z_rel": rel_diff(shares[1], aux_ref.z_loss),
        "counts_equal": torch.equal(counts, aux_ref.tokens_per_expert),
        # the EP layer runs the same expert path as the single-process layer, and says so
        "ran_fused": [ep.last_ran_fused, ref_layer.last_ran_fused],
        "local_counts": counts[lo:hi].tolist(),
        "deterministic": torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(shares, shares2)
                         and all(torch.equal(grads[n], grads2[n]) for n in grads),
        "grads": {},
        "dispatch_bytes_total": summary["dispatch"]["bytes_total"],
        "a2a_kinds": sorted(summary),
    }
    for n, g in grads.items():
        r = ref_grads[n].grad
        if n.startswith("experts."):
            r = r[lo:hi]
        out["grads"][n] = {"equal": torch.equal(g, r), "rel": rel_diff(g, r), "abs_sum": g.abs().sum().item()}
    if mx_dispatch:  # the forward equals plain single-process MXFP8 (no second rounding)
        plain = make_layer(recipe, False, shared, empty_last)
        y_plain, _, _ = run_single(plain, x, G)
        out["y_equals_plain_mx_forward"] = torch.equal(y, y_plain[sl])
    return out


def layer_checks() -> dict:
    res = {
        "bf16": layer_case("bf16", "bf16", False, shared=16),
        "mxfp8": layer_case("mxfp8", "mxfp8", False),
        "mxfp8_mx_dispatch": layer_case("mxfp8_mx_dispatch", "mxfp8", True, shared=16),
        "mxfp8_floor_mx_dispatch": layer_case("mxfp8_floor_mx_dispatch", "mxfp8-floor", True),
        "empty_last_rank": layer_case("empty_last_rank", "mxfp8", True, empty_last=E // dist.get_world_size()),
    }
    # the MXFP8 wire format: bytes per row against bf16
    res["mx_row_bytes"] = mx_row_bytes(D, 32)
    n_bad = 6 if dist.get_world_size() == 4 else 7  # not divisible by P
    try:
        ExpertParallelMoELayer(MoELayer(D, n_bad, K, F, 1, get_recipe("bf16")))
        res["indivisible_error"] = None
    except ValueError as e:
        res["indivisible_error"] = str(e)
    return res


def tiny_train_config(out: Path, data: str, P: int, recipe: str, **kw) -> TrainConfig:
    model = ModelConfig(d_model=64, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_expert=64, max_seq_len=32,
                        mx_dispatch=kw.pop("mx_dispatch", False), dtype=kw.pop("dtype", "bfloat16"))
    # device "cpu": the ranks run gloo on the CPU, also on a machine with a GPU ("auto" would pick it)
    base = dict(recipe=recipe, batch_size=4, seq_len=32, steps=6, eval_interval=3, eval_batches=1, ckpt_interval=3,
                warmup_steps=2, out_dir=str(out), data=data, progress=False, model=model, expert_parallel=P,
                device="cpu")
    base.update(kw)
    return TrainConfig(**base)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def single_process(fn):
    """Run ``fn`` as a plain process would (no torchrun WORLD_SIZE in the environment)."""
    saved = os.environ.pop("WORLD_SIZE")
    try:
        return fn()
    finally:
        os.environ["WORLD_SIZE"] = saved


def train_checks(tmp: Path, data: str, runs: list[list[str]], steps: int, resume: bool) -> dict:
    """Single-process against expert-parallel runs (rank 0 reports); optionally an
    interrupted-and-resumed run and a checkpoint from another P."""
    rank, P = dist.get_rank(), dist.get_world_size()
    res: dict = {}
    for recipe, dtype in runs:
        key = f"{recipe}_{dtype}"
        if rank == 0:
            single_process(lambda: train(tiny_train_config(tmp / f"sp_{key}", data, 1, recipe, dtype=dtype,
                                                           steps=steps)))
        dist.barrier()
        train(tiny_train_config(tmp / f"ep_{key}", data, P, recipe, dtype=dtype, steps=steps))
        if rank == 0:
            res[key] = {"single": read_metrics(tmp / f"sp_{key}"), "ep": read_metrics(tmp / f"ep_{key}")}
    if not resume:
        return res
    # the first run stopped on every rank right after step 4 (its step-3 checkpoint is the
    # latest), then resumed: the same metrics as the uninterrupted run
    recipe, dtype = runs[0]
    cfg = tiny_train_config(tmp / "ep_resume", data, P, recipe, dtype=dtype, steps=steps)
    interrupted_run(train, cfg)
    res["interrupted_at_step"] = load_checkpoint(tmp / "ep_resume")["step"]
    train(cfg, resume=True)
    if rank == 0:
        res["resume"] = {"uninterrupted": read_metrics(tmp / f"ep_{recipe}_{dtype}"),
                         "resumed": read_metrics(tmp / "ep_resume")}
        ckpt = load_checkpoint(tmp / "ep_resume")
        single = MoETransformer(cfg.model, recipe)
        single.load_state_dict(ckpt["model"])  # the whole model, in the single-process format
        res["ckpt"] = {"step": ckpt["step"], "expert_parallel": ckpt["expert_parallel"],
                       "optimizer_states": len(ckpt["optimizer"]),
                       "w13_shape": list(ckpt["model"]["blocks.0.ffn.experts.w13"].shape)}
        # the same checkpoint, claiming another P: refused with a clear message
        wrong = tmp / "ep_wrong_p"
        shutil.copytree(tmp / "ep_resume", wrong)
        ckpt["expert_parallel"] = P + 1
        save_checkpoint(wrong, ckpt)
    dist.barrier()
    try:
        train(tiny_train_config(tmp / "ep_wrong_p", data, P, recipe, dtype=dtype, steps=steps + 2), resume=True)
        res["wrong_p_error"] = None
    except ValueError as e:
        res["wrong_p_error"] = str(e)
    return res


def checks(task: dict, out: Path) -> dict:
    result: dict = {}
    if "layer" in task["checks"]:
        result["layer"] = layer_checks()
    if "train" in task["checks"]:
        result["train"] = train_checks(out / "runs", task["data"], task["runs"], task["steps"], task["resume"])
    return result


if __name__ == "__main__":
    sys.exit(worker_main(checks))
