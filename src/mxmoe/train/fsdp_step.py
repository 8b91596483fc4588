"""The training step of a 2-D mesh run (FSDP2 x expert parallel, :mod:`mxmoe.distributed.mesh`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.ep import loss_share
from ..distributed.mesh import clip_grad_norm_
from ..ops.weight_cache import weight_copy_cache
from .step import StepOutputs, TrainStep, guarded_optimizer_step


class FSDPExpertParallelStep(TrainStep):
    """:class:`~mxmoe.train.step.TrainStep` on one rank of a 2-D mesh (eager).

    One call, on every rank together: forward of this rank's sequences (FSDP2 all-gathers
    each module's parameters in its pre-forward hook), backward of its share of the loss
    (:func:`~mxmoe.distributed.ep.loss_share`: sums over its tokens divided by the global
    token count), FSDP2's reduce-scatters (sums: :func:`~mxmoe.distributed.mesh.shard_model`
    sets the divide factor to 1), global-norm clipping
    (:func:`~mxmoe.distributed.mesh.clip_grad_norm_`), AdamW on the shards, and the
    reported losses summed over the world (one all-reduce of three floats).

    Args:
        model: a :class:`~mxmoe.models.MoETransformer` after
            :func:`~mxmoe.distributed.mesh.shard_model`, on its device.
        opt: AdamW over its (DTensor) parameters.
        grad_clip: max global gradient norm; 0 disables clipping.
        device: this rank's device.
        tokens_global: B * S of the global batch.
        aux_loss_coef, z_loss_coef: the model's loss weights.
        log: as :class:`~mxmoe.train.step.TrainStep`.
        weight_cache: open :func:`~mxmoe.ops.weight_copy_cache` around forward and backward
            (needed by experts gathered as MXFP8: ``shard_model(mx_weight_gather=True)``).

    ``step(x, y, lr)``: x, y int64 (B / W, S) this rank's sequences. Returns
    :class:`~mxmoe.train.step.StepOutputs` with the global batch's losses (identical on
    every rank), the global gradient norm before clipping and the global (E,) counts.
    """

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, grad_clip: float, device: torch.device,
                 tokens_global: int, aux_loss_coef: float, z_loss_coef: float, log: Callable[[str], None] = print,
                 weight_cache: bool = False):
        super().__init__(model, opt, grad_clip, device, cuda_graph=False, log=log)
        self.weight_cache = weight_cache
        self.tokens_global, self.aux_loss_coef, self.z_loss_coef = tokens_global, aux_loss_coef, z_loss_coef
        self.params = list(model.parameters())

    def _run(self, x: Tensor, y: Tensor) -> StepOutputs:
        # experts gathered as MXFP8 hand their copies to the weight-copy cache (mx_gather)
        with weight_copy_cache() if self.weight_cache else contextlib.nullcontext():
            out = self.model(x)
            loss, ce = loss_share(out.logits, y, out.aux_loss, out.z_loss, self.tokens_global,
                                  self.aux_loss_coef, self.z_loss_coef)
            loss.backward()
        grad_norm = clip_grad_norm_(self.params, self.max_norm)
        # the global norm is the same on every rank: all ranks skip, or none
        skipped = guarded_optimizer_step(self.opt, self.params, grad_norm, on_device=False)
        reported = torch.stack([ce.detach(), out.aux_loss.detach(), out.z_loss.detach()])
        dist.all_reduce(reported)  # sums of the shares: the global batch's values
        return StepOutputs(reported[0], reported[1], reported[2], grad_norm.detach(),
                           [c.detach() for c in out.tokens_per_expert], skipped)
