"""Precision recipes: which GEMM operands are quantized, to what, and how.

A :class:`Recipe` is one object passed down from the trainer to every GEMM; there is no
global precision state. Named recipes:

- ``"bf16"``: no quantization; GEMM operands in bfloat16, float32 accumulation.
- ``"mxfp8"``: MXFP8 everywhere (E4M3 elements, E8M0 scales, block 32, ``rceil`` scales):
  the forward, dgrad and wgrad GEMMs each read operands quantized along their own
  contraction dimension, every copy from the high-precision tensor (docs/NUMERICS.md,
  "Quantizing for training").
- ``"mxfp8-floor"``: as ``mxfp8`` with the OCP ``floor`` scale rule.
- ``"mxfp8-bf16-wgrad"``: as ``mxfp8`` but the weight-gradient GEMM runs on unquantized
  operands (a common hedge: wgrad accumulates over all tokens and is the most sensitive).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .numerics.formats import MX_BLOCK_SIZE, ElemFormat, ScaleMode


BACKENDS = ("auto", "reference", "triton")
"""Quantizer backends: "auto" (the rule of :func:`mxmoe.ops.backend.use_triton`), "reference"
(pure torch, :mod:`mxmoe.numerics`) or "triton" (the kernels of :mod:`mxmoe.kernels`)."""


@dataclass(frozen=True)
class Recipe:
    """How the GEMMs of a training step are computed.

    Attributes:
        name: the recipe's name (as given to :func:`get_recipe`).
        quantize: False: plain bf16 GEMMs. True: MX-quantized operands.
        fmt: element format of every quantized GEMM operand (E4M3 for MXFP8).
        scale_mode: ``rceil`` (default, NVIDIA recipe) or ``floor`` (OCP).
        wgrad_high_precision: run the weight-gradient GEMM on unquantized operands.
        block_size: elements per scale block (32, the OCP value).
        backend: quantizer backend, "auto" (Triton kernels for CUDA tensors in float32 or
            bfloat16, the pure-torch reference otherwise), "reference" or "triton" (which
            refuses what it does not cover, float16 activations for one). Every backend
            gives the same codes, scales and dequantized values (a NaN block dequantizes
            to NaN whose payload bits follow the device's float conversion), so the
            choice changes speed only.
    """

    name: str
    quantize: bool
    fmt: ElemFormat = ElemFormat.E4M3
    scale_mode: ScaleMode = ScaleMode.RCEIL
    wgrad_high_precision: bool = False
    block_size: int = MX_BLOCK_SIZE
    backend: str = "auto"


RECIPES: dict[str, Recipe] = {
    "bf16": Recipe("bf16", quantize=False),
    "mxfp8": Recipe("mxfp8", quantize=True),
    "mxfp8-floor": Recipe("mxfp8-floor", quantize=True, scale_mode=ScaleMode.FLOOR),
    "mxfp8-bf16-wgrad": Recipe("mxfp8-bf16-wgrad", quantize=True, wgrad_high_precision=True),
}


def get_recipe(recipe: "Recipe | str", **overrides) -> Recipe:
    """Return the recipe named ``recipe`` (or ``recipe`` itself), with fields overridden.

    Args:
        recipe: a :class:`Recipe` or one of the names in :data:`RECIPES`.
        **overrides: fields to replace, e.g. ``scale_mode="floor"``,
            ``wgrad_high_precision=True``.

    Raises:
        ValueError: unknown recipe name or field; an override of the wrong kind.
    """
    if isinstance(recipe, Recipe):
        base = recipe
    elif isinstance(recipe, str) and recipe in RECIPES:
        base = RECIPES[recipe]
    else:
        raise ValueError(f"unknown recipe {recipe!r}; use one of {', '.join(map(repr, RECIPES))}")
    if not overrides:
        return base
    fields = {f.name for f in dataclasses.fields(Recipe)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"unknown recipe field(s) {sorted(unknown)}; fields are {sorted(fields)}")
    for name in ("quantize", "wgrad_high_precision"):
        if name in overrides and not isinstance(overrides[name], bool):
            raise ValueError(f"recipe field {name} must be True or False, got {overrides[name]!r}")
    if "block_size" in overrides:
        bs = overrides["block_size"]
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"recipe field block_size must be a positive int (32 for MX), got {bs!r}")
    if "fmt" in overrides:
        overrides["fmt"] = ElemFormat.parse(overrides["fmt"])
    if "scale_mode" in overrides:
        overrides["scale_mode"] = ScaleMode.parse(overrides["scale_mode"])
    if "backend" in overrides and overrides["backend"] not in BACKENDS:
        raise ValueError(f"unknown backend {overrides['backend']!r}; use one of {BACKENDS}")
    return dataclasses.replace(base, **overrides)
