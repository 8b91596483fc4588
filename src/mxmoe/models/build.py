"""``build_model``: the model a :class:`~mxmoe.models.ModelConfig` describes.

:class:`~mxmoe.models.MoETransformer` for mxmoe's own configs; for a config with
``hf_config`` (a Hugging Face transformers model), the builder that
:mod:`mxmoe.integrations` registers under ``"transformers"`` (layers above this one
register builders here, so the trainer below them can build their models).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..recipe import Recipe, get_recipe
from .transformer import ModelConfig, MoETransformer

ModelBuilder = Callable[[ModelConfig, Recipe], nn.Module]
"""``builder(cfg, recipe) -> model``; the model's ``forward(idx, targets)`` returns an
:class:`~mxmoe.models.LMOutput` and it has ``num_params()`` and ``flops_per_token(seq_len)``
as :class:`~mxmoe.models.MoETransformer` does."""

_BUILDERS: dict[str, ModelBuilder] = {}


def register_builder(kind: str, builder: ModelBuilder) -> None:
    """Make :func:`build_model` build configs of ``kind`` with ``builder`` (registering the
    same kind again replaces it). Kinds: ``"transformers"`` (configs with ``hf_config``)."""
    _BUILDERS[kind] = builder


def build_model(cfg: ModelConfig, recipe: Recipe | str = "mxfp8") -> nn.Module:
    """The model of ``cfg`` under ``recipe``: :class:`MoETransformer`, or for a config with
    ``hf_config`` the registered transformers builder's model.

    Raises:
        ValueError: unknown recipe; a transformers config with no builder registered (the
            message says what to install).
    """
    recipe = get_recipe(recipe)
    if cfg.hf_config is None:
        return MoETransformer(cfg, recipe)
    if "transformers" not in _BUILDERS:
        raise ValueError(f"model_type {cfg.hf_config['model_type']!r} is a transformers model: "
                         f"pip install 'mxmoe[hf]' and import mxmoe (which registers its builder)")
    return _BUILDERS["transformers"](cfg, recipe)
