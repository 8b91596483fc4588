"""mxmoe's experts backends inside transformers MoE blocks, against transformers' own.

Each family's MoE block (router, experts, combine, and a shared expert where the family
has one) runs on the same weights and inputs under transformers' ``grouped_mm`` backend
in float32 (the reference) and under mxmoe's backends:

- ``bf16``: bf16 parameters and activations, backend ``mxfp8``: the SwiGLU families run
  the fused MXFP8 expert op (:func:`mxmoe.mx_moe_experts`);
- ``float32``: float32 parameters and activations, backend ``mxfp8``: two MXFP8 grouped
  GEMMs with the family's own activation (gpt-oss takes this composed path in bf16 too,
  with its biases, interleaved gate/up and clamped SwiGLU).

The output, the input gradient and the weight gradients (gate_up_proj, down_proj, the
router weight) are compared by SQNR in dB against floors kept in :data:`SQNR_FLOORS_DB`,
one dict per family (measured on this CPU with torch 2.13 and transformers 5.17, floors
set about 3 dB under the measured value). Routing is checked to be identical, so the
SQNR measures the arithmetic alone. Under ``mxmoe_bf16`` the block equals transformers'
bf16 ``grouped_mm`` result within bf16 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import causal_lm, moe_block

from mxmoe.integrations.transformers import experts_layout, register

TOKENS = 96

# SQNR floors (dB) per family: {(activation dtype, tensor): floor}; tensors: out, dx (input
# grad), dw_gate_up, dw_down, dw_router. bf16 runs the fused op for the SwiGLU families.
TENSORS = ("out", "dx", "dw_gate_up", "dw_down", "dw_router")
SQNR_FLOORS_DB: dict[str, dict[tuple[str, str], float]] = {
    # measured bf16: 23.6 23.2 23.4 22.5 18.4; float32: 23.7 23.8 24.0 23.6 22.3 (the fused op's
    # router-weight gradient, act . d(act) / w from its MXFP8 backward GEMM, was 21.6 while
    # the combine kept an MXFP8 copy of y)
    "qwen3_moe": {**dict(zip((("bf16", t) for t in TENSORS), (20.5, 20.0, 20.5, 19.5, 15.5))),
                  **dict(zip((("float32", t) for t in TENSORS), (20.5, 20.5, 21.0, 20.5, 19.0)))},
    # measured bf16: 23.2 22.9 23.2 22.4 19.0 (19.2 with y's MXFP8 copy); float32: 23.2 23.7 23.7 23.5 21.4
    "mixtral": {**dict(zip((("bf16", t) for t in TENSORS), (20.0, 20.0, 20.0, 19.5, 16.0))),
                **dict(zip((("float32", t) for t in TENSORS), (20.0, 20.5, 20.5, 20.5, 18.5)))},
    # measured bf16: 24.9 24.5 22.8 22.3 19.1 (22.8 with y's MXFP8 copy); float32: 24.9 25.3 23.7 23.7 23.7
    "deepseek_v3": {**dict(zip((("bf16", t) for t in TENSORS), (22.0, 21.5, 19.5, 19.5, 16.0))),
                    **dict(zip((("float32", t) for t in TENSORS), (22.0, 22.0, 20.5, 20.5, 20.5)))},
    # composed in both (biases, interleaved gate/up, clamped SwiGLU)
    # measured bf16: 25.7 25.1 25.3 25.4 23.8; float32: 25.8 25.2 25.5 25.5 24.4
    "gpt_oss": {**dict(zip((("bf16", t) for t in TENSORS), (22.5, 22.0, 22.0, 22.0, 20.5))),
                **dict(zip((("float32", t) for t in TENSORS), (22.5, 22.0, 22.5, 22.5, 21.0)))},
}

FAMILIES = list(SQNR_FLOORS_DB)


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum().clamp_min(1e-300)))


def _router_weight(block):
    router = getattr(block, "gate", None) or block.router
    return router.weight


def run_block(model, backend: str, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output and gradients of the model's first MoE block on x (T, D), loss (out * g).sum()."""
    model.set_experts_implementation(backend)
    block = moe_block(model)
    routes = []
    router = getattr(block, "gate", None) or block.router
    handle = router.register_forward_hook(lambda m, i, o: routes.append(o[-1].detach().sort(dim=-1).values))
    x = x.detach().to(model.dtype).requires_grad_(True)
    out = block(x.unsqueeze(0))
    out = out[0] if isinstance(out, tuple) else out
    handle.remove()
    (out.float() * g).sum().backward()
    res = {"out": out.squeeze(0), "dx": x.grad, "dw_gate_up": block.experts.gate_up_proj.grad,
           "dw_down": block.experts.down_proj.grad, "dw_router": _router_weight(block).grad, "routes": routes[0]}
    return {k: v.detach().float() for k, v in res.items()}


