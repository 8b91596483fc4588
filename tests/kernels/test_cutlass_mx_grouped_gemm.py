"""The quantized-weight grouped GEMM (mxmoe.kernels.cutlass_mx_grouped_gemm): what can be
checked without an sm90 GPU: the build command and cache, the source's compile-time
switches, the eligibility rule, the argument tables, the dispatch from mx_grouped_mm and
its fallbacks. Everything here runs with or without a CUDA toolkit and CUTLASS headers
(fake nvcc / headers where a build is involved); only test_both_builds_compile needs the
real ones and is skipped without them. The kernel itself runs only on sm90 (tests/gpu);
its per-value arithmetic is emulated against the reference in
tests/kernels/test_cutlass_mx_arithmetic.py, but which register holds which row and k
(the fragment layout, the shuffles) is checked only by runs on the GPU."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from mxmoe.kernels import cutlass_mx_grouped_gemm
from mxmoe.ops.grouped_mm import mx_grouped_mm
from mxmoe.recipe import get_recipe

# the tables' and the quantizers' Triton kernels run on CUDA tensors where a GPU is present,
# in the interpreter on CPU tensors otherwise (tests/conftest.py)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _macros(cmd: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in cmd if a.startswith("-D") and "=" in a)


def test_build_command_for_each_format_mode_and_op():
    """One build per element format, scale mode and GEMM, for sm_90a, with the format and
    mode as the source reads them; the dgrad's with WT = 1 (the transposed weight operand),
    RASTER = 1 (its tile order) and entries of its own name."""
    for fmt, f in (("e4m3", 0), ("e5m2", 1)):
        for mode, m in (("rceil", 0), ("floor", 1)):
            for op in ("forward", "dgrad"):
                cmd = cutlass_mx_grouped_gemm.build_command(fmt, mode, "/tmp/x.so", "nvcc", "/c", op=op)
                d = _macros(cmd)
                assert d["FMT"] == str(f) and d["MODE"] == str(m)
                assert d.get("WT", "0") == ("1" if op == "dgrad" else "0")
                assert d.get("RASTER", "0") == ("1" if op == "dgrad" else "0")
                assert set(d) == ({"FMT", "MODE", "NAME", "WT", "RASTER"} if op == "dgrad" else {"FMT", "MODE", "NAME"})
                assert d["NAME"] + "_forward" == cutlass_mx_grouped_gemm.symbol(fmt, mode, op=op)
                assert "-arch=sm_90a" in cmd and "-shared" in cmd and cmd[-1] == str(cutlass_mx_grouped_gemm.SOURCE)
                assert "-I/c/include" in cmd and "-I/c/tools/util/include" in cmd
            assert cutlass_mx_grouped_gemm.symbol(fmt, mode, op="dgrad") != cutlass_mx_grouped_gemm.symbol(fmt, mode)
    with pytest.raises(ValueError, match="e2m1"):
        cutlass_mx_grouped_gemm.build_command("e2m1", "rceil", "/tmp/x.so")
    with pytest.raises(ValueError, match="nearest"):
        cutlass_mx_grouped_gemm.build_command("e4m3", "nearest", "/tmp/x.so")
    with pytest.raises(ValueError, match="wgrad"):
        cutlass_mx_grouped_gemm.build_command("e4m3", "rceil", "/tmp/x.so", op="wgrad")


def test_the_dgrad_walks_the_token_tiles_first():
    """The dgrad build's RASTER = 1 sets the grouped scheduler's raster order to AlongN in
    fill_args; the forward's (RASTER unset, 0) leaves CUTLASS's order."""
    src = cutlass_mx_grouped_gemm.SOURCE.read_text()
    body = src[src.index("void fill_args("):]
    body = body[:body.index("\n}\n")]
    i = body.index("#if RASTER\n")
    assert "args.scheduler.raster_order = decltype(args.scheduler.raster_order)::AlongN;" in body[i:body.index("#endif", i)]
    assert "#define RASTER 0" in src
    assert "-DRASTER=1" in cutlass_mx_grouped_gemm.build_command("e4m3", "rceil", "/tmp/x.so", "nvcc", "/c", op="dgrad")
    assert not any(a.startswith("-DRASTER") for a in cutlass_mx_grouped_gemm.build_command("e4m3", "rceil", "/tmp/x.so"))


def test_every_compile_time_switch_of_the_source_is_set_by_a_library_build():
    """The source's preprocessor switches are exactly the macros the library's builds set
    (FMT, MODE, WT, RASTER; NAME names the entries), each tested only against values those
    builds pass: no branch that neither the forward nor the dgrad build compiles."""
    import re

    src = cutlass_mx_grouped_gemm.SOURCE.read_text()
    conds = re.findall(r"^\s*#\s*(?:if|elif|ifdef|ifndef)\b(.*)$", src, flags=re.M)
    tested = {name for c in conds for name in re.findall(r"\b([A-Z][A-Z0-9_]*)\b", c)} - {"defined"}
    builds = [_macros(cutlass_mx_grouped_gemm.build_command(f, m, "/tmp/x.so", op=op))
              for f in cutlass_mx_grouped_gemm.FORMATS for m in cutlass_mx_grouped_gemm.SCALE_MODES
              for op in cutlass_mx_grouped_gemm.OPS]
    set_by_builds = set().union(*builds)
    assert tested == {"FMT", "MODE", "WT", "RASTER", "NAME"}, tested
    assert set_by_builds == tested, set_by_builds
    values = {k: {b.get(k, "0") for b in builds} for k in ("FMT", "MODE", "WT", "RASTER")}
    assert values == {"FMT": {"0", "1"}, "MODE": {"0", "1"}, "WT": {"0", "1"}, "RASTER": {"0", "1"}}
    for cond in conds:  # comparisons only with the values the builds pass
        for name, value in re.findall(r"\b(FMT|MODE|WT|RASTER)\s*==\s*(\d+)", cond):
            assert value in values[name], cond


def test_the_source_defines_the_entry_and_ships_with_the_package():
    src = cutlass_mx_grouped_gemm.SOURCE.read_text()
    assert "int CAT(NAME, _forward)(int groups, int nout, int k, void* problems, void* pa, void* pb, void* pd," in src
    assert cutlass_mx_grouped_gemm.SOURCE.parent.name == "kernels" and cutlass_mx_grouped_gemm.SOURCE.suffix == ".cu"  # pyproject: kernels/*.cu


def test_group_tables_from_offsets():
    """The Triton kernel (interpreter on the CPU) gives each expert's GEMM (N, its tokens,
    K) and the addresses of its weight, first token row and first output row, empty experts
    included; more experts than one block of the kernel."""
    from mxmoe.kernels.group_tables import BLOCK, group_tables

    for sizes in ([162, 0, 2577, 446, 0, 83], [3] * (BLOCK + 7), [0, 0, 5]):
        E, N, K = len(sizes), 64, 48
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32).to(DEV)
        T = int(offs[-1]) + 9
        w = torch.zeros(E, N, K, dtype=torch.bfloat16, device=DEV)
        x = torch.zeros(T, K, dtype=torch.bfloat16, device=DEV)
        out = torch.empty(T, N, dtype=torch.bfloat16, device=DEV)
        problems, pa, pb, pd = group_tables(offs, w, x, out)
        starts = [0] + offs[:-1].tolist()
        assert problems.dtype == torch.int32 and problems.tolist() == [[N, s, K] for s in sizes]
        assert pa.tolist() == [w[e].data_ptr() for e in range(E)]
        assert pb.tolist() == [x.data_ptr() + s * K * 2 for s in starts]
        assert pd.tolist() == [out.data_ptr() + s * N * 2 for s in starts]
        assert pb.tolist()[-1] == x[starts[-1]].data_ptr()


def test_group_tables_kernel_is_not_specialized_on_values():
    """The tables' Triton kernel is not specialized on any scalar value or on the offsets'
    alignment (a new T that is 1 or a multiple of 16, or another offsets view, would
    otherwise compile a new variant, possibly inside CUDA-graph capture), and the seen-shape
    key that lets the quantized-weight GEMM run under capture names the offsets dtype, the one remaining
    reason to compile."""
    import inspect

    from mxmoe.kernels import group_tables as gt

    k = gt._group_tables_kernel
    def names(items):  # a JITFunction keeps indices or names, the interpreter the decorator's arguments
        return [k.params[i].name if isinstance(i, int) else i for i in items]

    kw = getattr(k, "kwargs", None) or {"do_not_specialize": names(k.do_not_specialize),
                                        "do_not_specialize_on_alignment": names(k.do_not_specialize_on_alignment)}
    fn = getattr(k, "fn", k)
    params = inspect.signature(fn).parameters
    scalars = [n for n, prm in params.items() if not n.endswith("_ptr") and "constexpr" not in str(prm.annotation)]
    assert scalars and set(scalars) <= set(kw["do_not_specialize"]), scalars
    assert "ends_ptr" in kw["do_not_specialize_on_alignment"]
    r = get_recipe("mxfp8")
    cpu = torch.device("cpu", 0)
    keys = {cutlass_mx_grouped_gemm._shape_key(cpu, r, "forward", (4, 64, 32), dt) for dt in (torch.int32, torch.int64)}
    assert len(keys) == 2


def test_group_tables_of_the_dgrad():
    """With w^T (a transposed view, as cutlass_mx_grouped_gemm passes it) the tables describe the dgrad:
    per expert (K, its tokens, N), w[e]'s address, and dy / dx rows of N / K elements."""
    from mxmoe.kernels.group_tables import group_tables

    sizes = [7, 0, 20, 3]
    E, N, K = len(sizes), 24, 40
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32).to(DEV)
    w = torch.zeros(E, N, K, dtype=torch.bfloat16, device=DEV)
    dy = torch.zeros(30, N, dtype=torch.bfloat16, device=DEV)
    dx = torch.empty(30, K, dtype=torch.bfloat16, device=DEV)
    problems, pa, pb, pd = group_tables(offs, w.transpose(1, 2), dy, dx)
    starts = [0] + offs[:-1].tolist()
    assert problems.tolist() == [[K, s, N] for s in sizes]
    assert pa.tolist() == [w[e].data_ptr() for e in range(E)]
    assert pb.tolist() == [dy[s].data_ptr() for s in starts]
    assert pd.tolist() == [dx[s].data_ptr() for s in starts]


