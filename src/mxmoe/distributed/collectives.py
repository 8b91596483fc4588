"""Row all-to-all on torch.distributed, differentiable, with optional byte and time accounting.

``all_to_all_rows`` exchanges the rows of a (R, C) tensor: rank i sends rows
``send_splits[j]`` (consecutive, in rank order) to rank j and receives ``recv_splits[j]``
rows from rank j, concatenated in source-rank order. It is
``torch.distributed.all_to_all_single`` with split sizes given on the host. Split sizes
that depend on the routing must first be read back to the host (the expert-parallel
layer's host-splits dispatch); the padded dispatch passes equal splits that depend only on
shapes (a fixed capacity per rank pair), so nothing is read back.

``gather_counts`` all-gathers a small integer tensor (the per-expert counts) into one
(P, ...) tensor on the device, without reading it on the host.

:class:`AllToAllRows` is its ``autograd.Function``: the backward is the reverse
all-to-all (send and receive splits swapped), a permutation of rows between ranks, so
the gradient is exact and deterministic. (``torch.distributed.nn.functional.all_to_all_single``
does the same with gloo on torch 2.13, but warns there that it is deprecated in favour of
the private ``torch.distributed._functional_collectives``; this one is a few lines, takes
any dtype the backend carries (uint8 for the MXFP8 wire format) and can record bytes
and time.)

Collective calls must be made by every rank of the group in the same order; every call
here is, forward and backward (the backward order follows the graph, identical on every
rank).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class CommRecord:
    """One collective call.

    Attributes:
        kind: what was exchanged ("dispatch", "combine", "dispatch.grad", "combine.grad",
            "counts").
        bytes_remote: bytes this rank sent to other ranks (its own rows excluded).
        bytes_total: bytes of this rank's send buffer (its own rows included).
        seconds: duration of the call; None until :meth:`CommStats.summary` resolves CUDA
            events.
    """

    kind: str
    bytes_remote: int
    bytes_total: int
    seconds: float | None = None


class CommStats:
    """Collects bytes and time of the collectives of the expert-parallel layers.

    On CUDA each call is bracketed by CUDA events on the current stream (the time from
    the call's launch until the current stream may continue past it, which includes
    waiting for the slowest rank); on the CPU by ``time.perf_counter`` around the
    (synchronous) call. Off by default: layers record only when given a ``CommStats``.
    """

    def __init__(self):
        self.records: list[CommRecord] = []
        self._events: list[tuple[CommRecord, object, object]] = []

    def reset(self) -> None:
        """Forget every record (start of a new measurement window)."""
        self.records.clear()
        self._events.clear()

    @contextmanager
    def record(self, kind: str, bytes_remote: int, bytes_total: int, device: torch.device):
        """Context manager around one collective: appends a record of ``kind`` with its bytes
        (sent to other ranks / in all) and, on CUDA, times the block with CUDA events."""
        rec = CommRecord(kind, bytes_remote, bytes_total)
        self.records.append(rec)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((rec, start, end))
        else:
            t0 = time.perf_counter()
            yield
            rec.seconds = time.perf_counter() - t0

    def summary(self) -> dict[str, dict[str, float]]:
        """Per kind: ``calls``, ``bytes_remote``, ``bytes_total`` (sums) and ``ms`` (summed
        milliseconds) over the records since the last :meth:`reset`. Synchronizes CUDA."""
        if self._events:
            torch.cuda.synchronize()
            for rec, start, end in self._events:
                rec.seconds = start.elapsed_time(end) / 1e3
            self._events.clear()
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "bytes_remote": 0, "bytes_total": 0,
                                                                "ms": 0.0})
        for rec in self.records:
            s = out[rec.kind]
            s["calls"] += 1
            s["bytes_remote"] += rec.bytes_remote
            s["bytes_total"] += rec.bytes_total
            s["ms"] += (rec.seconds or 0.0) * 1e3
        return dict(out)


def all_to_all_rows(x_RC: Tensor, recv_splits: list[int], send_splits: list[int], group=None,
                    stats: CommStats | None = None, kind: str = "rows") -> Tensor:
    """Exchange rows between the ranks of ``group`` (no autograd).

    Args:
        x_RC: (R, ...) any dtype the backend carries (gloo and NCCL: float32, bfloat16,
            uint8, int64, ...); R = sum(send_splits). Rows for rank j are consecutive, in
            rank order.
        recv_splits: rows received from each rank (length = group size), host ints.
        send_splits: rows sent to each rank, host ints.
        group: process group (None: the default group).
        stats: optional :class:`CommStats` recorder; ``kind`` labels the record.

    Returns:
        (sum(recv_splits), ...) rows in source-rank order, x_RC's dtype and device.

    Raises:
        ValueError: the split lists do not match the group size or x_RC's row count.
    """
    world = dist.get_world_size(group)
    if len(recv_splits) != world or len(send_splits) != world:
        raise ValueError(f"split lists must have one entry per rank ({world}), got {len(recv_splits)} "
                         f"and {len(send_splits)}")
    if sum(send_splits) != x_RC.shape[0]:
        raise ValueError(f"send_splits sum to {sum(send_splits)} rows but x has {x_RC.shape[0]}")
    x_RC = x_RC.contiguous()
    out = x_RC.new_empty((sum(recv_splits), *x_RC.shape[1:]))
    if stats is None:
        dist.all_to_all_single(out, x_RC, recv_splits, send_splits, group=group)
        return out
    row_bytes = x_RC[0:1].numel() * x_RC.element_size() if x_RC.dim() > 1 else x_RC.element_size()
    me = dist.get_rank(group)
    remote = sum(n for j, n in enumerate(send_splits) if j != me) * row_bytes
    with stats.record(kind, remote, x_RC.shape[0] * row_bytes, x_RC.device):
        dist.all_to_all_single(out, x_RC, recv_splits, send_splits, group=group)
    return out


def gather_counts(counts_E: Tensor, group=None, stats: CommStats | None = None) -> Tensor:
    """All-gather every rank's counts into one device tensor (no host read).

    Args:
        counts_E: (E,) int64 on this rank's device (the same E on every rank).
        group: process group (None: the default group). stats: optional recorder
            (kind ``"counts"``).

    Returns:
        (P, E) int64 on counts_E's device, row s = rank s's counts.
    """
    world = dist.get_world_size(group)
    out_PE = counts_E.new_empty((world, *counts_E.shape))
    views = list(out_PE.unbind(0))  # contiguous rows of one tensor: no copy afterwards
    if stats is None:
        dist.all_gather(views, counts_E.contiguous(), group=group)
    else:
        nbytes = counts_E.numel() * counts_E.element_size()
        with stats.record("counts", nbytes * (world - 1), nbytes, counts_E.device):
            dist.all_gather(views, counts_E.contiguous(), group=group)
    return out_PE


def start_all_to_all_rows(x_RC: Tensor, recv_splits: list[int], send_splits: list[int], group=None,
                          stats: CommStats | None = None, kind: str = "rows"):
    """:func:`all_to_all_rows` issued with ``async_op=True``: returns ``(out, work)``; ``out``
    holds the received rows once ``work.wait()`` has returned (on CUDA: once the current
    stream has passed the wait, which does not block the host). ``stats`` records the
    bytes; its time spans the issue to the end of :func:`finish_all_to_all`."""
    world = dist.get_world_size(group)
    if len(recv_splits) != world or len(send_splits) != world or sum(send_splits) != x_RC.shape[0]:
        raise ValueError(f"split lists must have one entry per rank ({world}) and send_splits must sum to the "
                         f"rows of x ({x_RC.shape[0]}), got {send_splits} and {recv_splits}")
    x_RC = x_RC.contiguous()
    out = x_RC.new_empty((sum(recv_splits), *x_RC.shape[1:]))
    rec = None
    if stats is not None:
        row_bytes = x_RC[0:1].numel() * x_RC.element_size() if x_RC.dim() > 1 else x_RC.element_size()
        me = dist.get_rank(group)
        remote = sum(n for j, n in enumerate(send_splits) if j != me) * row_bytes
        rec = stats.record(kind, remote, x_RC.shape[0] * row_bytes, x_RC.device)
        rec.__enter__()
    work = dist.all_to_all_single(out, x_RC, recv_splits, send_splits, group=group, async_op=True)
    return out, (work, rec, x_RC)


def finish_all_to_all(handle) -> None:
    """Wait for an exchange of :func:`start_all_to_all_rows` (and close its record)."""
    work, rec, _ = handle  # the send buffer is kept alive until here
    work.wait()
    if rec is not None:
        rec.__exit__(None, None, None)


class ExchangeTicket:
    """Carries the in-flight work of one overlapped exchange between its start and wait
    (:class:`AllToAllStart`, :class:`AllToAllWait`), forward and backward."""

    def __init__(self):
        self.forward = None
        self.backward = None


class AllToAllStart(torch.autograd.Function):
    """Issue a row all-to-all without waiting (``async_op=True``); the output may be read
    only after :class:`AllToAllWait`. Backward: waits for the reverse exchange that
    ``AllToAllWait``'s backward issued and returns its rows, so that the autograd nodes created between the two
    in the forward (independent work, such as a shared expert) run while the gradient rows
    are in flight. Under ``create_graph`` the backward exchanges synchronously through
    :class:`AllToAllRows` instead (differentiable again, no overlap).

    ``AllToAllStart.apply(x_RC, recv_splits, send_splits, group, stats, kind, ticket)``.
    """

    @staticmethod
    def forward(ctx, x_RC: Tensor, recv_splits, send_splits, group, stats, kind: str, ticket: ExchangeTicket):
        ctx.ticket = ticket
        out, ticket.forward = start_all_to_all_rows(x_RC, recv_splits, send_splits, group, stats, kind)
        ticket.splits = (recv_splits, send_splits, group, stats, kind)
        return out

    @staticmethod
    def backward(ctx, dy: Tensor):
        if ctx.ticket.backward is None:  # a differentiable backward (create_graph): exchange here
            recv_splits, send_splits, group, stats, kind = ctx.ticket.splits
            return AllToAllRows.apply(dy, send_splits, recv_splits, group, stats, kind + ".grad"), \
                None, None, None, None, None, None
        dx, handle = ctx.ticket.backward  # the reverse exchange AllToAllWait's backward issued
        finish_all_to_all(handle)
        ctx.ticket.backward = None
        return dx, None, None, None, None, None, None


class AllToAllWait(torch.autograd.Function):
    """Wait for the exchange of an :class:`AllToAllStart` (the identity on its output).
    Backward: issues the reverse exchange of the gradient rows without waiting (the
    matching ``AllToAllStart`` backward waits).

    ``AllToAllWait.apply(out_RC, ticket)``.
    """

    @staticmethod
    def forward(ctx, out_RC: Tensor, ticket: ExchangeTicket):
        ctx.ticket = ticket
        finish_all_to_all(ticket.forward)
        ticket.forward = None
        return out_RC

    @staticmethod
    def backward(ctx, dy_RC: Tensor):
        if torch.is_grad_enabled():  # create_graph: AllToAllStart's backward exchanges, differentiably
            ctx.ticket.backward = None
            return dy_RC, None
        recv_splits, send_splits, group, stats, kind = ctx.ticket.splits
        ctx.ticket.backward = start_all_to_all_rows(dy_RC, send_splits, recv_splits, group, stats, kind + ".grad")
        # the gradient of AllToAllStart's output is the one in flight: AllToAllStart's backward
        # takes it from the ticket once received (dy_RC only keeps the graph connected)
        return dy_RC, None


class AllToAllRows(torch.autograd.Function):
    """Differentiable :func:`all_to_all_rows`; the backward is the reverse exchange, itself
    an ``AllToAllRows`` (so differentiable again: double backward is supported).

    ``AllToAllRows.apply(x_RC, recv_splits, send_splits, group, stats, kind)``.
    """

    @staticmethod
    def forward(ctx, x_RC: Tensor, recv_splits: list[int], send_splits: list[int], group, stats, kind: str):
        """Send rows of x (R, C) in ``send_splits`` chunks, receive ``recv_splits`` rows per rank."""
        ctx.recv_splits, ctx.send_splits, ctx.group, ctx.stats, ctx.kind = recv_splits, send_splits, group, stats, kind
        return all_to_all_rows(x_RC, recv_splits, send_splits, group, stats, kind)

    @staticmethod
    def backward(ctx, dy_RC: Tensor):
        """The reverse all-to-all of the gradient rows (splits swapped)."""
        dx = AllToAllRows.apply(dy_RC, ctx.send_splits, ctx.recv_splits, ctx.group, ctx.stats, ctx.kind + ".grad")
        return dx, None, None, None, None, None
