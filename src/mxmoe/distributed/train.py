"""The training loop under expert parallelism (one process per rank, started by torchrun).

Same run as :func:`mxmoe.training.train` (settings, schedule, logs, metrics,
checkpoints, exact resume), spread over P ranks:

- every rank builds the whole model under the run's seed (so the replicated parameters
  agree and the experts are the single-process ones), then keeps its E / P experts
  (:func:`~mxmoe.distributed.ep.shard_experts`);
- the batch of step s is the single-process batch (generator seeded with (seed, s)); rank
  r takes sequences r*B/P .. (r+1)*B/P - 1 of it;
- each rank backpropagates its share of the loss (:func:`~mxmoe.distributed.ep.loss_share`),
  then the replicated gradients are summed (:func:`~mxmoe.distributed.sync.all_reduce_grads`),
  the global norm clipped, and AdamW steps every rank's parameters;
- only rank 0 prints, writes config.json, metrics.jsonl and checkpoint.pt. The checkpoint
  holds the whole model in the single-process format (every rank's experts gathered) and
  the optimizer state of each rank; it resumes on the same P only.

Reported losses are the sums of the ranks' shares (the global batch's values); tokens/s
counts the global batch.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from ..model import MoETransformer
from ..recipe import get_recipe
from ..training.checkpoint import MetricsWriter, save_checkpoint, truncate_metrics, write_json
from ..training.data import Corpus, random_batch
from ..training.trainer import (
    _SEED_STRIDE,
    CONFIG_NAME,
    METRICS_NAME,
    TrainConfig,
    TrainResult,
    _log,
    lr_at,
    make_optimizer,
    peak_memory_gib,
    prepare_run,
)
from .ep import loss_share, shard_experts
from .launch import DistEnv, init_expert_parallel
from .sync import all_reduce_grads, clip_grad_norm_, gather_state, load_sharded_model_state, split_parameters


def rank_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rows rank*B/P .. (rank+1)*B/P - 1 of a (B, ...) batch (B divisible by P)."""
    per = batch.shape[0] // world_size
    return batch[rank * per:(rank + 1) * per]


def _check_ranks(cfg: TrainConfig, checkpoint: dict, out: Path) -> None:
    """A checkpoint resumes on the P that wrote it (checked before the other settings)."""
    saved_p = checkpoint.get("expert_parallel", 1)
    if saved_p != cfg.expert_parallel:
        raise ValueError(f"the checkpoint in {str(out)!r} was written with --expert-parallel {saved_p}, this run has "
                         f"--expert-parallel {cfg.expert_parallel}: resume on the same number of ranks (the optimizer "
                         f"state is stored per rank)")


@torch.no_grad()
def evaluate_expert_parallel(model: MoETransformer, batches, env: DistEnv) -> float:
    """Mean over ``batches`` of the batch's mean cross entropy (nats per token), each rank
    evaluating its slice of every batch (all ranks must call this together)."""
    model.eval()
    sums = []
    for x, y in batches:
        xs, ys = rank_slice(x, env.rank, env.world_size), rank_slice(y, env.rank, env.world_size)
        logits = model(xs.to(env.device)).logits
        sums.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ys.to(env.device).reshape(-1),
                                    reduction="sum") / y.numel())
    model.train()
    per_batch = torch.stack(sums)
    dist.all_reduce(per_batch)
    return per_batch.mean().item()