def test_group_tables_clamp_offsets_outside_the_contract():
    """Decreasing offsets or offsets past T give empty, shortened or overlapping groups, all
    inside x and out (the weight-pass path is undefined there too; this keeps the kernel
    from writing past out)."""
    from mxmoe.kernels.group_tables import group_tables

    offs = torch.tensor([50, 30, 120, 90, 400], dtype=torch.int32, device=DEV)  # T = 100
    w = torch.zeros(5, 8, 16, dtype=torch.bfloat16, device=DEV)
    x = torch.zeros(100, 16, dtype=torch.bfloat16, device=DEV)
    out = torch.empty(100, 8, dtype=torch.bfloat16, device=DEV)
    problems, _, pb, _ = group_tables(offs, w, x, out)
    assert problems[:, 1].tolist() == [50, 0, 70, 0, 10]  # each group: [previous end, its end] clamped to [0, T]
    assert pb.tolist() == [x.data_ptr() + r * 32 for r in (0, 50, 30, 100, 90)]


def test_applies_only_to_cuda_bf16_mxfp8():
    """On the CPU (and for bf16 / non-fp8 recipes) neither GEMM takes the quantized-weight path."""
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    w = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    offs = torch.tensor([30, 64], dtype=torch.int32)
    for name in ("mxfp8", "bf16"):
        assert not cutlass_mx_grouped_gemm.applies(x, w, offs, get_recipe(name))
        assert not cutlass_mx_grouped_gemm.applies(x[:, :16], w, offs, get_recipe(name), "dgrad")


