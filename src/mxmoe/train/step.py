"""One training step (forward, backward, gradient clipping, AdamW): :class:`TrainStep` in
one process, eager or replayed from a CUDA graph; :class:`ExpertParallelStep` on each rank
of an expert-parallel group (eager).

Why a graph: at the sizes of ``--preset h200`` the step is bound by the host, not the GPU.
Measured on the H200: the kernels of
one bf16 step take 37.6 ms and those of one MXFP8 step 39.1 ms, but launching them takes
50 ms and 132 ms of CPU (each MXFP8 quantizer launch costs ~200 us of Python and custom-op
dispatch). Replaying the step from a CUDA graph (:class:`torch.cuda.CUDAGraph`) removes
the host cost for every recipe alike, so the step runs at the speed of its kernels.

How (the "whole network capture" of the PyTorch CUDA-graph notes):

1. The first step of a process runs eagerly on a side stream (Triton compilation, cuDNN
   and cuBLAS set-up, AdamW state creation happen here; it is a real training step).
2. The second step is captured: static input buffers, forward, backward (the gradients
   are allocated inside the graph, so ``zero_grad`` is not called again), the gradient
   norm and clipping, ``AdamW.step`` with ``capturable=True`` and the learning rate held in
   a device tensor per parameter group. Capture runs nothing, so the graph is then
   replayed for that step.
3. Every later step copies its batch into the static buffers, writes the learning rate
   into the device tensors and replays.

Same numbers: a replay runs the kernels the eager step launched, with the same arguments,
so a graphed run computes what an eager run with a capturable AdamW computes, up to the
run-to-run spread of the step's atomic-using CUDA ops (``tests/gpu/test_train_step_cuda_graph.py``
compares them on the GPU). The capturable AdamW keeps its step counts and bias
corrections on the device, which rounds differently in the last bits from the host-side
arithmetic of the default AdamW, so a graphed run and a ``--no-cuda-graph`` run are close,
not bit-equal.

Device and streams: everything of the graphed path runs under ``torch.cuda.device`` of the
model's device, and the warm-up step and the capture use one side stream of that device
(``torch.cuda.graph``'s own default capture stream lives on whichever device was current
when it was first made: with the model on ``cuda:1`` and ``cuda:0`` current, the capture
would fail, or record an empty graph whose replays do nothing, pytorch#87894).

Requirements on the model: no host synchronization in forward or backward (no
``.item()``, no ``torch.bincount`` on CUDA, no shapes that depend on values). If capture
fails anyway (a ``RuntimeError``, which CUDA errors, ``torch.AcceleratorError``, are), the
step falls back to eager execution for the rest of the run, with a note: the gradients
the capture allocated are dropped, AdamW goes back to its default (non-capturable) mode
(capture runs no kernel, so parameters and AdamW state are those after the warm-up step),
and the current stream, which ``torch.cuda.graph`` leaves on its capture stream when ending
a failed capture raises, is restored.

Non-finite gradients: the global gradient norm that clipping computes anyway is checked
before the optimizer step (:func:`guarded_optimizer_step`). When it is NaN or inf (a NaN
or inf in any gradient) the update is skipped and :attr:`StepOutputs.skipped` is set. On
the CPU and in eager CUDA steps the optimizer step is not run at all (parameters and AdamW
state as they were). Inside a CUDA graph nothing may branch on the host, so there the
check runs on the device, without a host sync: the gradients are replaced by zeros and the
parameters are restored after ``AdamW.step`` from a copy taken before it, so they are
unchanged and the AdamW moments take one zero-gradient step (they decay by beta1, beta2).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.ep import loss_share
from ..distributed.sync import all_reduce_grads, clip_grad_norm_, split_parameters


class StepOutputs(NamedTuple):
    """Scalars and counts of one step, as device tensors (in graph mode the same tensors
    are overwritten by the next replay: read them before the next step).

    ce_loss, aux_loss, z_loss: float32 scalars of the step's batch (before the update).
    grad_norm: float32 scalar, global L2 norm of the gradients before clipping.
    tokens_per_expert: one (E,) int64 tensor per MoE layer.
    skipped: bool scalar, True when ``grad_norm`` was not finite and the update was
        skipped (:func:`guarded_optimizer_step`).
    """

    ce_loss: Tensor
    aux_loss: Tensor
    z_loss: Tensor
    grad_norm: Tensor
    tokens_per_expert: list[Tensor]
    skipped: Tensor


def configure_optimizer(opt: torch.optim.Optimizer, device: torch.device, capturable: bool) -> None:
    """Put ``opt`` (AdamW, after construction or ``load_state_dict``) in the mode the step
    needs: ``capturable`` True keeps the learning rate as a float32 device tensor per group
    and the step counts on the device (what a CUDA graph can replay); False keeps them as
    Python floats and host tensors (the default AdamW). Checkpoints written in either mode
    load into the other.

    Raises:
        ValueError: ``capturable`` on a non-CUDA device.
    """
    if capturable and device.type != "cuda":
        raise ValueError(f"a capturable optimizer needs a CUDA device, got {device}")
    for g in opt.param_groups:
        lr = float(g["lr"])  # a device tensor is read back once, at set-up
        g["capturable"] = capturable
        g["lr"] = torch.tensor(lr, dtype=torch.float32, device=device) if capturable else lr
        for p in g["params"]:
            st = opt.state.get(p)
            if st and "step" in st:
                st["step"] = st["step"].to(device=device if capturable else "cpu", dtype=torch.float32)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate: in place for a device tensor (no host sync, read
    by the next replay), by assignment for a float."""
    for g in opt.param_groups:
        if isinstance(g["lr"], Tensor):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr


