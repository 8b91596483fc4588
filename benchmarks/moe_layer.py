"""The MoE block, router to combine, forward + backward: mxmoe against the bf16 layers
users run and against the bf16 GEMM floor.

Shapes (D, F, E, top-k, T) = model width, expert width, experts, experts per token,
tokens: Qwen3-235B-A22B (4096, 1536, 128, 8, 16384), DeepSeek-V3 (7168, 2048, 256, 8,
16384), Mixtral-8x7B (4096, 14336, 8, 2, 8192); ``--tokens`` sets T for all. Each model in
``--skewed`` (default: Qwen3-235B-A22B in a full run) runs again with a skewed routing,
the same for every variant: a quarter of the experts take about 70% of the routed rows
(:func:`skew_routing`; the run prints the share and the largest expert's load).

Variants, built one at a time on the GPU (random init, std 0.02), each timed as one
forward of x (T, D) bf16 (requiring grad) and ``y.backward(dy)``, gradients set to None
before each step:

- ``mxmoe mxfp8``: :class:`mxmoe.nn.MoELayer` under the "mxfp8" recipe (fused expert op),
  float32 master weights (``--mxmoe-params bfloat16`` for bf16 ones), bf16 activations;
- ``mxmoe bf16``: the same layer under the "bf16" recipe;
- ``mxmoe mxfp8 (bf16 params)`` and ``mxmoe bf16 (bf16 params)``: both with bfloat16
  parameters (what FSDP2's MixedPrecisionPolicy hands the layer; the parameter mode of
  SonicMoE and the HF block);
- ``mxmoe bf16 gathered (bf16 params)`` (sm90 with quack-kernels): the same layer with
  ``MXMOE_EXPERT_ENGINE=quack``, i.e. experts and combine on QuACK's gathered grouped GEMMs
  (:mod:`mxmoe.ops.moe_experts_gathered`), QuACK's autotuning bounded as for SonicMoE;
- ``SonicMoE bf16`` (if ``import sonicmoe`` works, e.g. after ``source .hopper/activate``):
  ``sonicmoe.MoE`` with bf16 parameters, ``KernelBackendMoE.sonicmoe``. QuACK autotunes
  each GEMM over 44 sm90 configurations, compiling each on first use (minutes); by default
  the list is narrowed before QuACK's GEMM interface is imported to the 6 configurations
  around its default (pingpong, 128 x {128, 160, 192} tiles, clusters 2 x 1 and 1 x 2);
  ``--sonic-configs one`` keeps the default alone, ``all`` all 44 (SonicMoE may then be a
  little faster). Left out of ``--quick`` runs (its compilation alone outlasts them) unless
  ``--variants`` names it;
- ``HF grouped_mm bf16`` (if transformers is importable): transformers'
  ``Qwen3MoeSparseMoeBlock`` from a ``Qwen3MoeConfig`` with
  ``experts_implementation="grouped_mm"`` (``torch._grouped_mm`` underneath), bf16
  parameters, ``norm_topk_prob=True``;
- ``bf16 GEMM floor``: the six expert GEMMs of forward + backward (up and down projection,
  their dgrads and wgrads) as balanced bf16 ``torch.bmm`` over E experts of T * top-k / E
  rows: no router, permutation, activation or combine. No bf16 layer can beat it.

Reported per variant: ms per forward + backward; expert-GEMM TFLOP/s (18 A D F over the
A = T * top-k rows); "x SonicMoE" and "x HF" = their time / this time (above 1: faster);
"% of floor" = floor time / this time; with ``--breakdown``, GPU kernel ms per stage
(quantize, GEMM, router, gather/scatter/combine, activation, casts and copies, other: kernel
names matched against :data:`STAGES` in a torch.profiler run); activation MB kept for the backward =
``torch.cuda.memory_allocated`` after the forward minus before, less the output. A variant
that runs out of memory is reported as such.

    PYTHONPATH=src python3 benchmarks/moe_layer.py [--quick] [--models ...] [--tokens T]
    source .hopper/activate && PYTHONPATH=src:$PYTHONPATH python3 benchmarks/moe_layer.py   # with SonicMoE
    PYTHONPATH=src python3 benchmarks/moe_layer.py --smoke          # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import os
import sys
from typing import Any, Callable

import harness

SMOKE = harness.interpret_triton_if_smoke()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from mxmoe.nn import MoELayer  # noqa: E402
from mxmoe.recipe import get_recipe  # noqa: E402

SUBJECT = "moe_layer"
SMOKE_MODEL = {"smoke": (64, 64, 4, 2, 64)}
SKEWED = " skewed"  # suffix of a model name run with the skewed routing
SKEW_SHIFT = 4.0  # the input's component along the skew direction u
VARIANTS = ("mxmoe mxfp8", "mxmoe bf16", "mxmoe mxfp8 (bf16 params)", "mxmoe bf16 (bf16 params)",
            "mxmoe bf16 gathered (bf16 params)", "SonicMoE bf16", "HF grouped_mm bf16", "bf16 GEMM floor")
BF16_PARAMS = " (bf16 params)"  # suffix of the mxmoe variants with bf16 parameters
STD = 0.02


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Parameters created inside get ``dtype`` (no float32 copy first)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# ---- baselines ----------------------------------------------------------------------------

_SONIC: dict[str, Any] = {}


def _keep_config(c, configs: str) -> bool:
    """Whether a QuACK sm90 GemmConfig stays in the autotuning list: "one" keeps QuACK's
    default configuration (pingpong, tile 128 x 192, cluster 2 x 1, no swap), "narrow" the 6
    around it (tile 128 x {128, 160, 192}, cluster 2 x 1 or 1 x 2)."""
    tiles = (192,) if configs == "one" else (128, 160, 192)
    clusters = ((2, 1),) if configs == "one" else ((2, 1), (1, 2))
    return c.pingpong and c.tile_m == 128 and c.tile_n in tiles and not c.swap_ab and \
        (c.cluster_m, c.cluster_n) in clusters


def narrow_quack_autotuning(configs: str) -> None:
    """Once, before QuACK's GEMM interface is imported (by SonicMoE or by mxmoe's gathered
    experts): ``configs`` "one" or "narrow" replaces ``quack.gemm_config._get_sm90_configs``
    by a filter of its list (:func:`_keep_config`), so that QuACK's autotuning compiles 1 or
    6 kernels per GEMM kind instead of 44; "all" leaves it alone."""
    if configs == "all" or _SONIC.get("narrowed"):
        return
    import quack.gemm_config as gemm_config

    full = gemm_config._get_sm90_configs

    def narrowed(epilogue=None, tune_coop=True):
        all_configs = full(epilogue, tune_coop)
        return [c for c in all_configs if _keep_config(c, configs)] or all_configs[:1]

    gemm_config._get_sm90_configs = narrowed
    _SONIC["narrowed"] = configs


def load_sonicmoe(configs: str) -> dict[str, Any] | None:
    """Import SonicMoE once (None, with the reason in ``_SONIC["error"]``, if it is not
    installed), QuACK's autotuning narrowed first (:func:`narrow_quack_autotuning`)."""
    if "MoE" in _SONIC or "error" in _SONIC:
        return _SONIC if "MoE" in _SONIC else None
    try:
        narrow_quack_autotuning(configs)
        import sonicmoe
        from sonicmoe import KernelBackendMoE, MoE
        from sonicmoe.enums import ActivationType

        _SONIC.update(MoE=MoE, backend=KernelBackendMoE.sonicmoe, swiglu=ActivationType.SWIGLU,
                      version=getattr(sonicmoe, "__version__", "?"), configs=configs)
        return _SONIC
    except Exception as err:  # noqa: BLE001 - any import failure means "not available here"
        _SONIC["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
        return None


def build_hf_block(D: int, F: int, E: int, k: int, dev: torch.device) -> nn.Module:
    """transformers' Qwen3MoeSparseMoeBlock with grouped_mm experts and bf16 parameters.

    Raises:
        ImportError: transformers (or its Qwen3-MoE model) is not installed.
        RuntimeError: the config did not take ``experts_implementation="grouped_mm"``.
    """
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    shape = dict(hidden_size=D, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=k, norm_topk_prob=True,
                 num_hidden_layers=1)
    try:
        cfg = Qwen3MoeConfig(**shape, experts_implementation="grouped_mm")
    except TypeError:  # a config class that does not take the keyword: set the attribute
        cfg = Qwen3MoeConfig(**shape)
        cfg._experts_implementation = "grouped_mm"
    if getattr(cfg, "_experts_implementation", None) != "grouped_mm":
        raise RuntimeError(f"Qwen3MoeConfig kept experts_implementation={cfg._experts_implementation!r}")
    with torch.device(dev), default_dtype(torch.bfloat16):
        block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():  # the block alone is not initialized (the router starts at zero)
            p.normal_(std=STD)
    return block


def build_sonic(D: int, F: int, E: int, k: int, dev: torch.device, sonic: dict[str, Any]) -> nn.Module:
    with torch.device(dev), default_dtype(torch.bfloat16):
        return sonic["MoE"](num_experts=E, num_experts_per_tok=k, hidden_size=D, intermediate_size=F,
                            activation_function=sonic["swiglu"], add_bias=False, std=STD)


def floor_step(D: int, F: int, E: int, A: int, dev: torch.device) -> Callable[[], None]:
    """The six expert GEMMs of forward + backward as balanced bf16 bmm (A / E rows each)."""
    M = max(A // E, 1)
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, device=dev, generator=g, dtype=torch.bfloat16)

    x, w1, w2 = r(E, M, D), r(E, D, 2 * F) * STD, r(E, F, D) * STD
    act, dout, dh = r(E, M, F), r(E, M, D), r(E, M, 2 * F)

    def step():
        torch.bmm(x, w1)  # up projection (gate and up)
        torch.bmm(act, w2)  # down projection
        torch.bmm(dout, w2.transpose(1, 2))  # dgrad of down
        torch.bmm(act.transpose(1, 2), dout)  # wgrad of down
        torch.bmm(dh, w1.transpose(1, 2))  # dgrad of up
        torch.bmm(x.transpose(1, 2), dh)  # wgrad of up

    return step


# ---- one variant --------------------------------------------------------------------------

def param_dtype(variant: str, args) -> torch.dtype:
    """Parameter dtype of an mxmoe variant: bfloat16 for the " (bf16 params)" ones, else
    ``--mxmoe-params``."""
    return torch.bfloat16 if variant.endswith(BF16_PARAMS) else getattr(torch, args.mxmoe_params)


def build(variant: str, D: int, F: int, E: int, k: int, dev: torch.device, args) -> tuple[nn.Module, Callable]:
    """(module, forward(x) -> y) of a layer variant."""
    if variant.startswith("mxmoe"):
        recipe = get_recipe("mxfp8" if "mxfp8" in variant else "bf16")  # the Triton kernels on CUDA
        with torch.device(dev), default_dtype(param_dtype(variant, args)):
            layer = MoELayer(D, E, k, F, 1, recipe, fused=True)
        if "gathered" in variant:
            narrow_quack_autotuning(args.sonic_configs)
            return layer, lambda x: gathered_engine(layer, x)
        return layer, lambda x: layer(x)[0]
    if variant == "SonicMoE bf16":
        sonic = load_sonicmoe(args.sonic_configs)
        layer = build_sonic(D, F, E, k, dev, sonic)
        backend = sonic["backend"]
        return layer, lambda x: layer(x, kernel_backend_moe=backend)[0]
    if variant == "HF grouped_mm bf16":
        block = build_hf_block(D, F, E, k, dev)
        return block, lambda x: block(x.view(1, *x.shape)).view(x.shape)
    raise ValueError(f"unknown variant {variant!r}")


def router_weight(module: nn.Module, E: int, D: int) -> nn.Parameter:
    """The (E, D) router weight of a layer variant (mxmoe ``router.weight``, SonicMoE
    ``router.weight``, transformers ``gate.weight``).

    Raises:
        LookupError: no such parameter.
    """
    for name, p in module.named_parameters():
        if name.split(".")[-2:-1] in (["router"], ["gate"]) and name.endswith("weight") and tuple(p.shape) == (E, D):
            return p
    raise LookupError(f"no (E={E}, D={D}) router weight in {type(module).__name__}")


def skew_direction(D: int, dev: torch.device) -> torch.Tensor:
    """A fixed unit vector u (D,) float32 (seeded): the skew direction."""
    u = torch.randn(D, generator=torch.Generator().manual_seed(1234))
    return (u / u.norm()).to(dev)


def skew_routing(module: nn.Module, E: int, D: int, u: torch.Tensor) -> None:
    """In place: the router rows of the first E // 4 experts get (b / a) u, with the input
    shifted by a u (a = :data:`SKEW_SHIFT`, see :func:`main`), so their logits rise by about
    b = 0.02 sqrt(D), one standard deviation of the logits at the init std 0.02: a quarter of
    the experts then take about 70% of the routed rows (top-8 of 128)."""
    w = router_weight(module, E, D)
    with torch.no_grad():
        w[: max(E // 4, 1)] += (STD * D ** 0.5 / SKEW_SHIFT) * u.to(w.dtype)


def gathered_engine(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's forward with ``MXMOE_EXPERT_ENGINE=quack`` (restored after)."""
    old = os.environ.get("MXMOE_EXPERT_ENGINE")
    os.environ["MXMOE_EXPERT_ENGINE"] = "quack"
    try:
        return layer(x)[0]
    finally:
        if old is None:
            del os.environ["MXMOE_EXPERT_ENGINE"]
        else:
            os.environ["MXMOE_EXPERT_ENGINE"] = old


def skip_reason(variant: str, args) -> str | None:
    """Why a variant does not run here (None: it runs)."""
    if "gathered" in variant:
        from mxmoe.kernels import quack_moe

        if args.smoke or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
            return "sm90 GPU only"
        if not quack_moe.available():
            return "quack-kernels not importable (source .hopper/activate, or pip install 'mxmoe[hopper]')"
    if variant == "SonicMoE bf16":
        if args.smoke:
            return "CUDA only"
        if args.quick and not args.variants_given:
            return "not in --quick: QuACK compiles its GEMMs for minutes on first use (run without --quick)"
        if load_sonicmoe(args.sonic_configs) is None:
            return f"sonicmoe not importable ({_SONIC.get('error', '?')})"
    if variant == "HF grouped_mm bf16":
        try:
            import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401
        except Exception as err:  # noqa: BLE001 - not installed, or an incompatible version
            return f"transformers not importable ({type(err).__name__})"
    return None


def activation_bytes(forward: Callable, x: torch.Tensor, dev: torch.device) -> int | None:
    """Bytes the forward keeps alive for the backward: memory_allocated after minus before,
    less the output's own bytes (CUDA only)."""
    if dev.type != "cuda":
        return None
    xx = x.detach().requires_grad_(True)
    harness.free_memory()
    before = torch.cuda.memory_allocated(dev)
    y = forward(xx)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated(dev) - before - y.numel() * y.element_size()
    del y, xx
    return kept


# kernel name patterns -> stage, first match wins (Triton, CUTLASS/cuBLAS, QuACK/CuTe-DSL and
# torch kernel names on the H200); anything else is "other"
STAGES = (
    ("quantize", ("quantize", "_mx_", "mx_rows", "mx_tile", "grouped_tok", "grouped_col", "dequant", "fp8", "e4m3")),
    ("GEMM", ("gemm", "sm90_xmma", "cutlass", "nvjet", "wgmma", "matmul", "_mm_", "bmm", "gated", "Gemm")),
    ("router", ("topk", "softmax", "sort", "bincount", "histc", "cumsum", "argsort", "radix")),
    ("gather/scatter/combine", ("gather", "scatter", "index", "combine", "permute", "zero_fill")),
    ("activation", ("silu", "swiglu", "glu", "mul_kernel", "sigmoid")),
    ("casts/copies/elementwise", ("copy", "cast", "widen", "elementwise", "fill", "add", "vectorized")),
)


TOP_KERNELS = 12  # kernels listed by time in a breakdown


def stage_of(kernel: str) -> str:
    low = kernel.lower()
    for stage, keys in STAGES:
        if any(k.lower() in low for k in keys):
            return stage
    return "other"


def breakdown(step: Callable, dev: torch.device, reps: int = 3) -> dict[str, float]:
    """GPU kernel time per stage (ms per forward + backward) of ``step``, from torch.profiler
    over ``reps`` calls after one warm call; kernel names matched against :data:`STAGES`."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize(dev)
    from torch.autograd import DeviceType

    out: dict[str, float] = {}
    kernels: list[tuple[float, str]] = []
    for ev in prof.key_averages():  # device events only: the kernels themselves (CPU ops would count them twice)
        if getattr(ev, "device_type", None) != DeviceType.CUDA:
            continue
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0.0)
        if not t:
            continue
        st = stage_of(ev.key)
        out[st] = out.get(st, 0.0) + t / 1e3 / reps
        kernels.append((t / 1e3 / reps, ev.key))
    out = dict(sorted(out.items(), key=lambda kv: -kv[1]))
    out["top kernels"] = [(round(ms, 3), name[:90]) for ms, name in sorted(kernels, reverse=True)[:TOP_KERNELS]]
    return out


def run_variant(variant: str, D: int, F: int, E: int, k: int, x: torch.Tensor, dy: torch.Tensor,
                skew_u: torch.Tensor | None,
                dev: torch.device, args) -> dict[str, Any]:
    """Time one variant; returns {"ms", "act_MB", "note"} (ms None if it did not run)."""
    reason = skip_reason(variant, args)
    if reason:
        return {"ms": None, "act_MB": None, "note": reason}
    timing = dict(mode=args.timing, warmup_ms=args.warmup_ms, rep_ms=harness.rep_ms(args), smoke=args.smoke,
                  label=variant)
    module = fn = None
    try:
        if variant == "bf16 GEMM floor":
            fn = floor_step(D, F, E, x.shape[0] * k, dev)
            return {"ms": 1e3 * harness.bench(fn, **timing), "act_MB": None, "note": "six bf16 bmm, balanced"}
        module, forward = build(variant, D, F, E, k, dev, args)
        if skew_u is not None:
            skew_routing(module, E, D, skew_u)
        params = [p for p in module.parameters() if p.requires_grad]
        xx = x.detach().requires_grad_(True)

        def step():
            xx.grad = None
            for p in params:
                p.grad = None
            forward(xx).backward(dy)

        ms = 1e3 * harness.bench(step, **timing)
        stages = breakdown(step, dev) if args.breakdown and dev.type == "cuda" else None
        for p in params:
            p.grad = None
        act = activation_bytes(forward, x, dev)
        note = ""
        if isinstance(module, MoELayer):
            note = f"expert path: {module.last_expert_path}, params {str(param_dtype(variant, args))[6:]}"
            counts = module.last_tokens_per_expert.float()
            note += (f"; top quarter of experts {counts.sort(descending=True).values[: max(E // 4, 1)].sum() / counts.sum():.0%}"
                     f" of rows, max/mean {counts.max() / counts.mean():.2f}")
        elif variant == "SonicMoE bf16":
            note = f"sonic-moe {_SONIC['version']}, QuACK configs: {_SONIC['configs']}"
        elif variant == "HF grouped_mm bf16":
            note = f"experts_implementation={module.experts.config._experts_implementation}"
        return {"ms": ms, "act_MB": act / 1e6 if act is not None else None, "note": note, "stages_ms": stages}
    except torch.cuda.OutOfMemoryError:
        return {"ms": None, "act_MB": None, "note": "out of memory"}
    finally:
        del module, fn
        gc.collect()
        harness.free_memory()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(p, timing="eager")
    harness.add_models_arg(p)
    p.add_argument("--tokens", type=int, default=None, help="T for every model (default: each model's T)")
    p.add_argument("--variants", default=None, help="comma-separated (default: all; --quick: all but SonicMoE)")
    p.add_argument("--mxmoe-params", default="float32", choices=("float32", "bfloat16"),
                   help="dtype of mxmoe's parameters (default: %(default)s, the trainer's master weights)")
    p.add_argument("--sonic-configs", default="narrow", choices=("one", "narrow", "all"),
                   help="QuACK autotuning list for SonicMoE: its default configuration, the 6 around it, or all 44 "
                        "(default: %(default)s)")
    p.add_argument("--skewed", default=None,
                   help="comma-separated models to run again with a skewed routing (default: qwen3-235b-a22b in a "
                        "full run, none with --quick or --models; '' for none)")
    p.add_argument("--breakdown", action="store_true",
                   help="also profile each variant and print its GPU kernel time per stage (quantize, GEMM, router, "
                        "gather/scatter/combine, activation, casts/copies, other)")
    args = p.parse_args(argv)
    args.variants_given = args.variants is not None
    variants = [v.strip() for v in (args.variants or ",".join(VARIANTS)).split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; use {', '.join(VARIANTS)}")
    if not variants:
        p.error(f"--variants names no variant; use one or more of {', '.join(VARIANTS)}")
    if args.mxmoe_params == "bfloat16":  # the "(bf16 params)" variants would repeat the plain ones
        variants = [v for v in variants if not v.endswith(BF16_PARAMS)] or variants
    if args.tokens is not None and args.tokens < 1:
        p.error(f"--tokens must be a positive integer, got {args.tokens}")
    models = harness.selected_models(p, args, SMOKE_MODEL)
    if not args.smoke and importlib.util.find_spec("quack") is not None:
        # before anything imports QuACK's GEMM interface (it fixes its autotuning list then)
        narrow_quack_autotuning(args.sonic_configs)
    skewed = args.skewed if args.skewed is not None else (
        "smoke" if args.smoke else ("" if args.quick or args.models else "qwen3-235b-a22b"))
    for name in [n.strip() for n in skewed.split(",") if n.strip()]:
        if name not in models:
            p.error(f"--skewed {name!r} is not among the models run ({', '.join(models)})")
        models[name + SKEWED] = models[name]
    if args.tokens is not None:
        models = {n: (*m[:4], args.tokens) for n, m in models.items()}
    dev = harness.device_for(args)
    env = harness.environment()
    print(harness.title("MoE layer forward + backward against SonicMoE, HF transformers and the bf16 GEMM floor",
                        env, args), flush=True)
    if args.breakdown and dev.type != "cuda":
        print("note: --breakdown profiles GPU kernels; on the CPU there is nothing to break down", flush=True)
    rows: list[harness.Row] = []
    results: dict[str, dict[str, Any]] = {}
    for name, (D, F, E, k, T) in models.items():
        print(f"{name}: D={D} F={F} E={E} top-{k} T={T}", flush=True)
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=g)
        dy = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=g)
        skew_u = skew_direction(D, dev) if name.endswith(SKEWED) else None
        if skew_u is not None:
            x = (x.float() + SKEW_SHIFT * skew_u).bfloat16()
        res = {}
        for variant in variants:
            res[variant] = run_variant(variant, D, F, E, k, x, dy, skew_u, dev, args)
            gc.collect()  # the variant's module and graph, released with run_variant's frame
            harness.free_memory()
            print(f"  {variant:20s} {harness.fmt(res[variant]['ms'], '.2f')} ms  {res[variant]['note']}", flush=True)
            stages = res[variant].get("stages_ms")
            if stages:
                print("    stages (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items() if k != "top kernels"),
                      flush=True)
                for kernel_ms, kernel in stages["top kernels"]:
                    print(f"      {kernel_ms:8.3f} ms  {kernel}", flush=True)
        del x, dy
        harness.free_memory()
        flops = 18.0 * T * k * D * F
        ref = {key: res.get(v, {}).get("ms") for key, v in (("sonic", "SonicMoE bf16"), ("hf", "HF grouped_mm bf16"),
                                                              ("floor", "bf16 GEMM floor"))}
        body = []
        for variant in variants:
            ms, r = res[variant]["ms"], res[variant]
            ratios = {key: (ref[key] / ms if ms and ref[key] else None) for key in ref}
            r.update(x_sonicmoe=ratios["sonic"], x_hf=ratios["hf"], pct_floor=ratios["floor"])
            body.append([variant, harness.fmt(ms, ".2f"), harness.fmt(ms and flops / (ms * 1e-3) / 1e12, ".0f"),
                         harness.fmt(ratios["sonic"], ".2f", "x"), harness.fmt(ratios["hf"], ".2f", "x"),
                         harness.fmt(ratios["floor"] and 100 * ratios["floor"], ".0f", "%"),
                         harness.fmt(r["act_MB"], ".0f"), r["note"]])
            rows.append(harness.Row(f"{name} {variant}", f"D={D} F={F} E={E} k={k} T={T}",
                                    ms * 1e3 if ms else None, ref["hf"] * 1e3 if ref["hf"] else None, flops=flops,
                                    note=r["note"], extra={"x_sonicmoe": ratios["sonic"], "pct_floor": ratios["floor"],
                                                           "activation_MB": r["act_MB"]}))
        results[name] = res
        print()
        print(f"### {name} (D={D}, F={F}, E={E}, top-{k}, T={T})")
        print(harness.format_table(["variant", "ms", "expert TFLOP/s", "x SonicMoE", "x HF", "% of floor",
                                    "activation MB", "note"], body))
        print()
    if len(models) > 1:
        body = [[v, harness.fmt(harness.geomean(results[m][v].get("x_sonicmoe") for m in models), ".2f", "x"),
                 harness.fmt(harness.geomean(results[m][v].get("x_hf") for m in models), ".2f", "x"),
                 harness.fmt(harness.geomean(100 * f if f else None for f in (results[m][v].get("pct_floor")
                                                                               for m in models)), ".0f", "%")]
                for v in variants]
        print("### geometric mean over the shapes")
        print(harness.format_table(["variant", "x SonicMoE", "x HF", "% of floor"], body))
    harness.write_results(SUBJECT, args, env, rows, {
        "baseline": "HF transformers Qwen3MoeSparseMoeBlock, grouped_mm experts, bf16 (row ratio); SonicMoE and the "
                    "bf16 GEMM floor in each row's extra",
        "models": {n: dict(zip("DFEkT", m)) for n, m in models.items()}, "variants": results,
        "sonicmoe": {k: v for k, v in _SONIC.items() if isinstance(v, str)}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