@pytest.mark.parametrize("toolkit", ["absent", "present"])
def test_eligibility_rule(monkeypatch, toolkit):
    """Each condition of the rule, one at a time, from a case that qualifies. The rule is
    the same with or without nvcc and CUTLASS headers on this machine (it builds nothing: a
    build that fails later turns the path off, test_a_missing_library_warns_once...), so
    both are faked here and the environment (MXMOE_GROUPED_WQ, earlier failures) reset."""
    from mxmoe.numerics.formats import ElemFormat

    monkeypatch.setattr(cutlass_mx_grouped_gemm, "_FAILED", {})
    monkeypatch.delenv("MXMOE_GROUPED_WQ", raising=False)
    found = toolkit == "present"
    monkeypatch.setattr(cutlass_mx_grouped_gemm, "nvcc_path", lambda: "/fake/nvcc" if found else None)
    monkeypatch.setattr(cutlass_mx_grouped_gemm, "cutlass_dir", lambda: Path("/fake") if found else None)
    r = get_recipe("mxfp8")
    base = dict(x_shape=(16384, 2048), w_shape=(64, 1408, 2048), dtypes_bf16=True, contiguous=True, w_ptr=1 << 20,
                recipe=r, capability=(9, 0), capturing=False, seen=False)
    assert cutlass_mx_grouped_gemm.eligible(**base)
    assert cutlass_mx_grouped_gemm.eligible(**{**base, "recipe": get_recipe("mxfp8", fmt="e5m2")})
    assert cutlass_mx_grouped_gemm.eligible(**{**base, "recipe": get_recipe("mxfp8-floor")})
    assert cutlass_mx_grouped_gemm.eligible(**{**base, "x_shape": (640 * 64, 2048)})  # the token bound, inclusive
    assert cutlass_mx_grouped_gemm.eligible(**{**base, "capturing": True, "seen": True})
    assert cutlass_mx_grouped_gemm.eligible(**{**base, "op": "dgrad"})
    # the dgrad's own bound (its tile order makes it the faster path up to ~1152 per expert)
    assert cutlass_mx_grouped_gemm.MAX_TOKENS_PER_EXPERT_DGRAD > cutlass_mx_grouped_gemm.MAX_TOKENS_PER_EXPERT
    dg = cutlass_mx_grouped_gemm.MAX_TOKENS_PER_EXPERT_DGRAD * 64
    assert cutlass_mx_grouped_gemm.eligible(**{**base, "op": "dgrad", "x_shape": (dg, 2048)})
    assert not cutlass_mx_grouped_gemm.eligible(**{**base, "op": "dgrad", "x_shape": (dg + 1, 2048)})
    assert not cutlass_mx_grouped_gemm.eligible(**{**base, "x_shape": (dg, 2048)})  # the forward's bound is lower
    no = {
        "an op without a build": {"op": "wgrad"},
        "bf16 recipe": {"recipe": get_recipe("bf16")},
        "MXFP6": {"recipe": get_recipe("mxfp8", fmt=ElemFormat.E3M2)},
        "block 16": {"recipe": get_recipe("mxfp8", block_size=16)},
        "not bf16": {"dtypes_bf16": False},
        "not contiguous": {"contiguous": False},
        "w not 16-byte aligned": {"w_ptr": (1 << 20) + 2},
        "T = 0": {"x_shape": (0, 2048)},
        "K = 0": {"x_shape": (16384, 0), "w_shape": (64, 1408, 0)},
        "N = 0": {"w_shape": (64, 0, 2048)},
        "E = 0": {"w_shape": (0, 1408, 2048)},
        "K % 8": {"x_shape": (16384, 2044), "w_shape": (64, 1408, 2044)},
        "N % 8": {"w_shape": (64, 1404, 2048)},
        "too many tokens per expert": {"x_shape": (640 * 64 + 1, 2048)},
        "sm100": {"capability": (10, 0)},
        "sm89": {"capability": (8, 9)},
        "capture of an unseen shape": {"capturing": True},
    }
    for what, change in no.items():
        assert not cutlass_mx_grouped_gemm.eligible(**{**base, **change}), what
    monkeypatch.setenv("MXMOE_GROUPED_WQ", "0")
    assert not cutlass_mx_grouped_gemm.eligible(**base)
    monkeypatch.setenv("MXMOE_GROUPED_WQ", "1")
    monkeypatch.setitem(cutlass_mx_grouped_gemm._FAILED, ("e4m3", "rceil", "dgrad"), "failed before")
    assert not cutlass_mx_grouped_gemm.eligible(**base, op="dgrad")
    assert cutlass_mx_grouped_gemm.eligible(**base)  # the forward's build is another library
    monkeypatch.setitem(cutlass_mx_grouped_gemm._FAILED, ("e4m3", "rceil", "forward"), "failed before")
    assert not cutlass_mx_grouped_gemm.eligible(**base)


