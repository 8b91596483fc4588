"""The offsets contract of the grouped expert ops (:mod:`mxmoe.ops.offsets`): every kind
of bad offsets is refused on the CPU with a ValueError / TypeError naming the value, in
mx_grouped_mm, mx_grouped_mm_dgrad and mx_moe_experts alike; on other devices the values
are read only with MXMOE_CHECK_OFFSETS=1."""

from __future__ import annotations

import pytest
import torch

from mxmoe.ops.grouped_mm import mx_grouped_mm, mx_grouped_mm_dgrad
from mxmoe.ops.moe_experts import mx_moe_experts
from mxmoe.ops.offsets import CHECK_OFFSETS_ENV, check_offsets_values, offsets_checked
from mxmoe.recipe import get_recipe

MX = get_recipe("mxfp8", backend="reference")
T, K, N, E, k = 8, 64, 32, 3, 2  # the fused op: T tokens, A = T * k rows
A = T * k


def call(op: str, offsets: torch.Tensor):
    torch.manual_seed(0)
    if op == "mx_grouped_mm":
        return mx_grouped_mm(torch.randn(A, K), torch.randn(E, N, K), offsets, MX)
    if op == "mx_grouped_mm_dgrad":
        return mx_grouped_mm_dgrad(torch.randn(A, N), torch.randn(E, N, K), offsets, MX)
    x = torch.randn(T, K).bfloat16()
    src = torch.arange(T).repeat_interleave(k)  # each token twice, in order
    return mx_moe_experts(x, src, offsets, torch.randn(E, 2 * N, K) * 0.1, torch.randn(E, K, N) * 0.1, MX)


OPS = ["mx_grouped_mm", "mx_grouped_mm_dgrad", "mx_moe_experts"]
GOOD = [4, 4, A]  # an empty expert

# (offsets values, message): each kind of broken contract, for every op
BAD_VALUES = {
    "negative start": ([-2, 6, A], r"offsets\[0\] = -2 is negative"),
    "a decrease": ([6, 4, A], r"offsets\[1\] = 4 < offsets\[0\] = 6"),
    "a decrease at the end": ([4, A, A - 1], rf"offsets\[2\] = {A - 1} < offsets\[1\] = {A}"),
    "past the rows": ([4, 6, A + 1], rf"offsets\[-1\] = {A + 1} but the input has {A} rows"),
    "all negative": ([-3, -2, -1], r"offsets\[0\] = -3 is negative"),
}


@pytest.mark.parametrize("op", OPS)
def test_good_offsets_run(op):
    assert call(op, torch.tensor(GOOD, dtype=torch.int32)).shape[0] == A


@pytest.mark.parametrize("bad", BAD_VALUES)
@pytest.mark.parametrize("op", OPS)
def test_bad_offset_values_are_refused_on_the_cpu(op, bad):
    values, message = BAD_VALUES[bad]
    with pytest.raises(ValueError, match=rf"{op}: {message}; offsets are cumulative end rows: non-decreasing"):
        call(op, torch.tensor(values, dtype=torch.int32))


def test_the_fused_op_needs_every_row_in_an_expert():
    with pytest.raises(ValueError, match=rf"offsets\[-1\] = {A - 1} but the input has {A} rows; .* from 0 to {A}"):
        call("mx_moe_experts", torch.tensor([4, 6, A - 1], dtype=torch.int32))


BAD_TENSORS = {
    "float": (torch.tensor([4.0, 4.0, A]), TypeError, "dtype torch.float32"),
    "int16": (torch.tensor(GOOD, dtype=torch.int16), TypeError, "dtype torch.int16"),
    "too short": (torch.tensor(GOOD[:2], dtype=torch.int32), ValueError, r"shape \(E,\) = \(3,\)"),
    "too long": (torch.tensor([*GOOD, A], dtype=torch.int32), ValueError, r"shape \(E,\) = \(3,\)"),
    "2-D": (torch.tensor([GOOD], dtype=torch.int32), ValueError, r"shape \(E,\) = \(3,\)"),
    "0-d": (torch.tensor(A, dtype=torch.int32), ValueError, r"shape \(E,\) = \(3,\)"),
}


@pytest.mark.parametrize("bad", BAD_TENSORS)
@pytest.mark.parametrize("op", OPS)
def test_bad_offset_tensors_are_refused(op, bad):
    offsets, error, message = BAD_TENSORS[bad]
    with pytest.raises(error, match=message):
        call(op, offsets)


def test_int64_offsets_are_taken_by_the_grouped_gemm_only():
    offsets = torch.tensor(GOOD, dtype=torch.int64)
    assert call("mx_grouped_mm", offsets).shape == (A, N)
    with pytest.raises(TypeError, match="int32"):
        call("mx_moe_experts", offsets)


def test_off_the_cpu_values_are_read_only_when_asked(monkeypatch):
    """No host sync by default on a device (a meta tensor stands for one: reading its values
    would fail); MXMOE_CHECK_OFFSETS=1 turns the check on."""
    meta = torch.tensor(GOOD, dtype=torch.int32, device="meta")
    monkeypatch.delenv(CHECK_OFFSETS_ENV, raising=False)
    assert not offsets_checked(meta) and offsets_checked(torch.tensor(GOOD))
    check_offsets_values(meta, A, "op")  # not read: no error
    monkeypatch.setenv(CHECK_OFFSETS_ENV, "1")
    assert offsets_checked(meta)
    with pytest.raises(NotImplementedError):  # now it reads them (a meta tensor has no values to read)
        check_offsets_values(meta, A, "op")
