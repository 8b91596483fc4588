"""Torch versions of the QuACK GEMMs of mxmoe.kernels.quack_moe, with the semantics that
module documents (float32 accumulation, one bf16 rounding per output, h interleaved
[g0, u0, ...], the dgated epilogue's router-score scale and reduction): the reference of
tests/ops/test_moe_experts_gathered.py (CPU, in place of the kernels) and of
tests/gpu/test_gathered_experts_cuda.py (against the kernels)."""

from __future__ import annotations

import torch


def _inter(t):  # [gate | up] columns -> interleaved [g0, u0, ...]
    F = t.shape[1] // 2
    return torch.stack([t[:, :F], t[:, F:]], dim=2).reshape(t.shape)


def _concat(t):  # interleaved -> [gate | up]
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def _rows(cu, e):
    return slice(int(cu[e]), int(cu[e + 1]))


def ref_gated_up_projection(x_TD, src_A, cu_E1, w13_E2FD):
    h = torch.zeros(src_A.numel(), w13_E2FD.shape[1], device=x_TD.device)
    for e in range(w13_E2FD.shape[0]):
        r = _rows(cu_E1, e)
        h[r] = x_TD[src_A[r].long()].float() @ w13_E2FD[e].float().T
    h = _inter(h)
    g, u = h[:, 0::2], h[:, 1::2]
    return h.to(x_TD.dtype), (g * torch.sigmoid(g) * u).to(x_TD.dtype)


def ref_down_projection(act_AF, w2_EDF, cu_E1):
    y = torch.zeros(act_AF.shape[0], w2_EDF.shape[1], device=act_AF.device)
    for e in range(w2_EDF.shape[0]):
        r = _rows(cu_E1, e)
        y[r] = act_AF[r].float() @ w2_EDF[e].float().T
    return y.to(act_AF.dtype)


def ref_down_projection_dgated(dy_TD, src_A, cu_E1, w2_EDF, h_A2F, scores_A):
    g = torch.zeros(h_A2F.shape[0], w2_EDF.shape[2], device=h_A2F.device)
    for e in range(w2_EDF.shape[0]):
        r = _rows(cu_E1, e)
        g[r] = dy_TD[src_A[r].long()].float() @ w2_EDF[e].float()
    gate, up = h_A2F[:, 0::2].float(), h_A2F[:, 1::2].float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    sg = g * scores_A[:, None]
    dgate, dup = sg * up * sig * (1 + gate * (1 - sig)), sg * silu
    dh = torch.stack([dgate, dup], dim=2).reshape(h_A2F.shape).to(h_A2F.dtype)
    return dh, (silu * up * scores_A[:, None]).to(h_A2F.dtype), (silu * up * g).sum(1)


def ref_up_projection_dgrad(dh_A2F, w13_E2FD, cu_E1):
    dx = torch.zeros(dh_A2F.shape[0], w13_E2FD.shape[2], device=dh_A2F.device)
    dhc = _concat(dh_A2F).float()
    for e in range(w13_E2FD.shape[0]):
        r = _rows(cu_E1, e)
        dx[r] = dhc[r] @ w13_E2FD[e].float()
    return dx.to(dh_A2F.dtype)


def ref_gathered_weight_grad(a_TC, src_A, cu_E1, b_AN, out_ECN, interleaved_b):
    b = _concat(b_AN) if interleaved_b else b_AN
    for e in range(out_ECN.shape[0]):
        r = _rows(cu_E1, e)
        out_ECN[e].copy_(a_TC[src_A[r].long()].float().T @ b[r].float())
    return out_ECN


REF_ENGINE = {"gated_up_projection": ref_gated_up_projection, "down_projection": ref_down_projection,
              "down_projection_dgated": ref_down_projection_dgated, "up_projection_dgrad": ref_up_projection_dgrad,
              "gathered_weight_grad": ref_gathered_weight_grad}
