"""Export a training checkpoint as safetensors (MXFP8 or bf16 weights), load either kind
back, and evaluate either on the validation split.

File layout of ``mxmoe export CKPT OUT.safetensors --format mxfp8``:

- Each weight the recipe quantizes (``ModelConfig.quantized``: expert ``w13`` (E, 2F, D)
  and ``w2`` (E, D, F) and a shared expert's under "experts"; attention ``wqkv`` (3D, D) and
  ``wo`` (D, D) under "attention"; dense SwiGLU ``w13``, ``w2`` under "dense"; ``lm_head``
  under "lm_head") is stored as two tensors named after its state-dict key:

  - ``<key>.e4m3``: ``float8_e4m3fn`` element codes, the weight's shape with the last
    dim K (the GEMM contraction dim of y = x W^T) zero padded to a multiple of 32;
  - ``<key>.e8m0``: ``uint8`` scales, one per block of 32 consecutive elements along K,
    shape (..., ceil(K / 32)); byte b means 2^(b - 127), 255 is NaN (OCP MX v1.0 E8M0,
    stored as plain bytes so that any safetensors reader can load it; view it as
    ``torch.float8_e8m0fnu`` to get the E8M0 dtype).

  For example ``blocks.0.ffn.experts.w13.e4m3`` (E, 2F, D) and
  ``blocks.0.ffn.experts.w13.e8m0`` (E, 2F, D / 32). The weight is
  ``e4m3.float() * 2 ** (e8m0.float() - 127)`` blockwise, cut back to K. Quantized with
  :func:`mxmoe.quantize_mx` from the float32 master weight, with the training recipe's
  scale rule (rceil unless it was mxfp8-floor): the same bytes the recipe's forward GEMM
  reads.
- Every other parameter (embedding, norms, routers, and any GEMM the recipe leaves in
  high precision) is stored under its state-dict key in ``bfloat16``.
- ``--format bf16`` stores every parameter in ``bfloat16`` under its key.
- The metadata key ``"mxmoe"`` holds JSON: ``format_version``, ``format`` ("mxfp8" or
  "bf16"), ``elem_format`` ("e4m3"), ``block_size`` (32), ``scale_mode``,
  ``scale_encoding``, ``blocked_dim`` (-1), ``quantized`` (key -> original shape), ``model``
  (the ModelConfig), ``train`` (the TrainConfig, for the validation split), ``step`` and
  ``source``.

The file is written atomically (a temp file beside it, renamed over it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..models import ModelConfig, build_model
from ..numerics.formats import MX_BLOCK_SIZE, ElemFormat, ScaleMode
from ..numerics.mx_tensor import MXTensor
from ..ops.quantize import dequantize_mx, quantize_mx
from ..recipe import RECIPES, get_recipe
from .checkpoint import (
    CHECKPOINT_NAME,
    atomic_write_bytes,
    changed_tensors,
    check_finite_state,
    check_regular_file,
    resolve_checkpoint_path,
    state_checksums,
)
from .sharded_checkpoint import has_sharded_checkpoint
from .data import eval_batches, load_corpus
from .trainer import MAX_EVAL_TOKENS, TrainConfig, check_model_state, evaluate, resolve_device
from .trainer import load_training_checkpoint as load_checkpoint_of_run

EXPORT_FORMATS = ("mxfp8", "bf16")
FORMAT_VERSION = 1
METADATA_KEY = "mxmoe"
DATA_SUFFIX = ".e4m3"
SCALE_SUFFIX = ".e8m0"
SCALE_ENCODING = "uint8 E8M0: byte b is 2^(b - 127), 255 is NaN"
_SAFETENSORS_HEADER_BYTES = 8  # little-endian u64 length of the JSON header, then the header


def quantized_weight_keys(cfg: ModelConfig) -> list[str]:
    """State-dict keys of the weights that the recipe quantizes in a model of ``cfg``
    (the GEMMs named in ``cfg.quantized``), in model order."""
    keys = []
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        if "attention" in cfg.quantized:
            keys += [p + "attn.wqkv", p + "attn.wo"]
        if cfg.is_moe_layer(i):
            if "experts" in cfg.quantized:
                keys += [p + "ffn.experts.w13", p + "ffn.experts.w2"]
                if cfg.shared_expert:
                    keys += [p + "ffn.shared.w13", p + "ffn.shared.w2"]
        elif "dense" in cfg.quantized:
            keys += [p + "ffn.w13", p + "ffn.w2"]
    if "lm_head" in cfg.quantized:
        keys.append("lm_head")
    return keys


@dataclass
class Source:
    """Weights to evaluate: a training checkpoint or an exported file.

    Attributes:
        kind: "checkpoint", or the export format ("mxfp8", "bf16").
        cfg: the run's TrainConfig (model shape, recipe, data, batch shape).
        state: state dict, float32 CPU tensors (MXFP8 weights dequantized exactly).
        step: the training step the weights are from.
        path: the file read.
    """

    kind: str
    cfg: TrainConfig
    state: dict[str, Tensor]
    step: int
    path: Path


def is_safetensors(path: Path) -> bool:
    """Whether ``path`` starts like a safetensors file (u64 header length, then ``{``)."""
    with open(path, "rb") as f:
        head = f.read(_SAFETENSORS_HEADER_BYTES + 1)
    if len(head) <= _SAFETENSORS_HEADER_BYTES:
        return False
    n = int.from_bytes(head[:_SAFETENSORS_HEADER_BYTES], "little")
    return head[_SAFETENSORS_HEADER_BYTES:] == b"{" and n < path.stat().st_size


def is_mxmoe_export(path: Path) -> bool:
    """Whether the regular file ``path`` is a safetensors file with mxmoe export metadata
    (the header is read, not the tensors)."""
    from safetensors import SafetensorError, safe_open

    try:
        if not is_safetensors(path):
            return False
        with safe_open(path, framework="pt") as f:
            return METADATA_KEY in (f.metadata() or {})
    except (OSError, SafetensorError):
        return False


def load_training_checkpoint(path: str | Path) -> Source:
    """A checkpoint.pt (or a run directory holding one) as a :class:`Source`.

    Read with :func:`mxmoe.train.trainer.load_training_checkpoint`, the loader of
    ``train --resume`` (``weights_only``: nothing in the file is run; checksums, structure,
    settings and weight shapes checked).

    Raises:
        FileNotFoundError: no such file. ValueError: a file holding Python objects other
        than tensors and plain data (refused); a directory; not an mxmoe checkpoint, or
        a damaged one.
    """
    path, ckpt, cfg = load_checkpoint_of_run(path)
    state = {k: v.float() for k, v in ckpt["model"].items()}
    return Source("checkpoint", cfg, state, int(ckpt["step"]), path)


def export_checkpoint(src: str | Path, dst: str | Path, fmt: str = "mxfp8",
                      scale_mode: ScaleMode | str | None = None) -> dict[str, Any]:
    """Write the weights of training checkpoint ``src`` to ``dst`` as safetensors (layout
    in the module docstring).

    Args:
        src: a run directory or its checkpoint.pt.
        dst: the output file (replaced atomically if it exists).
        fmt: "mxfp8" (quantized weights as E4M3 + E8M0, the rest bf16) or "bf16".
        scale_mode: "rceil" or "floor" (default: the training recipe's, rceil for bf16).

    Returns:
        The metadata written (a dict; also under ``"mxmoe"`` in the file, as JSON).

    Raises:
        FileNotFoundError: ``src`` does not exist.
        ValueError: unknown ``fmt`` or ``scale_mode``; ``dst`` is a directory (or ends in a
            path separator), is ``src``'s checkpoint file, or exists and is not an earlier
            mxmoe export (a run's metrics.jsonl, a device, a FIFO: never replaced); ``src`` is not an mxmoe
            checkpoint, or one of a transformers model (``--hf-config``).
    """
    from safetensors.torch import save

    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; use one of {', '.join(EXPORT_FORMATS)}")
    if fmt == "bf16" and scale_mode is not None:
        raise ValueError(f"--scale-mode {scale_mode} chooses the MXFP8 scales; --format bf16 stores no scales: drop "
                         f"--scale-mode or use --format mxfp8")
    if str(dst).endswith(("/", os.sep)):
        raise ValueError(f"{str(dst)!r} names a directory; pass a file name such as {dst!s}model.safetensors")
    dst = Path(dst)
    if dst.is_dir():
        raise ValueError(f"{str(dst)!r} is a directory; pass a file name such as model.safetensors")
    if str(src).strip() and Path(src).is_file() and is_mxmoe_export(Path(src)):
        raise ValueError(f"{str(src)!r} is already an mxmoe export; mxmoe export reads a training checkpoint (a run "
                         f"directory or its checkpoint.pt)")
    source = load_training_checkpoint(src)
    if source.cfg.model.hf_config is not None:
        raise ValueError(f"{str(src)!r} trained a transformers model ({source.cfg.model.hf_config['model_type']}); "
                         f"mxmoe export writes mxmoe's own model: load its state dict into the transformers model "
                         f"and use save_pretrained")
    if dst.exists() and os.path.samefile(dst, source.path):
        raise ValueError(f"{str(dst)!r} is the checkpoint being exported: writing there would replace the training "
                         f"checkpoint; pass another file name such as model.safetensors")
    if dst.exists() or dst.is_symlink():  # replace only an earlier export: never a run's files or /dev/null
        check_regular_file(dst, "a safetensors file")
        if not is_mxmoe_export(dst):
            raise ValueError(f"{str(dst)!r} exists and is not an mxmoe export (it could be a run's metrics.jsonl or "
                             f"config.json); mxmoe export replaces only an earlier export: pass a new file name")
    recipe = get_recipe(source.cfg.recipe)
    mode = ScaleMode.parse(scale_mode) if scale_mode is not None else (
        recipe.scale_mode if recipe.quantize else ScaleMode.RCEIL)
    qkeys = quantized_weight_keys(source.cfg.model) if fmt == "mxfp8" else []
    missing = [k for k in qkeys if k not in source.state]
    if missing:
        raise ValueError(f"the checkpoint has no weights {missing}; it does not match its own model config")
    tensors: dict[str, Tensor] = {}
    shapes: dict[str, list[int]] = {}
    for key, w in source.state.items():
        if key in qkeys:
            mx = quantize_mx(w, ElemFormat.E4M3, block_size=MX_BLOCK_SIZE, dim=-1, scale_mode=mode, pad=True)
            tensors[key + DATA_SUFFIX] = mx.qdata.contiguous()
            tensors[key + SCALE_SUFFIX] = mx.scale.view(torch.uint8).contiguous()
            shapes[key] = list(w.shape)
        else:
            tensors[key] = w.to(torch.bfloat16).contiguous()
    meta = {
        "format_version": FORMAT_VERSION, "format": fmt, "elem_format": ElemFormat.E4M3.value,
        "block_size": MX_BLOCK_SIZE, "scale_mode": mode.value, "scale_encoding": SCALE_ENCODING,
        "blocked_dim": -1, "quantized": shapes, "model": source.cfg.model.to_dict(),
        "train": source.cfg.to_dict(), "step": source.step, "source": str(source.path),
        # sha256 of every tensor's dtype, shape and bytes: load_export refuses a file whose bytes changed
        "checksums": state_checksums(tensors)["tensors"],
    }
    data = save(tensors, metadata={METADATA_KEY: json.dumps(meta)})
    atomic_write_bytes(dst, lambda f: f.write(data))
    return meta


def load_export(path: str | Path) -> Source:
    """An exported safetensors file as a :class:`Source`: MXFP8 weights dequantized
    exactly to float32 with :func:`mxmoe.dequantize_mx`, bf16 tensors widened to float32.

    Raises:
        FileNotFoundError: no such file. ValueError: not an mxmoe export, or a malformed
        one (metadata fields or tensors missing or of the wrong kind, weights that do not
        fit the model of its settings), in one line naming the file.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist")
    try:
        with safe_open(path, framework="pt") as f:
            raw = (f.metadata() or {}).get(METADATA_KEY)
            if raw is None:
                raise ValueError(f"{str(path)!r} has no {METADATA_KEY!r} metadata: not written by mxmoe export")
            try:
                meta = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{str(path)!r}: its {METADATA_KEY!r} metadata is not JSON ({e})") from None
            if not isinstance(meta, dict):
                raise ValueError(f"{str(path)!r}: its {METADATA_KEY!r} metadata is a {type(meta).__name__}, not the "
                                 f"JSON object mxmoe export writes")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as e:
        raise ValueError(f"{str(path)!r} is not a readable safetensors file ({e})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{str(path)!r} has export format version {meta.get('format_version')}; "
                         f"this mxmoe reads version {FORMAT_VERSION}")
    stored = meta.get("checksums")  # exports written before checksums were added have none
    if stored is not None:
        changed = changed_tensors(stored, state_checksums(tensors)["tensors"]) if isinstance(stored, dict) else []
        if changed or not isinstance(stored, dict):
            raise ValueError(f"{str(path)!r} is damaged: its tensors do not match the checksums stored in it "
                             f"({', '.join(changed[:3]) or 'the checksums entry is malformed'}); export it again")
    try:  # every field and tensor the metadata names, read as the layout of the module docstring says
        mode = ScaleMode.parse(meta["scale_mode"])
        state = {}
        for key, shape in meta["quantized"].items():
            qdata = tensors.pop(key + DATA_SUFFIX)
            scale = tensors.pop(key + SCALE_SUFFIX).view(torch.float8_e8m0fnu)
            mx = MXTensor(qdata, scale, ElemFormat.parse(meta["elem_format"]), meta["block_size"], qdata.dim() - 1,
                          mode, shape[-1])
            state[key] = dequantize_mx(mx, torch.float32)
            if list(state[key].shape) != list(shape):
                raise ValueError(f"{key} dequantizes to {tuple(state[key].shape)}, the metadata says {tuple(shape)}")
        state.update({k: v.float() for k, v in tensors.items()})
        cfg = TrainConfig.from_dict(meta["train"])
        cfg.validate()
        step = meta["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step {step!r} is not an integer >= 0")
        kind = meta["format"]
        if kind not in EXPORT_FORMATS:
            raise ValueError(f"format {kind!r} is not one of {', '.join(EXPORT_FORMATS)}")
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError, RuntimeError) as e:
        what = f"no {e}" if isinstance(e, KeyError) else " ".join(str(e).split())[:200]
        raise ValueError(f"{str(path)!r} is not a well-formed mxmoe export ({type(e).__name__}: {what})") from None
    check_model_state(path, state, cfg.model)
    check_finite_state(path, state, use="evaluated")  # NaN codes, scale byte 255, a NaN bf16 weight
    return Source(kind, cfg, state, step, path)


def load_source(path: str | Path) -> Source:
    """A run directory (its checkpoint.pt, or the sharded checkpoint of a 2-D mesh run),
    checkpoint.pt or exported safetensors file (told apart by content)."""
    if has_sharded_checkpoint(path) and not (Path(path) / CHECKPOINT_NAME).exists():  # a 2-D mesh run's directory
        return load_training_checkpoint(path)
    resolved = resolve_checkpoint_path(path)
    # by content; a damaged file named .safetensors gets the safetensors reader's message
    if is_safetensors(resolved) or resolved.suffix == ".safetensors":
        return load_export(resolved)
    return load_training_checkpoint(resolved)


@dataclass
class EvalResult:
    """Validation loss of a :class:`Source`: ``val_loss`` (mean cross entropy, nats per
    token) over ``batches`` fixed batches of ``batch_size`` x ``seq_len`` tokens of the
    validation split, under ``recipe`` on ``device``."""

    val_loss: float
    batches: int
    batch_size: int
    seq_len: int
    recipe: str
    device: str
    kind: str
    step: int
    path: str


def evaluate_source(path: str | Path, *, data: str | None = None, batch_size: int | None = None,
                    seq_len: int | None = None, n_batches: int | None = None, recipe: str | None = None,
                    quant_backend: str | None = None, device: str = "auto") -> EvalResult:
    """Validation loss of a checkpoint or an export, on the split the run was evaluated on.

    Args:
        path: run directory, checkpoint.pt or exported .safetensors.
        data, batch_size, seq_len, n_batches: default to the run's own (``data``,
            ``batch_size``, ``seq_len``, ``eval_batches``), so the loss is comparable with
            its metrics' ``val_loss``.
        recipe: recipe of the forward GEMMs (default: the run's). quant_backend: the
            quantizer (default: the run's).
        device: "auto", "cpu", "cuda" or "cuda:N".

    Raises:
        FileNotFoundError: missing ``path`` or data path.
        ValueError: bad values (unknown recipe, non-positive sizes, seq_len above the
            model's max_seq_len, a corpus too short), or not an mxmoe file.
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("n_batches", n_batches)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if recipe is not None and recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; use one of {', '.join(RECIPES)}")
    dev = resolve_device(device)
    src = load_source(path)
    cfg = src.cfg
    bs, sl = batch_size or cfg.batch_size, seq_len or cfg.seq_len
    n = n_batches or cfg.eval_batches
    if sl > cfg.model.max_seq_len:
        raise ValueError(f"seq_len {sl} exceeds the longest sequence the model was built for, {cfg.model.max_seq_len}")
    if n * bs * sl > MAX_EVAL_TOKENS:
        raise ValueError(f"n_batches x batch_size x seq_len = {n * bs * sl:,} tokens exceeds {MAX_EVAL_TOKENS:,} "
                         f"(2**27, held in memory at once); use fewer or smaller batches")
    corpus = load_corpus(data if data is not None else cfg.data)
    if corpus.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the corpus has token ids up to {corpus.vocab_size - 1}, beyond the model's vocab_size "
                         f"{cfg.model.vocab_size}")
    batches = eval_batches(corpus.val, bs, sl, n)
    name = recipe or cfg.recipe
    model = build_model(cfg.model, get_recipe(name, backend=quant_backend or cfg.quant_backend))
    model.load_state_dict(src.state)
    model.to(dev)
    loss = evaluate(model, batches, dev)
    return EvalResult(loss, n, bs, sl, name, str(dev), src.kind, src.step, str(src.path))
