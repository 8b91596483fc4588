"""A weight of a dtype the MX quantizers do not read (float64, an integer) is refused by
every op and module that quantizes it, with a TypeError naming that weight (not the
activation ``x``) and what would work; the bf16 recipe, which casts, takes float64."""

from __future__ import annotations

import pytest
import torch

from mxmoe import GroupedExperts, MoE, MXLinear
from mxmoe.ops.grouped_mm import mx_grouped_mm, mx_grouped_mm_dgrad
from mxmoe.ops.linear import mx_linear
from mxmoe.ops.moe_experts import mx_moe_experts

D, F, E, T, k = 64, 32, 2, 4, 2


def offsets():
    return torch.tensor([T * k // 2, T * k], dtype=torch.int32)


# each op or module, with one weight given dtype ``dt``: (call, the name the message gives)
CASES = {
    "mx_linear w": (lambda dt, r: mx_linear(torch.randn(T, D), torch.randn(F, D).to(dt), r), "mx_linear: the weight w "),
    "mx_grouped_mm w": (lambda dt, r: mx_grouped_mm(torch.randn(T * k, D), torch.randn(E, F, D).to(dt), offsets(), r),
                        "mx_grouped_mm: the weight w "),
    "mx_grouped_mm_dgrad w": (lambda dt, r: mx_grouped_mm_dgrad(torch.randn(T * k, F), torch.randn(E, F, D).to(dt),
                                                                offsets(), r), "mx_grouped_mm_dgrad: the weight w "),
    "mx_moe_experts w13": (lambda dt, r: mx_moe_experts(torch.randn(T, D).bfloat16(), torch.arange(T).repeat_interleave(k),
                                                        offsets(), torch.randn(E, 2 * F, D).to(dt), torch.randn(E, D, F),
                                                        r), "mx_moe_experts: the weight w13 "),
    "mx_moe_experts w2": (lambda dt, r: mx_moe_experts(torch.randn(T, D).bfloat16(), torch.arange(T).repeat_interleave(k),
                                                       offsets(), torch.randn(E, 2 * F, D), torch.randn(E, D, F).to(dt),
                                                       r), "mx_moe_experts: the weight w2 "),
    "GroupedExperts": (lambda dt, r: GroupedExperts(E, D, F, recipe=r).to(dt)(
        torch.randn(T, D), torch.randint(0, E, (T, k)), torch.rand(T, k)), "GroupedExperts: the weight GroupedExperts.w13 "),
    "MoE": (lambda dt, r: MoE(D, E, k, F, recipe=r).to(dt)(torch.randn(T, D)), "MoE: the weight experts.w13 "),
    "MXLinear": (lambda dt, r: MXLinear(D, F, recipe=r).to(dt)(torch.randn(T, D)), "mx_linear: the weight w "),
}


@pytest.mark.parametrize("case", CASES)
def test_a_float64_weight_is_refused_by_name_under_mxfp8(case):
    call, name = CASES[case]
    with pytest.raises(TypeError, match=rf"^{name}has dtype torch.float64; recipe 'mxfp8' quantizes it and takes "
                                        r"float32, bfloat16 or float16 weights: cast it"):
        call(torch.float64, "mxfp8")


@pytest.mark.parametrize("case", [c for c in CASES if "moe_experts" not in c])  # the fused op is MXFP8-only
def test_bf16_takes_a_float64_weight(case):
    call, _ = CASES[case]
    out = call(torch.float64, "bf16")
    assert torch.isfinite((out[0] if isinstance(out, tuple) else out).float()).all()


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("mx_")])
def test_an_integer_weight_is_refused_by_name(case):
    call, name = CASES[case]
    with pytest.raises(TypeError, match=rf"^{name}must be a floating-point tensor, got torch.int32"):
        call(torch.int32, "mxfp8")
