"""mxmoe inside Hugging Face transformers MoE models: experts backends and model conversion.

transformers (5.17 to 5.x) routes the expert computation of every MoE block whose experts
class carries ``@use_experts_implementation`` through ``ExpertsInterface``: the block
calls ``experts_forward(experts, hidden_states_TD, top_k_index_Tk, top_k_weights_Tk)``
with the function registered under ``config._experts_implementation``. :func:`register`
adds one such function per mxmoe recipe (:data:`BACKENDS`):

    "mxfp8"             recipe mxfp8        (E4M3, rceil scales)
    "mxfp8-floor"       recipe mxfp8-floor  (OCP floor scales)
    "mxfp8-bf16-wgrad"  recipe mxfp8-bf16-wgrad
    "mxmoe_bf16"        recipe bf16         (mxmoe's bf16 GEMMs; the name avoids transformers' own)

after which ``model.set_experts_implementation("mxfp8")`` or
``from_pretrained(..., experts_implementation="mxfp8")`` selects it, and
:func:`convert_model` (what ``mxmoe.convert_to_mxfp8`` calls for a transformers model)
also converts the attention and dense projections.

The experts module holds (legend: T tokens, D hidden size, F expert width, E experts, k
top-k, A = T * k routed rows):

    gate_up_proj  (E, 2F, D), or (E, D, 2F) when ``is_transposed``; [gate; up] along 2F
                  when ``is_concatenated``, gate and up interleaved (g0, u0, g1, ...) otherwise
    up_proj       instead of gate_up_proj when ``has_gate`` is False: (E, F, D) / (E, D, F)
    down_proj     (E, D, F), or (E, F, D) when ``is_transposed``
    gate_up_proj_bias (E, 2F), down_proj_bias (E, D) when ``has_bias``
    act_fn, _apply_gate(h_A2F) -> (A, F): the family's activation (default act_fn(gate) * up)

Each block's parameters are read in place at every call (a transposed layout is passed as
a transposed view; the recipe makes its per-call quantized copies, or one per optimizer
step inside :func:`mxmoe.weight_copy_cache`); nothing is copied between steps.

Two paths, each exact for the families it takes:

- **fused**: gated SwiGLU experts (``act_fn`` SiLU, transformers' default ``_apply_gate``,
  [gate; up] concatenated, no biases: Qwen2/3-MoE, Mixtral, DeepSeek-V2/V3, OLMoE, ...)
  run :func:`mxmoe.nn.moe.routed_experts`, the path of :class:`mxmoe.nn.GroupedExperts`:
  the fused MXFP8 expert op :func:`mxmoe.mx_moe_experts` for bf16 activations under
  ``mxfp8`` / ``mxfp8-floor`` with D and F multiples of 32, else two
  :func:`mxmoe.mx_grouped_mm` and SiLU(gate) * up in the activation dtype.
- **composed**: every other layout and activation the interface describes (biases,
  interleaved gate/up, clamped SwiGLU such as gpt-oss or DeepSeek-V4, GELU, non-gated
  experts): both GEMMs through :func:`mxmoe.mx_grouped_mm` under the recipe, the biases
  added to the GEMM results, and the block's own ``_apply_gate`` / ``act_fn`` between
  them, as transformers' ``grouped_mm`` backend computes it.

Both sort the assignments by expert (stable), and the combine sums each token's k
weighted outputs in a fixed order (deterministic). Refused (ValueError at selection by
:func:`convert_model` / :func:`check_experts`, else at the block's first forward): expert
weights that are not floating point (pre-quantized FP8 checkpoints: load them
dequantized), expert-parallel sentinel indices (>= E). MoE families whose experts do not
go through the interface (DBRX, JetMoE, Llama 4, Switch Transformers, ...) are refused
by :func:`convert_model`, naming the family.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn
from transformers.integrations.moe import ExpertsInterface

from ..models import LMOutput, ModelConfig
from ..nn.convert import ModuleFilter
from ..nn.convert import convert_to_mxfp8 as convert_module
from ..nn.moe import routed_experts, tokens_per_expert
from ..ops import mx_grouped_mm
from ..ops.combine import combine_weighted
from ..ops.moe_experts import supports_fused_experts
from ..recipe import Recipe, get_recipe

try:  # the default gate of the interface (act_fn(gate) * up on [gate; up]); private in transformers
    from transformers.integrations.moe import _default_apply_gate
except ImportError:  # a later release renamed it: every family then takes the composed path (exact)
    _default_apply_gate = None

TESTED_VERSIONS = ">=5.17,<6"
"""The transformers versions this module is tested with (the ``hf`` extra's range)."""

BACKENDS: dict[str, str] = {
    "mxfp8": "mxfp8",
    "mxfp8-floor": "mxfp8-floor",
    "mxfp8-bf16-wgrad": "mxfp8-bf16-wgrad",
    "mxmoe_bf16": "bf16",
}
"""Experts implementation name -> mxmoe recipe name."""

_BACKEND_OF_RECIPE = {recipe: name for name, recipe in BACKENDS.items()}

_CONFIG_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "ffn_config")
"""Config attributes by which an MoE model that bypasses the interface is recognized."""

