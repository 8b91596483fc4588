"""Named presets: bundles of ``mxmoe train`` / ``mxmoe compare`` flag values.

A preset fills in every flag it names that the user did not give on the command line;
flags given explicitly always win (``mxmoe train --preset h200 --steps 500`` runs the h200
model for 500 steps). Which flags were given is found by parsing the command line a
second time with every default suppressed (:func:`explicit_dests`), so giving a flag its
default value still counts as giving it.

Presets (keys are argparse destinations, i.e. flag names with ``-`` -> ``_``):

- ``h200``: the BF16-vs-MXFP8 comparison model for one NVIDIA H200. An MoE LM of 8
  blocks, width 512, 8 heads, 32 SwiGLU experts of width 512 per block, top-2 routing:
  210.1M parameters in total, 21.4M active per token (embedding and LM head included),
  140 MFLOP of training per token at 512 tokens per sequence. 2000 steps of 32 x 512
  tokens (32.8M tokens), lr 1e-3 after 100 warmup steps, evaluation every 250 steps on 4
  batches per split, a checkpoint (2.5 GB with the AdamW state) every 1000 steps. Sized so
  that one recipe's 2000 steps fit in a 10-minute command on one H200.
- ``h200-fine``: the same comparison for a fine-grained MoE (the shape of DeepSeek-V3 and
  Qwen3-MoE blocks: many narrow experts, top-8). 8 blocks, width 512, 8 heads, 64 SwiGLU
  experts of width 256 per block, top-8 routing: 210.2M parameters in total, 34.1M active
  per token, 216 MFLOP of training per token at 512 tokens per sequence; the run settings
  of ``h200``. Each token's rows go to 8 experts, so the routed rows per step are 4 x
  ``h200``'s: the layer's dispatch, quantizers and grouped GEMMs at many experts are what
  it compares.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

PRESETS: dict[str, dict[str, Any]] = {
    "h200": {
        "layers": 8, "width": 512, "heads": 8, "experts": 32, "top_k": 2, "expert_width": 512,
        "batch_size": 32, "seq_len": 512, "steps": 2000, "lr": 1e-3, "warmup_steps": 100,
        "eval_interval": 250, "eval_batches": 4, "ckpt_interval": 1000,
    },
    "h200-fine": {
        "layers": 8, "width": 512, "heads": 8, "experts": 64, "top_k": 8, "expert_width": 256,
        "batch_size": 32, "seq_len": 512, "steps": 2000, "lr": 1e-3, "warmup_steps": 100,
        "eval_interval": 250, "eval_batches": 4, "ckpt_interval": 1000,
    },
}


def add_preset_argument(p: argparse.ArgumentParser) -> None:
    """``--preset NAME`` (choices: :data:`PRESETS`); an unknown name is an argparse error."""
    g = p.add_argument_group("preset")
    g.add_argument("--preset", default=None, choices=list(PRESETS),
                   help="named settings (h200: a 210M-parameter MoE, 32 experts top-2, 2000 steps of "
                        "32 x 512 tokens; h200-fine: the same size with 64 experts of width 256, top-8; see "
                        "docs/TRAINING.md, 'Presets'); flags given explicitly override the preset's values")


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:  # argparse keeps sub-commands in a private action list
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.append(sub)
                found.extend(_subparsers(sub))
    return found


def explicit_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations of the flags given in ``argv`` (not filled in from defaults).

    Args:
        parser: a freshly built parser; its defaults are overwritten here (pass a
            throw-away copy, not the parser used for the real parse).
        argv: the command line without the program name.
    """
    for p in [parser, *_subparsers(parser)]:
        for action in p._actions:
            action.default = argparse.SUPPRESS
        p._defaults.clear()
    return set(vars(parser.parse_args(argv)))


def apply_preset(args: argparse.Namespace, explicit: set[str]) -> list[str]:
    """Set every value of ``PRESETS[args.preset]`` on ``args`` whose flag is not in
    ``explicit``. Returns the preset keys that explicit flags overrode (sorted).

    Raises:
        ValueError: unknown preset name (argparse's choices normally catch it first).
    """
    name = getattr(args, "preset", None)
    if name is None:
        return []
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; use one of {', '.join(PRESETS)}")
    overridden = []
    for key, value in PRESETS[name].items():
        if key in explicit:
            overridden.append(key)
        else:
            setattr(args, key, value)
    return sorted(overridden)


def parse_with_preset(build: Callable[[], argparse.ArgumentParser], argv: list[str],
                      default: str | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Parse ``argv`` with a parser from ``build`` and fill in the values of its preset
    (``--preset``, or ``default`` when none is given) that no explicit flag overrides.

    Args:
        build: makes a fresh parser (called twice: the second one finds the explicit flags).
        argv: the command line without the program name.
        default: preset used when the command line names none (None: no preset).

    Returns:
        ``(args, overridden)``: the namespace and the preset keys explicit flags overrode.

    Raises:
        SystemExit: argparse errors (unknown flag, bad value), as ``parse_args``.
    """
    args = build().parse_args(argv)
    if default is not None and getattr(args, "preset", None) is None:
        args.preset = default
    if getattr(args, "preset", None) is None:
        return args, []
    return args, apply_preset(args, explicit_dests(build(), argv))
