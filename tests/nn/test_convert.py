"""convert_to_mxfp8: which modules it swaps, what it keeps (and says so), and that
parameters, state_dicts and optimizers are untouched."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import mxmoe
from mxmoe import GroupedExperts, MoE, MXLinear, convert_to_mxfp8
from mxmoe.nn.moe import TopKRouter
from mxmoe.recipe import get_recipe


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 128)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(128, 64, bias=False), nn.GELU())])
        self.odd = nn.Linear(30, 64)  # K = 30
        self.head = nn.Linear(64, 50)  # N = 50
        self.moe = MoE(64, 4, 2, 64, recipe="bf16")
        self.experts = GroupedExperts(4, 64, 64, recipe="bf16")
        self.mha = nn.MultiheadAttention(64, 2, batch_first=True)  # out_proj: a subclass of nn.Linear

    def forward(self, x):
        h = self.blocks[0](self.proj(x))
        h = h + self.moe(h)[0] + self.mha(h, h, h, need_weights=False)[0]
        return self.head(h) + self.odd(x[..., :30]).sum()


def _records(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "mxmoe" and "convert_to_mxfp8" in r.getMessage()]


def test_swaps_eligible_linears_and_sets_moe_recipes(caplog):
    torch.manual_seed(0)
    model = Net()
    before = {k: v for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    with caplog.at_level(logging.INFO, logger="mxmoe"):
        out = convert_to_mxfp8(model)
    assert out is model
    assert type(model.proj) is MXLinear and type(model.blocks[0][0]) is MXLinear
    assert type(model.odd) is nn.Linear and type(model.head) is nn.Linear
    assert type(model.mha.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert model.moe.recipe is get_recipe("mxfp8") and model.moe.fused
    assert model.experts.recipe is get_recipe("mxfp8")
    assert type(model.moe.router) is TopKRouter  # not an nn.Linear: never converted, never listed
    # the very same Parameter objects under the same names: state_dict keys and values unchanged
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())
    msgs = _records(caplog)
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith("convert_to_mxfp8: kept 3 modules in high precision: ")
    assert "odd (K=30 not a multiple of 32)" in msgs[0] and "head (N=50 not a multiple of 32)" in msgs[0]
    assert "mha.out_proj (NonDynamicallyQuantizableLinear, a subclass of nn.Linear: not swapped)" in msgs[0]
    assert "router" not in msgs[0]
    assert "converted 2 nn.Linear to MXLinear, set recipe mxfp8 on 2 mxmoe modules" in msgs[0]
    x = torch.randn(2, 5, 64)
    assert model(x).shape == (2, 5, 50)


def test_loads_a_state_dict_saved_before_conversion():
    torch.manual_seed(1)
    old = Net().state_dict()
    torch.manual_seed(2)
    model = convert_to_mxfp8(Net())
    model.load_state_dict(old)  # strict: the same keys
    assert all(torch.equal(model.state_dict()[k], v) for k, v in old.items())
    torch.manual_seed(2)
    ref = Net()
    ref.load_state_dict(model.state_dict())  # and the other way round


def test_module_filter_fn_is_respected(caplog):
    seen = []

    def keep_proj_and_moe(module, fqn):
        seen.append((fqn, type(module).__name__))
        return fqn not in ("proj", "moe")

    model = Net()
    with caplog.at_level(logging.INFO, logger="mxmoe"):
        convert_to_mxfp8(model, module_filter_fn=keep_proj_and_moe)
    assert type(model.proj) is nn.Linear and type(model.blocks[0][0]) is MXLinear
    assert model.moe.recipe.name == "bf16" and model.experts.recipe.name == "mxfp8"
    assert ("proj", "Linear") in seen and ("moe", "MoE") in seen and ("experts", "GroupedExperts") in seen
    assert not any(fqn.startswith("moe.") for fqn, _ in seen)  # MoE's parts are not candidates
    (msg,) = _records(caplog)
    assert "kept 5 modules" in msg
    assert "proj (excluded by module_filter_fn)" in msg and "moe (excluded by module_filter_fn, recipe bf16)" in msg


def test_idempotent_and_optimizer_built_before_conversion_keeps_training():
    torch.manual_seed(3)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    convert_to_mxfp8(model)
    types = {n: type(m) for n, m in model.named_modules()}
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert convert_to_mxfp8(model) is model
    assert {n: type(m) for n, m in model.named_modules()} == types
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    model(torch.randn(2, 5, 64)).square().mean().backward()
    opt.step()
    assert not torch.equal(model.proj.weight, sd["proj.weight"])
    assert not torch.equal(model.moe.experts.w13, sd["moe.experts.w13"])


def test_recipe_argument_and_errors():
    model = Net()
    with pytest.raises(ValueError, match="unknown recipe 'mxfp4'"):
        convert_to_mxfp8(model, recipe="mxfp4")
    assert type(model.proj) is nn.Linear  # nothing changed
    with pytest.raises(TypeError, match="takes an nn.Module"):
        convert_to_mxfp8({"proj": model.proj})
    with pytest.raises(TypeError, match="module_filter_fn must be callable"):
        convert_to_mxfp8(model, module_filter_fn="lm_head")
    convert_to_mxfp8(model, recipe=get_recipe("mxfp8", scale_mode="floor"))
    assert model.proj.recipe.scale_mode.value == "floor" and model.moe.recipe.scale_mode.value == "floor"
    convert_to_mxfp8(model, recipe="mxfp8-bf16-wgrad")  # an MXLinear / MoE already there is re-set
    assert model.proj.recipe.name == model.moe.recipe.name == "mxfp8-bf16-wgrad"


def test_shared_modules_tied_weights_and_a_bare_linear():
    lin = nn.Linear(32, 32)
    model = nn.Sequential(lin, nn.ReLU(), lin)  # one module under two names
    convert_to_mxfp8(model)
    assert type(model[0]) is MXLinear and model[0] is model[2]
    emb = nn.Embedding(64, 32)
    lm = nn.Module()
    lm.emb, lm.head = emb, nn.Linear(32, 64, bias=False)
    lm.head.weight = emb.weight  # tied
    convert_to_mxfp8(lm)
    assert type(lm.head) is MXLinear and lm.head.weight is lm.emb.weight
    bare = nn.Linear(64, 64)
    new = convert_to_mxfp8(bare)  # the model itself: a new module is returned
    assert type(new) is MXLinear and new.weight is bare.weight


def test_exported_from_the_package():
    # the package-level function hands transformers models to mxmoe.integrations.transformers
    # and every other module to mxmoe.nn.convert_to_mxfp8
    assert mxmoe.convert_to_mxfp8 is mxmoe.integrations.convert_to_mxfp8 is convert_to_mxfp8
    for name in ("MXLinear", "MoE", "GroupedExperts", "convert_to_mxfp8"):
        assert name in mxmoe.__all__ and name in mxmoe.nn.__all__


def test_a_refused_recipe_changes_nothing():
    """Every check runs before the first change: a module that refuses the recipe (an MoE
    with MXFP8 dispatch asked to run bf16) leaves the whole model as it was."""
    import mxmoe

    model = nn.ModuleDict({"a": nn.Linear(64, 64), "moe": mxmoe.MoE(64, 4, 2, 64, mx_dispatch=True),
                           "z": nn.Linear(64, 64)})
    before = {k: (type(v), getattr(v, "recipe", None)) for k, v in model.items()}
    with pytest.raises(ValueError, match="mx_dispatch"):
        mxmoe.convert_to_mxfp8(model, "bf16")
    assert {k: (type(v), getattr(v, "recipe", None)) for k, v in model.items()} == before


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_linears_of_dtypes_the_ops_do_not_take_are_kept_and_logged(dtype, caplog):
    import logging

    import mxmoe

    model = nn.Sequential(nn.Linear(64, 64).to(dtype), nn.Linear(64, 64))
    with caplog.at_level(logging.INFO, logger="mxmoe"):
        mxmoe.convert_to_mxfp8(model)
    assert type(model[0]) is nn.Linear and isinstance(model[1], mxmoe.MXLinear)
    assert f"0 (weight dtype {dtype}" in caplog.text
