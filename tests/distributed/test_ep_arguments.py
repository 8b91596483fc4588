"""Arguments of the expert-parallel layer refused by name in one process (a one-rank gloo
group): a layer that is not mxmoe's MoE, on/off arguments that are not bools (a string
such as "no" would switch the feature on), a capacity factor or sizes the capacity rule
cannot use."""

from __future__ import annotations

import pytest
import torch

from mxmoe.distributed.ep import ExpertParallelMoELayer, dispatch_capacity, shard_experts
from mxmoe.nn import GroupedExperts, MoE


def _layer() -> MoE:
    return MoE(32, 4, 2, 32, recipe="bf16")


BAD = {
    "a Linear": (lambda: ExpertParallelMoELayer(torch.nn.Linear(4, 4)), TypeError, "wraps an mxmoe MoE layer"),
    "None": (lambda: ExpertParallelMoELayer(None), TypeError, "wraps an mxmoe MoE layer .*got NoneType"),
    "overlap 'no'": (lambda: ExpertParallelMoELayer(_layer(), overlap="no"), TypeError,
                     "overlap must be True or False, got 'no'"),
    "mx_backward None": (lambda: ExpertParallelMoELayer(_layer(), mx_backward=None), TypeError,
                         "mx_backward must be True or False"),
    "mx_dispatch 'yes'": (lambda: ExpertParallelMoELayer(_layer(), mx_dispatch="yes"), TypeError,
                          "mx_dispatch must be True or False"),
    "comm_stats text": (lambda: ExpertParallelMoELayer(_layer(), comm_stats="x"), TypeError,
                        "comm_stats must be a CommStats or None"),
    "capacity inf": (lambda: ExpertParallelMoELayer(_layer(), capacity_factor=float("inf")), ValueError,
                     "capacity_factor must be a positive number"),
    "capacity 10**400": (lambda: ExpertParallelMoELayer(_layer(), capacity_factor=10**400), ValueError,
                         "capacity_factor must be a positive number"),
    "mx_backward under bf16": (lambda: ExpertParallelMoELayer(_layer(), mx_backward=True), ValueError,
                               r"^mx_backward \(MXFP8 gradients on the wire\) needs a quantizing recipe"),
    "shard_experts None": (lambda: shard_experts(None), TypeError, "takes the model"),
    "shard_experts overlap 'no'": (lambda: shard_experts(torch.nn.Sequential(_layer()), overlap="no"), TypeError,
                                   "overlap must be True or False"),
    "MoE fused 'no'": (lambda: MoE(32, 4, 2, 32, fused="no"), TypeError, "fused must be True or False"),
    "MoE mx_dispatch 'no'": (lambda: MoE(32, 4, 2, 32, mx_dispatch="no"), TypeError,
                             "mx_dispatch must be True or False"),
    "GroupedExperts fused 1": (lambda: GroupedExperts(4, 32, 32, fused=1), TypeError, "fused must be True or False"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_arguments_are_refused_by_name(group, case):
    call, error, message = BAD[case]
    with pytest.raises(error, match=message):
        call()


def test_a_huge_capacity_factor_is_the_worst_case(group):
    """f >= P already gives the worst case; a huge f must not overflow."""
    assert dispatch_capacity(16, 2, 4, 2, 1e308) == dispatch_capacity(16, 2, 4, 2) == 32
    assert ExpertParallelMoELayer(_layer(), capacity_factor=1e308).capacity_factor == 1e308


@pytest.mark.parametrize("args,message", [
    ((16, 2, 4, 1, 0.0), "capacity_factor must be a positive number"),
    ((16, 2, 4, 1, -1.0), "capacity_factor must be a positive number"),
    ((16, 2, 4, 1, float("nan")), "capacity_factor must be a positive number"),
    ((16, 2, 4, 1, "x"), "capacity_factor must be a positive number"),
    ((-16, 2, 4, 1), "tokens must be an integer >= 0, got -16"),
    ((16, 0, 4, 1), "top_k must be an integer >= 1"),
    ((16, 2, 4, 0), "world_size must be an integer >= 1, got 0"),
    ((16.0, 2, 4, 1), "tokens must be an integer"),
])
def test_dispatch_capacity_checks_its_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        dispatch_capacity(*args)


def test_an_input_of_the_wrong_width_is_refused_like_the_moe_layer(group):
    ep = ExpertParallelMoELayer(_layer())
    with pytest.raises(ValueError, match=r"ExpertParallelMoELayer takes activations of shape \(\.\.\., D=32\), got "
                                         r"\(2, 8, 16\)"):
        ep(torch.randn(2, 8, 16))
    y, _ = ep(torch.randn(2, 8, 32))
    assert y.shape == (2, 8, 32)
