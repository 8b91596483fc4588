"""convert_to_mxfp8 on transformers models: what is converted, state dicts, save_pretrained /
from_pretrained, families refused."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import causal_lm, config, moe_block
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import mxmoe
from mxmoe import MXLinear
from mxmoe.integrations.transformers import (
    BACKENDS,
    backend_name,
    check_experts,
    experts_layout,
    register,
)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_convert_keeps_the_state_dict_and_sets_the_backend(family):
    model = causal_lm(family)
    before = _state(model)
    params = {n: p for n, p in model.named_parameters()}
    assert mxmoe.convert_to_mxfp8(model) is model
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    assert model.config._experts_implementation == "mxfp8"
    converted = {n for n, m in model.named_modules() if isinstance(m, MXLinear)}
    attn = [n for n in converted if ".self_attn." in n]
    assert attn, f"{family}: no attention projection converted"
    assert "lm_head" not in converted and not any(n.endswith((".gate", ".router")) for n in converted)
    assert type(model.lm_head) is torch.nn.Linear
    if family == "deepseek_v3":  # the shared expert's dense projections follow the recipe
        assert "model.layers.1.mlp.shared_experts.gate_proj" in converted


def test_convert_options():
    model = causal_lm("qwen3_moe")
    mxmoe.convert_to_mxfp8(model, "mxfp8-floor", module_filter_fn=lambda m, fqn: fqn.endswith("q_proj"),
                           experts=False)
    assert model.config._experts_implementation == "grouped_mm"  # experts=False leaves the backend
    assert {n for n, m in model.named_modules() if isinstance(m, MXLinear)} == {
        "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"}
    mxmoe.convert_to_mxfp8(model, "bf16")
    assert model.config._experts_implementation == "mxmoe_bf16"
    with pytest.raises(ValueError, match="has no experts backend"):
        mxmoe.convert_to_mxfp8(model, mxmoe.get_recipe("mxfp8", wgrad_high_precision=True))
    with pytest.raises(TypeError, match="only a transformers model takes"):
        mxmoe.convert_to_mxfp8(torch.nn.Linear(32, 32), experts=False)
    assert {backend_name(r) for r in BACKENDS.values()} == set(BACKENDS)


def test_register_is_idempotent():
    from transformers.integrations.moe import ExpertsInterface

    assert register() == register() == tuple(BACKENDS)
    assert all(name in ExpertsInterface._global_mapping for name in BACKENDS)
    assert "grouped_mm" in ExpertsInterface._global_mapping  # transformers' own names untouched


def test_save_pretrained_and_from_pretrained(tmp_path):
    ref = causal_lm("qwen3_moe")
    ref.save_pretrained(tmp_path / "plain")
    model = causal_lm("qwen3_moe")
    mxmoe.convert_to_mxfp8(model)
    model.save_pretrained(tmp_path / "converted")

    def tensors(path):
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118

    plain, conv = tensors(tmp_path / "plain"), tensors(tmp_path / "converted")
    assert set(plain) == set(conv) and all(torch.equal(plain[k], conv[k]) for k in plain)
    saved = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert not any(name in json.dumps(saved) for name in ("mxfp8", "mxmoe")), "the backend is not part of the checkpoint"
    # the checkpoint loads in plain transformers, and with the mxfp8 backend selected at load
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "converted")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values(), strict=True))
    register()
    fast = AutoModelForCausalLM.from_pretrained(tmp_path / "converted", experts_implementation="mxfp8")
    assert fast.config._experts_implementation == "mxfp8"
    mxmoe.convert_to_mxfp8(fast)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fast(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_a_family_outside_the_interface_is_refused():
    model = causal_lm("jetmoe")
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"^jetmoe: this family's MoE experts do not go through transformers' "
                                         r"ExpertsInterface.*experts=False"):
        mxmoe.convert_to_mxfp8(model)
    assert before == {n: type(m) for n, m in model.named_modules()}  # refused before any change
    mxmoe.convert_to_mxfp8(model, experts=False)  # what the message proposes: the linear layers only
    assert any(isinstance(m, MXLinear) for m in model.modules())


def test_quantized_expert_weights_are_refused():
    model = causal_lm("mixtral")
    experts = moe_block(model).experts
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.data.to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(ValueError, match=r"^mixtral: MixtralExperts.gate_up_proj is torch.float8_e4m3fn"):
        check_experts(model)
    with pytest.raises(ValueError, match="mixtral"):
        mxmoe.convert_to_mxfp8(model)
    register()
    model.set_experts_implementation("mxfp8")  # selected directly: refused at the block's first forward
    with pytest.raises(ValueError, match="load a quantized checkpoint dequantized"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_every_family_of_the_interface_has_a_layout():
    """The layouts of the tested families: plain SwiGLU takes the fused path; gpt-oss
    (biases, interleaved, transposed, clamped SwiGLU) the composed one."""
    layouts = {f: experts_layout(moe_block(causal_lm(f)).experts) for f in ("qwen3_moe", "gpt_oss")}
    assert layouts["qwen3_moe"].fused and not layouts["gpt_oss"].fused
    assert layouts["gpt_oss"].has_bias and layouts["gpt_oss"].is_transposed and not layouts["gpt_oss"].is_concatenated
    assert config("qwen3_moe").model_type == "qwen3_moe"


def test_the_log_names_the_default_filter(caplog):
    """Without a module_filter_fn the LM head is kept by the default filter, and the log
    line says so (not "excluded by module_filter_fn", which the user did not pass)."""
    import logging

    model = causal_lm("qwen3_moe")
    with caplog.at_level(logging.INFO, logger="mxmoe"):
        mxmoe.convert_to_mxfp8(model)
    kept = [r.getMessage() for r in caplog.records if "kept" in r.getMessage()]
    assert kept and "lm_head (excluded by the default filter: LM head and routers stay in high precision)" in kept[0]
    assert "module_filter_fn" not in kept[0]
