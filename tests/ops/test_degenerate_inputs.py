"""Degenerate inputs of the public ops (a 0-d x, K = 0, a weight on another device such as
the meta device, a non-integer dim) end in a ValueError / TypeError naming the argument
and what would work, never in an internal error or in uninitialized memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mxmoe import MXTensor, dequantize_mx, fake_quantize_mx, mx_grouped_mm, mx_linear, quantize_mx
from mxmoe.numerics import from_blocked_scales, to_blocked_scales
from mxmoe.ops import mx_grouped_mm_dgrad, mx_moe_experts

OFFS = torch.tensor([2, 4], dtype=torch.int32)


def _on_meta(mx: MXTensor) -> MXTensor:
    return dataclasses.replace(mx, qdata=mx.qdata.to("meta"), scale=mx.scale.to("meta"))


CASES = {
    "mx_linear 0-d x": (lambda: mx_linear(torch.tensor(1.0), torch.randn(8, 64)), ValueError,
                        r"x is a 0-d tensor; mx_linear takes x of shape \(\.\.\., K\)"),
    "mx_linear K = 0": (lambda: mx_linear(torch.randn(4, 0), torch.randn(8, 0)), ValueError,
                        r"x has K = 0 features \(shape \(4, 0\)\); mx_linear needs K >= 1"),
    "mx_grouped_mm K = 0": (lambda: mx_grouped_mm(torch.randn(4, 0), torch.randn(2, 8, 0), OFFS), ValueError,
                            r"x has K = 0 \(shape \(4, 0\)\); mx_grouped_mm needs K >= 1"),
    "mx_grouped_mm float offsets": (lambda: mx_grouped_mm(torch.randn(4, 64), torch.randn(2, 8, 64), OFFS.double()),
                                    TypeError, r"offsets must be int32 or int64"),
    "quantize_mx float dim": (lambda: quantize_mx(torch.randn(4, 64), "e4m3", dim=1.0), TypeError,
                              r"dim must be an int \(the dimension to block\), got 1.0 of type float"),
    "quantize_mx bool dim": (lambda: quantize_mx(torch.randn(4, 64), "e4m3", dim=True), TypeError,
                             r"dim must be an int"),
    "quantize_mx dim out of range": (lambda: quantize_mx(torch.randn(4, 64), "e4m3", dim=2), ValueError,
                                     r"dim=2 is out of range for a 2-d tensor; use a dim in \[-2, 1\]"),
    "quantize_mx 0-d": (lambda: quantize_mx(torch.tensor(1.0), "e4m3"), ValueError, r"x is a 0-d tensor"),
    "quantize_mx list": (lambda: quantize_mx([1.0] * 32), TypeError, r"x must be a torch.Tensor, got list"),
    "fake_quantize_mx list": (lambda: fake_quantize_mx([1.0] * 32), TypeError, r"x must be a torch.Tensor, got list"),
    "quantize_mx meta": (lambda: quantize_mx(torch.empty(4, 32, device="meta")), ValueError,
                         r"x is on the meta device"),
    "fake_quantize_mx meta": (lambda: fake_quantize_mx(torch.empty(4, 32, device="meta")), ValueError,
                              r"x is on the meta device"),
    "dequantize_mx meta": (lambda: dequantize_mx(_on_meta(quantize_mx(torch.randn(4, 32)))), ValueError,
                           r"the MXTensor is on the meta device"),
    "MXTensor scale on another device": (lambda: dataclasses.replace(quantize_mx(torch.randn(4, 32)),
                                                                     scale=torch.empty(4, 1, dtype=torch.float8_e8m0fnu,
                                                                                       device="meta")),
                                         ValueError, r"MXTensor qdata and scale must be on one device"),
    "to_blocked_scales list": (lambda: to_blocked_scales([1, 2]), TypeError, r"scale must be a torch.Tensor"),
    "from_blocked_scales list": (lambda: from_blocked_scales([1, 2], 1, 1), TypeError,
                                 r"blocked must be a torch.Tensor"),
    "mx_moe_experts F = 0": (lambda: mx_moe_experts(torch.randn(4, 32, dtype=torch.bfloat16),
                                                    torch.arange(4).repeat_interleave(2),
                                                    torch.tensor([4, 8], dtype=torch.int32), torch.randn(2, 0, 32),
                                                    torch.randn(2, 32, 0), "mxfp8"),
                             ValueError, r"w13 \(E, 2F, D\) = \(2, 0, 32\) has an empty dimension"),
    "fake_quantize_mx float dim": (lambda: fake_quantize_mx(torch.randn(4, 64), "e4m3", dim=0.5), TypeError,
                                   r"dim must be an int"),
}


@pytest.mark.parametrize("case", CASES)
def test_degenerate_inputs_are_refused_by_name(case):
    call, error, message = CASES[case]
    with pytest.raises(error, match=message):
        call()


def _moe_experts_args():
    T, D, F, E, k = 4, 32, 32, 2, 2
    src = torch.arange(T).repeat_interleave(k)
    return dict(x_TD=torch.randn(T, D, dtype=torch.bfloat16), src_A=src,
                offsets_E=torch.tensor([4, 8], dtype=torch.int32), w13_E2FD=torch.randn(E, 2 * F, D),
                w2_EDF=torch.randn(E, D, F), recipe="mxfp8")


# every public op with valid arguments; each tensor argument is replaced in turn below
OPS = {
    "mx_linear": (mx_linear, lambda: dict(x=torch.randn(4, 64), w=torch.randn(8, 64))),
    "mx_grouped_mm": (mx_grouped_mm, lambda: dict(x=torch.randn(4, 64), w=torch.randn(2, 8, 64), offsets=OFFS)),
    "mx_grouped_mm_dgrad": (mx_grouped_mm_dgrad, lambda: dict(dy=torch.randn(4, 8), w=torch.randn(2, 8, 64),
                                                              offsets=OFFS)),
    "mx_moe_experts": (mx_moe_experts, _moe_experts_args),
}
TENSOR_ARGS = [(op, name) for op, (_, make) in OPS.items() for name, v in make().items() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("op", OPS)
def test_every_op_runs_with_its_valid_arguments(op):
    fn, make = OPS[op]
    assert torch.isfinite(fn(**make()).float()).all()


@pytest.mark.parametrize("op,name", TENSOR_ARGS)
def test_an_argument_that_is_a_list_is_refused_by_name(op, name):
    fn, make = OPS[op]
    args = make()
    args[name] = args[name].tolist()
    with pytest.raises(TypeError, match=rf"^{op}: {name} must be a torch.Tensor, got list; build it with "
                                        rf"torch.as_tensor"):
        fn(**args)


@pytest.mark.parametrize("op,name", TENSOR_ARGS)
@pytest.mark.parametrize("all_meta", [False, True], ids=["one on meta", "all on meta"])
def test_an_argument_on_the_meta_device_is_refused_by_name(op, name, all_meta):
    """A meta tensor has no data: the op must not compute on it (or return uninitialized
    memory), whether the other arguments are real or on the meta device too."""
    fn, make = OPS[op]
    args = make()
    for key, value in args.items():
        if isinstance(value, torch.Tensor) and (all_meta or key == name):
            args[key] = value.to("meta")
    first = name if not all_meta else next(k for k, v in args.items() if isinstance(v, torch.Tensor))
    with pytest.raises(ValueError, match=rf"^{op}: {first} is on the meta device \(a shape without data\)"):
        fn(**args)


@pytest.mark.parametrize("bad", [-1, 4, 1000])
def test_mx_moe_experts_refuses_token_indices_outside_the_tokens(bad):
    args = _moe_experts_args()
    args["src_A"] = args["src_A"].clone()
    args["src_A"][3] = bad
    with pytest.raises(ValueError, match=rf"src_A holds token index {bad}; token indices are 0 \.\. T - 1 = 3"):
        mx_moe_experts(**args)
