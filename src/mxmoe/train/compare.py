"""``mxmoe compare``: the same model, seed and data order trained under several recipes,
then one report: final losses, gap to bf16, speed, peak memory, MFU, and mxmoe's MXFP8
parity targets (met, or missed by how much).

Layout of a comparison directory OUT:

    OUT/<recipe>/            one ordinary training run per recipe (config.json,
                             metrics.jsonl, checkpoint.pt) plus result.json, written when
                             the run finished (device name, memory measure, versions)
    OUT/metrics-<recipe>.jsonl   copies of the runs' metrics files
    OUT/report.md            the table and the targets
    OUT/loss.png             train and validation curves, and the last 20% of steps zoomed

Each recipe trains in its own process (``python -m mxmoe.train.worker``), so its peak
memory is its own: the CUDA allocator peak on a GPU, the process's peak resident set
size on the CPU. Runs are found again by their settings: with ``reuse``, a recipe whose
finished run in OUT has the same settings is not trained again and an unfinished one is
resumed from its checkpoint, so recipes may be trained in separate commands and reported
together.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..recipe import RECIPES
from .checkpoint import CHECKPOINT_NAME, atomic_write_bytes, check_regular_file, read_metrics
from .data import Corpus, eval_batches, load_corpus
from .trainer import (
    CONFIG_NAME,
    METRICS_NAME,
    WARMUP_STEPS_SKIPPED,
    TrainConfig,
    check_backend_device,
    holds_run,
    resolve_device,
)

BASELINE_RECIPE = "bf16"
RESULT_NAME = "result.json"
REPORT_NAME = "report.md"
PLOT_NAME = "loss.png"
# mxmoe's parity targets for every quantized recipe against bf16 (MXFP8 should train like BF16,
# at no less speed and with less memory).
VAL_LOSS_GAP_TARGET_PCT = 1.0  # final validation loss at most 1% above bf16's
SPEED_TARGET_RATIO = 0.95  # tokens/s at least 0.95x bf16's
# Steady-state speed: train steps after the first WARMUP_STEPS_SKIPPED (the trainer's constant:
# allocator and kernel warm-up), as the trainer's summary line does.
# The step time is the median of those steps (one slow step, e.g. a page-in or another
# process's burst on the CPU, would move a mean of a few steps by a factor); with fewer than
# this many timed steps the report says the speed figures are not to be relied on.
MIN_TIMED_STEPS = 10
ZOOM_FRACTION = 0.2  # the zoomed panel shows the last 20% of steps
SMOOTHING_FRACTION = 0.01  # train curves are also drawn as a moving average over 1% of the steps
# Dense BF16 tensor-core peak in TFLOP/s (no sparsity), from NVIDIA's data sheets, matched
# as substrings of torch.cuda.get_device_name() in this order (the first match wins).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("A100", 312.0),
)
# Settings in which runs of one comparison may differ besides the recipe (a reused run may
# have been written somewhere else, on another device name, with another quantizer
# backend, which gives the same bits, or with other checkpoint intervals). Not --steps: a
# run extended to more steps has another learning-rate schedule than a run of that length.
REUSE_MAY_DIFFER = ("recipe", "out_dir", "device", "progress", "quant_backend", "ckpt_interval", "overwrite")
# Settings added after runs were written, with the value those runs had: a run from before
# --no-cuda-graph has no cuda_graph in its config.json and stepped eagerly. (Not in
# REUSE_MAY_DIFFER: graphed and eager steps differ several-fold in speed on a GPU.)
SETTINGS_BEFORE_ADDED = {"cuda_graph": False}


def parse_recipes(text: str) -> tuple[str, ...]:
    """``"bf16,mxfp8"`` -> ``("bf16", "mxfp8")``.

    Raises:
        ValueError: an empty list, an unknown recipe or a recipe named twice.
    """
    items = tuple(t.strip() for t in text.split(","))
    if not text.strip() or any(not t for t in items):
        raise ValueError(f"--recipes {text!r} has an empty entry; give a comma-separated list such as bf16,mxfp8")
    unknown = [t for t in items if t not in RECIPES]
    if unknown:
        raise ValueError(f"unknown recipe(s) {unknown} in --recipes; choose from {', '.join(RECIPES)}")
    twice = sorted({t for t in items if items.count(t) > 1})
    if twice:
        raise ValueError(f"recipe(s) {twice} named more than once in --recipes")
    return items


def recipe_config(cfg: TrainConfig, recipe: str, out_root: Path) -> TrainConfig:
    """``cfg`` under ``recipe``, writing to ``out_root/recipe``."""
    return dataclasses.replace(cfg, recipe=recipe, out_dir=str(Path(out_root) / recipe))


def check_run(cfg: TrainConfig, corpus: Corpus) -> None:
    """The checks :func:`~mxmoe.train.train` makes before it touches any file (settings,
    device, output directory, vocabulary, corpus long enough for the evaluation batches),
    made here for every recipe before the first one trains.

    Raises:
        ValueError: the first problem found.
    """
    cfg.validate()
    check_backend_device(cfg, resolve_device(cfg.device))  # --quant-backend triton off CUDA: before any run trains
    out = Path(cfg.out_dir)
    for path in (out.parent, out):
        if path.exists() and not path.is_dir():
            raise ValueError(f"{str(path)!r} is a file; pass a directory as --out-dir")
    if corpus.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the corpus has token ids up to {corpus.vocab_size - 1}, but the model's "
                         f"vocab_size is {cfg.model.vocab_size}; set --vocab-size {corpus.vocab_size}")
    eval_batches(corpus.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches)
    eval_batches(corpus.train, cfg.batch_size, cfg.seq_len, cfg.eval_batches)


# Settings that do nothing on the CPU (a CPU run's value of them is not compared).
GPU_ONLY_SETTINGS = ("cuda_graph",)


def _settings_diff(a: dict[str, Any], b: dict[str, Any], on_cpu: bool = False) -> list[str]:
    """Settings of train configs a and b that differ and matter; ``on_cpu``: the runs ran on
    the CPU, where :data:`GPU_ONLY_SETTINGS` change nothing."""
    a, b = {**SETTINGS_BEFORE_ADDED, **a}, {**SETTINGS_BEFORE_ADDED, **b}
    ignored = REUSE_MAY_DIFFER + (GPU_ONLY_SETTINGS if on_cpu else ())
    return [k for k in sorted(set(a) | set(b)) if k not in ignored and a.get(k) != b.get(k)]


def _read_json(path: Path) -> dict[str, Any] | None:
    check_regular_file(path, "a JSON file")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def _result_well_formed(result: Any) -> bool:
    """Whether a result.json holds what the report reads, of the right kinds: a JSON object
    whose ``rss_before_model_gib`` is a number or null, ``device_name`` and ``git`` strings
    or null, ``train`` an object with an integer ``steps``."""
    if not isinstance(result, dict):
        return False
    rss = result.get("rss_before_model_gib")
    texts = (result.get("device_name"), result.get("git"))
    train = result.get("train")
    return ((rss is None or isinstance(rss, (int, float)) and not isinstance(rss, bool))
            and all(t is None or isinstance(t, str) for t in texts)
            and isinstance(train, dict) and isinstance(train.get("steps"), int))


@dataclass
class Plan:
    """What :func:`run_compare` does with one recipe: ``action`` is "train" (a new run),
    "resume" (continue the unfinished or shorter run in ``cfg.out_dir``) or "reuse"
    (its finished run is already there)."""

    recipe: str
    cfg: TrainConfig
    action: str


def plan_runs(cfg: TrainConfig, recipes: tuple[str, ...], out_root: Path, reuse: bool) -> list[Plan]:
    """Decide, per recipe, whether to train, resume or reuse (see :class:`Plan`).

    Without ``reuse`` every recipe trains anew. With ``reuse``, a recipe directory that
    holds a run (config.json) must have the same settings except :data:`REUSE_MAY_DIFFER`;
    it is reused if it finished (result.json), resumed if it has a checkpoint, else
    trained anew.

    Raises:
        ValueError: with ``reuse``, a run in OUT whose settings differ; without ``reuse``
            or ``cfg.overwrite``, a recipe directory that already holds a run.
    """
    plans = []
    for recipe in recipes:
        rcfg = recipe_config(cfg, recipe, out_root)
        run_dir = Path(rcfg.out_dir)
        if not reuse and not cfg.overwrite and holds_run(run_dir):
            raise ValueError(f"{str(run_dir)!r} already holds a {recipe} run: pass --reuse to reuse or resume it, "
                             f"--overwrite to train it anew, or another --out-dir")
        config = _read_json(run_dir / CONFIG_NAME) if reuse else None
        if config is None:
            plans.append(Plan(recipe, dataclasses.replace(rcfg, overwrite=True) if reuse else rcfg, "train"))
            continue
        saved = {**SETTINGS_BEFORE_ADDED, **config["train"]}
        diff = _settings_diff(saved, rcfg.to_dict(), on_cpu=str(config.get("device", "")) == "cpu")
        if diff:
            raise ValueError(f"--reuse: the run in {str(run_dir)!r} has other settings than asked for: "
                             + ", ".join(f"{k}={saved.get(k)!r} (asked {rcfg.to_dict().get(k)!r})" for k in diff)
                             + "; give the same flags, or another --out-dir")
        result = _read_json(run_dir / RESULT_NAME)
        if result is not None and result["train"]["steps"] == rcfg.steps:
            plans.append(Plan(recipe, rcfg, "reuse"))
        elif (run_dir / CHECKPOINT_NAME).exists():
            plans.append(Plan(recipe, rcfg, "resume"))
        else:  # started, stopped before its first checkpoint: train it anew
            plans.append(Plan(recipe, dataclasses.replace(rcfg, overwrite=True), "train"))
    return plans


class RecipeRunError(RuntimeError):
    """A recipe's training process failed; ``returncode`` is its exit status."""

    def __init__(self, recipe: str, returncode: int, out_dir: str):
        self.returncode = returncode
        if returncode == 2:  # refused (settings, data, a path): nothing to resume
            hint = "fix what its message names and rerun"
        else:
            hint = f"{out_dir} holds its metrics and last checkpoint, if any: rerun with --reuse to resume it"
        super().__init__(f"recipe {recipe} stopped with exit status {returncode} (its messages are above); {hint}")