def test_mx_grouped_mm_dispatch(monkeypatch):
    """The forward takes the quantized-weight GEMM when it applies and no cached weight copy
    exists, uses its output as it is, quantizes the weight in a pass when it returns None (a
    failed library), and never takes it inside weight_copy_cache(); the backward is the
    weight-pass path's either way."""
    import mxmoe
    from mxmoe.ops import grouped_mm as gm
    from mxmoe.ops.quantize import fake_quantize_operand

    torch.manual_seed(0)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    w = torch.randn(3, 16, 64, dtype=torch.bfloat16)
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)
    r = get_recipe("mxfp8")
    want = mx_grouped_mm(x, w, offs, r)
    calls = []
    marker = torch.full((40, 16), 7.0, dtype=torch.bfloat16)

    def fake(result):
        def run(xq, w_, offs_, recipe):
            calls.append(xq)
            return result
        return run

    monkeypatch.setattr(gm.cutlass_mx_grouped_gemm, "applies", lambda *a: a[4:] != ("dgrad",))  # forward only
    monkeypatch.setattr(gm.cutlass_mx_grouped_gemm, "grouped_mm_nt_wq", fake(marker))
    xx = x.clone().requires_grad_(True)
    out = mx_grouped_mm(xx, w, offs, r)
    assert torch.equal(out, marker) and len(calls) == 1
    assert torch.equal(calls[0], fake_quantize_operand(x, r, dim=1, out_dtype=torch.bfloat16))  # the x pass
    out.float().sum().backward()
    assert xx.grad is not None and xx.grad.shape == x.shape
    monkeypatch.setattr(gm.cutlass_mx_grouped_gemm, "grouped_mm_nt_wq", fake(None))
    assert torch.equal(mx_grouped_mm(x, w, offs, r), want) and len(calls) == 2  # None: the weight pass
    with mxmoe.weight_copy_cache():
        assert torch.equal(mx_grouped_mm(x, w, offs, r), want)
    assert len(calls) == 2


