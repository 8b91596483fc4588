"""The offsets contract of the grouped expert ops, and its check.

``offsets`` (E,) holds the cumulative end row of each expert's group: expert e owns rows
``offsets[e-1] .. offsets[e] - 1`` (``offsets[-1]`` = 0 before expert 0) of the sorted
input. The ops need:

- an integer tensor (int32; :func:`~mxmoe.ops.grouped_mm.mx_grouped_mm` also takes int64)
  of shape (E,), E the weights' expert count, on the input's device;
- ``0 <= offsets[0]``, ``offsets[e-1] <= offsets[e]`` (non-decreasing: an expert may be
  empty) and ``offsets[-1] <= rows`` (``== rows`` for
  :func:`~mxmoe.ops.moe_experts.mx_moe_experts`).

Offsets that break this would make the GEMMs multiply rows by the wrong expert's weights
or read past the input. On the CPU the values are checked on every call (reading them
costs nothing). On CUDA, reading them would make the host wait for the device on every
call (and cannot run inside a CUDA graph), so the values are not checked by default;
setting the environment variable ``MXMOE_CHECK_OFFSETS=1`` checks them there too (a
debugging aid: one host sync per call).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

CHECK_OFFSETS_ENV = "MXMOE_CHECK_OFFSETS"


def offsets_checked(offsets: Tensor) -> bool:
    """Whether :func:`check_offsets_values` reads ``offsets``: always on the CPU, on other
    devices when ``MXMOE_CHECK_OFFSETS=1``."""
    return offsets.device.type == "cpu" or os.environ.get(CHECK_OFFSETS_ENV, "") == "1"


def check_offsets_values(offsets: Tensor, rows: int, fn: str, *, exact: bool = False) -> None:
    """Check the values of ``offsets`` (E,) against ``rows`` input rows (module docstring),
    where :func:`offsets_checked` says so.

    Args:
        offsets: (E,) integer tensor, cumulative end rows.
        rows: the number of rows of the sorted input.
        fn: the op's name, for the message.
        exact: require ``offsets[-1] == rows`` (every row belongs to an expert).

    Raises:
        ValueError: a negative first offset, a decrease, or a last offset past ``rows``
            (or, with ``exact``, short of it), naming the index and value.
    """
    if offsets.numel() == 0 or not offsets_checked(offsets):
        return
    o = offsets.detach().to("cpu", torch.int64)
    rule = f"offsets are cumulative end rows: non-decreasing, from 0 to {'' if exact else 'at most '}{rows}"
    if int(o[0]) < 0:
        raise ValueError(f"{fn}: offsets[0] = {int(o[0])} is negative; {rule}")
    drops = torch.nonzero(o[1:] < o[:-1])
    if drops.numel():
        i = int(drops[0, 0]) + 1
        raise ValueError(f"{fn}: offsets[{i}] = {int(o[i])} < offsets[{i - 1}] = {int(o[i - 1])}; {rule}")
    last = int(o[-1])
    if last > rows or (exact and last != rows):
        raise ValueError(f"{fn}: offsets[-1] = {last} but the input has {rows} rows; {rule}")