_ROUTER_NAMES = ("gate", "router", "shared_expert_gate")
"""Last name components of the modules kept in high precision by default besides the LM head."""


def backend_name(recipe: Recipe | str) -> str:
    """The experts implementation name of an mxmoe recipe ("mxfp8" -> "mxfp8", "bf16" ->
    "mxmoe_bf16"). The recipe's quantizer ``backend`` is not part of the choice: the
    registered backends run "auto", and every quantizer backend gives the same bits.

    Raises:
        ValueError: a recipe with no registered backend (a :class:`Recipe` with overridden
            fields: only the named recipes are registered).
    """
    recipe = get_recipe(recipe)
    # the quantizer backend changes speed only (every backend gives the same bits): ignored
    if recipe.name not in _BACKEND_OF_RECIPE or dataclasses.replace(recipe, backend="auto") != get_recipe(recipe.name):
        raise ValueError(f"recipe {recipe!r} has no experts backend; use one of the named recipes "
                         f"{', '.join(map(repr, _BACKEND_OF_RECIPE))}")
    return _BACKEND_OF_RECIPE[recipe.name]


def family(module: nn.Module) -> str:
    """The model type a module belongs to ("qwen3_moe", ...), from its config, else its
    class name."""
    config = getattr(module, "config", None)
    return getattr(config, "model_type", None) or type(module).__name__


@dataclass(frozen=True)
class ExpertsLayout:
    """How one experts module stores and computes its experts (read from the attributes
    ``@use_experts_implementation`` sets).

    Attributes:
        has_gate, has_bias, is_transposed, is_concatenated: the decorator's flags.
        swiglu: act_fn is SiLU and ``_apply_gate`` is transformers' default, so the gate is
            SiLU(gate) * up on [gate; up] (with ``is_concatenated``): mxmoe's SwiGLU.
    """

    has_gate: bool
    has_bias: bool
    is_transposed: bool
    is_concatenated: bool
    swiglu: bool

    @property
    def fused(self) -> bool:
        """Whether the block runs mxmoe's SwiGLU expert path (:func:`routed_experts`)."""
        return self.has_gate and self.swiglu and self.is_concatenated and not self.has_bias


