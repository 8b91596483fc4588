"""GroupedExperts: the experts of an MoE for a model with its own router. Same bits as
MoE's expert path for the same routing, fused and composed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mxmoe import GroupedExperts, MoE
from mxmoe.nn.moe import SwiGLUExperts
from mxmoe.recipe import get_recipe

D, E, FF, K = 64, 4, 64, 2


def _pair(recipe, fused=True, seed=0):
    torch.manual_seed(seed)
    moe = MoE(D, E, K, FF, n_layers=2, recipe=recipe, fused=fused)
    ge = GroupedExperts(E, D, FF, recipe=recipe, fused=fused)
    ge.load_state_dict(moe.experts.state_dict())  # the same w13 / w2 keys and layout
    return moe, ge


@pytest.mark.parametrize("recipe,dtype,fused,runs_fused", [
    ("mxfp8", torch.bfloat16, True, True),
    ("mxfp8", torch.bfloat16, False, False),
    ("mxfp8", torch.float32, True, False),
    ("bf16", torch.float32, True, False),
    ("mxfp8-bf16-wgrad", torch.bfloat16, True, False),
])
def test_equals_the_moe_expert_path_bit_for_bit(recipe, dtype, fused, runs_fused):
    """GroupedExperts fed MoE's own routing gives MoE's output and every gradient (x, the
    router through the combine weights, w13, w2) bit for bit."""
    moe, ge = _pair(recipe, fused)
    x = torch.randn(2, 37, D, dtype=dtype)
    g = torch.randn(2, 37, D, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, _ = moe(x1)
    r = moe.router(x2.reshape(-1, D))  # the same router, so its gradient sums both uses
    y2 = ge(x2.reshape(-1, D), r.experts_Tk, r.weights_Tk).reshape(x.shape)
    assert torch.equal(y1, y2) and y2.dtype == dtype
    assert moe.last_ran_fused is ge.last_ran_fused is runs_fused
    assert torch.equal(moe.last_tokens_per_expert, ge.last_tokens_per_expert)
    router_grads = []
    for y, xx in ((y1, x1), (y2, x2)):
        moe.router.weight.grad = None
        (y * g).sum().backward()
        router_grads.append(moe.router.weight.grad)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(router_grads[0], router_grads[1]) and router_grads[0].abs().sum() > 0
    assert torch.equal(moe.experts.w13.grad, ge.w13.grad) and torch.equal(moe.experts.w2.grad, ge.w2.grad)


def _naive(ge, x, experts, weights):
    """Token by token in float64 on bf16-rounded operands (the bf16 recipe)."""
    bf = lambda t: t.to(torch.bfloat16).double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gate, up = (bf(x[t]) @ bf(ge.w13[e]).t()).chunk(2)
            out[t] += weights[t, j].double() * (bf(F.silu(gate) * up) @ bf(ge.w2[e]).t())
    return out


def test_matches_token_by_token_reference_with_repeated_choices():
    """Against an independent loop: the index of each choice picks its expert, weights are
    used as given (not renormalized), a token may choose one expert twice."""
    torch.manual_seed(1)
    ge = GroupedExperts(E, D, FF, recipe="bf16")
    with torch.no_grad():
        ge.w13.mul_(10), ge.w2.mul_(10)
    x = torch.randn(9, D)
    experts = torch.tensor([[0, 3], [1, 1], [2, 0], [3, 3], [0, 1], [2, 2], [1, 3], [0, 0], [3, 2]])
    weights = torch.rand(9, K)
    y = ge(x, experts, weights)
    ref = _naive(ge, x, experts, weights)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2  # bf16 rounding of the hidden states
    assert ge.last_tokens_per_expert.tolist() == [5, 4, 4, 5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fused, composed
def test_an_empty_expert_gets_zero_gradients(dtype):
    torch.manual_seed(2)
    ge = GroupedExperts(E, D, FF, recipe="mxfp8")
    x = torch.randn(20, D, dtype=dtype, requires_grad=True)
    experts = torch.randint(0, E, (20, K))
    experts[experts == 2] = 1  # nobody routes to expert 2
    weights = torch.softmax(torch.randn(20, K), -1)
    y = ge(x, experts, weights)
    y.float().square().sum().backward()
    assert ge.last_ran_fused is (dtype == torch.bfloat16)
    assert ge.last_tokens_per_expert[2].item() == 0
    assert bool((ge.w13.grad[2] == 0).all()) and bool((ge.w2.grad[2] == 0).all())
    for e in (0, 1, 3):
        assert ge.w13.grad[e].abs().sum() > 0 and ge.w2.grad[e].abs().sum() > 0
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()


def test_no_tokens():
    ge = GroupedExperts(E, D, FF)
    y = ge(torch.zeros(0, D, dtype=torch.bfloat16), torch.zeros(0, K, dtype=torch.long), torch.zeros(0, K))
    assert y.shape == (0, D) and ge.last_tokens_per_expert.tolist() == [0] * E


def test_layout_init_and_recipe():
    torch.manual_seed(3)
    ref = SwiGLUExperts(E, D, FF, 2)
    torch.manual_seed(3)
    ge = GroupedExperts(E, D, FF, n_layers=2)
    assert list(ge.state_dict()) == ["w13", "w2"]
    assert ge.w13.shape == (E, 2 * FF, D) and ge.w2.shape == (E, D, FF)
    assert torch.equal(ge.w13, ref.w13) and torch.equal(ge.w2, ref.w2)
    assert ge.recipe.name == "mxfp8" and ge.fused
    ge.set_recipe("bf16")
    assert not ge.fused and "recipe=bf16" in repr(ge)
    ge.recipe = get_recipe("mxfp8")
    assert ge.fused
    assert not GroupedExperts(E, D, 48).fused  # F = 48: not a multiple of 32, composed path
    assert GroupedExperts(E, D, FF, dtype=torch.bfloat16).w2.dtype == torch.bfloat16


def test_clear_errors():
    ge = GroupedExperts(E, D, FF)
    x = torch.randn(6, D)
    ex = torch.randint(0, E, (6, K))
    w = torch.rand(6, K)
    cases = [
        ((x, ex.int(), w), TypeError, "int64 tensor of expert indices, got torch.int32"),
        ((x, ex, w.long()), TypeError, "floating-point tensor of combine weights"),
        ((x.long(), ex, w), TypeError, "float32, bfloat16 or float16 activations"),
        ((x.view(2, 3, D), ex, w), ValueError, r"flatten the leading dimensions"),
        ((x[:, :32], ex, w), ValueError, r"shape \(\.\.\., D=64\)"),
        ((x, ex[:5], w), ValueError, r"experts_Tk must have shape \(T=6, k\)"),
        ((x, ex, w[:, :1]), ValueError, "weights_Tk must have the shape of experts_Tk"),
        ((x, ex.masked_fill(ex == ex[0, 0], E), w), ValueError, r"in \[0, 4\), got values in"),
        ((x, ex - 5, w), ValueError, r"in \[0, 4\)"),
    ]
    for args, err, match in cases:
        with pytest.raises(err, match=match):
            ge(*args)
    with pytest.raises(ValueError, match=r"d_expert must be an integer in \[1, "):
        GroupedExperts(E, D, 0)
    with pytest.raises(ValueError, match="unknown recipe"):
        GroupedExperts(E, D, FF, recipe="fp8")