def run_worker(plan: Plan) -> None:
    """Train one recipe in a new process (``python -m mxmoe.train.worker``), which
    prints its log lines to this process's stdout and stderr.

    Raises:
        RecipeRunError: the process exited with a non-zero status.
    """
    cmd = [sys.executable, "-m", "mxmoe.train.worker", json.dumps(plan.cfg.to_dict())]
    if plan.action == "resume":
        cmd.append("--resume")
    sys.stdout.flush()
    sys.stderr.flush()
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        raise RecipeRunError(plan.recipe, rc, plan.cfg.out_dir)


def run_compare(cfg: TrainConfig, recipes: tuple[str, ...], out_root: str | Path, *, reuse: bool = False,
                corpus: Corpus | None = None, peak_tflops: float | None = None) -> Path:
    """Train ``cfg`` under each recipe (same seed, data order, settings), then write the
    report (:func:`build_report`).

    Args:
        cfg: settings of every run (its ``recipe`` and ``out_dir`` are replaced per recipe).
        recipes: recipe names, each at most once.
        out_root: the comparison directory OUT.
        reuse: reuse finished runs in OUT and resume unfinished ones (see :func:`plan_runs`).
        corpus: the loaded corpus of ``cfg.data`` (for the checks; loaded if None).
        peak_tflops: peak for MFU in TFLOP/s (default: looked up from the GPU name).

    Returns:
        Path of report.md.

    Raises:
        ValueError: bad settings, checked for every recipe before any run starts.
        FileNotFoundError: a missing data path.
        RecipeRunError: a recipe's run failed.
    """
    out_root = Path(out_root)
    if not recipes:
        raise ValueError("no recipes given; pass --recipes such as bf16,mxfp8")
    parse_recipes(",".join(recipes))
    if cfg.expert_parallel > 1 or cfg.data_parallel_shard:
        raise ValueError(f"mxmoe compare trains each recipe in one process and cannot launch --expert-parallel "
                         f"{cfg.expert_parallel} / --data-parallel-shard {cfg.data_parallel_shard}; run `torchrun ... "
                         f"mxmoe train` with those flags once per recipe instead")
    if corpus is None:
        corpus = load_corpus(cfg.data)
    for recipe in recipes:
        check_run(recipe_config(cfg, recipe, out_root), corpus)
    plans = plan_runs(cfg, recipes, out_root, reuse)
    for plan in plans:
        verb = {"train": "training", "resume": "resuming", "reuse": "reusing the finished run of"}[plan.action]
        print(f"mxmoe compare: {verb} {plan.recipe} in {plan.cfg.out_dir}", flush=True)
        if plan.action != "reuse":
            run_worker(plan)
    return build_report(out_root, recipes, peak_tflops=peak_tflops)


