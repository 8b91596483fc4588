"""The gathered bf16 experts on QuACK's kernels (sm90 GPU with the ``hopper`` extra):
each GEMM against the torch reference of its documented semantics, and the whole op and
MoE layer against the composed bf16 path, empty experts and a skewed routing included."""

import sys
from pathlib import Path

import pytest
import torch

from mxmoe.kernels import quack_moe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))
from gathered_reference import (ref_down_projection, ref_down_projection_dgated,  # noqa: E402
                                ref_gated_up_projection, ref_gathered_weight_grad, ref_up_projection_dgrad)

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and quack_moe.available()),
    reason="needs an sm90 GPU and quack-kernels (pip install 'mxmoe[hopper]')")
DEV = torch.device("cuda")


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def routing(T, k, E, skew, g):
    p = torch.ones(E)
    p[1] = 0.0  # expert 1 receives nothing
    if skew:
        p[0] = 50.0
    experts = torch.stack([torch.multinomial(p, k, generator=g) for _ in range(T)])
    order = torch.argsort(experts.reshape(-1), stable=True)
    offsets = torch.cumsum(torch.bincount(experts.reshape(-1), minlength=E), 0).to(torch.int32)
    return experts.to(DEV), order.to(DEV), offsets.to(DEV)


@pytest.mark.parametrize("T, k, E, D, F, skew", [(1024, 8, 16, 512, 256, False), (777, 2, 8, 256, 384, True),
                                                 (1, 1, 4, 128, 128, False)])
def test_each_gemm_matches_its_reference(T, k, E, D, F, skew):
    g = torch.Generator().manual_seed(T)
    _, order, offsets = routing(T, k, E, skew, g)
    cu = quack_moe.cu_seqlens(offsets)
    src = torch.div(order, k, rounding_mode="floor").to(torch.int32)
    A = src.numel()
    r = lambda *s: torch.randn(*s, generator=g).bfloat16().to(DEV)  # noqa: E731
    x, dy, w13, w2 = r(T, D), r(T, D), r(E, 2 * F, D) / D ** 0.5, r(E, D, F) / F ** 0.5
    s_A = torch.rand(A, generator=g).to(DEV)
    for got, want in zip(quack_moe.gated_up_projection(x, src, cu, w13), ref_gated_up_projection(x, src, cu, w13)):
        assert rel(got, want) < 1e-2
    h, act = ref_gated_up_projection(x, src, cu, w13)
    assert rel(quack_moe.down_projection(act, w2, cu), ref_down_projection(act, w2, cu)) < 1e-2
    for got, want in zip(quack_moe.down_projection_dgated(dy, src, cu, w2, h, s_A),
                         ref_down_projection_dgated(dy, src, cu, w2, h, s_A)):
        assert rel(got, want) < 1e-2
    dh = r(A, 2 * F)
    assert rel(quack_moe.up_projection_dgrad(dh, w13, cu), ref_up_projection_dgrad(dh, w13, cu)) < 1e-2
    for a, b, out, inter in ((x, dh, w13, True), (dy, act, w2, False)):
        got, want = torch.full_like(out, float("nan")), torch.empty_like(out)
        view = (lambda t: t.permute(0, 2, 1)) if inter else (lambda t: t)
        quack_moe.gathered_weight_grad(a, src, cu, b, view(got), interleaved_b=inter)
        ref_gathered_weight_grad(a, src, cu, b, view(want), interleaved_b=inter)
        assert rel(got, want) < 1e-2 and not got[1].any()  # an empty expert's gradient is written as zeros


@pytest.mark.parametrize("params", [torch.bfloat16, torch.float32])
def test_moe_layer_gathered_path_matches_composed(monkeypatch, params):
    from mxmoe.nn import MoE

    torch.manual_seed(0)
    moe = MoE(d_model=512, n_experts=16, top_k=4, d_expert=256, recipe="bf16").to(DEV, params)
    x = torch.randn(2048, 512, device=DEV).bfloat16().requires_grad_()
    dy = torch.randn(2048, 512, device=DEV).bfloat16()
    results = []
    for engine in ("default", "quack"):
        monkeypatch.setenv("MXMOE_EXPERT_ENGINE", engine)
        moe.zero_grad()
        x.grad = None
        y, _ = moe(x)
        y.backward(dy)
        assert moe.last_expert_path == ("gathered" if engine == "quack" else "composed")
        results.append([y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in moe.parameters()])
    for got, want in zip(results[1], results[0]):
        assert got.dtype == want.dtype and rel(got, want) < 2e-2
