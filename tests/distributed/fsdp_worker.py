"""One rank of the 2-D mesh checks (tests/distributed/test_fsdp_expert_parallel.py starts
W of these).

Run as ``python tests/distributed/fsdp_worker.py TASK_JSON`` with torchrun's environment.
The task says which meshes (D data-parallel shards x P expert-parallel ranks, D x P = W)
train which runs, which runs are interrupted and resumed on which meshes, and whether to
check the MXFP8 weight all-gather. Results (metrics lines, measured differences) go to
``OUT/rank{r}.json``; the tolerances live in the test file. Nothing is asserted here.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mxmoe.models import ModelConfig
from mxmoe.train import TrainConfig, train
from ranks import interrupted_run, worker_main


def tiny_config(out: Path, data: str, recipe: str, dtype: str, mesh: list[int], steps: int,
                mx_weight_gather: bool = False) -> TrainConfig:
    """The model and run of the tests: 2 layers, width 64, 4 experts (divisible by every
    mesh's W <= 4), global batch 4 (divisible by W)."""
    model = ModelConfig(d_model=64, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_expert=64, max_seq_len=32,
                        dtype=dtype)
    D, P = mesh
    return TrainConfig(recipe=recipe, batch_size=4, seq_len=32, steps=steps, eval_interval=3, eval_batches=1,
                       ckpt_interval=3, warmup_steps=2, out_dir=str(out), data=data, progress=False, model=model,
                       expert_parallel=P, data_parallel_shard=D, mx_weight_gather=mx_weight_gather, device="cpu")


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]



