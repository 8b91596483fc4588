"""MoE as a public module: defaults for models other than mxmoe's, the recipe switch, the
earlier name MoELayer, clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from mxmoe import GroupedExperts, MoE, MXLinear
from mxmoe.nn import MoELayer
from mxmoe.recipe import get_recipe


def test_moelayer_is_moe_and_keeps_its_call_forms():
    assert MoELayer is MoE
    torch.manual_seed(0)
    a = MoELayer(d_model=64, n_experts=4, top_k=2, d_expert=64, n_layers=3, recipe=get_recipe("mxfp8"))
    torch.manual_seed(0)
    b = MoE(64, 4, 2, 64, 3, "mxfp8")  # positional, recipe by name
    assert list(a.state_dict()) == ["router.weight", "experts.w13", "experts.w2"]
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.recipe is b.recipe is get_recipe("mxfp8")


def test_defaults():
    """n_layers defaults to 1 (it only scales w2's init); recipe to mxfp8."""
    torch.manual_seed(1)
    m = MoE(d_model=256, n_experts=8, top_k=2, d_expert=128)
    assert m.recipe.name == "mxfp8" and m.fused and m.shared is None and not m.mx_dispatch
    assert m.experts.w2.std().item() == pytest.approx(0.02 / math.sqrt(2), rel=0.05)
    torch.manual_seed(1)
    deep = MoE(256, 8, 2, 128, n_layers=8)
    assert deep.experts.w2.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.equal(m.experts.w13, deep.experts.w13)  # only w2 depends on n_layers
    assert "recipe=mxfp8" in repr(m) and "top_k=2" in repr(m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_set_recipe_equals_building_with_that_recipe(dtype):
    torch.manual_seed(2)
    switched = MoE(64, 4, 2, 64, recipe="bf16", shared_expert_hidden=32)
    assert not switched.fused
    built = MoE(64, 4, 2, 64, recipe="mxfp8", shared_expert_hidden=32)
    built.load_state_dict(switched.state_dict())
    assert switched.set_recipe("mxfp8") is switched
    assert switched.recipe is get_recipe("mxfp8") and switched.fused
    x = torch.randn(40, 64, dtype=dtype)
    res = []
    for m in (switched, built):
        xx = x.clone().requires_grad_()
        y, aux = m(xx)
        (y.float().square().sum() + aux.aux_loss).backward()
        res.append([y, xx.grad] + [p.grad for p in m.parameters()])
    assert all(torch.equal(u, v) for u, v in zip(*res))
    assert switched.last_ran_fused is (dtype == torch.bfloat16)
    switched.recipe = "bf16"  # the property setter
    y_bf16, _ = switched(x)
    assert not torch.equal(y_bf16, res[0][0]) and not switched.fused


def test_fused_follows_the_constructor_choice_and_the_recipe():
    m = MoE(64, 4, 2, 64, fused=False)
    assert not m.fused
    m.fused = True
    assert m.fused
    m.set_recipe("mxfp8-bf16-wgrad")  # the fused op has no high-precision wgrad
    assert not m.fused
    assert not MoE(64, 4, 2, 48).fused  # F = 48


def test_clear_errors():
    with pytest.raises(ValueError, match="unknown recipe 'fp8'"):
        MoE(64, 4, 2, 64, recipe="fp8")
    with pytest.raises(ValueError, match=r"n_layers must be an integer in \[1, .*got 0"):
        MoE(64, 4, 2, 64, n_layers=0)
    with pytest.raises(ValueError, match="top_k must be an integer in"):
        MoE(64, 4, 5, 64)
    with pytest.raises(ValueError, match="mx_dispatch needs a quantizing"):
        MoE(64, 4, 2, 64, recipe="bf16", mx_dispatch=True)
    m = MoE(64, 4, 2, 64, mx_dispatch=True)
    with pytest.raises(ValueError, match="mx_dispatch needs a quantizing"):
        m.set_recipe("bf16")
    assert m.recipe.name == "mxfp8"  # refused: unchanged
    with pytest.raises(ValueError, match=r"shape \(\.\.\., D=64\), got \(3, 32\)"):
        m(torch.randn(3, 32))
    with pytest.raises(TypeError, match="got torch.int64"):
        m(torch.ones(3, 64, dtype=torch.long))


# every size argument of the public modules, with the values a caller can get wrong: each
# is refused before any memory is allocated (2**40 experts would otherwise ask the
# allocator for petabytes), naming the argument and the range
MODULES = {
    "MXLinear": (lambda **kw: MXLinear(**{"in_features": 32, "out_features": 32, **kw}),
                 ["in_features", "out_features"]),
    "MoE": (lambda **kw: MoE(**{"d_model": 32, "n_experts": 4, "top_k": 2, "d_expert": 32, **kw}),
            ["d_model", "n_experts", "d_expert", "n_layers", "shared_expert_hidden"]),
    "GroupedExperts": (lambda **kw: GroupedExperts(**{"n_experts": 4, "d_model": 32, "d_expert": 32, **kw}),
                       ["n_experts", "d_model", "d_expert", "n_layers"]),
}
SIZE_CASES = [(m, a) for m, (_, args) in MODULES.items() for a in args]


@pytest.mark.parametrize("value", [-1, 0, 2**31, 2**40, 1.5, True, "8", None])
@pytest.mark.parametrize("module,arg", SIZE_CASES)
def test_every_size_argument_is_checked_before_allocating(module, arg, value):
    if arg == "shared_expert_hidden" and value == 0:
        pytest.skip("0 means no shared expert")
    with pytest.raises(ValueError, match=rf"^{arg} must be an integer in \[[01], 2,147,483,647\] .*got {value!r}"):
        MODULES[module][0](**{arg: value})


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8, "float32", torch.float64])
@pytest.mark.parametrize("module", ["MXLinear", "GroupedExperts"])
def test_a_parameter_dtype_that_cannot_train_under_the_recipe_is_refused(module, dtype):
    """Integer dtypes cannot take gradients; float64 cannot be quantized by the MX recipes
    (it can under bf16, which casts)."""
    with pytest.raises(TypeError, match=rf"^{module}: (dtype must be a floating-point torch.dtype|recipe 'mxfp8' "
                                        rf"quantizes the weights)"):
        MODULES[module][0](dtype=dtype)
    if dtype == torch.float64:
        assert MODULES[module][0](dtype=dtype, recipe="bf16").recipe.name == "bf16"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("module", ["MXLinear", "GroupedExperts"])
def test_the_mx_parameter_dtypes_build(module, dtype):
    m = MODULES[module][0](dtype=dtype)
    assert all(p.dtype == dtype for p in m.parameters())
