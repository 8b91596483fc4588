"""The ``mxmoe`` command line.

    mxmoe train [flags]     train the MoE LM under a precision recipe (CPU or GPU)
    mxmoe compare [flags]   train the same model under several recipes; report.md, loss.png
    mxmoe report OUT        rebuild a comparison's report.md and loss.png from its metrics
    mxmoe export CKPT OUT   write a checkpoint's weights as MXFP8 (or bf16) safetensors
    mxmoe eval SOURCE       validation loss of a checkpoint or an exported safetensors file

Expert parallel: ``torchrun --nproc-per-node P -m mxmoe train --expert-parallel P ...``; on a
2-D mesh (FSDP2 x expert parallel): ``torchrun --nproc-per-node D*P -m mxmoe train
--data-parallel-shard D --expert-parallel P ...``.

Every flag has a help text (``mxmoe train --help``). Bad flags stop with a message that
names the value and what would work, before any model is built or any file is written
(the corpus is read first: its vocabulary and length are part of the checks).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
from pathlib import Path

from ..distributed.launch import is_main_process
from ..models import QUANTIZABLE, ModelConfig
from ..recipe import BACKENDS, RECIPES
from ..train import TrainConfig, load_corpus, train
from ..train.data import eval_batches
from ..train.checkpoint import CHECKPOINT_NAME, check_regular_file
from ..train.cpu import set_threads_for_free_cores
from ..train.trainer import CONFIG_NAME, default_activation_dtype, resolve_device
from .presets import add_preset_argument, parse_with_preset


def _csv_choices(choices):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [t for t in items if t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
        return items

    return parse


def add_train_arguments(p: argparse.ArgumentParser, *, compare: bool = False) -> None:
    """The flags of ``mxmoe train`` (shared with commands that train). ``compare``: leave
    out ``--recipe`` and ``--resume`` (``mxmoe compare`` has ``--recipes`` and ``--reuse``)."""
    d, m = TrainConfig(), ModelConfig()
    add_preset_argument(p)
    g = p.add_argument_group("recipe")
    if not compare:
        g.add_argument("--recipe", default=d.recipe, choices=list(RECIPES),
                       help="precision recipe of the GEMMs (default: %(default)s)")
    g.add_argument("--quantize", type=_csv_choices(QUANTIZABLE), default=m.quantized,
                   help="comma-separated GEMMs that follow the recipe; the rest stay in high precision "
                        f"(default: {','.join(m.quantized)}; choices: {','.join(QUANTIZABLE)})")
    g.add_argument("--quant-backend", default=d.quant_backend, choices=list(BACKENDS),
                   help="MX quantizer: auto (Triton kernels on CUDA), reference (pure torch) or triton; "
                        "all give the same bits (default: %(default)s)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="activation dtype (parameters are float32); auto: bfloat16 on CUDA and on CPUs with native "
                        "bf16 (AVX512-BF16 or AMX), float32 on other CPUs, the resumed run's with --resume "
                        "(default: %(default)s)")

    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int, default=m.n_layers, help="transformer blocks (default: %(default)s)")
    g.add_argument("--width", type=int, default=m.d_model, help="model width d_model (default: %(default)s)")
    g.add_argument("--heads", type=int, default=m.n_heads, help="attention heads (default: %(default)s)")
    g.add_argument("--experts", type=int, default=m.n_experts, help="experts per MoE layer (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=m.top_k, help="experts per token (default: %(default)s)")
    g.add_argument("--expert-width", type=int, default=m.d_expert,
                   help="hidden width of each SwiGLU expert (default: %(default)s)")
    g.add_argument("--moe-every", type=int, default=m.moe_every,
                   help="MoE feed-forward in every n-th block, dense SwiGLU elsewhere (default: %(default)s)")
    g.add_argument("--dense-width", type=int, default=m.d_ff_dense,
                   help="hidden width of dense SwiGLU blocks (default: %(default)s)")
    g.add_argument("--shared-expert", type=int, default=m.shared_expert,
                   help="hidden width of a shared expert, 0 for none (default: %(default)s)")
    g.add_argument("--aux-loss-coef", type=float, default=m.aux_loss_coef,
                   help="weight of the load-balancing loss (default: %(default)s)")
    g.add_argument("--z-loss-coef", type=float, default=m.z_loss_coef,
                   help="weight of the router z-loss (default: %(default)s)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size (default: the corpus's, 256 for bytes)")
    g.add_argument("--hf-config", default=None, metavar="PATH_OR_MODEL_TYPE",
                   help="train a Hugging Face transformers MoE causal LM from scratch instead of mxmoe's model: a "
                        "config.json (or its directory; used as it is, its vocabulary and positions raised to the "
                        "corpus's and --seq-len) or a model type such as qwen3_moe or mixtral (its "
                        "default config with --width, --layers, --heads, --experts, --top-k, --expert-width and "
                        "the corpus's vocabulary); the families that work with the installed transformers are listed in "
                        "docs/INTEGRATIONS.md. Needs pip install 'mxmoe[hf]'")

    g = p.add_argument_group("data")
    g.add_argument("--data", default=None,
                   help="text file, directory of text files, or uint16 .bin token file "
                        "(default: the Python standard library's source)")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step (default: %(default)s)")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (default: %(default)s)")

    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default: %(default)s)")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warmup steps (default: %(default)s)")
    g.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio,
                   help="final lr as a fraction of the peak, after cosine decay (default: %(default)s)")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay (default: %(default)s)")
    g.add_argument("--grad-clip", type=float, default=d.grad_clip,
                   help="max global gradient norm, 0 to disable (default: %(default)s)")
    g.add_argument("--seed", type=int, default=d.seed, help="initialization and data-order seed (default: %(default)s)")
    g.add_argument("--max-bad-steps", type=int, default=d.max_bad_steps, metavar="N",
                   help="a step whose loss or gradient norm is NaN or inf is skipped (no update) and marked in the "
                        "metrics; stop with exit status 1 after N such steps in a row (default: %(default)s)")

    g = p.add_argument_group("run")
    g.add_argument("--eval-interval", type=int, default=d.eval_interval,
                   help="evaluate every n steps, and at the start and end (default: %(default)s)")
    g.add_argument("--eval-batches", type=int, default=d.eval_batches,
                   help="batches per evaluation and split (default: %(default)s)")
    g.add_argument("--ckpt-interval", type=int, default=d.ckpt_interval,
                   help="checkpoint every n steps, 0 for only at the end (default: %(default)s)")
    g.add_argument("--out-dir", default=d.out_dir,
                   help="output directory: config.json, metrics.jsonl, checkpoint.pt (compare: report.md, "
                        "loss.png and one such directory per recipe) (default: %(default)s)")
    if not compare:
        g.add_argument("--resume", action="store_true", help="continue from OUT_DIR/checkpoint.pt")
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    g.add_argument("--no-cuda-graph", action="store_true",
                   help="on CUDA, launch every step's kernels from Python (by default each step is replayed from "
                        "a CUDA graph, which removes the host's launch cost)")
    g.add_argument("--overwrite", action="store_true",
                   help="start anew in an --out-dir that already holds a run, replacing its files "
                        "(without it such a run is refused unless --resume)")

    g = p.add_argument_group("parallel (run under torchrun --nproc-per-node P)")
    g.add_argument("--expert-parallel", type=int, default=d.expert_parallel, metavar="P",
                   help="spread the experts over P ranks, one process each; --batch-size is the global batch "
                        "(default: %(default)s)")
    g.add_argument("--data-parallel-shard", type=int, default=d.data_parallel_shard, metavar="D",
                   help="run on a 2-D mesh of D data-parallel shards x --expert-parallel P ranks (torchrun "
                        "--nproc-per-node D*P): FSDP2 shards the non-expert parameters over all ranks and each expert "
                        "group's experts over D; sharded checkpoints (DCP) that resume on any mesh "
                        "(docs/EXPERT_PARALLEL.md); 0: no mesh (default: %(default)s)")
    g.add_argument("--mx-weight-gather", action="store_true",
                   help="with --data-parallel-shard and an MXFP8 recipe: gather the expert weights as MXFP8 codes + "
                        "scales (each rank quantizes its shard once per step; about half the bytes of bf16) instead "
                        "of FSDP2's float32 all-gather")
    g.add_argument("--mx-dispatch", action="store_true",
                   help="send the dispatched rows as MXFP8 (E4M3 codes + E8M0 scales, about half the bytes of "
                        "bf16); without --expert-parallel, the same rounding in one process")


def resolve_dtype_flag(args: argparse.Namespace) -> str | None:
    """Replace ``--dtype auto`` in ``args`` by a dtype: the resumed run's (its config.json)
    with ``--resume``, else :func:`~mxmoe.train.trainer.default_activation_dtype` of the
    device. Returns the line that says which and why (None when --dtype was given).

    Raises:
        ValueError: an unknown ``--device``.
    """
    if args.dtype != "auto":
        return None
    if getattr(args, "resume", False):
        try:
            check_regular_file(Path(args.out_dir) / CONFIG_NAME, "a run's config.json")
            saved = json.loads((Path(args.out_dir) / CONFIG_NAME).read_text())["train"]["model"]["dtype"]
        except (OSError, ValueError, KeyError, TypeError):
            saved = None
        if saved in ("bfloat16", "float32", "float16"):
            args.dtype = saved
            return f"activation dtype {saved}: the resumed run's (--dtype overrides)"
    args.dtype, why = default_activation_dtype(resolve_device(args.device))
    return f"activation dtype {args.dtype}: {why} (--dtype overrides)"


# config fields whose flag is not the field's name with dashes
_FLAG_OF_FIELD = {"d_model": "--width", "n_layers": "--layers", "n_heads": "--heads", "n_experts": "--experts",
                  "d_expert": "--expert-width", "d_ff_dense": "--dense-width", "max_seq_len": "--seq-len",
                  "quantized": "--quantize"}


def flag_names(message: str, flags: frozenset[str] | None = None,
               field_flags: dict[str, str] | None = None) -> str:
    """``message`` with the setting names in it written as the flags that set them:
    names with an underscore (``d_model`` as ``--width``, ``max_bad_steps`` as
    ``--max-bad-steps``) and one-word names written ``name=value`` or ``name must ...``
    (``lr=0.003`` as ``--lr=0.003``, ``steps must be`` as ``--steps must be``).

    Args:
        message: an error message of the library.
        flags: the command's flags (default: ``mxmoe train``'s); a name is rewritten only
            to a flag the command has.
        field_flags: the settings that may be rewritten, mapped to their flag where it is
            not the name with dashes (default: :class:`TrainConfig` and
            :class:`ModelConfig` fields, ``d_model`` to ``--width`` ...).
    """
    flags = _train_flags() if flags is None else flags
    names, renamed = (_CONFIG_FIELDS, _FLAG_OF_FIELD) if field_flags is None else (set(field_flags), field_flags)

    def flag(m: re.Match) -> str:
        name = m.group(1)
        if name not in names:
            return name
        f = renamed.get(name) or "--" + name.replace("_", "-")
        return f if f in flags else name

    return re.sub(r"(?<![-\w])([a-z]+(?:_[a-z0-9]+)+\b|[a-z]+(?==| must\b))", flag, message)


_CONFIG_FIELDS = {f.name for cls in (TrainConfig, ModelConfig) for f in dataclasses.fields(cls)}


@functools.cache
def _train_flags() -> frozenset[str]:
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    return frozenset(o for a in p._actions for o in a.option_strings)


def config_from_args(args: argparse.Namespace, vocab_size: int) -> TrainConfig:
    """Build and validate a TrainConfig from parsed flags (``--dtype auto`` resolved by
    :func:`resolve_dtype_flag` first, if not already).

    Raises:
        ValueError: a bad combination (for example top-k > experts), its message naming
            flags, not config fields (:func:`flag_names`).
    """
    try:
        return _config_from_args(args, vocab_size)
    except ValueError as e:
        raise ValueError(flag_names(str(e))) from None


def _config_from_args(args: argparse.Namespace, vocab_size: int) -> TrainConfig:
    resolve_dtype_flag(args)
    hf_config = getattr(args, "hf_config", None)
    if hf_config is not None and not hf_config.strip():
        raise ValueError("--hf-config is empty; pass a transformers config.json path or a model type such as "
                         "qwen3_moe (or leave the flag out for mxmoe's own model)")
    model = _hf_model_config(args, vocab_size) if hf_config is not None else ModelConfig(
        vocab_size=vocab_size if args.vocab_size is None else args.vocab_size, d_model=args.width,
        n_layers=args.layers, n_heads=args.heads,
        n_experts=args.experts, top_k=args.top_k, d_expert=args.expert_width, moe_every=args.moe_every,
        d_ff_dense=args.dense_width, shared_expert=args.shared_expert, max_seq_len=args.seq_len,
        aux_loss_coef=args.aux_loss_coef, z_loss_coef=args.z_loss_coef, quantized=args.quantize, dtype=args.dtype,
        mx_dispatch=args.mx_dispatch,
    )
    cfg = TrainConfig(
        recipe=args.recipe, quant_backend=args.quant_backend, batch_size=args.batch_size, seq_len=args.seq_len,
        steps=args.steps, lr=args.lr,
        min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, seed=args.seed, eval_interval=args.eval_interval, eval_batches=args.eval_batches,
        ckpt_interval=args.ckpt_interval, out_dir=args.out_dir, data=args.data, device=args.device,
        progress=not args.no_progress and sys.stderr.isatty(), overwrite=args.overwrite,
        expert_parallel=args.expert_parallel, data_parallel_shard=args.data_parallel_shard,
        mx_weight_gather=args.mx_weight_gather, cuda_graph=not args.no_cuda_graph, max_bad_steps=args.max_bad_steps,
        model=model,
    )
    cfg.validate()
    return cfg


def _hf_model_config(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """The ModelConfig of ``--hf-config`` (mxmoe.integrations.transformers.hf_config_dict).

    Raises:
        ValueError: transformers not installed, an unknown model type, a config that is not
            an MoE model; --mx-dispatch or a --moe-every / --dense-width / --shared-expert
            setting, which only mxmoe's model takes.
    """
    try:
        from ..integrations.transformers import hf_config_dict, model_config_from_hf
    except ImportError as e:
        raise ValueError(f"--hf-config needs transformers ({e}): pip install 'mxmoe[hf]'") from None
    m = ModelConfig()
    only_ours = [flag for flag, value, default in (("--moe-every", args.moe_every, m.moe_every),
                                                   ("--dense-width", args.dense_width, m.d_ff_dense),
                                                   ("--shared-expert", args.shared_expert, m.shared_expert),
                                                   ("--mx-dispatch", args.mx_dispatch, False)) if value != default]
    if only_ours:
        raise ValueError(f"{', '.join(only_ours)} {'sets' if len(only_ours) == 1 else 'set'} mxmoe's own model; with --hf-config the transformers config "
                         f"decides (edit its config.json)")
    vocab = vocab_size if args.vocab_size is None else args.vocab_size
    spec = args.hf_config
    sizes = None if Path(spec).exists() or spec.endswith(".json") else {
        "d_model": args.width, "n_layers": args.layers, "n_heads": args.heads, "n_experts": args.experts,
        "top_k": args.top_k, "d_expert": args.expert_width, "vocab_size": vocab}
    hf = hf_config_dict(spec, sizes, min_positions=args.seq_len, min_vocab=vocab)
    return model_config_from_hf(hf, aux_loss_coef=args.aux_loss_coef, z_loss_coef=args.z_loss_coef,
                                quantized=args.quantize, dtype=args.dtype)


def check_corpus_length(corpus, cfg: TrainConfig) -> None:
    """The trainer's check that both splits of the corpus hold a sequence (``seq_len + 1``
    tokens), made before training so that its message names ``--seq-len``.

    Raises:
        ValueError: a split shorter than a sequence, naming the flag and what would work.
    """
    try:
        for split in (corpus.train, corpus.val):
            eval_batches(split, 1, cfg.seq_len, 1)
    except ValueError as e:
        raise ValueError(flag_names(str(e))) from None


def cmd_train(args: argparse.Namespace) -> int:
    """`mxmoe train`: load the corpus, build the TrainConfig from the flags, train (or
    resume); returns the exit status."""
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --out-dir and --overwrite starts it anew; pass one of them")
    note = resolve_dtype_flag(args)
    if note and is_main_process():
        print(note, flush=True)
    if args.expert_parallel == 1 and not args.data_parallel_shard and resolve_device(args.device).type == "cpu":
        note = set_threads_for_free_cores()
        if note:
            print(note, flush=True)
    corpus = load_corpus(args.data)
    cfg = config_from_args(args, corpus.vocab_size)
    check_corpus_length(corpus, cfg)
    r = train(cfg, resume=args.resume, corpus=corpus)
    if not is_main_process():  # under torchrun only rank 0 reports
        return 0
    print(f"done: {r.steps} steps in {r.wall_s:.1f} s | train loss {r.first_loss:.4f} -> {r.last_loss:.4f} "
          f"| val loss {r.first_val_loss:.4f} -> {r.last_val_loss:.4f} | {r.tokens_per_s:,.0f} tok/s "
          f"| {r.ms_per_step:.0f} ms/step | peak {r.peak_mem_gib:.2f} GiB | {r.out_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `mxmoe` argument parser with every subcommand (train, compare, report, export, eval, ...)."""
    parser = argparse.ArgumentParser(prog="mxmoe", description="MXFP8 Mixture-of-Experts training")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train the MoE language model",
                       description="Train an MoE language model under a precision recipe.")
    add_train_arguments(p)
    p.set_defaults(func=cmd_train)
    from .compare import add_compare_commands
    from .export import add_export_commands

    add_compare_commands(sub)
    add_export_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `mxmoe` entry point: parse ``argv`` (default sys.argv[1:]) with presets, run the
    subcommand; returns the exit status: 2 with a one-line message for refused input or a
    path that cannot be used (permissions, not a directory, disk full), 1 for a run of
    non-finite steps (``--max-bad-steps``), 130 when interrupted."""
    args, overridden = parse_with_preset(build_parser, sys.argv[1:] if argv is None else argv)
    if getattr(args, "preset", None):
        print(f"preset {args.preset}" + (f" (overridden by flags: {', '.join(overridden)})" if overridden else ""))
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"mxmoe {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path that cannot be used: permissions, not a directory, disk full
        where = f" {e.filename!r}" if e.filename else ""
        reason = e.strerror or " ".join(str(e).split())
        print(f"mxmoe {args.command}: error: cannot use{where}: {reason}; check the path, its permissions and "
              f"the free space", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"mxmoe {args.command}: error: {e}; metrics.jsonl holds the steps so far", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        out_dir = getattr(args, "out_dir", None)
        if out_dir and (Path(out_dir) / CHECKPOINT_NAME).exists():
            hint = "rerun with --resume to continue from the last checkpoint"
        else:
            hint = "no checkpoint was written yet (see --ckpt-interval): rerun with --overwrite to start anew"
        print(f"mxmoe {args.command}: interrupted; {hint}", file=sys.stderr)
        return 130