def decisive_routing_(model, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Set the first MoE block's router weight to E orthonormal rows Q and return tokens
    x_t = 2 q_a + 1.5 q_b + 0.1 noise (a, b two experts of one half of the experts, so
    DeepSeek-V3's group-limited routing picks the same pair) and the output gradient g:
    every token's top-k set is decided by a logit gap of about 1.5, far above bf16
    rounding, so the bf16 and float32 blocks route alike."""
    from hf_models import D, E

    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(D, E, generator=gen, dtype=torch.float64))
    q = q.t().float()  # (E, D) orthonormal rows
    with torch.no_grad():
        _router_weight(moe_block(model)).copy_(q)
    half = E // 2
    group = torch.randint(0, 2, (TOKENS,), generator=gen) * half
    pick = torch.stack([torch.randperm(half, generator=gen)[:2] for _ in range(TOKENS)]) + group[:, None]
    x = 2.0 * q[pick[:, 0]] + 1.5 * q[pick[:, 1]] + 0.1 * torch.randn(TOKENS, D, generator=gen)
    return x, torch.randn(TOKENS, D, generator=gen)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register()


@pytest.mark.parametrize("family", FAMILIES)
def test_mxfp8_backend_against_transformers_float32(family, monkeypatch):
    import mxmoe.nn.moe

    fused_calls = []
    fused_op = mxmoe.nn.moe.mx_moe_experts
    monkeypatch.setattr(mxmoe.nn.moe, "mx_moe_experts",
                        lambda *a, **kw: fused_calls.append(a[0].dtype) or fused_op(*a, **kw))
    ref_model = causal_lm(family)
    x, g = decisive_routing_(ref_model)
    # the reference holds the bf16-rounded weights and input: the fused run's own values
    ref_model = ref_model.to(torch.bfloat16).float()
    x = x.bfloat16().float()
    ref = run_block(ref_model, "grouped_mm", x, g)
    measured = {}
    for path, dtype in (("bf16", torch.bfloat16), ("float32", torch.float32)):
        model = copy.deepcopy(ref_model).to(dtype)
        got = run_block(model, "mxfp8", x, g)
        assert torch.equal(got["routes"], ref["routes"]), f"{family} {path}: routing differs from the reference"
        for name in TENSORS:
            measured[(path, name)] = sqnr_db(ref[name], got[name])
    print(family, {k: round(v, 1) for k, v in measured.items()})
    swiglu = family != "gpt_oss"
    assert fused_calls == ([torch.bfloat16] if swiglu else []), "the fused op runs for bf16 SwiGLU experts only"
    floors = SQNR_FLOORS_DB[family]
    low = {k: (round(v, 1), floors[k]) for k, v in measured.items() if k in floors and v < floors[k]}
    assert not low, f"{family}: SQNR (measured, floor) dB below the floor: {low}"
    assert set(floors) == set(measured)


def test_float32_parameters_under_autocast_run_the_fused_op(monkeypatch):
    """float32 parameters under bf16 autocast: the experts take bf16 activations (the fused
    op), return float32, and give the bf16 run's SQNR against the float32 reference."""
    import mxmoe.nn.moe

    fused_calls = []
    fused_op = mxmoe.nn.moe.mx_moe_experts
    monkeypatch.setattr(mxmoe.nn.moe, "mx_moe_experts",
                        lambda *a, **kw: fused_calls.append(a[0].dtype) or fused_op(*a, **kw))
    model = causal_lm("qwen3_moe")
    x, g = decisive_routing_(model)
    ref = run_block(copy.deepcopy(model), "grouped_mm", x, g)
    block = moe_block(model)
    model.set_experts_implementation("mxfp8")
    xx = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(xx.unsqueeze(0)).squeeze(0)
    (out.float() * g).sum().backward()
    assert fused_calls == [torch.bfloat16] and out.dtype == torch.float32
    assert block.experts.gate_up_proj.grad.dtype == torch.float32
    floors = SQNR_FLOORS_DB["qwen3_moe"]
    for name, got in (("out", out), ("dx", xx.grad), ("dw_gate_up", block.experts.gate_up_proj.grad),
                      ("dw_down", block.experts.down_proj.grad)):
        assert sqnr_db(ref[name], got.detach()) >= floors[("bf16", name)] - 1.0, name


@pytest.mark.parametrize("family", FAMILIES)
def test_mxmoe_bf16_backend_equals_transformers_bf16(family):
    model = causal_lm(family)
    x, g = decisive_routing_(model)
    model = model.to(torch.bfloat16)
    ref = run_block(model, "grouped_mm", x, g)
    model.zero_grad()
    got = run_block(model, "mxmoe_bf16", x, g)
    assert torch.equal(got["routes"], ref["routes"])
    for name in ("out", "dx", "dw_gate_up", "dw_down", "dw_router"):
        err = (got[name] - ref[name]).norm() / ref[name].norm()
        print(family, name, float(err))
        assert err <= 2**-7, f"{family} {name}: relative error {float(err):.2e} is more than bf16 rounding (2^-7)"


def test_layouts_pick_the_path():
    fused = {f: experts_layout(moe_block(causal_lm(f)).experts).fused for f in FAMILIES}
    assert fused == {"qwen3_moe": True, "mixtral": True, "deepseek_v3": True, "gpt_oss": False}
