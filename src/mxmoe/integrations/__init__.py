"""Adapters for other libraries. Nothing here imports them at import time: each adapter
module imports its library when it is imported itself, so mxmoe works without them.

- :mod:`mxmoe.integrations.transformers`: MXFP8 experts backends for Hugging Face
  transformers MoE models (``experts_implementation="mxfp8"``) and
  :func:`~mxmoe.integrations.transformers.convert_model` (needs ``pip install "mxmoe[hf]"``).
- the trainer's builder of transformers models (``ModelConfig.hf_config``, ``mxmoe train
  --hf-config``), registered with :func:`mxmoe.models.register_builder` on import.
- :func:`convert_to_mxfp8`: the package-level ``mxmoe.convert_to_mxfp8``; a transformers
  model goes to :func:`mxmoe.integrations.transformers.convert_model`, any other model to
  :func:`mxmoe.nn.convert_to_mxfp8`.
"""

from __future__ import annotations

import sys

from torch import nn

from ..models import ModelConfig, register_builder
from ..nn.convert import ModuleFilter
from ..nn.convert import convert_to_mxfp8 as convert_module
from ..recipe import Recipe


def is_transformers_model(model: object) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (False without transformers:
    no such model can exist before the library is imported)."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, getattr(tf, "PreTrainedModel", ()))


def convert_to_mxfp8(model: nn.Module, recipe: Recipe | str = "mxfp8", module_filter_fn: ModuleFilter | None = None,
                     **kwargs) -> nn.Module:
    """Run the GEMMs of ``model`` under an MXFP8 recipe, in place: a transformers model
    through :func:`mxmoe.integrations.transformers.convert_model` (attention and dense
    projections to MXLinear, router and LM head kept, the experts backend set; ``kwargs``
    go there), any other ``nn.Module`` through :func:`mxmoe.nn.convert_to_mxfp8` (see its
    docstring for what is converted and the errors raised).

    Raises:
        TypeError: keyword arguments other than ``recipe`` and ``module_filter_fn`` for a
            model that is not a transformers model. Otherwise as the function it calls.
    """
    if is_transformers_model(model):
        from .transformers import convert_model

        return convert_model(model, recipe, module_filter_fn, **kwargs)
    if kwargs:
        raise TypeError(f"convert_to_mxfp8 got {sorted(kwargs)}, which only a transformers model takes; "
                        f"{type(model).__name__} takes recipe and module_filter_fn")
    return convert_module(model, recipe, module_filter_fn)


def _build_transformers_model(cfg: ModelConfig, recipe: Recipe) -> nn.Module:
    """The trainer's builder for ``ModelConfig.hf_config`` (imports transformers only now)."""
    from .transformers import build_causal_lm

    return build_causal_lm(cfg, recipe)


register_builder("transformers", _build_transformers_model)

__all__ = ["convert_to_mxfp8", "is_transformers_model"]