def train_step(model: MoETransformer, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, lr: float,
               cfg: TrainConfig, replicated: list, sharded: list, tokens_global: int, grad_sync=all_reduce_grads):
    """One optimizer step on every rank: forward on this rank's sequences, backward of its
    loss share, replicated gradients summed (``grad_sync``), global-norm clipping, AdamW.

    Args:
        x, y: int64 (B / P, S) this rank's inputs and targets, on the model's device.
        lr: learning rate of this step. replicated, sharded: :func:`~.sync.split_parameters`.
        tokens_global: B * S. grad_sync: the replicated-gradient reduction (a timed wrapper
            in benchmarks).

    Returns:
        ``(lm_output, reported, grad_norm)``: the model output of this rank, float32 (3,)
        global (cross entropy, aux loss, z loss) summed over the ranks (not yet read on the
        host), the global gradient norm before clipping.
    """
    for g in opt.param_groups:
        g["lr"] = lr
    out_lm = model(x)
    loss, ce = loss_share(out_lm.logits, y, out_lm.aux_loss, out_lm.z_loss, tokens_global,
                          cfg.model.aux_loss_coef, cfg.model.z_loss_coef)
    loss.backward()
    grad_sync(replicated)
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    grad_norm = clip_grad_norm_(replicated, sharded, max_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    reported = torch.stack([ce.detach(), out_lm.aux_loss.detach(), out_lm.z_loss.detach()])
    dist.all_reduce(reported)  # sums of the shares: the global batch's values
    return out_lm, reported, grad_norm


def train_expert_parallel(cfg: TrainConfig, resume: bool = False, corpus: Corpus | None = None) -> TrainResult:
    """:func:`mxmoe.training.train` over ``cfg.expert_parallel`` ranks (see the module
    docstring). Call it on every rank of a torchrun launch (or with a default process
    group already initialized).

    Returns:
        :class:`~mxmoe.training.TrainResult`, the same on every rank.

    Raises:
        ValueError: a bad setting (as ``train``), no torchrun environment, WORLD_SIZE !=
            expert_parallel, a checkpoint from a different P or with other settings.
        FileNotFoundError: missing data path, or ``resume`` without a checkpoint.
    """
    cfg.validate()
    env = init_expert_parallel(cfg.expert_parallel, cfg.device)
    result = _train(cfg, resume, corpus, env)  # on an error the process exits (torchrun stops the others)
    if env.owns_group:
        dist.barrier()  # nothing in flight from any peer when the connections close
        dist.destroy_process_group()
    return result


def _train(cfg: TrainConfig, resume: bool, corpus: Corpus | None, env: DistEnv) -> TrainResult:
    device, P, main = env.device, env.world_size, env.is_main
    progress = cfg.progress and main
    out, corpus, val_sets, train_eval_sets, checkpoint = prepare_run(cfg, resume, corpus, check_checkpoint=_check_ranks)
    # every rank has checked the out-dir (a run already there is refused by all of them alike)
    # before rank 0 writes into it below
    dist.barrier()

    torch.manual_seed(cfg.seed)
    model = MoETransformer(cfg.model, get_recipe(cfg.recipe, backend=cfg.quant_backend))
    params = model.num_params()  # of the whole model, before sharding
    flops = model.flops_per_token(cfg.seq_len)
    shard_experts(model)
    model = model.to(device)
    replicated, sharded = split_parameters(model)
    opt = make_optimizer(model, cfg)
    start_step = 0
    if checkpoint is not None:
        load_sharded_model_state(model, checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"][env.rank])
        start_step = checkpoint["step"]
        if main:
            truncate_metrics(out / METRICS_NAME, start_step)
    elif main and (out / METRICS_NAME).exists():
        (out / METRICS_NAME).unlink()

    if main:
        write_json(out / CONFIG_NAME, {
            "train": cfg.to_dict(), "params": params, "corpus": corpus.describe(), "device": str(device),
            "torch": torch.__version__, "flops_per_token": flops,
            "expert_parallel": {"ranks": P, "backend": env.backend, "experts_per_rank": cfg.model.n_experts // P},
        })
        if cfg.warmup_steps >= cfg.steps:
            _log(f"note: --warmup-steps {cfg.warmup_steps} >= --steps {cfg.steps}: the learning rate never decays "
                 f"(the run ends in warmup)", progress)
        _log(f"mxmoe train | recipe {cfg.recipe} | {params['total'] / 1e6:.2f}M params "
             f"({params['active'] / 1e6:.2f}M active) | {corpus.describe()} | expert parallel {P} "
             f"({env.backend}, {cfg.model.n_experts // P} experts per rank{', MXFP8 dispatch' if cfg.model.mx_dispatch else ''}) "
             f"| device {device}", progress)
    metrics = MetricsWriter(out / METRICS_NAME) if main else None
    tokens_per_step = cfg.batch_size * cfg.seq_len
    step_times: list[float] = []

    def run_eval(step: int) -> None:
        val = evaluate_expert_parallel(model, val_sets, env)
        tr = evaluate_expert_parallel(model, train_eval_sets, env)
        if main:
            metrics.write({"kind": "eval", "step": step, "loss": tr, "val_loss": val})
            _log(f"eval step {step:5d} | train loss {tr:.4f} | val loss {val:.4f}", progress)

    def save(step: int) -> None:
        gathered = gather_state(model, opt)
        if main:
            model_state, opt_states = gathered
            save_checkpoint(out, {"step": step, "model": model_state, "optimizer": opt_states,
                                  "train_config": cfg.to_dict(), "expert_parallel": P})
        dist.barrier()  # the checkpoint is on disk before any rank goes on

    if start_step == 0:
        run_eval(0)
    model.train()
    wall_start = time.perf_counter()
    bar = tqdm(range(start_step + 1, cfg.steps + 1), initial=start_step, total=cfg.steps,
               disable=not progress, desc=cfg.recipe, dynamic_ncols=True, file=sys.stderr)
    for step in bar:
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(cfg.seed * _SEED_STRIDE + step)
        x, y = random_batch(corpus.train, cfg.batch_size, cfg.seq_len, gen)
        x = rank_slice(x, env.rank, P).to(device, non_blocking=True)
        y = rank_slice(y, env.rank, P).to(device, non_blocking=True)
        lr = lr_at(step, cfg)
        out_lm, reported, grad_norm = train_step(model, opt, x, y, lr, cfg, replicated, sharded, tokens_per_step)
        loss_v, aux_v, z_v = reported.tolist()  # synchronizes: the step is done
        dt = time.perf_counter() - t0
        counts = torch.stack(out_lm.tokens_per_expert).float() if out_lm.tokens_per_expert else None
        load_max = (counts.max(dim=1).values / counts.mean(dim=1)).max().item() if counts is not None else 1.0
        record = {
            "kind": "train", "step": step, "loss": loss_v, "aux_loss": aux_v, "z_loss": z_v,
            "grad_norm": grad_norm.item(), "lr": lr, "tokens_per_s": tokens_per_step / dt, "ms_per_step": dt * 1e3,
            "mem_gib": peak_memory_gib(device), "expert_load_max": load_max,
        }
        if main:
            metrics.write(record)
        if not math.isfinite(loss_v):  # the same value on every rank: all stop
            raise FloatingPointError(f"loss is {loss_v} at step {step}; lower --lr or check the data")
        step_times.append(dt)
        if main:
            _log(f"step {step:5d} | loss {loss_v:.4f} | aux {aux_v:.3f} | grad norm {record['grad_norm']:.3f} "
                 f"| lr {lr:.2e} | {record['tokens_per_s']:,.0f} tok/s | {dt * 1e3:.0f} ms | {record['mem_gib']:.2f} GiB",
                 progress)
        if step % cfg.eval_interval == 0 or step == cfg.steps:
            run_eval(step)
        if (cfg.ckpt_interval and step % cfg.ckpt_interval == 0) or step == cfg.steps:
            save(step)
    bar.close()
    if metrics is not None:
        metrics.close()
    wall = time.perf_counter() - wall_start
    timed = step_times[min(5, len(step_times) // 2):] or step_times or [float("nan")]
    step_s = sum(timed) / len(timed)
    result = None
    if main:
        lines = [json.loads(line) for line in (out / METRICS_NAME).read_text().splitlines()]
        train_losses = [m["loss"] for m in lines if m["kind"] == "train"]
        val_losses = [m["val_loss"] for m in lines if m["kind"] == "eval"]
        result = TrainResult(
            first_loss=train_losses[0] if train_losses else float("nan"),
            last_loss=train_losses[-1] if train_losses else float("nan"),
            first_val_loss=val_losses[0] if val_losses else float("nan"),
            last_val_loss=val_losses[-1] if val_losses else float("nan"),
            wall_s=wall, tokens_per_s=tokens_per_step / step_s, ms_per_step=step_s * 1e3,
            peak_mem_gib=peak_memory_gib(device), steps=len(step_times), out_dir=str(out),
        )
    box = [result]
    dist.broadcast_object_list(box, src=0)
    return box[0]