def _is_silu(act_fn: object) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(act_fn, (nn.SiLU, SiLUActivation)) or act_fn is F.silu


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module of the interface (its class carries
    ``@use_experts_implementation``)."""
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "config")) and hasattr(
        module, "down_proj")


def experts_layout(module: nn.Module) -> ExpertsLayout:
    """The :class:`ExpertsLayout` of an experts module.

    Raises:
        ValueError: not an experts module of the interface, or its weights are not 3-D
            floating-point parameters (the message names the family and what would work).
    """
    if not is_experts_module(module):
        raise ValueError(f"{type(module).__name__} is not an experts module of transformers' ExpertsInterface "
                         f"(no @use_experts_implementation): mxmoe's experts backends cannot run it")
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    for name in (up_name, "down_proj"):
        w = getattr(module, name, None)
        if not isinstance(w, Tensor) or w.dim() != 3 or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            what = "missing" if not isinstance(w, Tensor) else f"{w.dtype}, shape {tuple(w.shape)}"
            raise ValueError(f"{family(module)}: {type(module).__name__}.{name} is {what}; mxmoe's experts backends "
                             f"take (E, N, K) float32/bfloat16/float16 weights (load a quantized checkpoint "
                             f"dequantized, or keep experts_implementation='grouped_mm')")
    cls_gate = getattr(type(module), "_apply_gate", None)
    default_gate = _default_apply_gate is not None and cls_gate is _default_apply_gate
    swiglu = default_gate and _is_silu(getattr(module, "act_fn", None))
    return ExpertsLayout(bool(module.has_gate), bool(module.has_bias), bool(module.is_transposed),
                         bool(getattr(module, "is_concatenated", True)), swiglu)


def _weight_ENK(w: Tensor, transposed: bool) -> Tensor:
    """An expert weight as (E, N, K) (out, in), a transposed view if it is stored (E, K, N)."""
    return w.transpose(1, 2) if transposed else w


def _composed(module: nn.Module, layout: ExpertsLayout, x_TD: Tensor, experts_Tk: Tensor, weights_Tk: Tensor,
              recipe: Recipe) -> Tensor:
    """The interface's grouped computation with mxmoe's GEMMs: sort by expert, up GEMM
    (+ bias), the block's gate or activation, down GEMM (+ bias), weighted combine."""
    k = experts_Tk.shape[1]
    E = module.num_experts
    experts_A = experts_Tk.reshape(-1)
    order_A = torch.argsort(experts_A, stable=True)
    offsets_E = torch.cumsum(tokens_per_expert(experts_A, E), 0).to(torch.int32)
    x_AD = x_TD.index_select(0, order_A // k)  # gather; backward scatters a permutation
    w_up = module.gate_up_proj if layout.has_gate else module.up_proj
    h = mx_grouped_mm(x_AD, _weight_ENK(w_up, layout.is_transposed), offsets_E, recipe)  # (A, D) -> (A, 2F or F)
    if layout.has_bias:
        experts_sorted_A = experts_A.index_select(0, order_A)
        bias = module.gate_up_proj_bias if layout.has_gate else module.up_proj_bias
        h = (h + bias.index_select(0, experts_sorted_A)).to(h.dtype)
    h = module._apply_gate(h) if layout.has_gate else module.act_fn(h)  # (A, F)
    y = mx_grouped_mm(h.to(x_TD.dtype), _weight_ENK(module.down_proj, layout.is_transposed), offsets_E, recipe)
    if layout.has_bias:
        y = (y + module.down_proj_bias.index_select(0, experts_sorted_A)).to(y.dtype)
    return combine_weighted(y, order_A, weights_Tk)


def experts_forward(module: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                    recipe: Recipe | str) -> Tensor:
    """One MoE block's experts under ``recipe``: the function each registered backend calls.

    Args:
        module: the block's experts module (its parameters are read in place).
        hidden_states: (T, D) float32/bfloat16/float16 activations.
        top_k_index: (T, k) int64 expert of each choice, in [0, E).
        top_k_weights: (T, k) floating combine weights (as the block's router gives them).
        recipe: a :class:`~mxmoe.recipe.Recipe` or its name.

    Returns:
        (T, D) in hidden_states' dtype: sum over j of weights[t, j] * expert(x[t]). Under
        ``torch.autocast``, float32 hidden states are cast to the autocast dtype first (the
        expert GEMMs run in it, as autocast's matmuls do; with bf16 the fused op runs).

    Raises:
        ValueError: as :func:`experts_layout`; on the CPU an expert index outside [0, E)
            (transformers' expert-parallel sentinels are not supported).
    """
    recipe = get_recipe(recipe)
    layout = experts_layout(module)
    if top_k_index.device.type == "cpu" and top_k_index.numel():
        lo, hi = int(top_k_index.min()), int(top_k_index.max())
        if lo < 0 or hi >= module.num_experts:
            raise ValueError(f"{family(module)}: expert indices must be in [0, {module.num_experts}), got values in "
                             f"[{lo}, {hi}]: expert-parallel sentinels are not supported by mxmoe's backends")
    device_type = hidden_states.device.type
    x_TD = hidden_states
    if torch.is_autocast_enabled(device_type) and x_TD.dtype == torch.float32:
        # under autocast the expert GEMMs take its dtype, as autocast's matmuls do (bf16: the fused op)
        x_TD = x_TD.to(torch.get_autocast_dtype(device_type))
    with torch.autocast(device_type, enabled=False):  # mxmoe's ops choose their own dtypes
        if layout.fused:
            w13_E2FD = _weight_ENK(module.gate_up_proj, layout.is_transposed)  # (E, 2F, D) = [gate; up]
            w2_EDF = _weight_ENK(module.down_proj, layout.is_transposed)  # (E, D, F)
            fused = supports_fused_experts(w13_E2FD.shape[2], w2_EDF.shape[2], recipe)
            y_TD, _, _ = routed_experts(x_TD, top_k_index, top_k_weights, w13_E2FD, w2_EDF, recipe, fused)
        else:
            y_TD = _composed(module, layout, x_TD, top_k_index, top_k_weights, recipe)
    return y_TD.to(hidden_states.dtype)


def _make_backend(recipe_name: str) -> Callable[..., Tensor]:
    recipe = get_recipe(recipe_name)

    # one eager region under torch.compile: mxmoe's autograd ops run eagerly anyway (note at
    # mxmoe.ops.grouped_mm._apply), and the index check reads the host
    @torch.compiler.disable
    def forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return experts_forward(self, hidden_states, top_k_index, top_k_weights, recipe)

    forward.__name__ = f"mxmoe_{recipe_name.replace('-', '_')}_experts_forward"
    forward.__qualname__ = forward.__name__
    forward.__doc__ = f"transformers experts backend: the block's experts under mxmoe recipe {recipe_name!r}."
    forward._mxmoe_recipe = recipe_name
    return forward


_BACKEND_FUNCTIONS = {name: _make_backend(recipe) for name, recipe in BACKENDS.items()}


def register() -> tuple[str, ...]:
    """Register mxmoe's experts backends (:data:`BACKENDS`) in transformers'
    ``ExpertsInterface``, so that ``experts_implementation="mxfp8"`` (or another name)
    selects them. Idempotent: registering again changes nothing. Returns the names.

    Raises:
        ValueError: one of the names is already registered by another library.
    """
    mapping = ExpertsInterface._global_mapping
    for name, fn in _BACKEND_FUNCTIONS.items():
        other = mapping.get(name)
        if other is not None and other is not fn:
            raise ValueError(f"experts implementation {name!r} is already registered ({other!r}); mxmoe's "
                             f"backends need the names {', '.join(map(repr, BACKENDS))}")
    for name, fn in _BACKEND_FUNCTIONS.items():
        ExpertsInterface.register(name, fn)
    return tuple(BACKENDS)


def check_experts(model: nn.Module) -> list[tuple[str, ExpertsLayout]]:
    """Check that mxmoe's backends can run every MoE block of a transformers model.

    Returns:
        (name, :class:`ExpertsLayout`) of each experts module, in ``named_modules`` order.

    Raises:
        ValueError: an experts module the backends refuse (:func:`experts_layout`), or an
            MoE model whose experts do not go through the interface (the message names
            the family and what to use instead).
    """
    found = [(name, experts_layout(m)) for name, m in model.named_modules() if is_experts_module(m)]
    if not found:
        config = getattr(model, "config", None)
        counts = [getattr(config, a, None) for a in _CONFIG_EXPERT_COUNTS]
        if any(c for c in counts if not isinstance(c, bool)):
            raise ValueError(_outside_interface_message(getattr(config, "model_type", type(model).__name__)))
    return found


def _outside_interface_message(model_type: str) -> str:
    return (f"{model_type}: this family's MoE experts do not go through transformers' ExpertsInterface, so mxmoe "
            f"cannot run them; convert only its linear layers with convert_to_mxfp8(model, experts=False), or build "
            f"the model with mxmoe.nn.MoE blocks")


def default_module_filter(model: nn.Module) -> ModuleFilter:
    """The default ``module_filter_fn`` of :func:`convert_model`: False (kept in high
    precision) for the LM head (the output embeddings, and any module named ``lm_head``)
    and the routers (a module whose last name is one of ``gate``, ``router``,
    ``shared_expert_gate``); True for the rest (attention and dense projections)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def keep_others(module: nn.Module, fqn: str) -> bool:
        last = fqn.rsplit(".", 1)[-1]
        return module is not head and last != "lm_head" and last not in _ROUTER_NAMES

    keep_others.description = "the default filter: LM head and routers stay in high precision"  # the log says it
    return keep_others


def convert_model(model: nn.Module, recipe: Recipe | str = "mxfp8", module_filter_fn: ModuleFilter | None = None,
                  *, experts: bool = True) -> nn.Module:
    """Run a transformers model's GEMMs under an MXFP8 recipe, in place.

    - Every ``nn.Linear`` with in and out features multiples of 32 that
      ``module_filter_fn`` keeps becomes an :class:`~mxmoe.nn.MXLinear` holding the same
      Parameters (:func:`mxmoe.nn.convert_to_mxfp8`); by default
      (:func:`default_module_filter`) the LM head and routers stay in high precision, and
      embeddings and norms are not linear layers.
    - With ``experts``: the experts backend of the recipe (:func:`backend_name`) is
      registered and set with ``model.set_experts_implementation``, after
      :func:`check_experts` accepted every block.

    State dict keys and values are unchanged: ``save_pretrained`` writes the same tensors,
    and the checkpoint loads into an unconverted model. Call it before ``torch.compile``,
    DDP or FSDP, and before building the optimizer (or keep it: the Parameters are the same).

    Args:
        model: a transformers ``PreTrainedModel``.
        recipe: a named :class:`~mxmoe.recipe.Recipe` or its name.
        module_filter_fn: ``(module, fqn) -> bool``, True converts; None is
            :func:`default_module_filter`.
        experts: set the experts backend (False: linear layers only).

    Returns:
        ``model``.

    Raises:
        ValueError: unknown recipe, a recipe with no backend, an MoE family or experts
            module the backends refuse (all before anything is changed).
        TypeError: ``model`` is not a transformers PreTrainedModel.
    """
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"convert_model takes a transformers PreTrainedModel, got {type(model).__name__}; "
                        f"use mxmoe.nn.convert_to_mxfp8 for other modules")
    recipe = get_recipe(recipe)
    name = backend_name(recipe) if experts else None
    if experts:
        check_experts(model)
        register()
    convert_module(model, recipe, default_module_filter(model) if module_filter_fn is None else module_filter_fn)
    if name is not None:
        model.set_experts_implementation(name)
        n_blocks = sum(1 for m in model.modules() if is_experts_module(m))
        logging.getLogger("mxmoe").info("convert_to_mxfp8: experts of %d MoE blocks set to the experts backend %r",
                                        n_blocks, name)
    return model


# ---- training a transformers model with mxmoe's trainer (mxmoe train --hf-config) ----------

_SIZE_KEYS: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "d_model": ("hidden_size",),
    "n_layers": ("num_hidden_layers",),
    "n_heads": ("num_attention_heads",),
    "n_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "top_k": ("num_experts_per_tok",),
    "d_expert": ("moe_intermediate_size", "intermediate_size"),
    "max_seq_len": ("max_position_embeddings",),
}
"""ModelConfig field -> the transformers config attributes that hold it, first match wins."""


def _size_attr(config, field: str) -> str | None:
    return next((a for a in _SIZE_KEYS[field] if getattr(config, a, None) is not None), None)


def hf_config_dict(spec: str, sizes: dict[str, int] | None = None, min_positions: int = 0,
                   min_vocab: int = 0) -> dict:
    """The transformers config named by ``spec``, as a dict (``to_dict()``).

    Args:
        spec: a config.json file, a directory holding one, or a transformers model type
            ("qwen3_moe", "mixtral", ...: its default config).
        sizes: ModelConfig size fields to write into the config (``d_model``, ``n_layers``,
            ``n_heads``, ``n_experts``, ``top_k``, ``d_expert``, ``vocab_size``), each into
            the attribute of :data:`_SIZE_KEYS` the config has; ``n_heads`` also sets
            ``head_dim`` = d_model / n_heads where the config has one, and the KV heads to
            n_heads where they no longer divide it.
        min_positions: raise ``max_position_embeddings`` to at least this (the sequence length).
        min_vocab: raise ``vocab_size`` to at least this (the corpus's).

    Raises:
        FileNotFoundError: ``spec`` looks like a path (ends in .json or holds a /) that does
            not exist. ValueError: an unknown model type, a file that is not a config.
    """
    from transformers import CONFIG_MAPPING, AutoConfig

    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--hf-config {spec!r} is a directory without a config.json; pass the config "
                                    f"file or the directory holding it")
        path = path / "config.json"
    if path.is_file():
        try:
            d = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--hf-config {str(path)!r} is not a JSON file ({e})") from None
        model_type = d.pop("model_type", None) if isinstance(d, dict) else None
        if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
            raise ValueError(f"{str(path)!r} is not a transformers config.json (model_type {model_type!r})")
        try:
            config = AutoConfig.for_model(model_type, **d)
        except Exception as e:  # noqa: BLE001 - transformers raises several types for a bad field value
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"--hf-config {str(path)!r}: transformers refuses this {model_type} config "
                             f"({first})") from None
    elif spec.endswith(".json") or "/" in spec:
        raise FileNotFoundError(f"--hf-config {spec!r}: no such config file")
    elif spec in CONFIG_MAPPING:
        config = AutoConfig.for_model(spec)
    else:
        raise ValueError(f"--hf-config {spec!r} is neither a config.json nor a transformers model type; "
                         f"use e.g. qwen3_moe or mixtral (the families of docs/INTEGRATIONS.md)")
    if _size_attr(config, "n_experts") is None:
        raise ValueError(f"{config.model_type} is not an MoE model (its config has none of "
                         f"{', '.join(_SIZE_KEYS['n_experts'])}); --hf-config trains MoE models")
    for field, value in (sizes or {}).items():
        attr = _size_attr(config, field)
        if attr is None:
            raise ValueError(f"{config.model_type} config has none of {_SIZE_KEYS[field]} for {field}")
        setattr(config, attr, value)
    if sizes and "n_heads" in sizes:
        heads = sizes["n_heads"]
        if getattr(config, "head_dim", None) is not None:
            config.head_dim = config.hidden_size // heads
        kv = getattr(config, "num_key_value_heads", None)
        if kv is not None and heads % kv:
            config.num_key_value_heads = heads
    config.max_position_embeddings = max(getattr(config, "max_position_embeddings", 0) or 0, min_positions)
    config.vocab_size = max(config.vocab_size, min_vocab)
    return config.to_dict()


def model_config_from_hf(hf: dict, **fields) -> ModelConfig:
    """A :class:`~mxmoe.models.ModelConfig` holding ``hf`` (``hf_config``), its size fields
    read back from it (for reports and checks); ``fields`` set the others (``quantized``,
    ``dtype``, ``aux_loss_coef``, ...)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**hf)
    sizes = {}
    for field in _SIZE_KEYS:
        attr = _size_attr(config, field)
        if attr is not None:
            sizes[field] = int(getattr(config, attr))
    if "n_experts" not in sizes:
        raise ValueError(f"{config.model_type} is not an MoE model (no {_SIZE_KEYS['n_experts']} in its config)")
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None:
        raise ValueError(f"{config.model_type} has no causal LM class in transformers; --hf-config trains causal LMs")
    if not cls._can_set_experts_implementation():
        raise ValueError(_outside_interface_message(config.model_type))
    _check_attention_heads(config)
    _check_config_values(config, cls)
    try:
        return ModelConfig(**sizes, **fields, hf_config=hf)
    except ValueError as e:  # name the config's own attributes (hidden_size), not mxmoe's fields (d_model)
        message = str(e)
        for field in sizes:
            attr = _size_attr(config, field)
            message = re.sub(rf"\b{field}\b", attr, message)
        raise ValueError(f"the {config.model_type} config: {message}") from None


# config sizes that must be positive integers wherever a config has them (0 heads, a head_dim
# of 0 or a sparse step of 0 would divide by zero inside the model's constructor)
_POSITIVE_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "intermediate_size", "moe_intermediate_size", "decoder_sparse_step", "num_experts",
                   "num_local_experts", "n_routed_experts", "num_experts_per_tok", "vocab_size")