# ---- the report ---------------------------------------------------------------------


def peak_tflops_for(device_name: str | None) -> float | None:
    """Dense BF16 peak (TFLOP/s) of a GPU named ``device_name`` (from
    :data:`PEAK_BF16_TFLOPS`), None for the CPU or an unknown GPU."""
    if not device_name:
        return None
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilization: achieved training FLOP/s over the peak.

    Achieved FLOP/s = ``flops_per_token`` x ``tokens_per_s``, where the FLOPs per token are
    :meth:`~mxmoe.models.MoETransformer.flops_per_token` (recorded in config.json):
    6 x the matmul parameters active per token (attention QKV and output projections,
    router, top_k of E experts' w13 and w2 -- or the dense SwiGLU --, shared expert, LM
    head; the embedding lookup excluded), i.e. 2 FLOPs per multiply-add in the forward
    and twice that in the backward; plus the attention scores and the weighted sum of
    values, 6 x n_layers x S x D per token (QK^T and AV each 2 x S x D FLOPs per token
    forward, halved by the causal mask, times 3 for forward + backward), with S the
    sequence length and D the width. MXFP8 runs are counted at the same FLOPs (the
    quantization work is overhead, not model FLOPs).

    Args:
        flops_per_token: training FLOPs per token.
        tokens_per_s: measured tokens per second.
        peak_tflops: the device's peak in TFLOP/s (dense BF16 for a GPU), None if unknown.

    Returns:
        A fraction in [0, 1] (normally), or None when ``peak_tflops`` is None.
    """
    if peak_tflops is None:
        return None
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12)


@dataclass
class RunSummary:
    """One recipe's numbers for the report.

    Attributes:
        recipe: recipe name. run_dir: its directory. steps: steps the run was set for.
        last_step: last train step in its metrics.
        finished: it ran to ``steps`` (last train line and an evaluation at ``steps``).
        train_curve: (step, train loss) per step. val_curve: (step, val loss) per evaluation.
        final_train_loss: train loss (cross entropy, nats per token) of the last step.
        final_val_loss: validation loss of the last evaluation.
        ms_per_step: median step time over steps > WARMUP_STEPS_SKIPPED (ms).
        tokens_per_s: batch_size x seq_len / median step time.
        timed_steps: how many steps that median is over.
        peak_mem_gib: max of the metrics' ``mem_gib`` (GiB; see ``memory_kind``).
        memory_kind: "cuda" (torch.cuda.max_memory_allocated of the run's process) or
            "rss" (peak resident set size of the run's process).
        rss_before_model_gib: on the CPU, the process's resident size before the model was
            built (interpreter, torch and corpus), when recorded.
        flops_per_token: training FLOPs per token (config.json).
        device, device_name: where it ran. config: config.json. result: result.json or None.
        cuda_graph: every train step ran graphed (metrics' ``cuda_graph``: False from a
            failed capture on; lines without it take config.json's setting).
    """

    recipe: str
    run_dir: Path
    steps: int
    last_step: int
    finished: bool
    train_curve: list[tuple[int, float]]
    val_curve: list[tuple[int, float]]
    final_train_loss: float
    final_val_loss: float
    ms_per_step: float
    tokens_per_s: float
    peak_mem_gib: float
    memory_kind: str
    rss_before_model_gib: float | None
    flops_per_token: float
    device: str
    device_name: str | None
    config: dict[str, Any]
    result: dict[str, Any] | None
    cuda_graph: bool = False
    timed_steps: int = 0

    @property
    def few_timed_steps(self) -> bool:
        """Fewer than MIN_TIMED_STEPS steps behind ms_per_step: its speed says little."""
        return self.timed_steps < MIN_TIMED_STEPS


def summarize_run(run_dir: Path) -> RunSummary:
    """Read one recipe's run (config.json, metrics.jsonl, result.json if there).

    Raises:
        FileNotFoundError: ``run_dir`` has no config.json or metrics.jsonl.
        ValueError: a damaged config.json (damaged metrics lines are skipped).
    """
    run_dir = Path(run_dir)
    for name in (CONFIG_NAME, METRICS_NAME):
        if not (run_dir / name).exists():
            raise FileNotFoundError(f"{run_dir / name} does not exist; is {str(run_dir)!r} a training run?")
    config = _read_json(run_dir / CONFIG_NAME)
    well_formed = isinstance(config, dict) and isinstance(config.get("train"), dict) \
        and isinstance(config["train"].get("steps"), int)
    if not well_formed:  # a damaged file, not a wrong argument: ValueError
        raise ValueError(f"{str(run_dir / CONFIG_NAME)!r} is damaged or not an mxmoe run's config (no JSON object "
                         f"with the run's 'train' settings); rerun the recipe, or leave this directory out")
    result = _read_json(run_dir / RESULT_NAME)
    if result is not None and not _result_well_formed(result):
        raise ValueError(f"{str(run_dir / RESULT_NAME)!r} is damaged or not an mxmoe run's result (fields of the wrong "
                         f"kind); rerun the recipe (mxmoe compare --reuse), or leave this directory out")
    tcfg = config["train"]
    lines = read_metrics(run_dir / METRICS_NAME)
    train = [m for m in lines if m.get("kind") == "train"]
    evals = [m for m in lines if m.get("kind") == "eval"]
    train_curve = [(m["step"], m["loss"]) for m in train]
    val_curve = [(m["step"], m["val_loss"]) for m in evals]
    last_step = train_curve[-1][0] if train_curve else 0
    finished = last_step == tcfg["steps"] and bool(val_curve) and val_curve[-1][0] == tcfg["steps"]
    timed = [m["ms_per_step"] for m in train if m["step"] > WARMUP_STEPS_SKIPPED] or [m["ms_per_step"] for m in train]
    ms = statistics.median(timed) if timed else math.nan
    device = config.get("device", "cpu")
    asked_graph = tcfg.get("cuda_graph", SETTINGS_BEFORE_ADDED["cuda_graph"])
    return RunSummary(
        recipe=tcfg["recipe"], run_dir=run_dir, steps=tcfg["steps"], last_step=last_step, finished=finished,
        train_curve=train_curve, val_curve=val_curve,
        final_train_loss=train_curve[-1][1] if train_curve else math.nan,
        final_val_loss=val_curve[-1][1] if val_curve else math.nan,
        ms_per_step=ms, tokens_per_s=tcfg["batch_size"] * tcfg["seq_len"] / (ms / 1e3),
        peak_mem_gib=max((m["mem_gib"] for m in train), default=math.nan),
        memory_kind="cuda" if device.startswith("cuda") else "rss",
        rss_before_model_gib=(result or {}).get("rss_before_model_gib"),
        flops_per_token=config["flops_per_token"], device=device,
        device_name=(result or {}).get("device_name"), config=config, result=result,
        cuda_graph=all(m.get("cuda_graph", asked_graph) for m in train),
        timed_steps=len(timed),
    )


@dataclass
class TargetCheck:
    """One target of one recipe against bf16: ``met``, the measured ``value`` and a
    sentence saying by how much it was met or missed."""

    recipe: str
    target: str
    met: bool
    value: str
    verdict: str


def check_targets(run: RunSummary, base: RunSummary) -> list[TargetCheck]:
    """mxmoe's MXFP8 parity targets for ``run`` against the bf16 run ``base``: final
    validation loss within :data:`VAL_LOSS_GAP_TARGET_PCT` % of bf16's, tokens/s at least
    :data:`SPEED_TARGET_RATIO` x bf16's, peak memory below bf16's."""
    checks = []
    gap = 100.0 * (run.final_val_loss - base.final_val_loss) / base.final_val_loss
    met = gap <= VAL_LOSS_GAP_TARGET_PCT
    checks.append(TargetCheck(
        run.recipe, f"final val loss within {VAL_LOSS_GAP_TARGET_PCT:g}% of bf16", met,
        f"{run.final_val_loss:.4f} vs {base.final_val_loss:.4f} ({gap:+.2f}%)",
        "met" if met else f"missed by {gap - VAL_LOSS_GAP_TARGET_PCT:.2f} percentage points "
                          f"({gap:+.2f}% against at most +{VAL_LOSS_GAP_TARGET_PCT:g}%)"))
    ratio = run.tokens_per_s / base.tokens_per_s
    met = ratio >= SPEED_TARGET_RATIO
    short = SPEED_TARGET_RATIO * base.tokens_per_s - run.tokens_per_s
    checks.append(TargetCheck(
        run.recipe, f"tokens/s >= {SPEED_TARGET_RATIO:g}x bf16", met,
        f"{run.tokens_per_s:,.0f} vs {base.tokens_per_s:,.0f} tok/s ({ratio:.3f}x)",
        ("met" if met else f"missed by {SPEED_TARGET_RATIO - ratio:.3f}x: {ratio:.3f}x of bf16 against at least "
                           f"{SPEED_TARGET_RATIO:g}x ({short:,.0f} tok/s short of "
                           f"{SPEED_TARGET_RATIO * base.tokens_per_s:,.0f} tok/s)")
        + (" (unreliable: too few timed steps)" if run.few_timed_steps or base.few_timed_steps else "")))
    diff = run.peak_mem_gib - base.peak_mem_gib
    met = diff < 0
    checks.append(TargetCheck(
        run.recipe, "peak memory below bf16", met,
        f"{run.peak_mem_gib:.3f} vs {base.peak_mem_gib:.3f} GiB ({100 * diff / base.peak_mem_gib:+.1f}%)",
        "met" if met else f"missed by {diff:.3f} GiB ({100 * diff / base.peak_mem_gib:+.1f}%: "
                          f"{'equal to' if diff == 0 else 'above'} bf16's)"))
    return checks


def _fmt(x: float | None, spec: str, na: str = "n/a") -> str:
    return na if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def render_report(runs: list[RunSummary], peak_tflops: float | None = None,
                  unfinished: list[RunSummary] | None = None) -> str:
    """The Markdown of report.md for finished ``runs`` (one per recipe).

    Args:
        runs: finished runs, in the order the table lists them.
        peak_tflops: peak for MFU (TFLOP/s); None: looked up per run from its GPU's name
            (:func:`peak_tflops_for`), "n/a" on the CPU and unknown GPUs.
        unfinished: runs found but not finished (listed, not compared).
    """
    base = next((r for r in runs if r.recipe == BASELINE_RECIPE), None)
    first = runs[0]
    t, params = first.config["train"], first.config["params"]
    m = t["model"]
    lines = [f"# mxmoe compare: {', '.join(r.recipe for r in runs)}", ""]
    lines.append(
        f"Same model, seed ({t['seed']}) and data order under each recipe: {m['n_layers']} layers, width "
        f"{m['d_model']}, {m['n_heads']} heads, {m['n_experts']} experts of width {m['d_expert']}, top-{m['top_k']}"
        f"{', MoE every ' + str(m['moe_every']) + ' blocks' if m['moe_every'] > 1 else ''}; "
        f"{params['total'] / 1e6:.1f}M parameters ({params['active'] / 1e6:.1f}M active per token), "
        f"{first.flops_per_token / 1e6:.1f} MFLOP per token (training). {t['steps']} steps of "
        f"{t['batch_size']} x {t['seq_len']} tokens, lr {t['lr']:g} (warmup {t['warmup_steps']}, cosine to "
        f"{t['min_lr_ratio']:g}x). Corpus: {first.config['corpus']}.")
    lines.append("")
    devices = sorted({f"{r.device_name or r.device} (torch {r.config.get('torch', '?')})" for r in runs})
    lines.append(f"Device: {'; '.join(devices)}." + (
        " **The runs ran on different devices: speed and memory are not comparable.**" if len(devices) > 1 else ""))
    on_cpu = all(r.memory_kind == "rss" for r in runs)
    differing = sorted({k for r in runs for k in _settings_diff(r.config["train"], t, on_cpu)} - {"model"})
    model_diff = any(r.config["train"]["model"] != m for r in runs)
    if differing or model_diff:
        lines.append("")
        lines.append(f"**The runs differ in settings** ({', '.join(differing + (['model'] if model_diff else []))}):"
                     " they are not a like-for-like comparison.")
    lines += ["", "| recipe | final train loss | final val loss | val gap to bf16 | train gap to bf16 | tokens/s "
                  "| ms/step | peak memory (GiB) | MFU | speedup vs bf16 |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        peak = peak_tflops if peak_tflops is not None else peak_tflops_for(r.device_name if r.memory_kind == "cuda"
                                                                           else None)
        u = mfu(r.flops_per_token, r.tokens_per_s, peak)
        if base is not None:
            vgap = f"{100 * (r.final_val_loss - base.final_val_loss) / base.final_val_loss:+.2f}%"
            tgap = f"{100 * (r.final_train_loss - base.final_train_loss) / base.final_train_loss:+.2f}%"
            speedup = f"{r.tokens_per_s / base.tokens_per_s:.3f}x"
        else:
            vgap = tgap = speedup = "n/a (no bf16 run)"
        lines.append(f"| {r.recipe} | {r.final_train_loss:.4f} | {r.final_val_loss:.4f} | {vgap} | {tgap} "
                     f"| {r.tokens_per_s:,.0f} | {r.ms_per_step:.1f} | {r.peak_mem_gib:.3f} "
                     f"| {_fmt(None if u is None else 100 * u, '.2f')}{'' if u is None else '%'} | {speedup} |")
    few = [r for r in runs if r.few_timed_steps]
    if few:
        lines += ["", "**Speed from too few steps:** " + ", ".join(f"{r.recipe} {r.timed_steps}" for r in few)
                  + f" timed step(s) (at least {MIN_TIMED_STEPS} after the first {WARMUP_STEPS_SKIPPED} are "
                  "needed for tokens/s and speedup to mean much; run more --steps)."]
    lines += ["", "## Targets", ""]
    others = [r for r in runs if r.recipe != BASELINE_RECIPE]
    if base is None or not others:
        lines.append("Not checked: the targets compare a quantized recipe with bf16, and this report does not hold "
                     "both (run `mxmoe compare --recipes bf16,mxfp8 --reuse` with the same flags to add the other).")
    else:
        checks = [c for r in others for c in check_targets(r, base)]
        lines += ["| recipe | target | measured | verdict |", "|---|---|---|---|"]
        lines += [f"| {c.recipe} | {c.target} | {c.value} | {c.verdict if c.met else '**' + c.verdict + '**'} |"
                  for c in checks]
        missed = [c for c in checks if not c.met]
        lines.append("")
        lines.append(f"{len(checks) - len(missed)} of {len(checks)} targets met"
                     + ("; missed: " + "; ".join(f"{c.recipe} {c.target}: {c.verdict}" for c in missed) + "."
                        if missed else "."))
        if on_cpu:
            lines.append("")
            lines.append("On the CPU the quantized recipes are emulated (quantize-dequantize passes, then bf16 "
                         "GEMMs), so the tokens/s target measures the emulation's overhead, not MXFP8 hardware; on "
                         "a CPU without fast bf16 matrix products (AVX512-BF16 or AMX) the GEMMs of every recipe "
                         "take a slow path and the speed ratio says little at all.")
    if unfinished:
        lines += ["", "Not compared (unfinished): " + ", ".join(
            f"{r.recipe} (step {r.last_step} of {r.steps}, in {r.run_dir})" for r in unfinished) + "."]
    lines += ["", "## How the numbers are measured", ""]
    lines.append(f"- Losses are cross entropy in nats per token. Final train loss: the last step's batch (the same "
                 f"batch for every recipe). Final val loss: the evaluation after the last step, "
                 f"{t['eval_batches']} fixed batch{'es' if t['eval_batches'] != 1 else ''} of the validation split. Gaps: (recipe - bf16) / bf16.")
    lines.append(f"- ms/step: median wall time of the training steps after step {WARMUP_STEPS_SKIPPED} (forward, "
                 f"backward, optimizer; evaluations and checkpoints not included); tokens/s = "
                 f"{t['batch_size']} x {t['seq_len']} tokens / that median; speedup = tokens/s over bf16's.")
    kinds = {r.memory_kind for r in runs}
    if "cuda" in kinds:
        lines.append("- Peak memory (GPU runs): `torch.cuda.max_memory_allocated` of the recipe's own process, "
                     "i.e. the peak of tensors allocated by the CUDA caching allocator during the run (parameters, "
                     "AdamW state, activations, gradients, quantized copies), not the reserved pool.")
    if "rss" in kinds:
        before = [f"{r.recipe} {r.rss_before_model_gib:.3f} GiB" for r in runs
                  if r.memory_kind == "rss" and r.rss_before_model_gib is not None]
        lines.append("- Peak memory (CPU runs): the peak resident set size (`ru_maxrss`) of the recipe's own "
                     "process, which includes the Python interpreter, torch and the corpus as well as the model's "
                     "tensors" + (f"; resident size before the model was built: {', '.join(before)}, so the "
                                  f"difference between recipes is the training's own" if before else "") + ".")
    lines.append("- MFU: training FLOPs per token x tokens/s / peak. FLOPs per token = 6 x matmul parameters "
                 "active per token (embedding lookup excluded, LM head included) + 6 x layers x seq_len x width for "
                 "causal attention scores and values (forward + backward); the same count for every recipe. Peak: "
                 + (f"{peak_tflops:g} TFLOP/s (given)." if peak_tflops is not None else
                    "the GPU's dense BF16 peak (" + ", ".join(f"{k} {v:g}" for k, v in PEAK_BF16_TFLOPS)
                    + " TFLOP/s); n/a on the CPU and on other GPUs unless --peak-tflops is given."))
    lines.append("- Curves: `loss.png`; per-step metrics: " + ", ".join(f"`metrics-{r.recipe}.jsonl`" for r in runs)
                 + ".")
    if "cuda" in kinds:
        graphed = {r.recipe: r.cuda_graph for r in runs if r.memory_kind == "cuda"}
        if all(graphed.values()):
            lines.append("- GPU steps: replayed from a CUDA graph after the first step (the default on CUDA; "
                         "`--no-cuda-graph` launches every kernel from Python).")
        elif not any(graphed.values()):
            lines.append("- GPU steps: launched eagerly from Python (`--no-cuda-graph`, a graph capture that "
                         "failed, or a run from before CUDA-graph steps).")
        else:
            lines.append("- GPU steps: replayed from a CUDA graph for " + ", ".join(k for k, v in graphed.items() if v)
                         + "; launched eagerly for " + ", ".join(k for k, v in graphed.items() if not v)
                         + ": speeds are not comparable.")
    commits = sorted({(r.result or {}).get("git") for r in runs} - {None})
    if commits:
        lines.append(f"- Code: mxmoe at git {', '.join(commits)}.")
    return "\n".join(lines) + "\n"


def moving_average(curve: list[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    """Trailing mean of the last ``window`` values of (step, value) pairs (fewer at the start)."""
    out, total = [], 0.0
    for i, (step, value) in enumerate(curve):
        total += value
        if i >= window:
            total -= curve[i - window][1]
        out.append((step, total / min(i + 1, window)))
    return out


def plot_curves(runs: list[RunSummary], path: Path) -> None:
    """Write ``path`` (PNG): per run, train loss per step (faint) and its moving average over
    :data:`SMOOTHING_FRACTION` of the steps, validation loss per evaluation (markers), all
    runs on one set of axes; and the same zoomed to the last :data:`ZOOM_FRACTION` of the
    steps. Atomic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = max(r.steps for r in runs)
    zoom_from = steps * (1 - ZOOM_FRACTION)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    window = max(1, round(steps * SMOOTHING_FRACTION))
    smoothed = [moving_average(r.train_curve, window) for r in runs]
    for ax, zoom in zip(axes, (False, True)):
        lo, hi = math.inf, -math.inf
        for i, r in enumerate(runs):
            c = colors[i % len(colors)]
            tr = [(s, v) for s, v in r.train_curve if not zoom or s >= zoom_from]
            sm = [(s, v) for s, v in smoothed[i] if not zoom or s >= zoom_from]
            va = [(s, v) for s, v in r.val_curve if not zoom or s >= zoom_from]
            if tr:
                ax.plot(*zip(*tr), color=c, lw=0.5, alpha=0.2)
                label = f"{r.recipe} train" + (f" (mean of {window} steps)" if window > 1 else "")
                ax.plot(*zip(*sm), color=c, lw=1.2, label=label)
            if va:
                ax.plot(*zip(*va), color=c, lw=1.8, ls="--", marker="o", ms=4, label=f"{r.recipe} val")
            values = [v for _, v in sm + va if math.isfinite(v)]  # the zoom's y range: not the raw noise
            if values:
                lo, hi = min(lo, *values), max(hi, *values)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per token)")
        ax.grid(alpha=0.3)
        if zoom:
            ax.set_xlim(zoom_from, steps + ZOOM_FRACTION * steps * 0.02)
            if math.isfinite(lo) and hi > lo:
                pad = 0.05 * (hi - lo)
                ax.set_ylim(lo - pad, hi + pad)
            ax.set_title(f"last {ZOOM_FRACTION:.0%} of steps")
        else:
            ax.set_title("train and validation loss")
            ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write_bytes(Path(path), lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


def find_runs(out_root: Path) -> list[Path]:
    """Recipe directories in ``out_root`` (those with a config.json), bf16 first, then in
    the order of :data:`~mxmoe.recipe.RECIPES`."""
    order = list(RECIPES)
    dirs = [d for d in Path(out_root).iterdir() if d.is_dir() and (d / CONFIG_NAME).exists()]
    return sorted(dirs, key=lambda d: (order.index(d.name) if d.name in order else len(order), d.name))


def build_report(out_root: str | Path, recipes: tuple[str, ...] | None = None,
                 peak_tflops: float | None = None) -> Path:
    """Write OUT/report.md, OUT/loss.png and OUT/metrics-<recipe>.jsonl from the runs in
    ``out_root``.

    Args:
        out_root: the comparison directory.
        recipes: the recipes to report, in order (each must have a finished run); None:
            every finished run found in ``out_root`` (unfinished ones are listed).
        peak_tflops: peak for MFU (TFLOP/s); None: from the GPU's name.

    Returns:
        Path of report.md.

    Raises:
        FileNotFoundError: ``out_root`` does not exist, or a recipe asked for has no run.
        ValueError: a recipe asked for has an unfinished run, or there is no finished run.
    """
    out_root = Path(out_root)
    if not out_root.is_dir():
        raise FileNotFoundError(f"{str(out_root)!r} is not a directory; pass the --out-dir of mxmoe compare")
    if peak_tflops is not None and not (peak_tflops > 0 and math.isfinite(peak_tflops)):
        raise ValueError(f"peak TFLOP/s must be a positive number, got {peak_tflops}")
    unfinished: list[RunSummary] = []
    if recipes is None:
        runs = []
        for d in find_runs(out_root):
            s = summarize_run(d)
            (runs if s.finished else unfinished).append(s)
        if not runs:
            raise ValueError(f"no finished run in {str(out_root)!r}"
                             + (f" (unfinished: {', '.join(r.recipe for r in unfinished)})" if unfinished else "")
                             + ": mxmoe report reads the --out-dir of mxmoe compare, one <recipe>/ directory per "
                               "recipe, each finished (result.json)")
    else:
        runs = [summarize_run(out_root / r) for r in recipes]
        for r in runs:
            if not r.finished:
                raise ValueError(f"the {r.recipe} run in {str(r.run_dir)!r} is not finished (step {r.last_step} of "
                                 f"{r.steps}); rerun mxmoe compare with --reuse to finish it")
    for r in runs:
        data = (r.run_dir / METRICS_NAME).read_bytes()
        atomic_write_bytes(out_root / f"metrics-{r.recipe}.jsonl", lambda f, data=data: f.write(data))
    plot_curves(runs, out_root / PLOT_NAME)
    text = render_report(runs, peak_tflops, unfinished).encode()
    path = out_root / REPORT_NAME
    atomic_write_bytes(path, lambda f: f.write(text))
    return path
