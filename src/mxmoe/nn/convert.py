"""``convert_to_mxfp8``: switch the GEMMs of an existing PyTorch model to MXFP8 in place.

In the style of torchao's ``convert_to_float8_training(model, module_filter_fn=...)``:
every eligible ``nn.Linear`` is replaced by an :class:`~mxmoe.nn.MXLinear` holding the same
Parameter objects, and every mxmoe MoE block (:class:`~mxmoe.nn.MoE`,
:class:`~mxmoe.nn.GroupedExperts`, and :class:`~mxmoe.nn.MXLinear` already there) is set to
the recipe. Parameters, their names and values, and so state_dicts and optimizers built
before the conversion, are unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from ..recipe import Recipe, get_recipe
from .linear import MXLinear
from .moe import GroupedExperts, MoE

logger = logging.getLogger("mxmoe")

ModuleFilter = Callable[[nn.Module, str], bool]
"""``module_filter_fn(module, fqn) -> bool``: True converts the module, False keeps it.
``fqn`` is the module's name in ``model.named_modules()`` ("" for the model itself)."""

_MXMOE_MODULES = (MXLinear, MoE, GroupedExperts)


_MX_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _dtype_reason(linear: nn.Linear) -> str | None:
    """Why ``linear`` cannot run the MX ops because of its weight dtype (None if it can)."""
    if linear.weight.dtype not in _MX_WEIGHT_DTYPES:
        return f"weight dtype {linear.weight.dtype}: the MX ops take float32, bfloat16 or float16"
    return None


def _shape_reason(linear: nn.Linear, block: int) -> str | None:
    """Why ``linear`` cannot take the MX layout, or None: K (in_features) and N
    (out_features) must be multiples of the block size (each GEMM blocks one of them)."""
    bad = [f"{name}={n}" for name, n in (("K", linear.in_features), ("N", linear.out_features)) if n % block]
    if not bad:
        return None
    return f"{' and '.join(bad)} not {'a multiple' if len(bad) == 1 else 'multiples'} of {block}"


