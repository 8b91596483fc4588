"""One rank of the padded-dispatch checks (tests/distributed/test_ep_dispatch.py starts P of
these).

Run as ``python tests/distributed/ep_dispatch_worker.py TASK_JSON`` with torchrun's
environment. Every rank computes the single-process reference itself (same seed, same data,
one thread), runs the expert-parallel layer over gloo and writes what it measured to
``OUT/rank{r}.json``. Nothing is asserted here except crashes.

The host-sync check (:class:`HostSyncRecorder`) records, during the layer's forward and
backward, every operation that makes the host wait for a CUDA device: reading a value
(``aten._local_scalar_dense``: ``.item()``, ``int()``, ``bool()``), ops whose output size
depends on values (``nonzero``, ``masked_select``, ``unique``, ``bincount``,
``repeat_interleave`` without ``output_size``), and the Python-level reads ``.tolist()``,
``.cpu()``, ``.numpy()``. On the CPU these cost nothing, so the recorder is what makes a
sync visible here. Reads from the CPU code paths of mxmoe.ops / numerics / kernels are not
counted (:data:`CUDA_CHECKED_PACKAGES` says why).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from mxmoe.distributed import CommStats, ExpertParallelMoELayer, dispatch_capacity, mx_row_bytes
from mxmoe.distributed.sync import all_reduce_grads, split_parameters
from mxmoe.nn.moe import MoELayer, routed_experts
from ranks import moe_layer, routed_inputs, worker_main

D, E, K, F, TOKENS_PER_RANK = 64, 8, 2, 32, 40
AUX_COEF, Z_COEF = 0.01, 0.001

SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "bincount", "equal", "is_nonzero", "item")
SYNC_METHODS = ("tolist", "cpu", "numpy", "item", "__bool__", "__int__", "__float__", "__index__")
# Packages below the MoE layer whose CPU code paths read values on the host where their CUDA
# paths do not (argument checks gated by the device type, the CPU wgrad operand trimming,
# the CPU quantizer's non-finite test): their CUDA paths are sync-free, which the single-GPU
# CUDA-graph capture of the whole train step checks (tests/gpu/test_train_step_cuda_graph.py).
# Events whose innermost mxmoe frame lies there are not counted; everything the
# expert-parallel layer itself and mxmoe.nn do is.
CUDA_CHECKED_PACKAGES = ("/mxmoe/ops/", "/mxmoe/numerics/", "/mxmoe/kernels/")


def _counted() -> bool:
    """Whether the event being recorded comes from code whose CUDA path is not checked
    elsewhere: the innermost frame inside the mxmoe package is not in
    :data:`CUDA_CHECKED_PACKAGES` (or there is no mxmoe frame)."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename.replace(os.sep, "/")
        if "/src/mxmoe/" in path:
            return not any(pkg in path for pkg in CUDA_CHECKED_PACKAGES)
        f = f.f_back
    return True


class HostSyncRecorder:
    """Context manager recording the operations that would synchronize with a CUDA device
    (module docstring) in ``self.events`` (names)."""

    def __init__(self):
        self.events: list[str] = []
        rec = self

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = func.overloadpacket.__name__
                if (name in SYNC_OPS or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                         and len(args) == 1)) and _counted():
                    rec.events.append(f"aten.{name}")
                    if os.environ.get("MXMOE_SYNC_TRACE"):
                        import traceback as tb
                        tb.print_stack(limit=8)
                return func(*args, **kwargs)

        class _Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in SYNC_METHODS and _counted():
                    rec.events.append(f"Tensor.{name}")
                return func(*args, **(kwargs or {}))

        self._modes = (_Function(), _Dispatch())

    def __enter__(self):
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)


def make_layer(recipe: str, mx_dispatch: bool = False, shared: int = 0, skew_to: int | None = None) -> MoELayer:
    # skew_to: experts skew_to .. skew_to + K score highest (feature 0 a large constant)
    skew = (slice(skew_to, skew_to + K), 50.0) if skew_to is not None else None
    return moe_layer(D, E, K, F, recipe, mx_dispatch, shared, skew)


