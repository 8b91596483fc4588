"""mx_moe_experts refuses weights and activations whose shapes do not fit each other with
a ValueError naming the argument, its shape and the shape that would work."""

from __future__ import annotations

import pytest
import torch

from mxmoe.ops.moe_experts import mx_moe_experts
from mxmoe.recipe import get_recipe

MX = get_recipe("mxfp8", backend="reference")
T, k, E, D, F = 4, 2, 2, 64, 32

GOOD = {"x": (T, D), "w13": (E, 2 * F, D), "w2": (E, D, F)}
# (argument, bad shape, message)
BAD = {
    "w2 of another D": ("w2", (E, 2 * D, F), r"w2 must be \(E, D, F\) = \(2, 64, 32\) .* got \(2, 128, 32\)"),
    "w2 of another F": ("w2", (E, D, 2 * F), r"w2 must be \(E, D, F\) = \(2, 64, 32\)"),
    "w2 of another E": ("w2", (E + 1, D, F), r"w2 must be \(E, D, F\) = \(2, 64, 32\)"),
    "w2 transposed": ("w2", (E, F, D), r"w2 must be \(E, D, F\)"),
    "w2 2-D": ("w2", (D, F), r"w2 must be \(E, D, F\)"),
    "w13 odd 2F": ("w13", (E, 2 * F + 1, D), r"w13 must be \(E, 2F, D\) \[gate; up\] weights, got shape \(2, 65, 64\)"),
    "w13 2-D": ("w13", (2 * F, D), r"w13 must be \(E, 2F, D\)"),
    "x of another D": ("x", (T, 2 * D), r"x must be \(T, D\) with D = 64 \(w13's last dim\), got \(4, 128\)"),
    "x 3-D": ("x", (1, T, D), r"x must be \(T, D\)"),
}


@pytest.mark.parametrize("bad", BAD)
def test_shapes_that_do_not_fit_are_refused(bad):
    name, shape, message = BAD[bad]
    shapes = {**GOOD, name: shape}
    x = torch.randn(*shapes["x"]).bfloat16()
    src = torch.arange(T).repeat_interleave(k)
    offsets = torch.tensor([k * T // 2, k * T], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        mx_moe_experts(x, src, offsets, torch.randn(*shapes["w13"]), torch.randn(*shapes["w2"]), MX)


def test_good_shapes_run():
    x = torch.randn(T, D).bfloat16()
    src = torch.arange(T).repeat_interleave(k)
    y = mx_moe_experts(x, src, torch.tensor([4, 8], dtype=torch.int32), torch.randn(E, 2 * F, D) * 0.1,
                       torch.randn(E, D, F) * 0.1, MX)
    assert y.shape == (T * k, D)


def test_unrouted_tail_rows_do_not_change_the_routed_rows():
    """``unrouted_tail=True`` (the padded expert-parallel receive buffer): rows past
    offsets[-1] belong to no expert. The routed rows' outputs and every gradient equal the
    op run on the routed rows alone, bit for bit; without the flag the CPU check refuses."""
    torch.manual_seed(0)
    E, D, F, R, pad = 3, 64, 32, 20, 12
    w13 = torch.randn(E, 2 * F, D, requires_grad=True)
    w2 = torch.randn(E, D, F, requires_grad=True)
    x = torch.randn(R + pad, D).to(torch.bfloat16)
    offsets = torch.tensor([7, 7, R], dtype=torch.int32)  # an empty expert in the middle
    src = torch.cat([torch.randperm(R), torch.arange(R, R + pad)])  # routed rows first, then the tail
    dy = torch.randn(R, D).to(torch.bfloat16)
    outs = []
    for rows, tail in ((x, True), (x[:R], False)):
        xi = rows.clone().requires_grad_()
        s = src if tail else src[:R]
        y = mx_moe_experts(xi, s, offsets, w13, w2, "mxfp8", unrouted_tail=tail)[:R]
        w13.grad = w2.grad = None
        (y.float() * dy.float()).sum().backward()
        outs.append((y.detach(), xi.grad[:R], w13.grad.clone(), w2.grad.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="offsets"):
        mx_moe_experts(x, src, offsets, w13, w2, "mxfp8")