def test_dgrad_dispatch(monkeypatch):
    """The backward's dgrad (and mx_grouped_mm_dgrad) takes the quantized-weight dgrad when
    it applies: it gets the dy pass (along N) and the raw weight, and its output is dx as it
    is; None (a failed library) gives the weight-pass values; inside weight_copy_cache() it
    is never taken (the cached copy along N is used)."""
    import mxmoe
    from mxmoe.ops import grouped_mm as gm
    from mxmoe.ops.quantize import fake_quantize_operand

    torch.manual_seed(0)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    w = torch.randn(3, 16, 64, dtype=torch.bfloat16)
    dy = torch.randn(40, 16, dtype=torch.bfloat16)
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)
    r = get_recipe("mxfp8")
    want = gm.mx_grouped_mm_dgrad(dy, w, offs, r)
    xx = x.clone().requires_grad_(True)
    mx_grouped_mm(xx, w, offs, r).backward(dy)
    assert torch.equal(xx.grad, want)  # the op alone is what the backward runs
    calls = []
    marker = torch.full((40, 64), 5.0, dtype=torch.bfloat16)

    def fake(result):
        def run(dyq, w_, offs_, recipe):
            calls.append((dyq, w_))
            return result
        return run

    monkeypatch.setattr(gm.cutlass_mx_grouped_gemm, "applies", lambda *a: a[4:] == ("dgrad",))  # dgrad only
    monkeypatch.setattr(gm.cutlass_mx_grouped_gemm, "grouped_mm_nn_wq", fake(marker))
    xx = x.clone().requires_grad_(True)
    mx_grouped_mm(xx, w, offs, r).backward(dy)
    assert torch.equal(xx.grad, marker) and len(calls) == 1
    assert torch.equal(calls[0][0], fake_quantize_operand(dy, r, dim=1, out_dtype=torch.bfloat16)) and calls[0][1] is w
    assert torch.equal(gm.mx_grouped_mm_dgrad(dy, w, offs, r), marker) and len(calls) == 2
    monkeypatch.setattr(gm.cutlass_mx_grouped_gemm, "grouped_mm_nn_wq", fake(None))
    assert torch.equal(gm.mx_grouped_mm_dgrad(dy, w, offs, r), want) and len(calls) == 3  # None: the weight pass
    with mxmoe.weight_copy_cache():
        xx = x.clone().requires_grad_(True)
        mx_grouped_mm(xx, w, offs, r).backward(dy)
        assert torch.equal(xx.grad, want)
    assert len(calls) == 3


def test_mx_grouped_mm_dgrad_checks_its_arguments():
    from mxmoe.ops.grouped_mm import mx_grouped_mm_dgrad

    dy, w = torch.randn(8, 16), torch.randn(2, 16, 32)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    assert mx_grouped_mm_dgrad(dy, w, offs).shape == (8, 32)
    with pytest.raises(ValueError, match="same N"):
        mx_grouped_mm_dgrad(torch.randn(8, 32), w, offs)
    with pytest.raises(TypeError, match="int32"):
        mx_grouped_mm_dgrad(dy, w, offs.float())
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        mx_grouped_mm_dgrad(dy.to(torch.int32), w, offs)
    with pytest.raises(ValueError, match="shape \\(E,\\)"):
        mx_grouped_mm_dgrad(dy, w, offs[:1])


def test_a_missing_library_warns_once_and_the_weight_pass_runs(monkeypatch, tmp_path):
    """A library that cannot be loaded: one warning naming the cause, then None (the caller
    quantizes the weight in a pass); the (format, mode, op) is remembered, so applies()
    says no after that."""
    monkeypatch.setenv("MXMOE_CUTLASS_WQ_LIB", str(tmp_path / "missing.so"))
    monkeypatch.setattr(cutlass_mx_grouped_gemm, "_FAILED", {})
    monkeypatch.setattr(cutlass_mx_grouped_gemm, "_LIBS", {})
    monkeypatch.setenv("MXMOE_CUTLASS_WQ_DGRAD_LIB", str(tmp_path / "missing_dgrad.so"))
    with pytest.warns(RuntimeWarning, match="quantized-weight grouped GEMM.*forward.*missing.so"):
        assert cutlass_mx_grouped_gemm.library("e5m2", "floor") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cutlass_mx_grouped_gemm.library("e5m2", "floor") is None  # no second warning
    assert ("e5m2", "floor", "forward") in cutlass_mx_grouped_gemm._FAILED
    monkeypatch.delenv("MXMOE_GROUPED_WQ", raising=False)
    case = ((64, 32), (2, 16, 32), True, True, 1 << 20)
    assert not cutlass_mx_grouped_gemm.eligible(*case, get_recipe("mxfp8-floor", fmt="e5m2"), (9, 0), False, False)
    assert cutlass_mx_grouped_gemm.eligible(*case, get_recipe("mxfp8"), (9, 0), False, False)  # another build
    with pytest.warns(RuntimeWarning, match="dgrad.*MXMOE_CUTLASS_WQ_DGRAD_LIB=.*missing_dgrad.so"):
        assert cutlass_mx_grouped_gemm.library("e5m2", "floor", "dgrad") is None
    assert ("e5m2", "floor", "dgrad") in cutlass_mx_grouped_gemm._FAILED


