"""The MoE layer: router, dispatch, experts, combine, losses."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from mxmoe.nn.moe import MoELayer, TopKRouter, load_balancing_loss, router_z_loss
from mxmoe.recipe import get_recipe


def naive_moe(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, float64 on bf16-rounded operands (the bf16 recipe)."""
    r = layer.router(x_TD)
    bf = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
    out = torch.zeros(x_TD.shape, dtype=torch.float64)
    for t in range(x_TD.shape[0]):
        for j in range(layer.top_k):
            e = r.experts_Tk[t, j].item()
            h = bf(x_TD[t]) @ bf(layer.experts.w13[e]).t()
            gate, up = h.chunk(2)
            act = F.silu(gate) * up
            out[t] += r.weights_Tk[t, j].double() * (bf(act) @ bf(layer.experts.w2[e]).t())
    return out


def test_router_topk_renormalized_and_ties_to_lower_index():
    router = TopKRouter(d_model=8, n_experts=6, top_k=3)
    with torch.no_grad():
        router.weight.zero_()  # every expert scores the same: ties everywhere
    r = router(torch.randn(5, 8))
    assert torch.equal(r.experts_Tk, torch.tensor([[0, 1, 2]] * 5))
    torch.testing.assert_close(r.weights_Tk.sum(-1), torch.ones(5))
    assert r.weights_Tk.dtype == torch.float32 and r.logits_TE.dtype == torch.float32
    with pytest.raises(ValueError, match="top_k must be an integer in"):
        TopKRouter(8, 4, 5)


def test_load_balancing_and_z_loss_values():
    T, E = 64, 4
    probs = torch.full((T, E), 1 / E)
    experts = torch.arange(T * 2).remainder(E).view(T, 2)  # perfectly balanced
    assert load_balancing_loss(probs, experts).item() == pytest.approx(1.0)
    skewed = torch.zeros(T, 2, dtype=torch.long)  # everything on expert 0
    probs_skewed = torch.zeros(T, E)
    probs_skewed[:, 0] = 1
    assert load_balancing_loss(probs_skewed, skewed).item() == pytest.approx(E)
    logits = torch.randn(T, E)
    assert router_z_loss(logits).item() == pytest.approx(torch.logsumexp(logits, -1).pow(2).mean().item())


@pytest.mark.parametrize("shared", [0, 32])
def test_moe_layer_matches_token_by_token_reference(shared):
    torch.manual_seed(0)
    layer = MoELayer(d_model=64, n_experts=5, top_k=2, d_expert=48, n_layers=2, recipe=get_recipe("bf16"),
                     shared_expert_hidden=shared)
    with torch.no_grad():  # larger weights so that routing and outputs are not all alike
        for p in layer.parameters():
            p.mul_(10)
    x = torch.randn(2, 37, 64)  # 74 tokens: not a multiple of 32
    y, aux = layer(x)
    assert y.shape == x.shape
    ref = naive_moe(layer, x.reshape(-1, 64))
    if shared:
        ref += layer.shared(x.reshape(-1, 64), get_recipe("bf16")).double()
    rel = ((y.reshape(-1, 64).double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2  # bf16 rounding of the expert hidden states only
    counts = layer.last_tokens_per_expert
    assert counts.sum().item() == 74 * 2 and torch.equal(aux.tokens_per_expert, counts)


def test_moe_layer_backward_matches_reference_autograd():
    torch.manual_seed(1)
    layer = MoELayer(d_model=32, n_experts=4, top_k=2, d_expert=32, n_layers=1, recipe=get_recipe("mxfp8"))
    x = torch.randn(40, 32, requires_grad=True)
    y, aux = layer(x)
    (y.square().sum() + aux.aux_loss + aux.z_loss).backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert layer.router.weight.grad.abs().sum() > 0  # the router learns through the combine weights
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_moe_layer_is_deterministic_and_handles_all_tokens_on_one_expert():
    torch.manual_seed(2)
    layer = MoELayer(32, 8, 2, 32, 1, get_recipe("mxfp8"))
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[3] = 5.0  # expert 3 wins for (nearly) every token with positive sum
        layer.router.weight[6] = 4.0
    x = torch.rand(50, 32) + 0.1
    y1, _ = layer(x)
    y2, _ = layer(x)
    assert torch.equal(y1, y2)
    counts = layer.last_tokens_per_expert
    assert counts[3].item() == 50 and counts[6].item() == 50 and counts.sum().item() == 100


def test_moe_layer_with_no_tokens():
    layer = MoELayer(32, 4, 2, 32, 1, get_recipe("mxfp8"))
    y, aux = layer(torch.zeros(0, 32))
    assert y.shape == (0, 32)
    assert aux.aux_loss.item() == 0 and aux.z_loss.item() == 0
    assert layer.last_tokens_per_expert.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("kw,match", [
    (dict(block_size=0), "block_size must be a positive int"),
    (dict(quantize="no"), "quantize must be True or False"),
    (dict(backend="cuda"), "unknown backend 'cuda'"),
    (dict(scale_mode="ceil"), "unknown scale mode 'ceil'"),
    (dict(bogus=1), "unknown recipe field"),
])
def test_get_recipe_refuses_bad_overrides(kw, match):
    with pytest.raises(ValueError, match=match):
        get_recipe("mxfp8", **kw)