def clip_grads_(params: list[Tensor], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)`` (the same bits): the global L2
    norm of the gradients (float32 scalar on their device), then every gradient scaled by
    min(1, max_norm / (norm + 1e-6)). Returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def guarded_optimizer_step(opt: torch.optim.Optimizer, params: list[Tensor], grad_norm: Tensor, *,
                           on_device: bool, snapshot: list[Tensor] | None = None) -> Tensor:
    """Run ``opt.step()`` unless ``grad_norm`` (the global gradient norm, a 0-d tensor) is
    NaN or inf. Returns the 0-d bool tensor "skipped" on ``grad_norm``'s device.

    ``on_device`` False: the check is read on the host (free on the CPU; one sync on CUDA)
    and a skipped step runs nothing: parameters and optimizer state stay as they were.
    ``on_device`` True (what a CUDA graph can replay: no host sync, no branch): the
    gradients of ``params`` are zeroed when skipped, the step runs, and each parameter is
    restored from ``snapshot`` (one tensor like each of ``params``, overwritten here) when
    skipped: the parameters are unchanged, the optimizer's moments take one zero-gradient
    step. A finite step gives the bits of a plain ``opt.step()`` either way.

    Raises:
        ValueError: ``on_device`` without a ``snapshot`` of one tensor per parameter.
    """
    skipped = ~torch.isfinite(grad_norm)
    if not on_device:
        if not bool(skipped):
            opt.step()
        return skipped
    if snapshot is None or len(snapshot) != len(params):
        raise ValueError("on_device needs a snapshot with one tensor per parameter")
    for p in params:
        if p.grad is not None:
            p.grad.masked_fill_(skipped, 0.0)  # NaN * 0 is NaN: fill, not scale
    torch._foreach_copy_(snapshot, [p.detach() for p in params])
    opt.step()
    with torch.no_grad():
        for p, s in zip(params, snapshot):
            p.copy_(torch.where(skipped, s, p))
    return skipped


def _first_cause(err: BaseException) -> str:
    """Type and first line of the error that made a capture fail: when an op fails inside
    ``torch.cuda.graph``, ending the invalidated capture raises again ("operation failed due
    to a previous error during capture"), with the op's own error as its context."""
    while "previous error during capture" in str(err) and err.__context__ is not None:
        err = err.__context__
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