def test_missing_toolkit_or_headers_are_named(monkeypatch, tmp_path):
    """_build says what is missing (nvcc, or the CUTLASS headers and how to get them)."""
    monkeypatch.setenv("MXMOE_CACHE_DIR", str(tmp_path / "cache"))  # an empty cache: a filled one needs neither
    monkeypatch.setenv("MXMOE_NVCC", str(tmp_path / "nvcc"))
    monkeypatch.setenv("MXMOE_CUTLASS_DIR", str(tmp_path / "cutlass"))
    with pytest.raises(RuntimeError, match="CUTLASS 4.2 headers not found.*nvidia-cutlass"):
        cutlass_mx_grouped_gemm._build("e4m3", "rceil")
    monkeypatch.setattr(cutlass_mx_grouped_gemm, "nvcc_path", lambda: None)
    with pytest.raises(RuntimeError, match="nvcc not found"):
        cutlass_mx_grouped_gemm._build("e4m3", "rceil")


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("MXMOE_GROUPED_WQ", "0")
    assert not cutlass_mx_grouped_gemm.enabled()
    monkeypatch.setenv("MXMOE_GROUPED_WQ", "1")
    assert cutlass_mx_grouped_gemm.enabled()


def test_cpu_forward_unchanged():
    """mx_grouped_mm on the CPU runs the weight-pass path (values of the quantize pass)."""
    torch.manual_seed(0)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    w = torch.randn(3, 16, 64, dtype=torch.bfloat16)
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)
    from mxmoe.ops.gemm import grouped_mm_nt
    from mxmoe.ops.quantize import fake_quantize_operand

    r = get_recipe("mxfp8")
    want = grouped_mm_nt(fake_quantize_operand(x, r, dim=1, out_dtype=torch.bfloat16),
                         fake_quantize_operand(w, r, dim=2, out_dtype=torch.bfloat16), offs)
    assert torch.equal(mx_grouped_mm(x, w, offs, r), want)


def test_cached_path_depends_on_the_build_not_on_the_machine(monkeypatch, tmp_path):
    """The cache name hashes the source and the settings, not where nvcc and CUTLASS are: a
    filled cache folder works on another machine; formats and modes get their own files."""
    monkeypatch.setenv("MXMOE_CACHE_DIR", str(tmp_path))
    a = cutlass_mx_grouped_gemm.cached_path("e4m3", "rceil")
    monkeypatch.setenv("MXMOE_NVCC", "/elsewhere/nvcc")
    monkeypatch.setenv("MXMOE_CUTLASS_DIR", "/elsewhere/cutlass")
    assert cutlass_mx_grouped_gemm.cached_path("e4m3", "rceil") == a and a.parent == tmp_path
    names = {cutlass_mx_grouped_gemm.cached_path(f, m, op).name for f in ("e4m3", "e5m2") for m in ("rceil", "floor")
             for op in ("forward", "dgrad")}
    assert len(names) == 8
    a.write_bytes(b"")  # a cached file is used as it is: no nvcc or headers needed
    assert cutlass_mx_grouped_gemm._build("e4m3", "rceil") == a


