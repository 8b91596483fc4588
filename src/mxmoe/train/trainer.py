"""The training loop: AdamW, warmup + cosine decay, gradient clipping, evaluation,
atomic checkpoints, exact resume, one log line and one metrics line per step.

One loop (:func:`train`) runs in one process or on each of P expert-parallel ranks under
torchrun (``cfg.expert_parallel = P``); the expert-parallel pieces it uses are those of
:mod:`mxmoe.distributed` (sharded experts, the ranks' batch slices, gradient all-reduce,
gathered checkpoints) and :class:`~mxmoe.train.step.ExpertParallelStep`.

Determinism: the batch of step s is drawn from a generator seeded with (seed, s), the
model has no dropout, so a run resumed from a checkpoint draws the same batches and, on
the same machine, computes the same losses as an uninterrupted one. Over P ranks every
rank draws the same global batch and keeps its slice of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import math
import os
import resource
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from ..distributed.batch import evaluate_expert_parallel, rank_slice
from ..distributed.ep import shard_experts
from ..distributed.launch import DistEnv, init_expert_parallel
from ..distributed.mesh import ExpertParallelMesh, init_mesh, shard_model
from ..distributed.sync import gather_state, load_sharded_model_state
from ..models import ModelConfig, MoETransformer, build_model
from ..recipe import BACKENDS, RECIPES, get_recipe
from .checkpoint import (
    CHECKPOINT_NAME,
    MetricsWriter,
    check_finite_state,
    check_regular_file,
    check_training_checkpoint,
    load_checkpoint,
    nonfinite_state,
    read_metrics,
    resolve_checkpoint_path,
    save_checkpoint,
    truncate_metrics,
    write_json,
)
from .data import Corpus, eval_batches, load_corpus, random_batch
from .fsdp_step import FSDPExpertParallelStep
from .sharded_checkpoint import (
    LATEST_NAME,
    SHARDED_CHECKPOINT_DIR,
    has_sharded_checkpoint,
    load_sharded_checkpoint,
    local_state,
    read_whole_model_state,
    read_sharded_checkpoint,
    save_sharded_checkpoint,
    sharded_state,
)
from .step import ExpertParallelStep, TrainStep

METRICS_NAME = "metrics.jsonl"
CONFIG_NAME = "config.json"
# Steady-state speed: the step time skips the first WARMUP_STEPS_SKIPPED steps (allocator and
# kernel warm-up), here and in compare.py's reading of metrics.jsonl
WARMUP_STEPS_SKIPPED = 5
# the batch of step s is drawn from a generator seeded with seed * _SEED_STRIDE + s
_SEED_STRIDE = 1_000_003
# Settings a resumed run may change: where it runs and logs, and how long it goes on (a
# larger --steps stretches the cosine schedule from the resumed step on).
RESUME_MAY_CHANGE = ("out_dir", "device", "progress", "steps", "eval_interval", "ckpt_interval", "quant_backend",
                     "overwrite", "cuda_graph", "max_bad_steps")
# A loss above ABSURD_LOSS_FACTOR * ln(vocab_size) + ABSURD_LOSS_MARGIN nats is far worse than
# guessing uniformly (ln(vocab_size)): the run has diverged to finite values (e.g. --lr 10)
ABSURD_LOSS_FACTOR = 2.0
ABSURD_LOSS_MARGIN = 1.0
# seeds are 32-bit, as numpy's and most tools'; seed * _SEED_STRIDE + step then fits torch's generator
MAX_SEED = 2**32 - 1
# the largest step count or interval accepted (2**40 steps would never end)
MAX_COUNT = 2**40
# the most tokens one step may take: rows are indexed in int32 in the kernels
MAX_TOKENS_PER_STEP = 2**31
# the most tokens one evaluation set may hold (two sets, validation and training, are
# built before the run as int64 windows: 2 GiB each at this bound)
MAX_EVAL_TOKENS = 2**27
# bytes each parameter takes in training: float32 weight and gradient, AdamW's two moments
TRAIN_BYTES_PER_PARAMETER = 16
# the most ranks a mesh dimension may have (--expert-parallel, --data-parallel-shard): far
# beyond any machine, small enough that the products of the checks stay readable
MAX_RANKS = 2**20
# the advisory lock a run holds on its --out-dir while it writes there (fcntl.flock)
LOCK_NAME = ".mxmoe.lock"
# the checkpoint key of the training corpus's token hash (Corpus.fingerprint): a resume
# compares corpora by their tokens, not by how --data is spelled
DATA_HASH_KEY = "data_sha256"


@dataclass
class TrainConfig:
    """Everything a run needs besides the model shape (``model``).

    Attributes:
        recipe: precision recipe name ("bf16", "mxfp8", "mxfp8-floor", "mxfp8-bf16-wgrad").
        quant_backend: quantizer backend of the recipe ("auto": Triton kernels on CUDA,
            "reference": pure torch, "triton"); every backend gives the same codes, scales
            and values (NaN payload bits aside).
        batch_size: sequences per step. seq_len: tokens per sequence.
        steps: optimizer steps. lr: peak learning rate; warmup_steps linear warmup, then
            cosine decay to lr * min_lr_ratio at the last step.
        weight_decay: AdamW decay of matrices (not of norms). beta1, beta2: AdamW betas.
        grad_clip: max global gradient norm (0 disables clipping).
        seed: initialization and data-order seed.
        eval_interval: evaluate every n steps (and at steps 0 and ``steps``); eval_batches
            batches per split.
        ckpt_interval: checkpoint every n steps (and at the end); 0: only at the end.
        out_dir: where config.json, metrics.jsonl and checkpoint.pt go.
        data: corpus path (None: the Python standard library).
        device: "auto" (cuda if available), "cpu", "cuda" or "cuda:N".
        progress: show a progress bar.
        overwrite: start anew in an ``out_dir`` that holds a run (its files are replaced);
            otherwise such a run is refused unless resuming.
        expert_parallel: P > 1 spreads the experts over P ranks (run under torchrun, one
            process per rank; :mod:`mxmoe.distributed`); each rank takes batch_size / P
            sequences of every batch (batch_size is the global batch).
        data_parallel_shard: D >= 1 runs on the 2-D mesh (D data-parallel shards x
            ``expert_parallel`` P, :mod:`mxmoe.distributed.mesh`) under torchrun with D x P
            processes: FSDP2 shards the non-expert parameters over all ranks and each expert
            group's experts over D; checkpoints are sharded (DCP,
            :mod:`mxmoe.train.sharded_checkpoint`) and resume on any mesh. 0 (default): no
            mesh; ``expert_parallel`` P > 1 then replicates the non-expert parameters.
        mx_weight_gather: on the mesh, under a quantizing recipe, gather the expert weights
            as MXFP8 codes + scales (each rank quantizes its shard once per step) instead of
            letting FSDP2 gather the float32 weights (:mod:`mxmoe.distributed.mx_gather`).
        cuda_graph: on a CUDA device, replay each step from a CUDA graph after the first
            (:mod:`mxmoe.train.step`: removes the host's launch cost, which bounds small
            models; AdamW then runs with ``capturable=True``). Ignored on the CPU and in
            expert-parallel runs.
        max_bad_steps: stop (FloatingPointError) after this many consecutive steps whose
            loss or gradient norm is not finite; each such step's update is skipped.
        model: the model shape.
    """

    recipe: str = "mxfp8"
    quant_backend: str = "auto"
    batch_size: int = 16
    seq_len: int = 256
    steps: int = 200
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    eval_interval: int = 50
    eval_batches: int = 4
    ckpt_interval: int = 100
    out_dir: str = "runs/mxmoe"
    data: str | None = None
    device: str = "auto"
    progress: bool = True
    overwrite: bool = False
    expert_parallel: int = 1
    data_parallel_shard: int = 0
    mx_weight_gather: bool = False
    cuda_graph: bool = True
    max_bad_steps: int = 5
    model: ModelConfig = field(default_factory=ModelConfig)

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting and what would work (a value of
        the wrong type included: e.g. ``lr="3e-4"``, ``model={}``)."""
        if not isinstance(self.model, ModelConfig):
            _bad(f"model must be a ModelConfig, got {type(self.model).__name__}; build it with ModelConfig(...) or "
                 f"ModelConfig.from_dict(...)")
        for name, choices in (("recipe", RECIPES), ("quant_backend", BACKENDS), ("device", None)):
            value = getattr(self, name)
            if not isinstance(value, str) or (choices is not None and value not in choices):
                options = ", ".join(choices) if choices is not None else "auto, cpu, cuda or cuda:N"
                _bad(f"unknown {name} {value!r}; use one of {options}")
        if self.data is not None and not isinstance(self.data, (str, os.PathLike)):
            _bad(f"data must be a path to a corpus file or None (the Python standard library), got {self.data!r}")
        for name in ("progress", "overwrite", "cuda_graph", "mx_weight_gather"):
            if not isinstance(getattr(self, name), bool):
                _bad(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                _bad(f"{name} must be a number, got {value!r} ({type(value).__name__})")
        for name in ("batch_size", "seq_len", "steps", "eval_interval", "eval_batches", "max_bad_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
                _bad(f"{name} must be an integer in [1, {MAX_COUNT:,}] (2**40), got {value!r}")
        for name in ("ckpt_interval", "warmup_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
                _bad(f"{name} must be an integer in [0, {MAX_COUNT:,}] (2**40), got {value!r}")
        if self.batch_size * self.seq_len > MAX_TOKENS_PER_STEP:
            _bad(f"batch_size x seq_len = {self.batch_size * self.seq_len:,} tokens per step exceeds "
                 f"{MAX_TOKENS_PER_STEP:,} (2**31, int32 row indices); use a smaller batch_size or seq_len")
        if self.eval_batches * self.batch_size * self.seq_len > MAX_EVAL_TOKENS:
            _bad(f"eval_batches x batch_size x seq_len = {self.eval_batches * self.batch_size * self.seq_len:,} "
                 f"tokens per evaluation set exceeds {MAX_EVAL_TOKENS:,} (2**27; the sets are held in memory); use "
                 f"fewer eval_batches")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            _bad(f"seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        if not isinstance(self.out_dir, (str, os.PathLike)) or not str(self.out_dir).strip():
            _bad(f"out_dir must name a directory, got {self.out_dir!r}; pass e.g. --out-dir runs/mxmoe")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            _bad(f"lr must be a positive number, got {self.lr}")
        if not (self.grad_clip >= 0 and math.isfinite(self.grad_clip)):
            _bad(f"grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            _bad(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.lr * self.weight_decay > 1:
            _bad(f"lr={self.lr:g} x weight_decay={self.weight_decay:g} = {self.lr * self.weight_decay:g} > 1: AdamW's "
                 f"decoupled decay multiplies each weight by 1 - lr x decay per step, which would flip its sign "
                 f"every step; use a weight_decay of at most 1 / lr = {1 / self.lr:g} (typical: 0.01-0.1)")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            _bad(f"AdamW betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        if not 0 <= self.min_lr_ratio <= 1:
            _bad(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.seq_len > self.model.max_seq_len:
            _bad(f"seq_len={self.seq_len} exceeds the model's max_seq_len={self.model.max_seq_len}")
        self.model.validate()
        if isinstance(self.expert_parallel, bool) or not isinstance(self.expert_parallel, int) \
                or not 1 <= self.expert_parallel <= MAX_RANKS:
            _bad(f"expert_parallel must be an integer in [1, {MAX_RANKS:,}] (2**20 ranks), got {self.expert_parallel!r}")
        if self.model.hf_config is not None and self.expert_parallel > 1:
            _bad(f"--expert-parallel {self.expert_parallel} runs mxmoe's own MoE layer; a transformers model "
                 f"(--hf-config) trains in one process: use --expert-parallel 1")
        D = self.data_parallel_shard
        if isinstance(D, bool) or not isinstance(D, int) or not 0 <= D <= MAX_RANKS:
            _bad(f"data_parallel_shard must be an integer in [0, {MAX_RANKS:,}] (0: no mesh; 2**20 ranks), got {D!r}")
        if D:
            ranks = D * self.expert_parallel
            if self.model.hf_config is not None:
                _bad(f"--data-parallel-shard {D} runs mxmoe's own MoE layer; a transformers model (--hf-config) trains "
                     f"in one process")
            if self.model.n_experts % ranks:
                _bad(f"--experts {self.model.n_experts} do not split over the mesh --data-parallel-shard {D} x "
                     f"--expert-parallel {self.expert_parallel} = {ranks} ranks (each rank's FSDP2 shard holds whole "
                     f"experts); use a number of experts divisible by {ranks}")
            if self.batch_size % ranks:
                _bad(f"--batch-size {self.batch_size} does not split over the mesh --data-parallel-shard {D} x "
                     f"--expert-parallel {self.expert_parallel} = {ranks} ranks; use a multiple of {ranks} (the global "
                     f"batch)")
        if self.mx_weight_gather and not (D and RECIPES[self.recipe].quantize and "experts" in self.model.quantized):
            _bad(f"--mx-weight-gather gathers expert weights as MXFP8 on the mesh: it needs --data-parallel-shard D >= 1, "
                 f"a quantizing recipe (mxfp8, ...) and the experts quantized (--quantize experts,...); got "
                 f"--data-parallel-shard {D}, recipe {self.recipe!r} and --quantize {','.join(self.model.quantized)!r}")
        if self.model.n_experts % self.expert_parallel:
            _bad(f"--experts {self.model.n_experts} do not split over --expert-parallel {self.expert_parallel} "
                 f"ranks; use a number of experts divisible by {self.expert_parallel}")
        if self.batch_size % self.expert_parallel:
            _bad(f"--batch-size {self.batch_size} does not split over --expert-parallel {self.expert_parallel} "
                 f"ranks; use a multiple of {self.expert_parallel} (the global batch)")
        if RECIPES[self.recipe].quantize and not self.model.quantized:
            _bad(f"recipe {self.recipe!r} would quantize no GEMM: the list of quantized GEMMs is empty "
                 f"(--quantize ''), which makes the run a bf16 run; name the GEMMs to quantize (e.g. --quantize "
                 f"experts) or use --recipe bf16")
        if self.model.mx_dispatch and not RECIPES[self.recipe].quantize:
            _bad(f"--mx-dispatch rounds expert inputs to MXFP8; recipe {self.recipe!r} does not quantize")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the config (the model config nested); :meth:`from_dict` reverses it."""
        d = dataclasses.asdict(self)
        d["model"] = self.model.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """The config :meth:`to_dict` wrote (the model config nested; missing keys take
        their defaults, unknown keys are ignored).

        Raises:
            TypeError: ``d`` or its ``model`` entry is not a dict.
        """
        if not isinstance(d, dict):
            raise TypeError(f"TrainConfig.from_dict takes a dict (what to_dict wrote), got {type(d).__name__}")
        d = dict(d)
        model = ModelConfig.from_dict(d.pop("model", {}))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(model=model, **{k: v for k, v in d.items() if k in known})


def _bad(msg: str):
    raise ValueError(msg)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warmup over
    ``warmup_steps``, then cosine decay from lr to lr * min_lr_ratio at ``steps``."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1 + math.cos(math.pi * progress))


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda if available, else cpu; otherwise torch.device(name).

    Raises:
        ValueError: an unknown device name, or a CUDA device asked for and none available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device; use --device cpu")
    return dev


def default_activation_dtype(device: torch.device) -> tuple[str, str]:
    """The activation dtype a run on ``device`` is fastest in, and why (one clause).

    On CUDA: bfloat16. On the CPU: bfloat16 only where the CPU computes it natively
    (AVX512-BF16 or AMX tiles, as ``torch.cpu`` reports them); elsewhere (AVX2-only x86
    CPUs, most laptops and many cloud VMs, and other architectures) bf16 matmuls are
    emulated, several times slower than float32, so float32 (measured on a 2-core AVX2
    EPYC: 19.4 s per step of the default model in bf16, about 1.3 s in float32). The same
    where the instructions exist but are switched off for torch (``ATEN_CPU_CAPABILITY``
    below avx512, ``ONEDNN_MAX_CPU_ISA`` below AVX512_CORE_BF16).
    """
    if device.type == "cuda":
        return "bfloat16", "a CUDA device"
    capability = torch.backends.cpu.get_cpu_capability()
    native = [name for name, has in (("AVX512-BF16", torch.cpu._is_avx512_bf16_supported()),
                                     ("AMX", torch.cpu._is_amx_tile_supported())) if has]
    # the instructions may be there but switched off for torch: ATEN_CPU_CAPABILITY below
    # AVX512 for ATen's kernels, or ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 for oneDNN's
    # matmuls (then bf16 is emulated as on a CPU without them)
    isa = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    if native and (capability in ("DEFAULT", "AVX2") or not (isa == "ALL" or any(
            k in isa for k in ("BF16", "FP16", "AMX", "AVX10")))):
        return "float32", (f"bf16 instructions are switched off for torch (torch capability {capability}, "
                           f"ONEDNN_MAX_CPU_ISA {isa}), where bf16 matmuls are emulated and several times slower "
                           f"than float32")
    if native:
        return "bfloat16", f"this CPU computes bf16 natively ({' and '.join(native)}; torch capability {capability})"
    return "float32", (f"this CPU has no native bf16 (no AVX512-BF16 or AMX; torch capability {capability}), where "
                       f"bf16 matmuls are emulated and several times slower than float32")


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and expert tensors (dim >= 2), none on norms. A
    group holding both FSDP2 DTensors and plain tensors (experts gathered as MXFP8) is
    split in two, DTensors first (the foreach kernels take one kind per list)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = []
    for params, wd in ((decay, cfg.weight_decay), (no_decay, 0.0)):
        dtensors = [p for p in params if isinstance(p, DTensor)]
        plain = [p for p in params if not isinstance(p, DTensor)]
        parts = [dtensors, plain] if dtensors and plain else [params]
        groups += [{"params": part, "weight_decay": wd} for part in parts]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=False, foreach=True)


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this run: CUDA allocator peak on GPU, process peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


@torch.no_grad()
def evaluate(model: MoETransformer, batches, device: torch.device) -> float:
    """Mean cross entropy (nats per token) over ``batches``."""
    model.eval()
    total = 0.0
    for x, y in batches:
        total += model(x.to(device), y.to(device)).ce_loss.item()
    model.train()
    return total / len(batches)


@dataclass
class TrainResult:
    """Summary of a finished run: first and last losses of the whole run (resumed parts
    included, read back from metrics.jsonl); wall time, speed and memory of this call
    (``steps``: optimizer steps it ran)."""

    first_loss: float
    last_loss: float
    first_val_loss: float
    last_val_loss: float
    wall_s: float
    tokens_per_s: float
    ms_per_step: float
    peak_mem_gib: float
    steps: int
    out_dir: str


def _log(msg: str, progress: bool) -> None:
    if progress:
        tqdm.write(msg, file=sys.stdout)
    else:
        print(msg, flush=True)


class PreparedRun(NamedTuple):
    """What :func:`prepare_run` read: the output directory, the corpus, the fixed eval
    batches of each split ((x, y) int64 (batch_size, seq_len) pairs) and, on resume, the
    loaded checkpoint (None otherwise); ``data_sha256``, the corpus's
    :meth:`~mxmoe.train.data.Corpus.fingerprint` (stored in checkpoints)."""

    out: Path
    corpus: Corpus
    val_sets: list
    train_eval_sets: list
    checkpoint: dict | None
    data_sha256: str


def holds_run(out: Path) -> bool:
    """``out`` has a run's metrics or checkpoint in it."""
    return (Path(out) / METRICS_NAME).exists() or (Path(out) / CHECKPOINT_NAME).exists() \
        or has_sharded_checkpoint(out)


_MISSING = object()

# the `mxmoe train` flag of each model setting (the top-level settings are --<key with dashes>)
_MODEL_FLAGS = {"vocab_size": "--vocab-size", "d_model": "--width", "n_layers": "--layers", "n_heads": "--heads",
                "n_experts": "--experts", "top_k": "--top-k", "d_expert": "--expert-width",
                "moe_every": "--moe-every", "d_ff_dense": "--dense-width", "shared_expert": "--shared-expert",
                "max_seq_len": "--seq-len", "aux_loss_coef": "--aux-loss-coef", "z_loss_coef": "--z-loss-coef",
                "quantized": "--quantize", "dtype": "--dtype", "mx_dispatch": "--mx-dispatch"}


def _settings_diff(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(key, saved value, new value) of every setting that differs between two config dicts;
    a nested dict (the model's) is compared key by key, its keys named ``<key>.<subkey>``
    (``model.n_layers``). A key on one side only differs (its missing value is shown as
    ``None``)."""
    diff = []
    for k in list(now) + [k for k in saved if k not in now]:
        a, b = saved.get(k, _MISSING), now.get(k, _MISSING)
        if isinstance(a, dict) and isinstance(b, dict):
            diff += _settings_diff(a, b, f"{prefix}{k}.")
        elif a is _MISSING or b is _MISSING or a != b:
            diff.append((f"{prefix}{k}", None if a is _MISSING else a, None if b is _MISSING else b))
    return diff


_NO_FLAG = ("beta1", "beta2")  # settings of the API only


def _setting_name(key: str) -> str:
    """``key`` with its `mxmoe train` flag, e.g. ``model.d_model (--width)``."""
    model_key = key.removeprefix("model.")
    if model_key != key:
        flag = _MODEL_FLAGS.get(model_key)
    else:
        flag = None if key in _NO_FLAG else "--" + key.replace("_", "-")
    return f"{key} ({flag})" if flag else key


def load_training_checkpoint(path: str | os.PathLike) -> tuple[Path, dict[str, Any], TrainConfig]:
    """The one loader of a training checkpoint for ``train --resume``, ``eval`` and
    ``export``: :func:`~mxmoe.train.checkpoint.load_checkpoint` (weights_only, checksums),
    then its structure, its settings and its model weights against the model of those
    settings (names and shapes), so that a file that would fail later fails here, in one
    line naming it. A run directory holding the sharded checkpoint of a 2-D mesh run (and
    no checkpoint.pt) gives its whole model, read in this one process (its checksums
    checked; no optimizer state: ``{}``), and the step directory as the file.

    Args:
        path: a run directory or its checkpoint.pt.

    Returns:
        ``(file, checkpoint dict, its TrainConfig)``.

    Raises:
        FileNotFoundError: no checkpoint there.
        ValueError: a directory, an unreadable or foreign file, a damaged one, or one
            whose structure, settings or weights are not those of an mxmoe run.
    """
    if has_sharded_checkpoint(path) and not (Path(path) / CHECKPOINT_NAME).exists():
        return _load_sharded_for_one_process(Path(path))
    file = resolve_checkpoint_path(path)
    ckpt = load_checkpoint(file)
    check_training_checkpoint(file, ckpt)
    cfg = saved_settings(ckpt["train_config"], file)
    check_model_state(file, ckpt["model"], cfg.model)
    return file, ckpt, cfg


def saved_settings(train_config: Any, where: Path) -> TrainConfig:
    """The validated :class:`TrainConfig` a checkpoint stores (:meth:`TrainConfig.to_dict`).

    Raises:
        ValueError: one line naming ``where`` when the settings cannot be read or validated.
    """
    try:
        cfg = TrainConfig.from_dict(train_config)
        cfg.validate()
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{str(where)!r} holds settings this mxmoe cannot use ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None
    return cfg


def _load_sharded_for_one_process(out: Path) -> tuple[Path, dict[str, Any], TrainConfig]:
    """:func:`load_training_checkpoint` of a run directory holding the sharded checkpoint of
    a 2-D mesh run: the whole model (experts of every rank) in one process; no optimizer
    state (``eval`` and ``export`` read the model only)."""
    checkpoint, cfg = load_sharded_resume(out)
    step_dir = checkpoint["sharded_dir"]
    with torch.device("meta"):
        ref = build_model(cfg.model, get_recipe("bf16"))
    try:
        state = read_whole_model_state(step_dir, {k: v.shape for k, v in ref.state_dict().items()})
    except (RuntimeError, ValueError, KeyError, CheckpointException) as e:  # DCP: a tensor missing or reshaped
        last = [line.strip() for line in str(e).splitlines() if line.strip()]  # DCP's message ends with the cause
        raise ValueError(f"{str(step_dir)!r} does not fit the model of its own settings in {LATEST_NAME} "
                         f"({(last[-1] if last else type(e).__name__)[:200]})") from None
    check_finite_state(step_dir, state, use="evaluated or exported")
    ckpt = {"step": checkpoint["step"], "model": state, "optimizer": {}, "train_config": checkpoint["train_config"]}
    return step_dir, ckpt, cfg


def check_model_state(path: Path, state: dict[str, torch.Tensor], model_cfg: ModelConfig) -> None:
    """Refuse (one-line ValueError naming ``path``) model weights whose names or shapes are
    not those of the model ``build_model(model_cfg)`` makes (mxmoe's ``MoETransformer``, or
    the transformers model of an ``--hf-config`` run; built on the meta device: no memory)."""
    with torch.device("meta"):
        ref = build_model(model_cfg, get_recipe("bf16"))
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    missing = [k for k in want if k not in state]
    extra = [k for k in state if k not in want]
    shapes = [f"{k} is {tuple(state[k].shape)}, the model's {want[k]}" for k in want
              if k in state and tuple(state[k].shape) != want[k]]
    floats = [k for k in want if k in state and not state[k].is_floating_point()]
    if not (missing or extra or shapes or floats):
        return
    parts = ([f"missing {missing[:3]}"] if missing else []) + ([f"unexpected {extra[:3]}"] if extra else []) \
        + shapes[:3] + ([f"not floating point: {floats[:3]}"] if floats else [])
    raise ValueError(f"{str(path)!r} holds weights that do not fit the model of its own settings: "
                     + "; ".join(parts))


def _check_ranks(cfg: TrainConfig, checkpoint: dict, out: Path) -> None:
    """A checkpoint resumes on the number of ranks that wrote it (checked before the other
    settings, for its clearer message): it holds one optimizer state per rank. A checkpoint
    without the ``expert_parallel`` key was written by one process."""
    saved_p = checkpoint.get("expert_parallel", 1)
    if saved_p != cfg.expert_parallel:
        raise ValueError(f"the checkpoint in {str(out)!r} was written with --expert-parallel {saved_p}, this run has "
                         f"--expert-parallel {cfg.expert_parallel}: resume on the same number of ranks (the optimizer "
                         f"state is stored per rank)")


def load_sharded_resume(out: Path) -> tuple[dict[str, Any], TrainConfig]:
    """The sharded checkpoint of a 2-D mesh run in ``out`` (its files checked against their
    checksums, :func:`~mxmoe.train.sharded_checkpoint.read_sharded_checkpoint`) as the
    checkpoint dict the resume reads (``step``, ``train_config``, the corpus hash and
    ``sharded_dir``, the step directory), and its settings.

    Raises:
        FileNotFoundError: none there. ValueError: damaged, or settings this mxmoe cannot use.
    """
    if not has_sharded_checkpoint(out) and (out / CHECKPOINT_NAME).exists():
        raise ValueError(f"{str(out)!r} holds a single-file checkpoint ({CHECKPOINT_NAME}), not the sharded checkpoint "
                         f"of a 2-D mesh run: resume it without --data-parallel-shard (on the --expert-parallel it "
                         f"was written with)")
    step_dir, latest = read_sharded_checkpoint(out)
    saved = saved_settings(latest["train_config"], step_dir)
    checkpoint = {"step": latest["step"], "train_config": latest["train_config"], "sharded_dir": step_dir,
                  "mesh": latest.get("mesh")}
    if isinstance(latest.get(DATA_HASH_KEY), str):
        checkpoint[DATA_HASH_KEY] = latest[DATA_HASH_KEY]
    return checkpoint, saved


def prepare_run(cfg: TrainConfig, resume: bool, corpus: Corpus | None) -> PreparedRun:
    """Everything that can refuse a run, checked before any file is touched: the output
    directory, the corpus (loaded from ``cfg.data`` unless given) against the model's
    vocabulary, the eval batches, and on ``resume`` the checkpoint (its number of ranks,
    then its settings and its step against ``cfg``).

    Raises:
        ValueError: ``out_dir`` is a file, or holds a run and neither ``resume`` nor
            ``cfg.overwrite``; the corpus has ids past ``vocab_size``; a split
            shorter than seq_len + 1 tokens; a checkpoint written with another
            ``expert_parallel``, with other settings, or already at ``cfg.steps``; a
            checkpoint file that :func:`~mxmoe.train.checkpoint.load_checkpoint` refuses
            (Python objects other than tensors and plain data: nothing of it is run) or
            cannot read.
        FileNotFoundError: missing data path, or ``resume`` without a checkpoint.
    """
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out-dir {str(out)!r} is a file; pass a directory")
    if not resume and not cfg.overwrite and holds_run(out):
        raise ValueError(f"--out-dir {str(out)!r} already holds a run ({METRICS_NAME} / {CHECKPOINT_NAME}); "
                         f"pass --resume to continue it, --overwrite to replace it, or another --out-dir")
    if corpus is None:
        corpus = load_corpus(cfg.data)
    if corpus.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the corpus has token ids up to {corpus.vocab_size - 1}, but the model's "
                         f"vocab_size is {cfg.model.vocab_size}; set --vocab-size {corpus.vocab_size}")
    val_sets = eval_batches(corpus.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches)
    train_eval_sets = eval_batches(corpus.train, cfg.batch_size, cfg.seq_len, cfg.eval_batches)
    checkpoint = None
    data_sha256 = corpus.fingerprint()
    if resume:
        if cfg.data_parallel_shard:
            checkpoint, saved = load_sharded_resume(out)
        else:
            if has_sharded_checkpoint(out) and not (out / CHECKPOINT_NAME).exists():
                raise ValueError(f"{str(out)!r} holds a sharded checkpoint ({SHARDED_CHECKPOINT_DIR}) of a 2-D mesh run: "
                                 f"resume it with --data-parallel-shard D --expert-parallel P under torchrun (any mesh; "
                                 f"one process: --data-parallel-shard 1 --expert-parallel 1)")
            try:
                _, checkpoint, saved = load_training_checkpoint(out)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"{e}; to start a new run rather than resume one, train without --resume "
                                        f"(with --overwrite if the directory holds a run stopped before its first "
                                        f"checkpoint)") from None
            _check_ranks(cfg, checkpoint, out)
        # the corpus by its tokens when the checkpoint has their hash (the path may be
        # spelled differently, or name another file), else by the --data text
        by_tokens = isinstance(checkpoint.get(DATA_HASH_KEY), str)
        if by_tokens and checkpoint[DATA_HASH_KEY] != data_sha256:
            raise ValueError(f"--data {cfg.data!r} holds other tokens than the corpus the checkpoint in {str(out)!r} "
                             f"was trained on (--data {saved.data!r} then; {corpus.describe()} now): resume with that "
                             f"corpus, or start a new run in another --out-dir")
        may_change = RESUME_MAY_CHANGE + (("data",) if by_tokens else ()) \
            + (("expert_parallel", "data_parallel_shard") if cfg.data_parallel_shard else ())  # any mesh
        mismatched = [(k, a, b) for k, a, b in _settings_diff(saved.to_dict(), cfg.to_dict())
                      if k not in may_change]
        if mismatched:
            raise ValueError("--resume with settings that differ from the checkpoint's: "
                             + "; ".join(f"{_setting_name(k)}: checkpoint {a!r}, now {b!r}"
                                         for k, a, b in mismatched)
                             + "; use the original settings or a new --out-dir")
        if checkpoint["step"] >= cfg.steps:
            raise ValueError(f"the checkpoint in {str(out)!r} is at step {checkpoint['step']}, the run has "
                             f"--steps {cfg.steps}: nothing to do; pass a larger --steps to train on")
    return PreparedRun(out, corpus, val_sets, train_eval_sets, checkpoint, data_sha256)


def train(cfg: TrainConfig, resume: bool = False, corpus: Corpus | None = None) -> TrainResult:
    """Train the MoE LM of ``cfg.model`` under ``cfg.recipe``; write config.json,
    metrics.jsonl and checkpoint.pt to ``cfg.out_dir``.

    One process (``cfg.expert_parallel == 1``), or one rank of ``cfg.expert_parallel = P``
    (call it on every rank of a torchrun launch, or with a default process group already
    initialized; :mod:`mxmoe.distributed`). The run is the same in both (settings,
    schedule, batches, logs, metrics, checkpoints, exact resume); over P ranks:

    - every rank builds the whole model under the run's seed (so the replicated parameters
      agree and the experts are the single-process ones), then keeps its E / P experts
      (:func:`~mxmoe.distributed.ep.shard_experts`);
    - rank r takes sequences r*B/P .. (r+1)*B/P - 1 of every batch
      (:func:`~mxmoe.distributed.batch.rank_slice`) and steps with
      :class:`~mxmoe.train.step.ExpertParallelStep`; reported losses are the global batch's;
    - only rank 0 prints and writes config.json, metrics.jsonl and checkpoint.pt. The
      checkpoint holds the whole model in the single-process format (every rank's experts
      gathered) and one optimizer state per rank; it resumes on the same P only.

    With ``cfg.data_parallel_shard = D >= 1`` it runs on the 2-D mesh of D x P ranks
    (:mod:`mxmoe.distributed.mesh`): FSDP2 shards the parameters
    (:func:`~mxmoe.distributed.mesh.shard_model`), rank r takes sequences r*B/W ..
    (r+1)*B/W - 1 of W = D x P, every step is a
    :class:`~mxmoe.train.fsdp_step.FSDPExpertParallelStep`, and checkpoints are sharded
    (:mod:`mxmoe.train.sharded_checkpoint`): every rank writes its shards, and they
    resume on any mesh.

    Args:
        cfg: the run's configuration (validated here, before any work).
        resume: continue from ``out_dir/checkpoint.pt`` (same configuration required).
        corpus: an already loaded corpus (default: ``load_corpus(cfg.data)``).

    Returns:
        :class:`TrainResult` (over P ranks: the same on every rank).

    Raises:
        ValueError: a bad setting; a checkpoint whose configuration or number of ranks
            differs; with P > 1, no torchrun environment or WORLD_SIZE != P; with P == 1,
            a torchrun launch of several processes.
        FileNotFoundError: missing data path, or ``resume`` without a checkpoint.
        FloatingPointError: the run ends with steps whose updates were skipped, or
            ``cfg.max_bad_steps`` consecutive steps with a non-finite loss
            or gradient norm (their updates skipped, their metrics lines written), or a
            checkpoint due while a parameter or AdamW state holds NaN or inf (not written);
            the message names the step and the last checkpoint written.
    """
    cfg.validate()
    if cfg.data_parallel_shard:
        env = init_expert_parallel(cfg.expert_parallel, cfg.device, cfg.data_parallel_shard)
        mesh = init_mesh(cfg.data_parallel_shard, cfg.expert_parallel, env.device.type)
        result = _train(cfg, resume, corpus, env.device, env, mesh)
        if env.owns_group:
            dist.barrier()
            dist.destroy_process_group()
        return result
    if cfg.expert_parallel == 1:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(f"launched with WORLD_SIZE={os.environ['WORLD_SIZE']} but --expert-parallel 1; pass "
                             f"--expert-parallel {os.environ['WORLD_SIZE']}, or a mesh --data-parallel-shard D --expert-parallel P "
                             f"with D x P = {os.environ['WORLD_SIZE']}")
        return _train(cfg, resume, corpus, resolve_device(cfg.device), None)
    env = init_expert_parallel(cfg.expert_parallel, cfg.device)
    result = _train(cfg, resume, corpus, env.device, env)  # on an error the process exits (torchrun stops the others)
    if env.owns_group:
        dist.barrier()  # nothing in flight from any peer when the connections close
        dist.destroy_process_group()
    return result


def check_backend_device(cfg: TrainConfig, device: torch.device) -> None:
    """``--quant-backend triton`` needs the Triton kernels' device: refuse it before any file
    is written on a device they do not run on (the CPU without ``TRITON_INTERPRET=1``).

    Raises:
        ValueError: naming the device and what would work.
    """
    check_quant_backend_device(cfg.quant_backend, RECIPES[cfg.recipe].quantize, device)


def check_quant_backend_device(quant_backend: str, quantizes: bool, device: torch.device) -> None:
    """The rule of :func:`check_backend_device` for a backend name, whether the recipe
    quantizes, and the device (``mxmoe eval`` checks its ``--quant-backend`` with it).

    Raises:
        ValueError: "triton" for a quantizing recipe off CUDA without ``TRITON_INTERPRET=1``.
    """
    if quant_backend == "triton" and quantizes and device.type != "cuda" \
            and os.environ.get("TRITON_INTERPRET", "") != "1":
        raise ValueError(f"--quant-backend triton runs the Triton kernels, which need a CUDA device; this run is on "
                         f"{device}: use --quant-backend auto or reference (the same bits), or set TRITON_INTERPRET=1 "
                         f"for Triton's (slow) CPU interpreter")


def check_model_fits(cfg: TrainConfig, device: torch.device) -> None:
    """Refuse, before any file is written, a model whose float32 weights, gradients and
    AdamW state (16 bytes per parameter, :meth:`ModelConfig.parameter_count`) exceed the
    memory of ``device`` (CUDA: the GPU's total memory, its experts split over
    ``cfg.expert_parallel`` ranks; the CPU: the machine's physical memory). Activations
    come on top, so a run that passes may still run out of memory; one that fails cannot
    fit.

    Raises:
        ValueError: naming the parameter count, the bytes needed and the memory there is.
    """
    params = cfg.model.parameter_count()
    need = params * TRAIN_BYTES_PER_PARAMETER / (max(1, cfg.expert_parallel) * max(1, cfg.data_parallel_shard))
    if device.type == "cuda":
        have, where = torch.cuda.get_device_properties(device).total_memory, f"the GPU {device}"
    else:
        try:
            have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine"
        except (ValueError, OSError, AttributeError):
            return  # the platform does not say; the allocator will
    if need > have:
        raise ValueError(f"the model has {params:,} parameters: their float32 weights, gradients and AdamW state "
                         f"need {need / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} GiB of {where}; use "
                         f"smaller --width, --layers, --experts or --expert-width")


@contextlib.contextmanager
def out_dir_lock(out: Path, enabled: bool = True):
    """Hold an advisory lock (``fcntl.flock`` on ``out/.mxmoe.lock``) for the body: a second
    run into the same directory is refused while the first writes there. The lock goes with
    the process (a killed run leaves no stale lock); the file stays.

    Raises:
        ValueError: another process holds the lock (its pid in the message).
    """
    if not enabled:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    check_regular_file(path, "a lock file")
    f = open(path, "a+")  # noqa: SIM115 - held open for the body
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise ValueError(f"--out-dir {str(out)!r} is in use by another mxmoe run (pid {holder}, lock "
                             f"{str(path)!r}); wait for it to finish or pass another --out-dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield
    finally:
        f.close()  # releases the lock


def _train(cfg: TrainConfig, resume: bool, corpus: Corpus | None, device: torch.device,
           env: DistEnv | None, mesh: ExpertParallelMesh | None = None) -> TrainResult:
    """The training loop of :func:`train` on ``device``: one process (``env`` None) or one
    rank of an expert-parallel group (``env``); rank 0 holds the out-dir lock."""
    check_backend_device(cfg, device)
    check_model_fits(cfg, device)
    prepared = prepare_run(cfg, resume, corpus)  # every refusal before any file is written
    main = env is None or env.rank == 0
    with out_dir_lock(prepared.out, enabled=main):
        if main and not resume and not cfg.overwrite and holds_run(prepared.out):  # written since the check
            raise ValueError(f"--out-dir {str(prepared.out)!r} now holds a run (written by another process); pass "
                             f"another --out-dir")
        return _train_locked(cfg, device, env, prepared, mesh)


def _train_locked(cfg: TrainConfig, device: torch.device, env: DistEnv | None, prepared: PreparedRun,
                  mesh: ExpertParallelMesh | None = None) -> TrainResult:
    P, rank = cfg.expert_parallel, env.rank if env is not None else 0
    ranks = env.world_size if env is not None else 1  # the global batch splits over all of them
    main = rank == 0
    progress = cfg.progress and main
    out, corpus, val_sets, train_eval_sets, checkpoint, data_sha256 = prepared
    if env is not None:
        # every rank has checked the out-dir (a run already there is refused by all of them
        # alike) before rank 0 writes into it below
        dist.barrier()

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, get_recipe(cfg.recipe, backend=cfg.quant_backend))
    params = model.num_params()  # of the whole model (before the experts are spread)
    flops = model.flops_per_token(cfg.seq_len)
    if mesh is not None:
        model = model.to(device)
        shard_model(model, mesh, mx_weight_gather=cfg.mx_weight_gather)  # RNG untouched
    else:
        if env is not None:
            shard_experts(model)  # RNG untouched: every rank's replicated parameters stay equal
        model = model.to(device)
    opt = make_optimizer(model, cfg)
    start_step = 0
    trimmed = None
    if checkpoint is not None:
        if mesh is not None:  # any mesh: each rank reads its parts of the global tensors
            load_sharded_checkpoint(checkpoint["sharded_dir"], sharded_state(model, opt, mesh, cfg.model.n_experts))
        elif env is None:
            model.load_state_dict(checkpoint["model"])
            load_optimizer_state(opt, checkpoint["optimizer"], out / CHECKPOINT_NAME)
        else:
            load_sharded_model_state(model, checkpoint["model"])
            load_optimizer_state(opt, checkpoint["optimizer"][rank], out / CHECKPOINT_NAME)
        start_step = checkpoint["step"]
        if main:
            trimmed = truncate_metrics(out / METRICS_NAME, start_step).describe(METRICS_NAME, start_step)
    elif main:  # a new run in an old directory (--overwrite): the old run's log and checkpoint go
        (out / METRICS_NAME).unlink(missing_ok=True)
        (out / CHECKPOINT_NAME).unlink(missing_ok=True)  # else a resume or eval would read the old weights
        shutil.rmtree(out / SHARDED_CHECKPOINT_DIR, ignore_errors=True)

    if main:
        run_info = {
            "train": cfg.to_dict(), "params": params, "corpus": corpus.describe(), "device": str(device),
            "torch": torch.__version__, "flops_per_token": flops,
        }
        where = f"device {device}"
        if mesh is not None:
            run_info["expert_parallel"] = {"ranks": ranks, "backend": env.backend,
                                           "experts_per_rank": cfg.model.n_experts // P,
                                           "mesh": {"dp_shard": mesh.dp_shard, "ep": mesh.ep}}
            where = (f"mesh {mesh.shape_text} (dp_shard x ep, FSDP2, {env.backend}, {cfg.model.n_experts // P} experts "
                     f"per expert-parallel rank{', MXFP8 dispatch' if cfg.model.mx_dispatch else ''}) | {where}")
        elif env is not None:
            run_info["expert_parallel"] = {"ranks": P, "backend": env.backend,
                                           "experts_per_rank": cfg.model.n_experts // P}
            where = (f"expert parallel {P} ({env.backend}, {cfg.model.n_experts // P} experts per rank"
                     f"{', MXFP8 dispatch' if cfg.model.mx_dispatch else ''}) | {where}")
        write_json(out / CONFIG_NAME, run_info)
        if cfg.warmup_steps >= cfg.steps:
            _log(f"note: --warmup-steps {cfg.warmup_steps} >= --steps {cfg.steps}: the learning rate never decays "
                 f"(the run ends in warmup)", progress)
        _log(f"mxmoe train | recipe {cfg.recipe} | {params['total'] / 1e6:.2f}M params "
             f"({params['active'] / 1e6:.2f}M active) | {corpus.describe()} | {where}", progress)
        if start_step:
            _log(f"resuming from the checkpoint of step {start_step} in {out}", progress)
            if trimmed:
                _log(trimmed, progress)

    metrics = MetricsWriter(out / METRICS_NAME) if main else None
    tokens_per_step = cfg.batch_size * cfg.seq_len  # the global batch
    step_times: list[float] = []

    def run_eval(step: int) -> None:
        if env is None:
            val = evaluate(model, val_sets, device)
            tr = evaluate(model, train_eval_sets, device)
        else:
            val = evaluate_expert_parallel(model, val_sets, device)
            tr = evaluate_expert_parallel(model, train_eval_sets, device)
        if main:
            metrics.write({"kind": "eval", "step": step, "loss": tr, "val_loss": val})
            _log(f"eval step {step:5d} | train loss {tr:.4f} | val loss {val:.4f}", progress)

    last_ckpt: list[int | None] = [start_step if checkpoint is not None else None]  # step of the last one written

    def save(step: int) -> None:
        # a checkpoint with a non-finite value would replace the last good one: refuse it
        # (every rank checks its own parameters and AdamW state; over P ranks they agree)
        where = nonfinite_state(*(local_state(model, opt) if mesh is not None else (model.state_dict(),
                                                                                    opt.state_dict())))
        if env is not None:
            flag = torch.tensor([0.0 if where is None else 1.0], device=device)
            dist.all_reduce(flag)
            where = where or ("another rank's state" if flag.item() else None)
        if where is not None:  # updates are skipped on non-finite gradients: nothing would repair it
            raise FloatingPointError(f"not writing the checkpoint of step {step}: {where} holds NaN or inf; "
                                     f"{_last_good(out, last_ckpt[0])}; lower --lr or check the data")
        if mesh is not None:
            save_sharded_checkpoint(out, sharded_state(model, opt, mesh, cfg.model.n_experts),
                                    {"train_config": cfg.to_dict(), DATA_HASH_KEY: data_sha256,
                                     "mesh": [mesh.dp_shard, mesh.ep]}, step)
            last_ckpt[0] = step
            return
        if env is None:
            save_checkpoint(out, {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                                  "train_config": cfg.to_dict(), "expert_parallel": P, DATA_HASH_KEY: data_sha256})
            last_ckpt[0] = step
            return
        gathered = gather_state(model, opt)
        if main:
            model_state, opt_states = gathered
            save_checkpoint(out, {"step": step, "model": model_state, "optimizer": opt_states,
                                  "train_config": cfg.to_dict(), "expert_parallel": P, DATA_HASH_KEY: data_sha256})
        last_ckpt[0] = step
        dist.barrier()  # the checkpoint is on disk before any rank goes on

    # after the checkpoint is loaded: the step puts AdamW in the mode it needs
    def log(msg: str) -> None:
        _log(msg, progress)

    if mesh is not None:
        train_step = FSDPExpertParallelStep(model, opt, cfg.grad_clip, device, tokens_per_step, cfg.model.aux_loss_coef,
                                            cfg.model.z_loss_coef, log=log, weight_cache=cfg.mx_weight_gather)
    elif env is None:
        train_step = TrainStep(model, opt, cfg.grad_clip, device, cfg.cuda_graph, log=log)
    else:
        train_step = ExpertParallelStep(model, opt, cfg.grad_clip, tokens_per_step, cfg.model.aux_loss_coef,
                                        cfg.model.z_loss_coef, log=log)
    if start_step == 0:
        run_eval(0)
    model.train()
    wall_start = time.perf_counter()
    bar = tqdm(range(start_step + 1, cfg.steps + 1), initial=start_step, total=cfg.steps,
               disable=not progress, desc=cfg.recipe, dynamic_ncols=True, file=sys.stderr)
    bad_steps: list[int] = []  # the current run of consecutive steps with skipped updates
    absurd_loss = ABSURD_LOSS_FACTOR * math.log(cfg.model.vocab_size) + ABSURD_LOSS_MARGIN
    warned_absurd = False
    for step in bar:
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(cfg.seed * _SEED_STRIDE + step)
        x, y = random_batch(corpus.train, cfg.batch_size, cfg.seq_len, gen)
        if env is not None:
            x, y = rank_slice(x, rank, ranks), rank_slice(y, rank, ranks)
        lr = lr_at(step, cfg)
        outs = train_step(x, y, lr)
        loss = outs.ce_loss.item()  # synchronizes: the step is done
        skipped = bool(outs.skipped.item())  # already on the host's side of that sync
        dt = time.perf_counter() - t0
        counts = torch.stack(outs.tokens_per_expert).float() if outs.tokens_per_expert else None
        load_max = (counts.max(dim=1).values / counts.mean(dim=1)).max().item() if counts is not None else 1.0
        record = {
            "kind": "train", "step": step, "loss": loss, "aux_loss": outs.aux_loss.item(),
            "z_loss": outs.z_loss.item(), "grad_norm": outs.grad_norm.item(), "lr": lr,
            "tokens_per_s": tokens_per_step / dt, "ms_per_step": dt * 1e3,
            "mem_gib": peak_memory_gib(device), "expert_load_max": load_max,
            "cuda_graph": train_step.graphed,  # False after a capture that failed (eager from then on)
            "skipped": skipped,  # the update was not applied: non-finite gradient norm
        }
        if main:
            metrics.write(record)
        step_times.append(dt)
        if main:
            _log(f"step {step:5d} | loss {loss:.4f} | aux {record['aux_loss']:.3f} "
                 f"| grad norm {record['grad_norm']:.3f} | lr {lr:.2e} | {record['tokens_per_s']:,.0f} tok/s "
                 f"| {dt * 1e3:.0f} ms | {record['mem_gib']:.2f} GiB"
                 + (" | update skipped (non-finite gradient norm)" if skipped else ""), progress)
            if not warned_absurd and math.isfinite(loss) and loss > absurd_loss:
                warned_absurd = True
                _log(f"warning: loss {loss:.1f} at step {step} is far above ln(vocab_size) = "
                     f"{math.log(cfg.model.vocab_size):.2f} nats (uniform guessing): the run is diverging; "
                     f"lower --lr (now {cfg.lr:g}) or check the data", progress)
        # over P ranks: the loss and the global gradient norm are the same on every rank, all stop
        if skipped or not math.isfinite(loss):
            bad_steps.append(step)
            if len(bad_steps) >= cfg.max_bad_steps:
                raise FloatingPointError(
                    f"{len(bad_steps)} consecutive steps ({bad_steps[0]} to {step}) had a non-finite loss or gradient "
                    f"norm (loss {loss}, grad norm {record['grad_norm']}), their updates skipped; stopped at step "
                    f"{step} (--max-bad-steps {cfg.max_bad_steps}); {_last_good(out, last_ckpt[0])}; lower --lr or "
                    f"check the data")
        else:
            bad_steps.clear()
        if step % cfg.eval_interval == 0 or step == cfg.steps:
            run_eval(step)
        if (cfg.ckpt_interval and step % cfg.ckpt_interval == 0) or step == cfg.steps:
            save(step)
    bar.close()
    if metrics is not None:
        metrics.close()
    if bad_steps:  # fewer than --max-bad-steps, but the run ended without updating the weights again
        raise FloatingPointError(
            f"the run ended with {len(bad_steps)} consecutive steps ({bad_steps[0]} to {bad_steps[-1]}) whose "
            f"updates were skipped (non-finite loss or gradient norm): the weights saved at step {bad_steps[-1]} are "
            f"those of step {bad_steps[0] - 1}; lower --lr, check the data or the loss coefficients")
    wall = time.perf_counter() - wall_start
    result = None
    if main:
        result = _summarize(out, step_times, wall, tokens_per_step, device)
    if env is None:
        return result
    box = [result]
    dist.broadcast_object_list(box, src=0)  # rank 0 read the metrics file: the same result on every rank
    return box[0]


def _last_good(out: Path, step: int | None) -> str:
    if step is None:
        return "no checkpoint was written"
    name = SHARDED_CHECKPOINT_DIR if has_sharded_checkpoint(out) else CHECKPOINT_NAME
    return f"the last good checkpoint is {out / name} (step {step})"


def load_optimizer_state(opt: torch.optim.Optimizer, state: dict, path) -> None:
    """``opt.load_state_dict(state)`` after checking that the state fits ``opt``'s
    parameters: as many groups with as many parameters, and every tensor of a parameter's
    state (AdamW's moments) of that parameter's shape (a 0-d ``step`` aside). Torch would
    load a wrong shape and fail later inside the optimizer step.

    Raises:
        ValueError: naming the checkpoint file, the parameter and the shapes.
    """
    groups = state.get("param_groups") if isinstance(state, dict) else None
    per_param = state.get("state") if isinstance(state, dict) else None
    mine = [g["params"] for g in opt.param_groups]
    if not isinstance(groups, list) or not isinstance(per_param, dict) \
            or [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups] != [len(p) for p in mine]:
        raise ValueError(f"{str(path)!r}: its optimizer state does not fit this model (parameter groups of "
                         f"other sizes); it was written for another model or is damaged")
    params = [p for group in mine for p in group]
    ids = [i for g in groups for i in g["params"]]
    for index, param in zip(ids, params):
        for key, value in (per_param.get(index) or {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(f"{str(path)!r}: the optimizer's {key!r} of parameter {index} has shape "
                                 f"{tuple(value.shape)}, the parameter {tuple(param.shape)}; the checkpoint is "
                                 f"damaged or from another model")
    opt.load_state_dict(state)


def _summarize(out: Path, step_times: list[float], wall: float, tokens_per_step: int,
               device: torch.device) -> TrainResult:
    """The :class:`TrainResult` of a finished run: first and last losses of the whole run,
    resumed parts included, from its metrics file; steady-state speed of this call's steps
    (the median step time after the first ``WARMUP_STEPS_SKIPPED``, allocator and kernel
    warm-up; compare.py reads metrics.jsonl the same way)."""
    lines = read_metrics(out / METRICS_NAME)
    train_losses = [m["loss"] for m in lines if m["kind"] == "train"]
    val_losses = [m["val_loss"] for m in lines if m["kind"] == "eval"]
    steps_run = len(step_times)
    timed = step_times[min(WARMUP_STEPS_SKIPPED, steps_run // 2):] or step_times or [float("nan")]
    step_s = statistics.median(timed)  # robust to one slow step
    return TrainResult(
        first_loss=train_losses[0] if train_losses else float("nan"),
        last_loss=train_losses[-1] if train_losses else float("nan"),
        first_val_loss=val_losses[0] if val_losses else float("nan"),
        last_val_loss=val_losses[-1] if val_losses else float("nan"),
        wall_s=wall, tokens_per_s=tokens_per_step / step_s, ms_per_step=step_s * 1e3,
        peak_mem_gib=peak_memory_gib(device), steps=steps_run, out_dir=str(out),
    )
