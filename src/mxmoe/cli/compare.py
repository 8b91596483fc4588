"""``mxmoe compare`` and ``mxmoe report``: parsers and commands (see
:mod:`mxmoe.train.compare` for what they write)."""

from __future__ import annotations

import argparse
import sys

from ..recipe import RECIPES
from ..train import load_corpus
from ..train.compare import RecipeRunError, build_report, parse_recipes, run_compare

DEFAULT_COMPARE_DIR = "runs/compare"
DEFAULT_RECIPES = "bf16,mxfp8"


def _recipes_arg(text: str) -> tuple[str, ...]:
    try:
        return parse_recipes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of TFLOP/s, got {text!r}")
    return value


# what reading a run whose config.json, result.json or metrics lines hold the wrong fields
# or types raises, past the checks of mxmoe.train.compare (which name the damaged file)
DAMAGED_RUN_ERRORS = (KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError)


def damaged_runs_message(out_dir, e: Exception) -> str:
    """One line for a run directory whose files hold fields of the wrong kind."""
    return (f"the runs under {str(out_dir)!r} hold a damaged or foreign config.json, result.json or metrics line "
            f"({type(e).__name__}: {e}); rerun the recipes into another --out-dir, or remove the damaged recipe's "
            f"directory and rerun with --reuse")


def cmd_compare(args: argparse.Namespace) -> int:
    """`mxmoe compare`: train the same model under each recipe in turn, then write the side-by-side report."""
    from . import check_corpus_length, config_from_args, resolve_dtype_flag

    note = resolve_dtype_flag(args)
    if note:
        print(note, flush=True)
    corpus = load_corpus(args.data)
    args.recipe = args.recipes[0]
    cfg = config_from_args(args, corpus.vocab_size)
    check_corpus_length(corpus, cfg)
    try:
        report = run_compare(cfg, args.recipes, args.out_dir, reuse=args.reuse, corpus=corpus,
                             peak_tflops=args.peak_tflops)
    except RecipeRunError as e:
        print(f"mxmoe compare: error: {e}", file=sys.stderr)
        return e.returncode
    except DAMAGED_RUN_ERRORS as e:
        raise ValueError(damaged_runs_message(args.out_dir, e)) from None
    print(f"mxmoe compare: wrote {report}")
    print(report.read_text())
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """`mxmoe report`: rebuild the comparison report from finished runs in ``args.out_dir``."""
    if not str(args.out_dir).strip():
        raise ValueError("the compare directory is empty; pass the --out-dir of mxmoe compare (e.g. runs/compare)")
    try:
        report = build_report(args.out_dir, args.recipes, peak_tflops=args.peak_tflops)
    except DAMAGED_RUN_ERRORS as e:
        raise ValueError(damaged_runs_message(args.out_dir, e)) from None
    print(f"mxmoe report: wrote {report}")
    print(report.read_text())
    return 0


def _add_peak_flag(g) -> None:
    g.add_argument("--peak-tflops", type=_positive_float, default=None,
                   help="device peak in TFLOP/s for MFU (default: the GPU's dense BF16 peak from a table of "
                        "known GPUs, e.g. 989 for the H100/H200; MFU is n/a on the CPU and unknown GPUs)")


def add_compare_commands(sub) -> None:
    """Add ``compare`` and ``report`` to the ``mxmoe`` sub-command parsers ``sub``."""
    from . import add_train_arguments

    p = sub.add_parser(
        "compare", help="train the same model under several recipes and report loss, speed and memory",
        description="Train the same model, seed and data order under each recipe (each in its own process, "
                    "into OUT_DIR/<recipe>/), then write OUT_DIR/report.md, OUT_DIR/loss.png and "
                    "OUT_DIR/metrics-<recipe>.jsonl. Every training flag of `mxmoe train` applies to all recipes.")
    g = p.add_argument_group("comparison")
    g.add_argument("--recipes", type=_recipes_arg, default=parse_recipes(DEFAULT_RECIPES),
                   help=f"comma-separated recipes; bf16 is the baseline of the gaps and targets (default: {DEFAULT_RECIPES}; "
                        f"choices: {','.join(RECIPES)})")
    g.add_argument("--reuse", action="store_true",
                   help="reuse finished runs in OUT_DIR with the same settings and resume unfinished ones, "
                        "instead of training every recipe anew (to train recipes in separate commands)")
    _add_peak_flag(g)
    add_train_arguments(p, compare=True)
    p.set_defaults(func=cmd_compare, out_dir=DEFAULT_COMPARE_DIR)

    p = sub.add_parser("report", help="rebuild a comparison's report.md and loss.png from its runs",
                       description="Rebuild OUT_DIR/report.md, loss.png and metrics-<recipe>.jsonl from the "
                                   "runs in OUT_DIR/<recipe>/ (no training).")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the --out-dir of mxmoe compare")
    p.add_argument("--recipes", type=_recipes_arg, default=None,
                   help="recipes to report, in order (default: every finished run in OUT_DIR)")
    _add_peak_flag(p)
    p.set_defaults(func=cmd_report)