def _wide_range_experts(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """(E, N, K) float32: each expert's rows at their own scale over 2^-20 .. 2^20, some
    zeros, one NaN and one inf (special blocks travel too)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-20, 21, shape[:2] + (1,), generator=g).float())
    w[torch.rand(*shape, generator=g) < 0.05] = 0.0
    w[1, 3, 5], w[-1, -1, -1] = float("nan"), float("inf")
    return w


def _same_mx(a, b) -> bool:
    return (a.qdata.view(torch.uint8).equal(b.qdata.view(torch.uint8)) and a.scale.view(torch.uint8).equal(
        b.scale.view(torch.uint8)) and a.shape == b.shape and a.dim == b.dim)


def mx_gather_checks() -> dict:
    """Expert weights quantized per shard and all-gathered as codes + scales, against the
    single-process quantization of the whole weight, both blockings, rceil and floor;
    on a random weight split as FSDP2 splits it and on a real FSDP2 shard of a model."""
    from mxmoe.distributed.mesh import init_mesh, shard_model
    from mxmoe.distributed.mx_gather import DGRAD_BLOCKED_DIM, FORWARD_BLOCKED_DIM, all_gather_mx_experts
    from mxmoe.models import MoETransformer
    from mxmoe.ops.quantize import quantize_mx
    from mxmoe.recipe import get_recipe

    rank, G = dist.get_rank(), dist.get_world_size()
    res: dict = {}
    full = _wide_range_experts((4, 72, 40), seed=5)  # N = 72 and K = 40: padded blocks on both axes
    for name in ("mxfp8", "mxfp8-floor"):
        recipe = get_recipe(name)
        for dim_name, dim in (("forward", FORWARD_BLOCKED_DIM), ("dgrad", DGRAD_BLOCKED_DIM)):
            shard = full.chunk(G)[rank]
            got, wire = all_gather_mx_experts(shard, recipe, dim)
            want = quantize_mx(full, recipe.fmt, dim=dim, scale_mode=recipe.scale_mode, pad=True)
            res[f"random_{name}_{dim_name}"] = {"equal": _same_mx(got, want), "wire_bytes": wire,
                                                "shard_elems": shard.numel()}
    # the control: shards split along a blocked dimension (K = 40 in halves of 20) quantize
    # blocks the whole weight does not have, so the concatenation differs
    halves = [quantize_mx(h, "e4m3", dim=-1, pad=True).dequantize() for h in full.chunk(2, dim=-1)]
    whole = quantize_mx(full, "e4m3", dim=-1, pad=True).dequantize()
    res["control_split_along_k_equal"] = torch.equal(torch.cat(halves, dim=-1).nan_to_num(), whole.nan_to_num())
    # a real FSDP2 shard: the model of the training checks on the mesh G x 1
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(d_model=64, n_layers=1, n_heads=2, n_experts=4, top_k=2, d_expert=64,
                                       max_seq_len=32), "mxfp8")
    shard_model(model, init_mesh(G, 1, "cpu"))
    for pname in ("w13", "w2"):
        w = getattr(model.blocks[0].ffn.experts, pname)
        for dim_name, dim in (("forward", FORWARD_BLOCKED_DIM), ("dgrad", DGRAD_BLOCKED_DIM)):
            got, _ = all_gather_mx_experts(w.to_local(), get_recipe("mxfp8"), dim)
            want = quantize_mx(w.full_tensor().detach(), "e4m3", dim=dim, pad=True)
            res[f"fsdp2_{pname}_{dim_name}"] = {"equal": _same_mx(got, want), "local_experts": w.to_local().shape[0]}
    return res


def mx_weight_gather_layer_check() -> dict:
    """An MoE layer on the mesh G x 1 with its experts gathered as MXFP8
    (gather_experts_as_mxfp8) against the single-process layer: output, input gradient
    (the dgrad reads the gathered copy blocked along N) and expert weight gradients
    (reduce-scattered to the shards). Expert rows at scales 2^-12 .. 2^12: a 32-block along
    N then spans rows of other scales, so a dgrad copy quantized from the forward copy's
    values (no weight-copy cache: a second rounding) differs - the control."""
    import contextlib

    from mxmoe.distributed.ep import shard_experts
    from mxmoe.distributed.mesh import init_mesh
    from mxmoe.distributed.mx_gather import gather_experts_as_mxfp8
    from mxmoe.nn.moe import MoELayer
    from mxmoe.ops.weight_cache import weight_copy_cache
    from mxmoe.recipe import get_recipe

    rank, G = dist.get_rank(), dist.get_world_size()
    recipe = get_recipe("mxfp8")
    T = 48  # tokens per rank

    def make() -> MoELayer:
        torch.manual_seed(0)
        layer = MoELayer(64, 4, 2, 64, 1, recipe)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for w in (layer.experts.w13, layer.experts.w2):
                w.mul_(torch.exp2(torch.randint(-12, 13, (*w.shape[:2], 1), generator=g).float()))
        return layer

    g = torch.Generator().manual_seed(3)
    x = torch.randn(G * T, 64, generator=g).to(torch.bfloat16)
    upstream = torch.randn(G * T, 64, generator=g)
    ref = make()
    x_ref = x.clone().requires_grad_()
    y_ref, _ = ref(x_ref)
    ((y_ref.float() * upstream).sum() / x.shape[0]).backward()
    mesh = init_mesh(G, 1, "cpu")
    holder = torch.nn.Module()
    holder.ffn = make()
    shard_experts(holder, group=mesh.ep_group, batch_group=mesh.dp_group)
    layer = holder.ffn
    stats = gather_experts_as_mxfp8(layer, recipe, mesh.dp_group, mesh.dp_rank)
    sl = slice(rank * T, (rank + 1) * T)
    res: dict = {}
    for cached in (True, False):
        for p in layer.parameters():
            p.grad = None
        xr = x[sl].clone().requires_grad_()
        with weight_copy_cache() if cached else contextlib.nullcontext():
            y, _ = layer(xr)
            ((y.float() * upstream[sl]).sum() / x.shape[0]).backward()
        key = "cached" if cached else "control_uncached"
        res[key] = {"y_equal": torch.equal(y, y_ref[sl].detach()), "dx_equal": torch.equal(xr.grad, x_ref.grad[sl])}
        for name in ("w13", "w2"):
            got = getattr(layer.experts, name).grad
            want = getattr(ref.experts, name).grad.chunk(G)[rank]
            res[key][f"{name}_grad_rel"] = ((got - want).abs().max() / want.abs().max()).item()
            res[key][f"{name}_shard_experts"] = got.shape[0]
    res["gathered_bytes"] = stats["gathered_bytes"]
    return res


def mesh_name(mesh: list[int]) -> str:
    return f"{mesh[0]}x{mesh[1]}"


def train_checks(tmp: Path, data: str, task: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    res: dict = {"runs": {}, "resumed": {}}
    for mesh in task.get("meshes", []):
        for recipe, dtype in task["runs"]:
            key = f"{mesh_name(mesh)}_{recipe}_{dtype}"
            train(tiny_config(tmp / key, data, recipe, dtype, mesh, task["steps"]))
            if rank == 0:
                res["runs"][key] = read_metrics(tmp / key)
    for mesh in task.get("mx_weight_gather_meshes", []):  # the experts gathered as MXFP8, not by FSDP2
        for recipe, dtype in task["mx_weight_gather_runs"]:
            key = f"{mesh_name(mesh)}_{recipe}_{dtype}_mx_weight_gather"
            train(tiny_config(tmp / key, data, recipe, dtype, mesh, task["steps"], mx_weight_gather=True))
            if rank == 0:
                res["runs"][key] = read_metrics(tmp / key)
    for spec in task.get("resume", []):
        recipe, dtype = spec["run"]
        source = Path(spec["source"]) if "source" in spec else tmp / f"interrupted_{mesh_name(spec['write'])}"
        if "source" not in spec:
            interrupted_run(train, tiny_config(source, data, recipe, dtype, spec["write"], task["steps"]))
        for mesh in spec["resume_on"]:
            target = tmp / f"resumed_{source.name}_on_{mesh_name(mesh)}"
            if rank == 0:
                shutil.copytree(source, target)
            dist.barrier()
            train(tiny_config(target, data, recipe, dtype, mesh, task["steps"]), resume=True)
            if rank == 0:
                latest = json.loads((target / "checkpoint.dcp" / "latest.json").read_text())
                res["resumed"][target.name] = {"metrics": read_metrics(target), "latest_step": latest["step"],
                                               "latest_mesh": latest["mesh"],
                                               "step_dirs": sorted(p.name for p in (target / "checkpoint.dcp").iterdir())}
    res["world"] = world
    return res


def checks(task: dict, out: Path) -> dict:
    result: dict = {}
    if task.get("mx_gather"):
        result["mx_gather"] = mx_gather_checks()
        result["mx_weight_gather_layer"] = mx_weight_gather_layer_check()
    result["train"] = train_checks(out / "runs", task["data"], task)
    return result


if __name__ == "__main__":
    sys.exit(worker_main(checks))
