"""The bf16 experts on QuACK's gathered grouped GEMMs (mxmoe.ops.moe_experts_gathered).

No GPU here: the QuACK GEMMs of mxmoe.kernels.quack_moe are replaced by torch functions
with the semantics the module documents (float32 accumulation, one bf16 rounding per
output, interleaved h), so the op's autograd wiring, routing indices, saved tensors and
router-score gradient are checked against a float64 autograd reference of the layer's
math. Where QuACK is installed, a second test runs the real wrappers against QuACK's own
torch references (``gemm_ref``, ``gemm_gated_ref``, ``gemm_dgated_ref``) to check the
argument conventions (B transposes, gather index, ``concat_layout``); the kernels
themselves run in tests/gpu/test_gathered_experts_cuda.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mxmoe.kernels import quack_moe
from mxmoe.nn import MoE
from mxmoe.ops import backend
from mxmoe.ops.moe_experts_gathered import gathered_moe_experts
from mxmoe.recipe import get_recipe

from gathered_reference import (REF_ENGINE, ref_down_projection, ref_down_projection_dgated,
                                ref_gated_up_projection, ref_gathered_weight_grad, ref_up_projection_dgrad)

BF16 = get_recipe("bf16")


@pytest.fixture
def torch_engine(monkeypatch):
    for name, fn in REF_ENGINE.items():
        monkeypatch.setattr(quack_moe, name, fn)
    monkeypatch.setattr(quack_moe, "supports", lambda x, d, f: True)


def routing(T, k, E, g, empty=()):
    """(experts (T, k), scores (T, k) float32, order, offsets) with the experts in ``empty``
    receiving no token."""
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    experts = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(T)])
    scores = torch.rand(T, k, generator=g).softmax(-1)
    order = torch.argsort(experts.reshape(-1), stable=True)
    offsets = torch.cumsum(torch.bincount(experts.reshape(-1), minlength=E), 0).to(torch.int32)
    return experts, scores, order, offsets


def layer_float64(x, scores, w13, w2, experts):
    """out[t] = sum_j s[t, j] * w2_e (silu(g) * u), [g; u] = w13_e x[t], in float64."""
    F = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            h = w13[e] @ x[t]
            out[t] = out[t] + scores[t, j] * (w2[e] @ (torch.nn.functional.silu(h[:F]) * h[F:]))
    return out


def rel(got, want):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@pytest.mark.parametrize("T, k, E, D, F, empty, wdtype", [
    (13, 2, 4, 32, 16, ((),), torch.bfloat16),
    (9, 1, 3, 16, 8, ((1,),), torch.bfloat16),
    (7, 3, 5, 24, 32, ((0, 4),), torch.float32),
])
def test_gathered_experts_match_float64_layer(torch_engine, T, k, E, D, F, empty, wdtype):
    """Output and the gradients of x, the router scores, w13 and w2 (float32 parameters get
    float32 gradients) within bf16 rounding of a float64 autograd reference, empty experts
    included (their weight gradients exactly zero)."""
    g = torch.Generator().manual_seed(T * 100 + k)
    experts, scores, order, offsets = routing(T, k, E, g, empty[0])
    x = torch.randn(T, D, generator=g).bfloat16().requires_grad_()
    w13 = (torch.randn(E, 2 * F, D, generator=g) / D ** 0.5).to(wdtype).requires_grad_()
    w2 = (torch.randn(E, D, F, generator=g) / F ** 0.5).to(wdtype).requires_grad_()
    s = scores.clone().requires_grad_()
    out = gathered_moe_experts(x, s, w13, w2, order, offsets, BF16)
    dy = torch.randn(T, D, generator=g).bfloat16()
    out.backward(dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, s, w13, w2)]
    want = layer_float64(*leaves, experts)
    want.backward(dy.double())
    assert out.dtype == torch.bfloat16 and out.shape == (T, D)
    assert rel(out, want) < 1e-2
    dtypes = (torch.bfloat16, torch.float32, wdtype, wdtype)
    for got, ref, dtype, name in zip((x.grad, s.grad, w13.grad, w2.grad), leaves, dtypes, ("x", "scores", "w13", "w2")):
        assert got.dtype == dtype, name
        assert rel(got, ref.grad) < 2e-2, name
    for e in empty[0]:
        assert not w13.grad[e].any() and not w2.grad[e].any()


def test_moe_layer_takes_the_gathered_path_only_when_asked(torch_engine, monkeypatch):
    """MoE under the bf16 recipe: MXMOE_EXPERT_ENGINE=quack on a device where the GEMMs
    apply runs the gathered op (``last_expert_path``), within bf16 rounding of the composed
    path; unset, the composed path as before; an MX recipe never takes it."""
    torch.manual_seed(0)
    moe = MoE(d_model=32, n_experts=4, top_k=2, d_expert=16, recipe="bf16").bfloat16()
    x = torch.randn(2, 5, 32).bfloat16()
    monkeypatch.setattr(quack_moe, "available", lambda: True)
    monkeypatch.setattr(quack_moe, "on_sm90", lambda x: True)
    monkeypatch.delenv("MXMOE_EXPERT_ENGINE", raising=False)
    want, _ = moe(x)
    assert moe.last_expert_path == "composed"
    monkeypatch.setenv("MXMOE_EXPERT_ENGINE", "quack")
    got, _ = moe(x)
    assert moe.last_expert_path == "gathered" and moe.last_ran_fused is False
    assert rel(got, want) < 1e-2
    moe(x.float())  # float32 activations: not this path
    assert moe.last_expert_path == "composed"
    moe.set_recipe("mxfp8")
    moe(x)
    assert moe.last_expert_path != "gathered"


def test_expert_engine_setting_is_checked(monkeypatch):
    """A value outside ("default", "quack") (case and spaces aside) is a ValueError quoting
    it; "quack" without QuACK is a ValueError naming the extra only where the path would
    apply (an sm90 GPU); elsewhere, and for MX recipes, the setting is ignored."""
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    monkeypatch.setenv("MXMOE_EXPERT_ENGINE", "sonic")
    with pytest.raises(ValueError, match="MXMOE_EXPERT_ENGINE='sonic'"):
        backend.expert_engine()
    for value in ("QUACK", " quack "):
        monkeypatch.setenv("MXMOE_EXPERT_ENGINE", value)
        assert backend.expert_engine() == "quack"
    monkeypatch.setattr(quack_moe, "available", lambda: False)
    assert not backend.use_gathered_experts(x, BF16, 8, 8)  # the CPU: ignored
    monkeypatch.setattr(quack_moe, "on_sm90", lambda t: True)
    assert not backend.use_gathered_experts(x, get_recipe("mxfp8"), 8, 8)
    with pytest.raises(ValueError, match=r"mxmoe\[hopper\]"):
        backend.use_gathered_experts(x, BF16, 8, 8)
    monkeypatch.setenv("MXMOE_EXPERT_ENGINE", "")
    assert backend.expert_engine() == "default"
    assert not backend.use_gathered_experts(x, BF16, 8, 8)


def test_gathered_experts_refuse_what_they_cannot_run():
    """Off an sm90 GPU with QuACK the op says what it needs; a quantizing recipe, float32
    x, mismatched shapes and index dtypes are refused naming the argument."""
    g = torch.Generator().manual_seed(1)
    _, scores, order, offsets = routing(6, 2, 3, g)
    x, w13, w2 = torch.zeros(6, 16).bfloat16(), torch.zeros(3, 16, 16).bfloat16(), torch.zeros(3, 16, 8).bfloat16()
    with pytest.raises(ValueError, match="sm90 GPU"):
        gathered_moe_experts(x, scores, w13, w2, order, offsets, BF16)
    with pytest.raises(ValueError, match="bf16 recipe"):
        gathered_moe_experts(x, scores, w13, w2, order, offsets, get_recipe("mxfp8"))
    with pytest.raises(ValueError, match="bfloat16 activations"):
        gathered_moe_experts(x.float(), scores, w13, w2, order, offsets, BF16)
    with pytest.raises(ValueError, match="w2 must be"):
        gathered_moe_experts(x, scores, w13, w2[:, :, :4], order, offsets, BF16)
    with pytest.raises(ValueError, match="scores must be"):
        gathered_moe_experts(x, scores[:5], w13, w2, order, offsets, BF16)
    with pytest.raises(TypeError, match="int64"):
        gathered_moe_experts(x, scores, w13, w2, order.int(), offsets, BF16)
    with pytest.raises(TypeError, match="not a|tensor"):
        gathered_moe_experts(x, scores.tolist(), w13, w2, order, offsets, BF16)


def test_cu_seqlens_prepends_zero():
    cu = quack_moe.cu_seqlens(torch.tensor([0, 3, 3, 7], dtype=torch.int32))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 0, 3, 3, 7]


def test_weighted_sum_token_rows_triton_equals_torch():
    """The combine's weighted gather-sum: the Triton kernel in the interpreter bit for bit
    the torch path (float32, choice order, one rounding); on a GPU the compiler may fuse
    the multiply and add (the fused MXFP8 combine rounds each product first, which it
    cannot)."""
    from mxmoe.kernels.moe_experts import triton_sum_token_rows
    from mxmoe.ops.moe_experts_gathered import weighted_sum_token_rows

    g = torch.Generator().manual_seed(3)
    T, k, D = 11, 3, 96
    y = torch.randn(T * k, D, generator=g).bfloat16()
    rows = torch.randperm(T * k, generator=g)
    w = torch.rand(T, k, generator=g)
    want = weighted_sum_token_rows(y, rows, w)
    got = triton_sum_token_rows(y, rows, k, torch.bfloat16, w)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="float32"):
        triton_sum_token_rows(y, rows, k, torch.bfloat16, w.bfloat16())


# ---- QuACK's own references (only where quack-kernels is installed) -------------------------

def _interleave_noncontiguous(t):
    """QuACK's concat_layout rule for a tensor: its non-contiguous dim, [first; second]
    halves, is read as interleaved (layout_utils.concat_to_interleave)."""
    dim = -2 if t.stride(-1) == 1 else -1
    return t.unflatten(dim, (2, t.shape[dim] // 2)).transpose(dim - 1, dim).flatten(dim - 1, dim)


@pytest.fixture
def quack_refs(monkeypatch):
    if importlib.util.find_spec("quack") is None:
        pytest.skip("quack-kernels not installed (pip install 'mxmoe[hopper]')")
    gi = pytest.importorskip("quack.gemm_interface")

    def gemm(A, B, out=None, cu_seqlens_m=None, cu_seqlens_k=None, A_idx=None, dynamic_scheduler=False,
             concat_layout=None):
        assert A_idx is None or A_idx.dtype == torch.int32
        idx = A_idx.long() if A_idx is not None else None
        B = _interleave_noncontiguous(B) if concat_layout and "B" in concat_layout else B
        r = gi.gemm_ref(A.float(), B.float(), cu_seqlens_m=cu_seqlens_m, cu_seqlens_k=cu_seqlens_k, A_idx=idx)
        if concat_layout and "out" in concat_layout:  # r's interleaved columns into out's [first; second] halves
            dim = out.dim() - 2 if out.stride(-1) == 1 else out.dim() - 1
            half = out.shape[dim] // 2
            out.unflatten(dim, (2, half)).copy_(r.unflatten(dim, (half, 2)).transpose(dim, dim + 1))
        else:
            out.copy_(r)
        return out

    def gemm_gated(A, B, activation, preact_out, postact_out, cu_seqlens_m, A_idx, concat_layout=None):
        assert A_idx.dtype == torch.int32 and cu_seqlens_m.dtype == torch.int32  # QuACK's index types
        B = _interleave_noncontiguous(B) if concat_layout and "B" in concat_layout else B
        pre, post = gi.gemm_gated_ref(A.float(), B.float(), activation=activation,
                                      cu_seqlens_m=cu_seqlens_m, A_idx=A_idx.long())
        preact_out.copy_(pre)
        postact_out.copy_(post)
        return preact_out, postact_out

    def gemm_dgated(A, B, PreAct, activation, dx_out, postact_out, colvec_scale, colvec_reduce, cu_seqlens_m,
                    A_idx, dynamic_scheduler):
        # the epilogue (gemm_dact.py): D scaled by colvec before dgated; postact scaled after;
        # the reduction of postact * D taken before the scaling
        g = gi.gemm_ref(A.float(), B.float(), cu_seqlens_m=cu_seqlens_m, A_idx=A_idx.long())
        one = dict(B=torch.eye(g.shape[1])[None], cu_seqlens_m=torch.tensor([0, g.shape[0]], dtype=torch.int32),
                   activation=activation)  # identity GEMM: the epilogue alone (varlen: CPU-capable ref)
        dx, _ = gi.gemm_dgated_ref(g * colvec_scale[:, None], PreAct=PreAct.float(), **one)
        _, post_raw = gi.gemm_dgated_ref(g, PreAct=PreAct.float(), **one)
        dx_out.copy_(dx)
        postact_out.copy_(post_raw * colvec_scale[:, None])
        return dx_out, postact_out, (post_raw * g).sum(1)

    monkeypatch.setattr(gi, "gemm", gemm)
    monkeypatch.setattr(gi, "gemm_gated", gemm_gated)
    monkeypatch.setattr(gi, "gemm_dgated", gemm_dgated)


def test_quack_wrappers_follow_quack_conventions(quack_refs):
    """mxmoe's wrappers (B transposes, gather index, concat_layout of w13 and dw13) through
    QuACK's torch references give the results of the documented semantics."""
    g = torch.Generator().manual_seed(5)
    T, k, E, D, F = 10, 2, 3, 16, 8
    _, scores, order, offsets = routing(T, k, E, g, (1,))
    cu = quack_moe.cu_seqlens(offsets)
    src = torch.div(order, k, rounding_mode="floor").to(torch.int32)
    A = src.numel()
    x = torch.randn(T, D, generator=g).bfloat16()
    dy = torch.randn(T, D, generator=g).bfloat16()
    w13 = torch.randn(E, 2 * F, D, generator=g).bfloat16()
    w2 = torch.randn(E, D, F, generator=g).bfloat16()
    s_A = torch.rand(A, generator=g)

    def close(a, b):
        return all(rel(u, v) < 1e-2 for u, v in zip(a, b))

    assert close(quack_moe.gated_up_projection(x, src, cu, w13), ref_gated_up_projection(x, src, cu, w13))
    h, act = ref_gated_up_projection(x, src, cu, w13)
    assert rel(quack_moe.down_projection(act, w2, cu), ref_down_projection(act, w2, cu)) < 1e-2
    assert close(quack_moe.down_projection_dgated(dy, src, cu, w2, h, s_A),
                 ref_down_projection_dgated(dy, src, cu, w2, h, s_A))
    dh = torch.randn(A, 2 * F, generator=g).bfloat16()
    assert rel(quack_moe.up_projection_dgrad(dh, w13, cu), ref_up_projection_dgrad(dh, w13, cu)) < 1e-2
    got, want = torch.empty_like(w13), torch.empty_like(w13)
    quack_moe.gathered_weight_grad(x, src, cu, dh, got.permute(0, 2, 1), interleaved_b=True)
    ref_gathered_weight_grad(x, src, cu, dh, want.permute(0, 2, 1), interleaved_b=True)
    assert rel(got, want) < 1e-2 and not got[1].any()
    got, want = torch.empty_like(w2), torch.empty_like(w2)
    quack_moe.gathered_weight_grad(dy, src, cu, act, got, interleaved_b=False)
    ref_gathered_weight_grad(dy, src, cu, act, want, interleaved_b=False)
    assert rel(got, want) < 1e-2 and not got[1].any()