def _check_config_values(config, cls) -> None:
    """Refuse config values transformers accepts but cannot build or train with: a
    normalization epsilon that is not a positive number (``rms_norm_eps`` -1 trains into
    NaN), and anything that makes the model's constructor fail (KV heads 0, a
    ``decoder_sparse_step`` of 0, an unknown ``hidden_act``, a size given as text), found by
    building the model on the meta device (no memory).

    Raises:
        ValueError: naming the attribute (or transformers' own error) and the model type.
    """
    values = config.to_dict()
    for key, value in values.items():
        if key.endswith(("_eps", "epsilon")) and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                                     and math.isfinite(value) and value > 0):
            raise ValueError(f"the {config.model_type} config has {key} {value!r}; a normalization epsilon must be a "
                             f"small positive number such as 1e-6")
        if key in _POSITIVE_SIZES and value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                                              or value < 1):
            raise ValueError(f"the {config.model_type} config has {key} {value!r}; it must be a positive integer")
    small = copy.deepcopy(config)  # the layers repeat: two are enough to find a value they fail on (fast for
    small.num_hidden_layers = min(getattr(config, "num_hidden_layers", 2) or 2, 2)  # 100,000-layer configs)
    try:
        with torch.device("meta"):
            try:
                cls(small)
            except Exception:  # noqa: BLE001 - a family may tie per-layer lists to the layer count: build it all
                cls(config)
    except Exception as e:  # noqa: BLE001 - transformers' constructors raise many types for bad values
        first = " ".join(str(e).split())[:200] or type(e).__name__
        raise ValueError(f"transformers cannot build a {config.model_type} model from this config "
                         f"({type(e).__name__}: {first}); check its values") from None