def inputs(P: int, skew: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return routed_inputs(P, TOKENS_PER_RANK, D, skew)


def run_single(layer: MoELayer, x: torch.Tensor, G: torch.Tensor):
    x = x.clone().requires_grad_()
    y, aux = layer(x)
    ((y.float() * G).sum() / x.shape[0] + AUX_COEF * aux.aux_loss + Z_COEF * aux.z_loss).backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def run_ep(ep: ExpertParallelMoELayer, x, G, rank: int, recorder: HostSyncRecorder | None = None):
    sl = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    x_r = x[sl].clone().requires_grad_()
    for p in ep.parameters():
        p.grad = None
    if recorder is not None:
        with recorder:
            y, aux = ep(x_r)
            loss = (y.float() * G[sl]).sum() / x.shape[0] + AUX_COEF * aux.aux_loss + Z_COEF * aux.z_loss
            loss.backward()
    else:
        y, aux = ep(x_r)
        ((y.float() * G[sl]).sum() / x.shape[0] + AUX_COEF * aux.aux_loss + Z_COEF * aux.z_loss).backward()
    all_reduce_grads(split_parameters(ep)[0])
    return y.detach(), x_r.grad, {n: p.grad.clone() for n, p in ep.named_parameters() if p.grad is not None}


def compare(ep: ExpertParallelMoELayer, y, dx, grads, y_ref, dx_ref, grads_ref, rank: int) -> dict:
    sl = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    lo, hi = ep.expert_range
    out = {"y_equal": torch.equal(y, y_ref[sl]), "dx_equal": torch.equal(dx, dx_ref[sl]), "experts_equal": True,
           "router_rel": 0.0}
    for n, g in grads.items():
        r = grads_ref[n]
        if r is None:
            out["experts_equal"] = False  # a gradient one process does not have
            continue
        if n.startswith("experts."):
            out["experts_equal"] &= torch.equal(g, r[lo:hi])
        elif n.startswith("router."):
            out["router_rel"] = ((g - r).abs().max() / r.abs().max()).item()
    return out


def case_modes(recipe: str, mx_dispatch: bool, shared: int) -> dict:
    """Padded and host-splits dispatch against one process, the bytes each sends, and the
    host-sync recorder on both (it must see the host-splits reads)."""
    rank, P = dist.get_rank(), dist.get_world_size()
    x, G = inputs(P, False)
    ref = make_layer(recipe, mx_dispatch, shared)
    base = copy.deepcopy(ref)
    y_ref, dx_ref, g_ref = run_single(ref, x, G)
    out = {}
    for mode in ("padded", "host-splits"):
        stats, rec = CommStats(), HostSyncRecorder()
        ep = ExpertParallelMoELayer(copy.deepcopy(base), comm_stats=stats, dispatch=mode)
        y, dx, grads = run_ep(ep, x, G, rank, rec)
        s = stats.summary()
        out[mode] = compare(ep, y, dx, grads, y_ref, dx_ref, g_ref, rank)
        out[mode].update(sync_events=sorted(set(rec.events)), n_sync_events=len(rec.events),
                         dispatch_bytes_total=s["dispatch"]["bytes_total"], kinds=sorted(s),
                         dropped=int(ep.last_dropped_rows), ran_fused=ep.last_ran_fused)
    return out


def case_skewed(capacity_factor: float | None) -> dict:
    """Every token's top-k on the experts of rank P-1 (k <= L): every source sends rank
    P-1 exactly T * k rows, the worst-case capacity. With the default capacity: exact.
    With a capacity factor the overflow is dropped: counted, and the output equals one
    process whose dropped assignments contribute nothing (their combine weight zeroed)."""
    rank, P = dist.get_rank(), dist.get_world_size()
    L = E // P
    skew_to = E - L
    x, G = inputs(P, True)
    ref = make_layer("mxfp8", skew_to=skew_to)
    base = copy.deepcopy(ref)
    y_ref, dx_ref, g_ref = run_single(ref, x, G)
    ep = ExpertParallelMoELayer(copy.deepcopy(base), capacity_factor=capacity_factor)
    y, dx, grads = run_ep(ep, x, G, rank)
    out = compare(ep, y, dx, grads, y_ref, dx_ref, g_ref, rank)
    C = dispatch_capacity(TOKENS_PER_RANK, K, L, P, capacity_factor)
    counts = ep.last_tokens_per_expert
    out.update(capacity=C, dropped=int(ep.last_dropped_rows), rows_to_last_rank=int(counts[skew_to:].sum()) // P,
               ran_fused=ep.last_ran_fused)
    # independent count of the drops, and the forward of one process without them
    with torch.no_grad():
        r = ref.router(x)
        weights = r.weights_Tk.clone()
        dropped = 0
        for s in range(P):
            ex = r.experts_Tk[s * TOKENS_PER_RANK:(s + 1) * TOKENS_PER_RANK].reshape(-1)
            order = torch.argsort(ex, stable=True)
            sent = [0] * P
            for a in order.tolist():
                j = int(ex[a]) // L
                if sent[j] >= C:
                    dropped += 1
                    weights[s * TOKENS_PER_RANK + a // K, a % K] = 0.0
                sent[j] += 1
        y_drop, _, _ = routed_experts(x, r.experts_Tk, weights, base.experts.w13, base.experts.w2, base.recipe,
                                      base.fused)
    sl = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    out.update(dropped_expected=dropped, y_equals_single_without_dropped=torch.equal(y, y_drop[sl]))
    return out


def case_mx_backward(recipe: str, freeze_w2: bool) -> dict:
    """MXFP8 combine gradient: exact against one process when w2 takes no gradient; with
    w2 trained the layer keeps the activation dtype (and stays exact)."""
    rank, P = dist.get_rank(), dist.get_world_size()
    x, G = inputs(P, False)
    G[::7, 5] *= 300.0  # outlier gradient features: those rows' D-blocks get coarse scales, unlike the token blocks
    ref = make_layer(recipe)
    if freeze_w2:
        ref.experts.w2.requires_grad_(False)
    base = copy.deepcopy(ref)
    y_ref, dx_ref, g_ref = run_single(ref, x, G)
    stats = CommStats()
    ep = ExpertParallelMoELayer(copy.deepcopy(base), comm_stats=stats, mx_backward=True)
    y, dx, grads = run_ep(ep, x, G, rank)
    out = compare(ep, y, dx, grads, y_ref, dx_ref, g_ref, rank)
    s = stats.summary()
    out.update(mx_backward=ep.last_mx_backward, combine_grad_bytes_total=s["combine.grad"]["bytes_total"],
               combine_bytes_total=s["combine"]["bytes_total"], w13_has_grad="experts.w13" in grads)
    if not freeze_w2:  # forcing MXFP8 gradients while w2 trains: its wgrad reads rounded rows and differs
        from mxmoe.distributed.ep import _CombineExchange

        class Forced(ExpertParallelMoELayer):
            def _combine_exchange(self, y_NC, recv_splits, send_splits, during=None):
                out = _CombineExchange.apply(y_NC, recv_splits, send_splits, self.group, None, self.recipe)
                return out, (during() if during is not None else None)

        forced = Forced(copy.deepcopy(base))
        y3, dx3, grads3 = run_ep(forced, x, G, rank)
        lo, hi = forced.expert_range
        out["forced_w2_equal"] = torch.equal(grads3["experts.w2"], g_ref["experts.w2"][lo:hi])
        out["forced_y_equal"] = torch.equal(y3, y_ref[rank * TOKENS_PER_RANK:(rank + 1) * TOKENS_PER_RANK])
    if freeze_w2:  # the same layer without the option: bf16 gradients, the same results
        plain = ExpertParallelMoELayer(copy.deepcopy(base))
        y2, dx2, grads2 = run_ep(plain, x, G, rank)
        out["same_as_bf16_wire"] = torch.equal(y, y2) and torch.equal(dx, dx2) and all(
            torch.equal(grads[n], grads2[n]) for n in grads)
    return out


def case_overlap(dispatch: str) -> dict:
    """The shared expert runs while the combine (forward) and its gradient (backward) are in
    flight: the order of issue, shared expert and wait, logged; and the results equal the
    layer without overlap bit for bit (every parameter gradient, the shared expert's too)."""
    import mxmoe.distributed.collectives as coll

    rank, P = dist.get_rank(), dist.get_world_size()
    x, G = inputs(P, False)
    base = make_layer("mxfp8", shared=32)
    events: list[str] = []
    real_start, real_finish = coll.start_all_to_all_rows, coll.finish_all_to_all

    def start(x_RC, recv, send, group=None, stats=None, kind="rows"):
        events.append(f"issue {kind}")
        out, handle = real_start(x_RC, recv, send, group, stats, kind)
        return out, handle + (kind,)

    def finish(handle):
        events.append(f"wait {handle[-1]}")
        real_finish(handle[:-1])

    ep = ExpertParallelMoELayer(copy.deepcopy(base), dispatch=dispatch)
    ep.shared.register_forward_hook(lambda *a: events.append("shared forward"))
    ep.shared.register_full_backward_hook(lambda *a: events.append("shared backward"))
    coll.start_all_to_all_rows, coll.finish_all_to_all = start, finish
    try:
        y, dx, grads = run_ep(ep, x, G, rank)
    finally:
        coll.start_all_to_all_rows, coll.finish_all_to_all = real_start, real_finish
    plain = ExpertParallelMoELayer(copy.deepcopy(base), dispatch=dispatch, overlap=False)
    y2, dx2, grads2 = run_ep(plain, x, G, rank)
    return {"events": events, "overlapped": ep.last_overlapped, "plain_overlapped": plain.last_overlapped,
            "same_as_without_overlap": torch.equal(y, y2) and torch.equal(dx, dx2)
            and sorted(grads) == sorted(grads2) and all(torch.equal(grads[n], grads2[n]) for n in grads)}


def checks(task: dict, out: Path) -> dict:
    result: dict = {}
    result["modes_mxfp8"] = case_modes("mxfp8", False, 16)
    result["modes_mxfp8_mx_dispatch"] = case_modes("mxfp8", True, 0)
    result["modes_bf16"] = case_modes("bf16", False, 0)
    result["skewed_exact"] = case_skewed(None)
    result["skewed_capacity"] = case_skewed(0.75)
    result["mx_backward_frozen_w2"] = case_mx_backward("mxfp8", True)
    result["mx_backward_floor_frozen_w2"] = case_mx_backward("mxfp8-floor", True)
    result["mx_backward_trained_w2"] = case_mx_backward("mxfp8", False)
    result["overlap_padded"] = case_overlap("padded")
    result["overlap_host_splits"] = case_overlap("host-splits")
    result["mx_row_bytes"] = mx_row_bytes(D, 32)
    return result


if __name__ == "__main__":
    sys.exit(worker_main(checks))