def convert_to_mxfp8(model: nn.Module, recipe: Recipe | str = "mxfp8",
                     module_filter_fn: ModuleFilter | None = None) -> nn.Module:
    """Run the linear and MoE GEMMs of ``model`` under an MXFP8 recipe, in place.

    What is converted:

    - every module of type exactly ``nn.Linear`` whose in_features (K) and out_features
      (N) are multiples of the recipe's block size (32, the MX block: the forward GEMM
      blocks along K, the dgrad along N) is replaced by
      ``MXLinear.from_float(linear, recipe)``, which holds the same Parameter objects;
    - every :class:`~mxmoe.nn.MoE`, :class:`~mxmoe.nn.GroupedExperts` and
      :class:`~mxmoe.nn.MXLinear` gets ``set_recipe(recipe)`` (so the function is
      idempotent, and a model built with ``MoE(recipe="bf16")`` trains its experts in
      MXFP8 afterwards). The MoE router is not an nn.Linear and always stays in float32.

    ``module_filter_fn(module, fqn)`` is called for each of these candidates (fqn: its
    name in ``model.named_modules()``); False keeps the module as it is. By default
    nothing else is excluded; models usually keep the LM head (and a router of their own,
    if it is an nn.Linear) in high precision, e.g.
    ``module_filter_fn=lambda m, fqn: fqn != "lm_head" and not fqn.endswith("router")``.

    Modules kept in high precision (nn.Linear of other shapes, subclasses of nn.Linear
    such as ``nn.MultiheadAttention.out_proj``, whose owner reads the weight without
    calling the module, filtered-out modules) are listed in one INFO line of the
    ``"mxmoe"`` logger: ``convert_to_mxfp8: kept 2 modules in high precision: head
    (K=30 not a multiple of 32), lm_head (excluded by module_filter_fn); ...`` (a filter
    with a ``description`` attribute is named by it).

    Call it before wrapping the model (FSDP, DDP, ``torch.compile``) and before
    :func:`mxmoe.distributed.shard_experts`, which copies the recipe of each MoE.

    Args:
        model: any ``nn.Module``.
        recipe: a :class:`~mxmoe.recipe.Recipe` or its name ("mxfp8", "mxfp8-floor",
            "mxfp8-bf16-wgrad"; "bf16" works too and gives bf16 GEMMs).
        module_filter_fn: see above; None converts every candidate.

    Returns:
        ``model``, modified in place (the state_dict keys and values are unchanged). If
        ``model`` itself is an eligible nn.Linear, the new MXLinear (it cannot replace
        itself in its parent).

    Raises:
        ValueError: unknown recipe, or a recipe a module refuses (an ``MoE`` with
            ``mx_dispatch`` and a recipe that does not quantize); raised before anything is
            changed. TypeError: ``model`` not an nn.Module, ``module_filter_fn`` not callable.
    """
    recipe = get_recipe(recipe)
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_to_mxfp8 takes an nn.Module, got {type(model).__name__}")
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(f"module_filter_fn must be callable as (module, fqn) -> bool, got {module_filter_fn!r}")
    kept: list[str] = []
    to_set: list[nn.Module] = []  # mxmoe modules that take the recipe
    # how the log names the filter: a filter may say what it is (``description``)
    excluded_by = f"excluded by {getattr(module_filter_fn, 'description', 'module_filter_fn')}"

    # Plan first, change nothing: every check that can raise runs before the model is touched.
    def plan_one(module: nn.Module, fqn: str) -> nn.Module:
        """The module that replaces ``module`` (itself if none); queues recipe changes."""
        if not isinstance(module, (nn.Linear, *_MXMOE_MODULES)):
            return module
        label = fqn or f"<model: {type(module).__name__}>"
        allowed = module_filter_fn is None or bool(module_filter_fn(module, fqn))
        if isinstance(module, _MXMOE_MODULES):
            if allowed:
                module._check_recipe(recipe)
                to_set.append(module)
            elif not module.recipe.quantize:
                kept.append(f"{label} ({excluded_by}, recipe {module.recipe.name})")
            return module
        if type(module) is not nn.Linear:
            kept.append(f"{label} ({type(module).__name__}, a subclass of nn.Linear: not swapped)")
            return module
        if not allowed:
            kept.append(f"{label} ({excluded_by})")
            return module
        reason = _shape_reason(module, recipe.block_size) or _dtype_reason(module)
        if reason is not None:
            kept.append(f"{label} ({reason})")
            return module
        return MXLinear.from_float(module, recipe)  # shares the Parameters; the model is unchanged

    result = plan_one(model, "")
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    if result is model:
        done: dict[int, nn.Module] = {}  # a module reachable under two names is converted once
        for parent_name, parent in list(model.named_modules()):
            # _modules, not named_children(): that skips a second name of the same child
            for child_name, child in list(parent._modules.items()):
                if child is None:
                    continue
                if id(child) not in done:
                    done[id(child)] = plan_one(child, f"{parent_name}.{child_name}" if parent_name else child_name)
                if done[id(child)] is not child:
                    swaps.append((parent, child_name, done[id(child)]))
    # Apply.
    for module in to_set:
        module.set_recipe(recipe)
    for parent, child_name, new in swaps:
        setattr(parent, child_name, new)
    counts = {"linear": len({id(new) for _, _, new in swaps}) + (result is not model), "mxmoe": len(to_set)}
    listed = f": {', '.join(kept)}" if kept else ""
    logger.info("convert_to_mxfp8: kept %d modules in high precision%s; converted %d nn.Linear to MXLinear, "
                "set recipe %s on %d mxmoe modules", len(kept), listed, counts["linear"], recipe.name,
                counts["mxmoe"])
    return result