def _check_attention_heads(config) -> None:
    """Refuse, before a model is built, attention shapes the model would fail on in its
    first forward: query heads not a multiple of the KV heads, an odd head dimension
    (rotary embeddings rotate pairs), a width that does not split into the heads when the
    config gives no head_dim.

    Raises:
        ValueError: naming the config fields and what would work.
    """
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(heads, int) or not isinstance(hidden, int):
        return
    if not isinstance(kv, int) or kv < 1 or heads % kv:
        raise ValueError(f"{config.model_type}: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv}; use KV heads that divide the query heads")
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"{config.model_type}: hidden_size {hidden} does not split into {heads} attention "
                             f"heads; use --heads dividing --width")
        head_dim = hidden // heads
    if head_dim % 2:
        given = getattr(config, "head_dim", None) is not None
        source = f"head_dim {head_dim}" if given else f"head dimension {head_dim} (hidden_size {hidden} / {heads} heads)"
        fix = "use an even head_dim in the config" if given else "use --heads giving an even --width / --heads"
        raise ValueError(f"{config.model_type}: {source} is odd; rotary embeddings need an even one: {fix}")


class TransformersCausalLM(nn.Module):
    """A transformers causal LM behind the interface of :class:`~mxmoe.models.MoETransformer`
    (what the trainer, evaluation and ``mxmoe compare`` call).

    Built by :func:`build_causal_lm`. Parameters (state_dict keys ``model.<transformers key>``)
    are in ``cfg.dtype`` (bf16 by default, as transformers models train; mxmoe's own model
    keeps float32 master weights). Forward: ``idx`` (B, S) int64 -> :class:`~mxmoe.models.LMOutput`:
    float32 logits, cross entropy against ``targets`` (B, S) (already shifted, as the trainer's
    batches are), the family's load-balancing loss (``output_router_logits``; 0 for families
    without one, such as DeepSeek-V3) weighted by ``cfg.aux_loss_coef``, z loss 0, and the
    tokens per expert of every MoE block (from the routing each experts module receives).
    """

    def __init__(self, model: nn.Module, cfg: ModelConfig):
        super().__init__()
        self.model, self.cfg = model, cfg
        self._experts = [m for m in model.modules() if is_experts_module(m)]
        self._counts: list[Tensor] = []
        for m in self._experts:
            m.register_forward_pre_hook(self._count)

    def _count(self, module: nn.Module, args: tuple) -> None:
        if len(args) >= 2 and isinstance(args[1], Tensor):
            self._counts.append(tokens_per_expert(args[1].detach(), module.num_experts))

    def num_params(self) -> dict[str, int]:
        """Parameter counts: total, and active per token (top-k of each block's experts)."""
        total = sum(p.numel() for p in self.parameters())
        expert = sum(p.numel() for m in self._experts for p in m.parameters(recurse=False))
        active = total - expert + expert * self.cfg.top_k // self.cfg.n_experts
        return {"total": total, "active": active}

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, as :meth:`~mxmoe.models.MoETransformer.flops_per_token`
        counts them (6 x active matmul parameters without the input embedding, plus causal
        attention 6 * n_layers * S * D)."""
        embed = self.model.get_input_embeddings().weight.numel()
        return 6.0 * (self.num_params()["active"] - embed) + 6.0 * self.cfg.n_layers * seq_len * self.cfg.d_model

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> LMOutput:
        """idx (B, S) int64 -> :class:`~mxmoe.models.LMOutput` (class docstring)."""
        self._counts = []
        out = self.model(input_ids=idx, output_router_logits=True, use_cache=False)
        logits = out.logits.float()
        zero = torch.zeros((), device=idx.device)
        aux = getattr(out, "aux_loss", None)
        aux = zero if aux is None else aux.float()
        loss = ce = None
        if targets is not None:
            B, S = idx.shape
            ce = F.cross_entropy(logits.view(B * S, -1), targets.reshape(-1))
            loss = ce + self.cfg.aux_loss_coef * aux
        return LMOutput(logits, loss, ce, aux, zero, list(self._counts))


def _quantized_filter(model: nn.Module, quantized: tuple[str, ...]) -> ModuleFilter:
    """convert's module filter for ModelConfig.quantized: "attention" (modules under a
    ``self_attn``), "dense" (other linear layers but routers), "lm_head"."""
    head = model.get_output_embeddings()

    def keep(module: nn.Module, fqn: str) -> bool:
        if module is head or fqn.rsplit(".", 1)[-1] == "lm_head":
            return "lm_head" in quantized
        if fqn.rsplit(".", 1)[-1] in _ROUTER_NAMES:
            return False
        return ("attention" if ".self_attn." in f".{fqn}." else "dense") in quantized

    return keep


def build_causal_lm(cfg: ModelConfig, recipe: Recipe | str) -> TransformersCausalLM:
    """The trainer's model for ``cfg.hf_config``: ``AutoModelForCausalLM.from_config`` (random
    init from torch's current seed), parameters in ``cfg.dtype``, converted by
    :func:`convert_model` with ``recipe`` for the GEMMs in ``cfg.quantized`` (the experts
    backend of the recipe if "experts" is listed, else ``mxmoe_bf16``).

    Raises:
        ValueError: ``cfg.hf_config`` is None, or as :func:`convert_model`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.hf_config is None:
        raise ValueError("build_causal_lm needs a ModelConfig with hf_config (a transformers config dict)")
    recipe = get_recipe(recipe)
    config = AutoConfig.for_model(**cfg.hf_config)
    model = AutoModelForCausalLM.from_config(config).to(cfg.torch_dtype)
    convert_model(model, recipe, _quantized_filter(model, cfg.quantized), experts=False)
    check_experts(model)
    register()
    model.set_experts_implementation(backend_name(recipe) if "experts" in cfg.quantized else "mxmoe_bf16")
    return TransformersCausalLM(model, cfg)


__all__ = [
    "BACKENDS",
    "TESTED_VERSIONS",
    "ExpertsLayout",
    "TransformersCausalLM",
    "backend_name",
    "build_causal_lm",
    "check_experts",
    "convert_model",
    "default_module_filter",
    "experts_forward",
    "experts_layout",
    "family",
    "hf_config_dict",
    "is_experts_module",
    "model_config_from_hf",
    "register",
]