def test_cached_path_does_not_depend_on_where_the_package_lies(monkeypatch, tmp_path):
    """The same source in another checkout (another absolute path) names the same cache
    entry, for every format, mode and op: a cache folder filled in one checkout serves
    another (before, the source's absolute path was part of the hash, so a carried cache
    was only found at the path it was built from); an edit of the source names a new one."""
    monkeypatch.setenv("MXMOE_CACHE_DIR", str(tmp_path / "cache"))
    keys = [(f, m, op) for f in ("e4m3", "e5m2") for m in ("rceil", "floor") for op in ("forward", "dgrad")]
    here = [cutlass_mx_grouped_gemm.cached_path(*k) for k in keys]
    other = tmp_path / "elsewhere" / "src" / "mxmoe" / "kernels" / "cutlass_mx_grouped_gemm.cu"
    other.parent.mkdir(parents=True)
    other.write_text(cutlass_mx_grouped_gemm.SOURCE.read_text())
    monkeypatch.setattr(cutlass_mx_grouped_gemm, "SOURCE", other)
    assert [cutlass_mx_grouped_gemm.cached_path(*k) for k in keys] == here
    assert cutlass_mx_grouped_gemm.build_command("e4m3", "rceil", "/tmp/x.so")[-1] == str(other)  # the build reads that file
    other.write_text(other.read_text() + "\n// edited\n")
    assert all(cutlass_mx_grouped_gemm.cached_path(*k) != h for k, h in zip(keys, here))


def test_ctypes_signatures_match_the_c_entries(monkeypatch):
    """_load's argtypes have as many entries as the C functions have parameters, of the
    right widths (a mismatch would pass garbage to the kernel on the GPU only)."""
    import ctypes
    import re

    src = cutlass_mx_grouped_gemm.SOURCE.read_text()

    class Fake:
        def __init__(self, path):
            pass

        def __getattr__(self, name):
            fn = type("Fn", (), {})()
            setattr(self, name, fn)
            return fn

    monkeypatch.setattr(ctypes, "CDLL", Fake)
    width = {"int": ctypes.c_int, "void*": ctypes.c_void_p, "long long": ctypes.c_longlong}
    for op in ("forward", "dgrad"):
        lib = cutlass_mx_grouped_gemm._load("x.so", "e4m3", "rceil", op)
        for what in ("forward", "workspace_bytes", "last_error"):
            m = re.search(r"CAT\(NAME, _" + what + r"\)\(([^)]*)\)", src)
            assert m, what
            params = [p.strip().rsplit(" ", 1)[0].replace(" *", "*") for p in m.group(1).split(",") if p.strip()]
            fn = getattr(lib, cutlass_mx_grouped_gemm.symbol("e4m3", "rceil", what, op))
            assert [width[p] for p in params] == list(fn.argtypes), what
        assert getattr(lib, cutlass_mx_grouped_gemm.symbol("e4m3", "rceil", "forward", op)).restype is ctypes.c_int
        assert getattr(lib, cutlass_mx_grouped_gemm.symbol("e4m3", "rceil", "workspace_bytes", op)).restype is ctypes.c_longlong


def test_processes_needing_one_build_take_turns(tmp_path):
    """Two builds of one (format, mode, op) at once (ranks of one node): the first compiles,
    the second waits on the lock file meanwhile and then finds the library (one compile)."""
    import os
    import subprocess
    import sys
    import textwrap
    import time

    runs, go = tmp_path / "runs", tmp_path / "go"
    fake_nvcc = tmp_path / "nvcc"
    # a fake nvcc: counts its runs, waits for the test's go, writes the file given after -o
    fake_nvcc.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, sys, time
        open({str(runs)!r}, 'a').write('x')
        t = time.time()
        while not os.path.exists({str(go)!r}) and time.time() - t < 60:
            time.sleep(0.05)
        open(sys.argv[sys.argv.index('-o') + 1], 'wb').write(b'lib')
    """))
    fake_nvcc.chmod(0o755)
    (tmp_path / "cutlass" / "include" / "cutlass").mkdir(parents=True)
    (tmp_path / "cutlass" / "include" / "cutlass" / "cutlass.h").write_text("")
    env = {**os.environ, "MXMOE_CACHE_DIR": str(tmp_path / "cache"), "MXMOE_NVCC": str(fake_nvcc),
           "MXMOE_CUTLASS_DIR": str(tmp_path / "cutlass")}
    code = "from mxmoe.kernels import cutlass_mx_grouped_gemm as c; print(c._build('e4m3', 'rceil', 'dgrad'))"

    def start():
        return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    first = start()
    t0 = time.time()
    while not runs.exists():  # the first one holds the lock and runs nvcc
        assert time.time() - t0 < 120 and first.poll() is None, first.communicate()
        time.sleep(0.05)
    second = start()
    lines = []
    for line in second.stderr:  # it says it waits (and then blocks on the lock)
        lines.append(line)
        if "waiting for another process's build" in line:
            break
    else:
        raise AssertionError(f"the second process did not wait: {lines}")
    go.write_text("")
    outs = [first.communicate(timeout=120), second.communicate(timeout=120)]
    assert first.returncode == 0 and second.returncode == 0, outs
    assert outs[0][0] == outs[1][0] and outs[0][0].strip().endswith(".so")
    assert runs.read_text() == "x"  # one compile


def _fake_toolchain(tmp_path, fail: bool):
    """A fake nvcc (counts its runs in tmp_path/runs; waits for tmp_path/go; fails if
    ``fail``, else writes its -o file) and CUTLASS headers; returns the environment."""
    import os
    import sys
    import textwrap

    nvcc = tmp_path / "nvcc"
    nvcc.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, sys, time
        open({str(tmp_path / 'runs')!r}, 'a').write('x')
        t = time.time()
        while not os.path.exists({str(tmp_path / 'go')!r}) and time.time() - t < 60:
            time.sleep(0.05)
        if {fail!r}:
            sys.stderr.write('fake nvcc: error here')
            sys.exit(3)
        open(sys.argv[sys.argv.index('-o') + 1], 'wb').write(b'lib')
    """))
    nvcc.chmod(0o755)
    (tmp_path / "cutlass" / "include" / "cutlass").mkdir(parents=True)
    (tmp_path / "cutlass" / "include" / "cutlass" / "cutlass.h").write_text("")
    return {**os.environ, "MXMOE_CACHE_DIR": str(tmp_path / "cache"), "MXMOE_NVCC": str(nvcc),
            "MXMOE_CUTLASS_DIR": str(tmp_path / "cutlass")}


