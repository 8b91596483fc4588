"""``mxmoe export`` and ``mxmoe eval``: parsers and commands (file layout in
:mod:`mxmoe.train.export`)."""

from __future__ import annotations

import argparse

from ..numerics.formats import ScaleMode
from ..recipe import BACKENDS
from ..recipe import RECIPES
from ..train.export import EXPORT_FORMATS, evaluate_source, export_checkpoint
from ..train.trainer import check_quant_backend_device, resolve_device


def cmd_export(args: argparse.Namespace) -> int:
    """`mxmoe export`: write a checkpoint's weights as safetensors (bf16, or MXFP8 codes + scales)."""
    meta = export_checkpoint(args.checkpoint, args.output, args.format, args.scale_mode)
    n_q = len(meta["quantized"])
    detail = (f"{n_q} weights as MXFP8 (E4M3 data + E8M0 scales, blocks of {meta['block_size']} along the last dim, "
              f"{meta['scale_mode']} scales), the rest in bf16" if args.format == "mxfp8" else "every weight in bf16")
    print(f"mxmoe export: wrote {args.output} from step {meta['step']} of {meta['source']}: {detail}")
    return 0


# evaluate_source's argument names in its messages, and the eval flags that set them
EVAL_FIELD_FLAGS = {"batch_size": "--batch-size", "seq_len": "--seq-len", "n_batches": "--eval-batches",
                    "data": "--data", "recipe": "--recipe", "device": "--device"}


def cmd_eval(args: argparse.Namespace) -> int:
    """`mxmoe eval`: validation loss of a checkpoint or an export on the run's corpus; errors
    name the eval flags (``--batch-size``, not ``batch_size``)."""
    from . import flag_names

    try:
        # checked before the checkpoint is read (it names the recipe), so for every recipe
        check_quant_backend_device(args.quant_backend, True, resolve_device(args.device))
        r = evaluate_source(args.source, data=args.data, batch_size=args.batch_size, seq_len=args.seq_len,
                            n_batches=args.eval_batches, recipe=args.recipe, quant_backend=args.quant_backend,
                            device=args.device)
    except ValueError as e:
        raise ValueError(flag_names(str(e), frozenset(EVAL_FIELD_FLAGS.values()), EVAL_FIELD_FLAGS)) from None
    print(f"val loss {r.val_loss:.6f} | {r.batches} batches of {r.batch_size} x {r.seq_len} tokens "
          f"| recipe {r.recipe} | {r.kind} at step {r.step} | {r.path} | device {r.device}")
    return 0


def add_export_commands(sub) -> None:
    """Add ``export`` and ``eval`` to the ``mxmoe`` sub-command parsers ``sub``."""
    p = sub.add_parser("export", help="write a checkpoint's weights as MXFP8 (or bf16) safetensors",
                       description="Write the weights of a training checkpoint to a safetensors file: the weights "
                                   "the recipe quantizes as MXFP8 (<key>.e4m3 float8_e4m3fn data and <key>.e8m0 "
                                   "uint8 E8M0 scales, blocks of 32 along the last dim), everything else in bf16; "
                                   "or everything in bf16. Naming and metadata: docs/TRAINING.md, 'mxmoe export'.")
    p.add_argument("checkpoint", metavar="CKPT", help="a run directory (--out-dir of mxmoe train) or its checkpoint.pt")
    p.add_argument("output", metavar="OUT", help="the safetensors file to write (replaced atomically)")
    p.add_argument("--format", default="mxfp8", choices=list(EXPORT_FORMATS),
                   help="mxfp8: quantized weights as E4M3 + E8M0, the rest bf16; bf16: all bf16 (default: %(default)s)")
    p.add_argument("--scale-mode", default=None, choices=[m.value for m in ScaleMode],
                   help="E8M0 scale rule of the MXFP8 weights (default: the training recipe's; rceil for bf16 runs)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("eval", help="validation loss of a checkpoint or an exported safetensors file",
                       description="Evaluate a training checkpoint or an mxmoe export on the validation split the "
                                   "run used (same data, batch shape and number of batches unless given), so the "
                                   "loss change from exporting is `mxmoe eval RUN` against `mxmoe eval OUT.safetensors`.")
    p.add_argument("source", metavar="SOURCE", help="run directory, checkpoint.pt or .safetensors written by mxmoe export")
    p.add_argument("--data", default=None, help="corpus path (default: the run's)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per batch (default: the run's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the run's)")
    p.add_argument("--eval-batches", type=int, default=None, help="validation batches (default: the run's)")
    p.add_argument("--recipe", default=None, choices=list(RECIPES),
                   help="recipe of the forward GEMMs (default: the run's)")
    p.add_argument("--quant-backend", default=None, choices=list(BACKENDS),
                   help="MX quantizer (default: the run's); every backend gives the same bits")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    p.set_defaults(func=cmd_eval)