class TrainStep:
    """Callable running one optimizer step of ``model`` on a batch.

    Args:
        model: returns an object with ``loss`` (to backpropagate), ``ce_loss``,
            ``aux_loss``, ``z_loss`` and ``tokens_per_expert`` for ``model(x, y)``.
        opt: its optimizer (AdamW); configured here for the mode.
        grad_clip: max global gradient norm; 0 disables clipping (the norm is still
            computed and reported).
        device: where the model lives.
        cuda_graph: replay the step from a CUDA graph (only on CUDA devices; ignored
            elsewhere).
        log: called with a one-line note if graph capture fails and the run goes on eagerly.

    ``step(x, y, lr)``: x, y (batch, seq_len) int64 token ids (any device); lr the
    learning rate of this step. Returns :class:`StepOutputs`.
    """

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, grad_clip: float,
                 device: torch.device, cuda_graph: bool, log: Callable[[str], None] = print):
        self.model, self.opt, self.device, self.log = model, opt, device, log
        self.max_norm = grad_clip if grad_clip > 0 else float("inf")
        self.graphed = bool(cuda_graph) and device.type == "cuda"
        configure_optimizer(opt, device, capturable=self.graphed)
        self._warm = False
        self._stream = None  # the side stream of the warm-up step and the capture (graph mode)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: tuple[Tensor, Tensor, StepOutputs] | None = None
        self._snapshot: list[Tensor] | None = None  # parameter copies of the on-device guard (graph mode)
        self._capturing = False

    def _optimizer_step(self, params: list[Tensor], grad_norm: Tensor) -> Tensor:
        """AdamW unless the gradient norm is not finite; the "skipped" flag. While a CUDA
        graph is captured the check stays on the device."""
        if self._capturing:
            if self._snapshot is None:
                self._snapshot = [torch.empty_like(p) for p in params]
            return guarded_optimizer_step(self.opt, params, grad_norm, on_device=True, snapshot=self._snapshot)
        return guarded_optimizer_step(self.opt, params, grad_norm, on_device=False)

    def _run(self, x: Tensor, y: Tensor) -> StepOutputs:
        out = self.model(x, y)
        out.loss.backward()
        params = list(self.model.parameters())
        grad_norm = clip_grads_(params, self.max_norm)
        skipped = self._optimizer_step(params, grad_norm)
        # detached: the returned losses must not keep this step's autograd graph (and its
        # AccumulateGrad nodes, bound to this step's stream) alive into the next step
        return StepOutputs(out.ce_loss.detach(), out.aux_loss.detach(), out.z_loss.detach(), grad_norm.detach(),
                           [c.detach() for c in out.tokens_per_expert], skipped)

    def _eager(self, x: Tensor, y: Tensor) -> StepOutputs:
        outs = self._run(x, y)
        self.opt.zero_grad(set_to_none=True)
        return outs

    def __call__(self, x: Tensor, y: Tensor, lr: float) -> StepOutputs:
        set_lr(self.opt, lr)
        if not self.graphed:
            return self._eager(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
        with torch.cuda.device(self.device):  # streams, capture and replay on the model's device
            return self._graphed(x, y, lr)

    def _graphed(self, x: Tensor, y: Tensor, lr: float) -> StepOutputs:
        if self._graph is not None:
            sx, sy, outs = self._static
            sx.copy_(x, non_blocking=True)
            sy.copy_(y, non_blocking=True)
            self._graph.replay()
            return outs
        x, y = x.to(self.device), y.to(self.device)
        main = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        if not self._warm:  # first step: eager, on a side stream (set-up work stays out of the graph)
            self._stream.wait_stream(main)
            with torch.cuda.stream(self._stream), warnings.catch_warnings():
                # AdamW warns once that a capturable instance steps uncaptured: intended here
                warnings.filterwarnings("ignore", message=".*capturable=True.*without .* graph capture")
                outs = self._eager(x, y)
            main.wait_stream(self._stream)
            self._warm = True
            return outs
        sx, sy = x.clone(), y.clone()
        graph = torch.cuda.CUDAGraph()
        failure = None
        try:
            self._capturing = True
            with torch.cuda.graph(graph, stream=self._stream):
                outs = self._run(sx, sy)
        except RuntimeError as err:  # an op that cannot be captured: go on eagerly (below)
            failure = _first_cause(err)
        finally:
            self._capturing = False
        if failure is None:
            self._graph, self._static = graph, (sx, sy, outs)
            graph.replay()
            return outs
        # out of the except block, so that the traceback's frames (the partial capture's
        # tensors and autograd nodes, bound to the capture stream) are released first
        torch.cuda.set_stream(main)  # a failed capture_end leaves the capture stream current
        del graph
        self.opt.zero_grad(set_to_none=True)  # gradients allocated by the capture: never computed
        self._snapshot = None
        self.graphed = False
        configure_optimizer(self.opt, self.device, capturable=False)
        set_lr(self.opt, lr)
        self.log(f"note: CUDA graph capture of the train step failed ({failure}); running eagerly")
        return self._eager(x, y)


class ExpertParallelStep(TrainStep):
    """:class:`TrainStep` on one rank of an expert-parallel group (eager; no CUDA graph: the
    all-to-all split sizes are host ints read once per MoE layer).

    One call, on every rank together: forward of this rank's sequences, backward of its
    share of the loss (:func:`~mxmoe.distributed.ep.loss_share`: the cross entropy summed
    over its tokens divided by the global token count, plus its aux and z loss shares),
    replicated gradients summed over the ranks (``grad_sync``), global-norm clipping
    (:func:`~mxmoe.distributed.sync.clip_grad_norm_`), AdamW, and the reported losses
    summed over the ranks (one all-reduce of three floats). Summed over the ranks, the
    shares are the single-process loss of the global batch, and their gradients the
    single-process gradient (:mod:`mxmoe.distributed.sync`).

    Args:
        model: an expert-parallel :class:`~mxmoe.models.MoETransformer`
            (:func:`~mxmoe.distributed.ep.shard_experts` applied), on its device.
        opt: its optimizer (AdamW over this rank's parameters).
        grad_clip: max global gradient norm; 0 disables clipping.
        tokens_global: B * S, the global batch's tokens (every rank's share divides by it).
        aux_loss_coef, z_loss_coef: the model's loss weights.
        grad_sync: the reduction of the replicated gradients
            (default :func:`~mxmoe.distributed.sync.all_reduce_grads`; a benchmark passes a
            timed wrapper of it).
        log: as :class:`TrainStep`.

    ``step(x, y, lr)``: x, y int64 (B / P, S) this rank's inputs and targets. Returns
    :class:`StepOutputs` whose ``ce_loss``, ``aux_loss`` and ``z_loss`` are the global
    batch's values (identical on every rank), ``grad_norm`` the global norm before
    clipping and ``tokens_per_expert`` the global (E,) counts of each MoE layer.
    """

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, grad_clip: float, tokens_global: int,
                 aux_loss_coef: float, z_loss_coef: float, grad_sync: Callable[[list], None] = all_reduce_grads,
                 log: Callable[[str], None] = print):
        device = next(model.parameters()).device
        super().__init__(model, opt, grad_clip, device, cuda_graph=False, log=log)
        self.tokens_global, self.aux_loss_coef, self.z_loss_coef = tokens_global, aux_loss_coef, z_loss_coef
        self.grad_sync = grad_sync
        self.replicated, self.sharded = split_parameters(model)

    def _run(self, x: Tensor, y: Tensor) -> StepOutputs:
        out = self.model(x)
        loss, ce = loss_share(out.logits, y, out.aux_loss, out.z_loss, self.tokens_global,
                              self.aux_loss_coef, self.z_loss_coef)
        loss.backward()
        self.grad_sync(self.replicated)
        grad_norm = clip_grad_norm_(self.replicated, self.sharded, self.max_norm)
        # the global norm is the same on every rank: all ranks skip, or none
        skipped = guarded_optimizer_step(self.opt, self.replicated + self.sharded, grad_norm, on_device=False)
        reported = torch.stack([ce.detach(), out.aux_loss.detach(), out.z_loss.detach()])
        dist.all_reduce(reported)  # sums of the shares: the global batch's values
        return StepOutputs(reported[0], reported[1], reported[2], grad_norm.detach(),
                           [c.detach() for c in out.tokens_per_expert], skipped)
