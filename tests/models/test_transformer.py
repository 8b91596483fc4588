"""The language model (mxmoe.models): forward and backward under every recipe, where the
recipe acts, dense and MoE blocks, configuration errors."""

from __future__ import annotations

import math

import pytest
import torch

from mxmoe.models import ModelConfig, MoETransformer


def _tiny_cfg(**kw) -> ModelConfig:
    base = dict(d_model=64, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_expert=64, max_seq_len=32)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "mxfp8-floor", "mxfp8-bf16-wgrad"])
def test_model_forward_backward(recipe):
    torch.manual_seed(0)
    model = MoETransformer(_tiny_cfg(), recipe)
    idx = torch.randint(0, 256, (2, 32))
    out = model(idx, idx)
    assert out.logits.shape == (2, 32, 256) and out.logits.dtype == torch.float32
    assert abs(out.ce_loss.item() - math.log(256)) < 0.1  # near uniform at init
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing
    assert len(out.tokens_per_expert) == 2


def test_recipe_reaches_the_configured_gemms(monkeypatch):
    """Count GEMMs that go through the recipe: with quantized=("experts",) attention and
    the LM head use plain high-precision linears."""
    import mxmoe.models.transformer as tr

    calls = []
    real = tr.mx_linear
    monkeypatch.setattr(tr, "mx_linear", lambda x, w, r: calls.append(w.shape) or real(x, w, r))
    idx = torch.randint(0, 256, (1, 32))
    MoETransformer(_tiny_cfg(quantized=("experts",)), "mxfp8")(idx)
    assert calls == []
    MoETransformer(_tiny_cfg(quantized=("experts", "attention", "lm_head")), "mxfp8")(idx)
    assert len(calls) == 2 * 2 + 1  # qkv and out projection per layer, plus the LM head


def test_dense_layers_between_moe_layers():
    model = MoETransformer(_tiny_cfg(n_layers=4, moe_every=2, d_ff_dense=96), "mxfp8")
    assert [b.is_moe for b in model.blocks] == [False, True, False, True]
    out = model(torch.randint(0, 256, (1, 16)), torch.randint(0, 256, (1, 16)))
    assert len(out.tokens_per_expert) == 2
    p = model.num_params()
    assert p["active"] < p["total"]


@pytest.mark.parametrize("kw,match", [
    (dict(n_experts=0), "n_experts must be a positive integer"),
    (dict(top_k=5), "top_k=5 exceeds n_experts=4"),
    (dict(n_heads=3), "n_heads=3"),
    (dict(quantized=("router",)), "unknown entries"),
    (dict(dtype="fp8"), "dtype 'fp8'"),
    (dict(n_layers=True), "n_layers must be a positive integer"),
    (dict(d_ff_dense=-5), "d_ff_dense must be a positive integer"),
    (dict(z_loss_coef=-1.0), "z_loss_coef must be a finite number"),
])
def test_model_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        _tiny_cfg(**kw)


def test_sequence_longer_than_rope_table_is_refused():
    model = MoETransformer(_tiny_cfg(), "bf16")
    with pytest.raises(ValueError, match="exceeds max_seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("kw", [{}, {"moe_every": 2, "shared_expert": 64}, {"moe_every": 3, "n_layers": 7,
                                 "d_ff_dense": 96, "n_experts": 5, "top_k": 1}, {"vocab_size": 300, "d_model": 64,
                                                                                  "n_heads": 2}])
def test_parameter_count_is_the_built_models(kw):
    cfg = ModelConfig(**kw)
    assert cfg.parameter_count() == sum(p.numel() for p in MoETransformer(cfg).parameters())


@pytest.mark.parametrize("kw", [{"d_model": 2**20, "n_heads": 2**10}, {"n_layers": 2**30}, {"n_experts": 2**30},
                                {"d_expert": 2**30}, {"shared_expert": 2**30}])
def test_sizes_past_the_parameter_bound_are_refused_without_building(kw):
    with pytest.raises(ValueError, match=r"parameters .* more than 1.1e\+12 \(2\*\*40\)"):
        ModelConfig(**kw)


@pytest.mark.parametrize("field", ["vocab_size", "d_model", "n_layers", "n_heads", "n_experts", "top_k", "d_expert",
                                   "moe_every", "d_ff_dense", "max_seq_len", "shared_expert"])
def test_every_size_past_int32_is_refused(field):
    match = "exceeds 1,048,576" if field == "vocab_size" else rf"{field} must be (at most|an integer in \[0,) 2,147,483,647"
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{field: 2**31})
