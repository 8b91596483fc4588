"""MXFP8 weight copies made once per optimizer step: the weight-copy cache.

The MXFP8 GEMMs quantize each weight along the contraction dimension of the GEMM that
reads it: the forward along K (w_NK / w_ENK blocked along its last dimension) and the
dgrad along N (blocked along the dimension before it). Made per call, each copy is a
read and a write of the whole weight; at E = 64 experts that is 22-43% of the grouped
GEMM's time on the H200. A weight changes only at the
optimizer step, so with gradient accumulation over M micro-batches one quantization per
step can serve all 2M of those GEMMs. Transformer Engine does the same for its FP8
weights (``is_first_microbatch``), and so do Megatron's FP8 parameters; ``torch.autocast``
keeps a cache of its weight casts in the same scoped way.

Usage::

    with mxmoe.weight_copy_cache():
        for x, y in micro_batches:
            loss_fn(model(x), y).backward()
    optimizer.step()

Inside the context, the first forward that uses a weight makes both of its copies,
from one read of the weight where the Triton backend runs (:func:`~mxmoe.ops.quantize.fake_quantize_rowcol`).
Later calls reuse the copies while the weight is unchanged: the same tensor, storage,
shape and version counter (in-place updates such as ``optimizer.step()`` bump the counter,
so updates by the usual optimizers are seen; see the list of exceptions below).
Leaving the outermost context frees the copies. A
backward that runs after the context has closed still gets the dgrad copy made in its
forward, because the autograd ops keep that copy with their saved state.

In ``mx_grouped_mm`` under the bf16 recipe the cached copy is the weight's bf16 cast (one copy serves both
GEMMs), so BF16 and MXFP8 runs with gradient accumulation compare like for like.

Costs: the MXFP8 copies take 2 x the weight's elements in the GEMM operand dtype while the
context is open. The cache is skipped, and every call quantizes, while a CUDA graph is
being captured: a replay would otherwise keep reading copies made before the optimizer's
update. Numerics do not change: a cached copy is bit for bit the per-call copy.

Update weights outside the context: open it per optimizer step and call
``optimizer.step()`` after leaving it. Some writes do not bump a tensor's version counter,
so a copy made before them would be reused: writes through ``w.data`` (also
``Module.to()`` round trips, which reassign ``.data``), fused optimizers
(``torch.optim.AdamW(fused=True)`` on this CPU build), ``torch.distributed`` in-place
collectives (broadcast, all_reduce). The cache is process-wide (autograd runs CUDA
backwards on its own threads), not used under ``torch.compile`` tracing, nor for
inference tensors. The copies are in the GEMM's operand dtype (bf16 for bf16
activations and the fused MoE op; float32 for float32 activations).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..recipe import Recipe
from .quantize import fake_quantize_operand, fake_quantize_rowcol

FWD_DIM = -1  # the forward GEMM contracts over K, the weight's last dimension
DGRAD_DIM = -2  # the dgrad contracts over N, the dimension before it


@dataclass
class _Entry:
    ref: weakref.ref
    version: int
    data_ptr: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    strides: tuple[int, ...]
    copies: dict[int, Tensor] = field(default_factory=dict)  # blocked dim -> dequantized copy

    def valid_for(self, w: Tensor) -> bool:
        return (self.ref() is w and self.version == w._version and self.data_ptr == w.data_ptr()
                and self.shape == tuple(w.shape) and self.dtype == w.dtype and self.strides == w.stride())


class WeightCopyCache:
    """The state of one :func:`weight_copy_cache` context: copies by weight and recipe.

    Attributes:
        hits: weight copies served from the cache.
        misses: weight copies made (one pass may make two).
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, _Entry] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return sum(len(e.copies) for e in self._entries.values())

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached copies (a cast equal to its weight counts as 0)."""
        return sum(c.nbytes for e in self._entries.values() for c in {id(c): c for c in e.copies.values()}.values()
                   if e.ref() is None or c.data_ptr() != e.ref().data_ptr())

    def clear(self) -> None:
        """Frees every copy (the counters stay)."""
        self._entries.clear()

    def put(self, w: Tensor, recipe: Recipe, out_dtype: torch.dtype, copies: dict[int, Tensor]) -> None:
        """Hold ``copies`` ({FWD_DIM or DGRAD_DIM: tensor of w's shape in ``out_dtype``}) as
        ``w``'s copies under ``recipe``, made elsewhere: the caller vouches that each equals
        what :meth:`copies` would make from ``w`` (an expert weight gathered as MXFP8 codes
        and scales, :mod:`mxmoe.distributed.mx_gather`, whose ``w`` holds only the forward
        copy's values, from which the dgrad copy could not be made again).

        Raises:
            ValueError: a key other than FWD_DIM / DGRAD_DIM, or a copy of another shape or dtype.
        """
        for dim, c in copies.items():
            if dim not in (FWD_DIM, DGRAD_DIM) or c.shape != w.shape or c.dtype != out_dtype:
                raise ValueError(f"a weight copy must be keyed FWD_DIM or DGRAD_DIM and have the weight's shape "
                                 f"{tuple(w.shape)} and dtype {out_dtype}; got {dim}: {tuple(c.shape)} {c.dtype}")
        key = (id(w), recipe.quantize, recipe.fmt, recipe.scale_mode, recipe.block_size, recipe.backend, out_dtype)
        entries = self._entries

        def drop(ref: weakref.ref, key: tuple = key) -> None:
            if (e := entries.get(key)) is not None and e.ref is ref:
                del entries[key]

        entry = _Entry(weakref.ref(w, drop), w._version, w.data_ptr(), tuple(w.shape), w.dtype, w.stride())
        entry.copies.update(copies)
        entries[key] = entry

    def copies(self, w: Tensor, recipe: Recipe, out_dtype: torch.dtype, dims: tuple[int, ...]) -> tuple[Tensor, ...]:
        """The copies of ``w`` blocked along each of ``dims`` (FWD_DIM, DGRAD_DIM), made
        on a miss (both from one read when both are missing) and kept."""
        key = (id(w), recipe.quantize, recipe.fmt, recipe.scale_mode, recipe.block_size, recipe.backend, out_dtype)
        entry = self._entries.get(key)
        if entry is None or not entry.valid_for(w):
            entries = self._entries

            def drop(ref: weakref.ref, key: tuple = key) -> None:  # the weight died: free its copies
                if (e := entries.get(key)) is not None and e.ref is ref:
                    del entries[key]

            entry = _Entry(weakref.ref(w, drop), w._version, w.data_ptr(), tuple(w.shape), w.dtype, w.stride())
            entries[key] = entry
        if not recipe.quantize:  # a plain cast (the bf16 recipe): one copy serves both GEMMs
            hit = FWD_DIM in entry.copies
            self.hits += hit
            self.misses += not hit
            if not hit:
                entry.copies[FWD_DIM] = w.to(out_dtype)
            return tuple(entry.copies[FWD_DIM] for _ in dims)
        missing = [d for d in dims if d not in entry.copies]
        self.hits += len(dims) - len(missing)
        self.misses += len(missing)
        if len(missing) == 2:
            entry.copies[FWD_DIM], entry.copies[DGRAD_DIM] = fake_quantize_rowcol(w, recipe, out_dtype=out_dtype)
        elif missing:
            entry.copies[missing[0]] = fake_quantize_operand(w, recipe, dim=missing[0], out_dtype=out_dtype)
        return tuple(entry.copies[d] for d in dims)


_ACTIVE: list[WeightCopyCache] = []  # process-wide: autograd runs CUDA backwards on its own threads


class weight_copy_cache:  # noqa: N801 (a context manager used like a function, as torch.no_grad)
    """Context manager: inside it, the MXFP8 ops make each weight's quantized copies once
    and reuse them while the weight is unchanged (module docstring). Nested contexts
    share the outermost one's cache; leaving the outermost frees the copies.

    ``with weight_copy_cache() as cache:`` gives the :class:`WeightCopyCache`
    (``cache.hits``, ``cache.misses``, ``len(cache)``).
    """

    def __enter__(self) -> WeightCopyCache:
        _ACTIVE.append(WeightCopyCache() if not _ACTIVE else _ACTIVE[-1])
        return _ACTIVE[-1]

    def __exit__(self, *exc) -> None:
        cache = _ACTIVE.pop()
        if not _ACTIVE:  # the outermost context (also when one instance is re-entered)
            cache.clear()


def active_cache(w: Tensor | None = None) -> WeightCopyCache | None:
    """The open cache, or None outside a context, while a CUDA graph is captured, under
    ``torch.compile`` tracing, and for an inference tensor ``w`` (no version counter)."""
    if not _ACTIVE:
        return None
    if w is not None and w.is_inference():
        return None
    if torch.compiler.is_compiling():
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    return _ACTIVE[-1]


def weight_operands(w: Tensor, recipe: Recipe, out_dtype: torch.dtype, dgrad: bool) -> tuple[Tensor, Tensor | None]:
    """The forward operand of ``w`` (N, K) or (E, N, K), quantized along K and dequantized
    to ``out_dtype``, and, when a cache is open and ``dgrad``, the dgrad operand (along N)
    made in the same pass. Outside a cache the dgrad operand is None: the backward makes
    it then, so it does not live from forward to backward. For a recipe that does not
    quantize (bf16) both operands are ``w`` cast to ``out_dtype``, cached the same way, so
    that a BF16 baseline gets the same once-per-step treatment."""
    cache = active_cache(w)
    if not recipe.quantize and (cache is None or w.dtype == out_dtype):
        return w.to(out_dtype), (w.to(out_dtype) if dgrad and cache is not None else None)
    if cache is None:
        return fake_quantize_operand(w, recipe, dim=FWD_DIM, out_dtype=out_dtype), None
    if not dgrad:
        return cache.copies(w, recipe, out_dtype, (FWD_DIM,))[0], None
    return cache.copies(w, recipe, out_dtype, (FWD_DIM, DGRAD_DIM))


def dgrad_operand(w: Tensor, recipe: Recipe, out_dtype: torch.dtype, made: Tensor | None) -> Tensor:
    """The dgrad operand of ``w`` (along N): ``made`` in the forward if given, else from
    the cache if one is open, else quantized now."""
    if made is not None:
        return made
    cache = active_cache(w)
    if not recipe.quantize and (cache is None or w.dtype == out_dtype):
        return w.to(out_dtype)
    if cache is None:
        return fake_quantize_operand(w, recipe, dim=DGRAD_DIM, out_dtype=out_dtype)
    return cache.copies(w, recipe, out_dtype, (DGRAD_DIM,))[0]