def test_a_failed_build_is_not_repeated_by_the_processes_that_waited(tmp_path):
    """The lock holder's nvcc fails: the process waiting on the lock reports that failure
    (nvcc's message) instead of compiling again; the lock file is open to every user."""
    import subprocess
    import sys
    import time

    env = _fake_toolchain(tmp_path, fail=True)
    code = "from mxmoe.kernels import cutlass_mx_grouped_gemm as c; c._build('e4m3', 'rceil')"
    first = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    t0 = time.time()
    while not (tmp_path / "runs").exists():
        assert time.time() - t0 < 120 and first.poll() is None, first.communicate()
        time.sleep(0.05)
    second = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    for line in second.stderr:
        if "waiting for another process's build" in line:
            break
    (tmp_path / "go").write_text("")
    errs = [first.communicate(timeout=120)[1], second.communicate(timeout=120)[1]]
    assert first.returncode != 0 and second.returncode != 0
    assert "nvcc failed (3): fake nvcc: error here" in errs[0]
    assert "another process's build failed" in errs[1] and "fake nvcc: error here" in errs[1]
    assert (tmp_path / "runs").read_text() == "x"  # one compile
    locks = list((tmp_path / "cache").glob("*.lock"))
    assert len(locks) == 1 and locks[0].stat().st_mode & 0o777 == 0o666


def test_without_flock_each_process_compiles(monkeypatch, tmp_path):
    """A file system without flock (ENOLCK): the build runs without the lock."""
    import errno
    import fcntl

    for k, v in _fake_toolchain(tmp_path, fail=False).items():
        monkeypatch.setenv(k, v)
    (tmp_path / "go").write_text("")

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "no locks here")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    path = cutlass_mx_grouped_gemm._build("e4m3", "rceil", "dgrad")
    assert path.exists() and path.read_bytes() == b"lib" and (tmp_path / "runs").read_text() == "x"


def test_both_builds_compile(tmp_path, monkeypatch):
    """The library's own build (``_build``: build_command, the cache, the lock) of the
    forward and the dgrad compiles with the real nvcc and CUTLASS 4.2 headers, and the
    result has the C entries ``_load`` binds. Needs the toolkit (CUDA >= 12.8) and the
    headers, not a GPU; a few minutes."""
    import concurrent.futures

    nvcc, cutlass = cutlass_mx_grouped_gemm.nvcc_path(), cutlass_mx_grouped_gemm.cutlass_dir()
    if nvcc is None or cutlass is None or not (cutlass / "include" / "cutlass" / "cutlass.h").exists():
        pytest.skip("needs nvcc (MXMOE_NVCC, the PATH or $CUDA_HOME) and CUTLASS 4.2 headers (MXMOE_CUTLASS_DIR or "
                    "`pip install nvidia-cutlass==4.2.0`)")
    monkeypatch.setenv("MXMOE_CACHE_DIR", str(tmp_path))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        paths = dict(zip(("forward", "dgrad"), pool.map(lambda op: cutlass_mx_grouped_gemm._build("e4m3", "rceil", op),
                                                        ("forward", "dgrad"))))
    for op, path in paths.items():
        assert path == cutlass_mx_grouped_gemm.cached_path("e4m3", "rceil", op) and path.stat().st_size > 0
        cutlass_mx_grouped_gemm._load(str(path), "e4m3", "rceil", op)  # AttributeError if an entry is missing
