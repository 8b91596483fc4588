"""MXLinear: the nn.Linear face of mx_linear (same parameters and init as nn.Linear, same
bits as the functional op, forward and backward)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mxmoe import MXLinear, mx_linear
from mxmoe.recipe import get_recipe


def _reference(x, w, b, recipe):
    """mx_linear, then the bias added in float32 and rounded once to x's dtype."""
    y = mx_linear(x, w, recipe)
    return y if b is None else (y.float() + b.float()).to(x.dtype)


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxlinear_equals_mx_linear_forward_and_backward(recipe, bias, dtype):
    torch.manual_seed(0)
    lin = MXLinear(64, 96, bias=bias, recipe=recipe)
    with torch.no_grad():
        if bias:
            lin.bias.normal_()  # nn.Linear's init gives small biases: make them matter
    x = torch.randn(3, 5, 64, dtype=dtype)  # 3-D input: leading dimensions kept
    g = torch.randn(3, 5, 96, dtype=dtype)
    w_ref = lin.weight.detach().clone().requires_grad_()
    b_ref = lin.bias.detach().clone().requires_grad_() if bias else None
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = lin(x1)
    y_ref = _reference(x2, w_ref, b_ref, recipe)
    assert y.shape == (3, 5, 96) and y.dtype == dtype
    assert torch.equal(y, y_ref)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(lin.weight.grad, w_ref.grad) and lin.weight.grad.dtype == torch.float32
    if bias:
        assert torch.equal(lin.bias.grad, b_ref.grad)


def test_mxfp8_is_not_the_high_precision_linear():
    """The recipe reaches the GEMM: MXFP8 differs from nn.Linear, bf16 is F.linear in bf16."""
    torch.manual_seed(1)
    lin = MXLinear(64, 64)
    ref = nn.Linear(64, 64, bias=False)
    ref.weight = lin.weight
    x = torch.randn(8, 64)
    assert not torch.equal(lin(x), ref(x))
    assert ((lin(x) - ref(x)).norm() / ref(x).norm()).item() < 0.1  # MXFP8 rounding only
    lin.recipe = "bf16"  # the setter takes a name
    assert lin.recipe is get_recipe("bf16")
    assert torch.equal(lin(x), torch.nn.functional.linear(x.bfloat16(), lin.weight.bfloat16()).float())


def test_same_parameters_and_init_as_nn_linear():
    torch.manual_seed(3)
    ref = nn.Linear(64, 96, bias=True)
    torch.manual_seed(3)
    lin = MXLinear(64, 96, bias=True)
    assert list(lin.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    assert torch.equal(lin.weight, ref.weight) and torch.equal(lin.bias, ref.bias)
    assert isinstance(lin, nn.Linear) and lin.bias is not None
    assert MXLinear(64, 96).bias is None  # bias=False by default
    half = MXLinear(32, 32, dtype=torch.bfloat16)
    assert half.weight.dtype == torch.bfloat16
    assert repr(lin) == "MXLinear(in_features=64, out_features=96, bias=True, recipe=mxfp8)"
    assert "recipe=mxfp8-floor" in repr(MXLinear(32, 32, recipe="mxfp8-floor"))


def test_from_float_shares_the_parameters():
    torch.manual_seed(4)
    ref = nn.Linear(64, 32)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)  # built before the conversion
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    ref.eval()
    lin = MXLinear.from_float(ref, recipe="mxfp8")
    assert lin.weight is ref.weight and lin.bias is ref.bias
    assert not lin.training and lin.recipe is get_recipe("mxfp8")
    assert list(lin.state_dict()) == list(sd) and all(torch.equal(lin.state_dict()[k], v) for k, v in sd.items())
    lin(torch.randn(4, 64)).sum().backward()
    opt.step()  # the optimizer updates the parameters the MXLinear reads
    assert not torch.equal(lin.weight, sd["weight"]) and lin.weight is ref.weight
    no_bias = MXLinear.from_float(nn.Linear(32, 32, bias=False))
    assert no_bias.bias is None and list(no_bias.state_dict()) == ["weight"]


def test_leading_dimensions_and_single_vectors():
    torch.manual_seed(5)
    lin = MXLinear(40, 32, bias=True)  # K = 40: tail block zero padded by mx_linear
    x = torch.randn(2, 3, 4, 40)
    y = lin(x)
    assert y.shape == (2, 3, 4, 32)
    assert torch.equal(y, lin(x.reshape(-1, 40)).reshape(2, 3, 4, 32))
    assert lin(torch.randn(40)).shape == (32,)
    assert lin(torch.randn(0, 40)).shape == (0, 32)


def test_clear_errors():
    lin = MXLinear(64, 32)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16 activations, got torch.int64"):
        lin(torch.ones(2, 64, dtype=torch.long))
    with pytest.raises(TypeError, match="got torch.float64"):
        lin(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"input of shape \(\.\.\., 64\), got \(2, 63\)"):
        lin(torch.randn(2, 63))
    with pytest.raises(ValueError, match=r"got \(\)"):
        lin(torch.tensor(1.0))
    with pytest.raises(ValueError, match="unknown recipe 'fp8'"):
        MXLinear(64, 32, recipe="fp8")
    with pytest.raises(ValueError, match="unknown recipe"):
        lin.set_recipe("mxfp4")
    assert lin.recipe.name == "mxfp8"  # a refused recipe leaves the old one
    with pytest.raises(TypeError, match="takes an nn.Linear, got Conv1d"):
        MXLinear.from_float(nn.Conv1d(4, 4, 1))
