"""Design (g) in the library (mxmoe.kernels.cutlass_wq): what can be checked without an
sm90 GPU: the build command and cache, the eligibility rule, the argument tables, the
dispatch from mx_grouped_mm and its fallbacks. The kernel itself runs only on the H200
(benchmarks/check_grouped_wq.py there checks it bit for bit against design (a) through
mx_grouped_mm); its per-value arithmetic is emulated against the reference in
tests/test_wq_prototypes.py, but which register holds which row and k (the fragment
layout, the shuffles) is checked only by those H200 runs."""

from __future__ import annotations

import warnings

import pytest
import torch

from mxmoe.kernels import cutlass_wq
from mxmoe.ops.grouped_mm import mx_grouped_mm
from mxmoe.recipe import get_recipe

# the tables' and the quantizers' Triton kernels run on CUDA tensors where a GPU is present,
# in the interpreter on CPU tensors otherwise (tests/conftest.py)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_build_command_builds_the_measured_variant_for_each_format_mode_and_op():
    """The library's build is benchmarks/cutlass_mixed.py's q9x family (128 x 320 tiles, QDQ
    5, the k-tile loop), for sm_90a, with the format and mode as the source reads them; the
    dgrad's the same with WT = 1 (the transposed weight operand) and entries of its own name."""
    for fmt, f in (("e4m3", 0), ("e5m2", 1)):
        for mode, m in (("rceil", 0), ("floor", 1)):
            for op in ("forward", "dgrad"):
                cmd = cutlass_wq.build_command(fmt, mode, "/tmp/x.so", "nvcc", "/c", op=op)
                d = dict(a[2:].split("=", 1) for a in cmd if a.startswith("-D") and "=" in a)
                assert d["FMT"] == str(f) and d["MODE"] == str(m)
                assert (d["VARIANT"], d["TN"], d["QDQ"], d["LOOP"], d["STAGES"]) == ("3", "320", "5", "4", "3")
                assert d.get("WT", "0") == ("1" if op == "dgrad" else "0")
                assert d.get("RASTER", "0") == ("1" if op == "dgrad" else "0")  # its tile order (session 16)
                assert d["NAME"] + "_forward" == cutlass_wq.symbol(fmt, mode, op=op)
                assert "-arch=sm_90a" in cmd and "-shared" in cmd and cmd[-1] == str(cutlass_wq.SOURCE)
                assert "-I/c/include" in cmd and "-I/c/tools/util/include" in cmd
            assert cutlass_wq.symbol(fmt, mode, op="dgrad") != cutlass_wq.symbol(fmt, mode)
    with pytest.raises(ValueError, match="e2m1"):
        cutlass_wq.build_command("e2m1", "rceil", "/tmp/x.so")
    with pytest.raises(ValueError, match="nearest"):
        cutlass_wq.build_command("e4m3", "nearest", "/tmp/x.so")
    with pytest.raises(ValueError, match="wgrad"):
        cutlass_wq.build_command("e4m3", "rceil", "/tmp/x.so", op="wgrad")


def test_the_dgrad_walks_the_token_tiles_first():
    """The dgrad build's RASTER = 1 sets the grouped scheduler's raster order to AlongN in
    fill_args (the order measured at 0.848-0.851x against 0.817-0.821x, session 16); RASTER =
    2 is the measurement build of benchmarks/wq_raster.py (order from the environment, a
    marker entry), and the default (0) leaves CUTLASS's order."""
    src = cutlass_wq.SOURCE.read_text()
    body = src[src.index("void fill_args("):]
    body = body[:body.index("\n}\n")]
    i, j = body.index("#if RASTER == 2"), body.index("#elif RASTER\n")
    assert 'getenv("MXMOE_WQ_RASTER")' in body[i:j] and 'getenv("MXMOE_WQ_SWIZZLE")' in body[i:j]
    tail = body[j:]
    assert "args.scheduler.raster_order = decltype(args.scheduler.raster_order)::AlongN;" in tail[:tail.index("#endif")]
    assert "#define RASTER 0" in src and "int CAT(NAME, _raster_from_env)() { return 1; }" in src
    assert "-DRASTER=1" in cutlass_wq.build_command("e4m3", "rceil", "/tmp/x.so", "nvcc", "/c", op="dgrad")
    assert not any(a.startswith("-DRASTER") for a in cutlass_wq.build_command("e4m3", "rceil", "/tmp/x.so", op="forward"))
    for op in ("forward", "dgrad"):  # wq_raster's builds: the library's command with RASTER=2 in place of the op's
        plain = cutlass_wq.build_command("e4m3", "rceil", "/tmp/x.so", "nvcc", "/c", op=op)
        raster = cutlass_wq.build_command("e4m3", "rceil", "/tmp/x.so", "nvcc", "/c", op=op, macros={"RASTER": 2})
        assert [a for a in raster if a != "-DRASTER=2"] == [a for a in plain if not a.startswith("-DRASTER")]
        assert raster.count("-DRASTER=2") == 1 and cutlass_wq.OPS[op].get("RASTER") != 2


def test_the_source_defines_the_entry_and_ships_with_the_package():
    src = cutlass_wq.SOURCE.read_text()
    assert "int CAT(NAME, _forward)(int groups, int nout, int k, void* problems, void* pa, void* pb, void* pd," in src
    assert cutlass_wq.SOURCE.parent.name == "kernels" and cutlass_wq.SOURCE.suffix == ".cu"  # pyproject: kernels/*.cu


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
    key that lets design (g) run under capture names the offsets dtype, the one remaining
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
    keys = {cutlass_wq._shape_key(cpu, r, "forward", (4, 64, 32), dt) for dt in (torch.int32, torch.int64)}
    assert len(keys) == 2


def test_group_tables_of_the_dgrad():
    """With w^T (a transposed view, as cutlass_wq passes it) the tables describe the dgrad:
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
    inside x and out (design (a) is undefined there too; this keeps the kernel from writing
    past out)."""
    from mxmoe.kernels.group_tables import group_tables

    offs = torch.tensor([50, 30, 120, 90, 400], dtype=torch.int32, device=DEV)  # T = 100
    w = torch.zeros(5, 8, 16, dtype=torch.bfloat16, device=DEV)
    x = torch.zeros(100, 16, dtype=torch.bfloat16, device=DEV)
    out = torch.empty(100, 8, dtype=torch.bfloat16, device=DEV)
    problems, _, pb, _ = group_tables(offs, w, x, out)
    assert problems[:, 1].tolist() == [50, 0, 70, 0, 10]  # each group: [previous end, its end] clamped to [0, T]
    assert pb.tolist() == [x.data_ptr() + r * 32 for r in (0, 50, 30, 100, 90)]


def test_applies_only_to_cuda_bf16_mxfp8():
    """On the CPU (and for bf16 / non-fp8 recipes) the forward never takes design (g)."""
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    w = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    offs = torch.tensor([30, 64], dtype=torch.int32)
    for name in ("mxfp8", "bf16"):
        assert not cutlass_wq.applies(x, w, offs, get_recipe(name))
        assert not cutlass_wq.applies(x[:, :16], w, offs, get_recipe(name), "dgrad")


def test_eligibility_rule(monkeypatch):
    """Each condition of the rule, one at a time, from a case that qualifies."""
    from mxmoe.numerics.formats import ElemFormat

    monkeypatch.setattr(cutlass_wq, "_FAILED", {})
    r = get_recipe("mxfp8")
    base = dict(x_shape=(16384, 2048), w_shape=(64, 1408, 2048), dtypes_bf16=True, contiguous=True, w_ptr=1 << 20,
                recipe=r, capability=(9, 0), capturing=False, seen=False)
    assert cutlass_wq.eligible(**base)
    assert cutlass_wq.eligible(**{**base, "recipe": get_recipe("mxfp8", fmt="e5m2")})
    assert cutlass_wq.eligible(**{**base, "recipe": get_recipe("mxfp8-floor")})
    assert cutlass_wq.eligible(**{**base, "x_shape": (640 * 64, 2048)})  # the token bound, inclusive
    assert cutlass_wq.eligible(**{**base, "capturing": True, "seen": True})
    assert cutlass_wq.eligible(**{**base, "op": "dgrad"})
    # the dgrad's own bound (its tile order makes it the faster design up to ~1152 per expert)
    assert cutlass_wq.MAX_TOKENS_PER_EXPERT_DGRAD > cutlass_wq.MAX_TOKENS_PER_EXPERT
    dg = cutlass_wq.MAX_TOKENS_PER_EXPERT_DGRAD * 64
    assert cutlass_wq.eligible(**{**base, "op": "dgrad", "x_shape": (dg, 2048)})
    assert not cutlass_wq.eligible(**{**base, "op": "dgrad", "x_shape": (dg + 1, 2048)})
    assert not cutlass_wq.eligible(**{**base, "x_shape": (dg, 2048)})  # the forward's bound is lower
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
        assert not cutlass_wq.eligible(**{**base, **change}), what
    monkeypatch.setenv("MXMOE_GROUPED_WQ", "0")
    assert not cutlass_wq.eligible(**base)
    monkeypatch.setenv("MXMOE_GROUPED_WQ", "1")
    monkeypatch.setitem(cutlass_wq._FAILED, ("e4m3", "rceil", "dgrad"), "failed before")
    assert not cutlass_wq.eligible(**base, op="dgrad")
    assert cutlass_wq.eligible(**base)  # the forward's build is another library
    monkeypatch.setitem(cutlass_wq._FAILED, ("e4m3", "rceil", "forward"), "failed before")
    assert not cutlass_wq.eligible(**base)


def test_mx_grouped_mm_dispatch(monkeypatch):
    """The forward takes design (g) when it applies and no cached weight copy exists, uses
    its output as it is, runs design (a) when it returns None (a failed library), and never
    takes it inside weight_copy_cache(); the backward is design (a)'s either way."""
    import mxmoe
    from mxmoe.ops import grouped_mm as gm
    from mxmoe.ops.quantize import fake_quantize

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

    monkeypatch.setattr(gm.cutlass_wq, "applies", lambda *a: a[4:] != ("dgrad",))  # forward only
    monkeypatch.setattr(gm.cutlass_wq, "grouped_mm_nt_wq", fake(marker))
    xx = x.clone().requires_grad_(True)
    out = mx_grouped_mm(xx, w, offs, r)
    assert torch.equal(out, marker) and len(calls) == 1
    assert torch.equal(calls[0], fake_quantize(x, r, dim=1, out_dtype=torch.bfloat16))  # the x pass
    out.float().sum().backward()
    assert xx.grad is not None and xx.grad.shape == x.shape
    monkeypatch.setattr(gm.cutlass_wq, "grouped_mm_nt_wq", fake(None))
    assert torch.equal(mx_grouped_mm(x, w, offs, r), want) and len(calls) == 2  # None: design (a)
    with mxmoe.weight_copy_cache():
        assert torch.equal(mx_grouped_mm(x, w, offs, r), want)
    assert len(calls) == 2


def test_dgrad_dispatch(monkeypatch):
    """The backward's dgrad (and mx_grouped_mm_dgrad) takes design (g)'s dgrad when it
    applies: it gets the dy pass (along N) and the raw weight, and its output is dx as it
    is; None (a failed library) gives design (a)'s values; inside weight_copy_cache() it is
    never taken (the cached copy along N is used)."""
    import mxmoe
    from mxmoe.ops import grouped_mm as gm
    from mxmoe.ops.quantize import fake_quantize

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

    monkeypatch.setattr(gm.cutlass_wq, "applies", lambda *a: a[4:] == ("dgrad",))  # dgrad only
    monkeypatch.setattr(gm.cutlass_wq, "grouped_mm_nn_wq", fake(marker))
    xx = x.clone().requires_grad_(True)
    mx_grouped_mm(xx, w, offs, r).backward(dy)
    assert torch.equal(xx.grad, marker) and len(calls) == 1
    assert torch.equal(calls[0][0], fake_quantize(dy, r, dim=1, out_dtype=torch.bfloat16)) and calls[0][1] is w
    assert torch.equal(gm.mx_grouped_mm_dgrad(dy, w, offs, r), marker) and len(calls) == 2
    monkeypatch.setattr(gm.cutlass_wq, "grouped_mm_nn_wq", fake(None))
    assert torch.equal(gm.mx_grouped_mm_dgrad(dy, w, offs, r), want) and len(calls) == 3  # None: design (a)
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


def test_a_missing_library_warns_once_and_the_forward_runs_design_a(monkeypatch, tmp_path):
    """A library that cannot be loaded: one warning naming the cause, then None (the caller
    runs design (a)); the (format, mode) is remembered, so applies() says no after that."""
    monkeypatch.setenv("MXMOE_CUTLASS_WQ_LIB", str(tmp_path / "missing.so"))
    monkeypatch.setattr(cutlass_wq, "_FAILED", {})
    monkeypatch.setattr(cutlass_wq, "_LIBS", {})
    monkeypatch.setenv("MXMOE_CUTLASS_WQ_DGRAD_LIB", str(tmp_path / "missing_dgrad.so"))
    with pytest.warns(RuntimeWarning, match="design \\(g\\).*missing.so"):
        assert cutlass_wq.library("e5m2", "floor") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cutlass_wq.library("e5m2", "floor") is None  # no second warning
    assert ("e5m2", "floor", "forward") in cutlass_wq._FAILED
    with pytest.warns(RuntimeWarning, match="dgrad.*MXMOE_CUTLASS_WQ_DGRAD_LIB=.*missing_dgrad.so"):
        assert cutlass_wq.library("e5m2", "floor", "dgrad") is None
    assert ("e5m2", "floor", "dgrad") in cutlass_wq._FAILED


def test_missing_toolkit_or_headers_are_named(monkeypatch, tmp_path):
    """_build says what is missing (nvcc, or the CUTLASS headers and how to get them)."""
    monkeypatch.setenv("MXMOE_CACHE_DIR", str(tmp_path / "cache"))  # an empty cache: a filled one needs neither
    monkeypatch.setenv("MXMOE_NVCC", str(tmp_path / "nvcc"))
    monkeypatch.setenv("MXMOE_CUTLASS_DIR", str(tmp_path / "cutlass"))
    with pytest.raises(RuntimeError, match="CUTLASS 4.2 headers not found.*nvidia-cutlass"):
        cutlass_wq._build("e4m3", "rceil")
    monkeypatch.setattr(cutlass_wq, "nvcc_path", lambda: None)
    with pytest.raises(RuntimeError, match="nvcc not found"):
        cutlass_wq._build("e4m3", "rceil")


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("MXMOE_GROUPED_WQ", "0")
    assert not cutlass_wq.enabled()
    monkeypatch.setenv("MXMOE_GROUPED_WQ", "1")
    assert cutlass_wq.enabled()


def test_cpu_forward_unchanged():
    """mx_grouped_mm on the CPU still runs design (a) (values of the quantize pass)."""
    torch.manual_seed(0)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    w = torch.randn(3, 16, 64, dtype=torch.bfloat16)
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)
    from mxmoe.ops.gemm import grouped_mm_nt
    from mxmoe.ops.quantize import fake_quantize

    r = get_recipe("mxfp8")
    want = grouped_mm_nt(fake_quantize(x, r, dim=1, out_dtype=torch.bfloat16),
                         fake_quantize(w, r, dim=2, out_dtype=torch.bfloat16), offs)
    assert torch.equal(mx_grouped_mm(x, w, offs, r), want)


def test_cached_path_depends_on_the_build_not_on_the_machine(monkeypatch, tmp_path):
    """The cache name hashes the source and the settings, not where nvcc and CUTLASS are: a
    filled cache folder works on another machine; formats and modes get their own files."""
    monkeypatch.setenv("MXMOE_CACHE_DIR", str(tmp_path))
    a = cutlass_wq.cached_path("e4m3", "rceil")
    monkeypatch.setenv("MXMOE_NVCC", "/elsewhere/nvcc")
    monkeypatch.setenv("MXMOE_CUTLASS_DIR", "/elsewhere/cutlass")
    assert cutlass_wq.cached_path("e4m3", "rceil") == a and a.parent == tmp_path
    names = {cutlass_wq.cached_path(f, m, op).name for f in ("e4m3", "e5m2") for m in ("rceil", "floor")
             for op in ("forward", "dgrad")}
    assert len(names) == 8
    a.write_bytes(b"")  # a cached file is used as it is: no nvcc or headers needed
    assert cutlass_wq._build("e4m3", "rceil") == a


def test_cached_path_does_not_depend_on_where_the_package_lies(monkeypatch, tmp_path):
    """The same source in another checkout (another absolute path) names the same cache
    entry, for every format, mode and op: a cache folder filled in one checkout serves
    another (before, the source's absolute path was part of the hash, so a carried cache
    was only found at the path it was built from); an edit of the source names a new one."""
    monkeypatch.setenv("MXMOE_CACHE_DIR", str(tmp_path / "cache"))
    keys = [(f, m, op) for f in ("e4m3", "e5m2") for m in ("rceil", "floor") for op in ("forward", "dgrad", "w8")]
    here = [cutlass_wq.cached_path(*k) for k in keys]
    other = tmp_path / "elsewhere" / "src" / "mxmoe" / "kernels" / "cutlass_wq.cu"
    other.parent.mkdir(parents=True)
    other.write_text(cutlass_wq.SOURCE.read_text())
    monkeypatch.setattr(cutlass_wq, "SOURCE", other)
    assert [cutlass_wq.cached_path(*k) for k in keys] == here
    assert cutlass_wq.build_command("e4m3", "rceil", "/tmp/x.so")[-1] == str(other)  # the build reads that file
    other.write_text(other.read_text() + "\n// edited\n")
    assert all(cutlass_wq.cached_path(*k) != h for k, h in zip(keys, here))


def test_ctypes_signatures_match_the_c_entries(monkeypatch):
    """_load's argtypes have as many entries as the C functions have parameters, of the
    right widths (a mismatch would pass garbage to the kernel on the GPU only)."""
    import ctypes
    import re

    src = cutlass_wq.SOURCE.read_text()

    class Fake:
        def __init__(self, path):
            pass

        def __getattr__(self, name):
            fn = type("Fn", (), {})()
            setattr(self, name, fn)
            return fn

    monkeypatch.setattr(ctypes, "CDLL", Fake)
    width = {"int": ctypes.c_int, "void*": ctypes.c_void_p, "long long": ctypes.c_longlong}
    for op in ("forward", "dgrad", "w8"):
        lib = cutlass_wq._load("x.so", "e4m3", "rceil", op)
        for what in (cutlass_wq._ENTRY[op], "workspace_bytes", "last_error"):
            m = re.search(r"CAT\(NAME, _" + what + r"\)\(([^)]*)\)", src)
            assert m, what
            params = [p.strip().rsplit(" ", 1)[0].replace(" *", "*") for p in m.group(1).split(",") if p.strip()]
            fn = getattr(lib, cutlass_wq.symbol("e4m3", "rceil", what, op))
            assert [width[p] for p in params] == list(fn.argtypes), what
        assert getattr(lib, cutlass_wq.symbol("e4m3", "rceil", cutlass_wq._ENTRY[op], op)).restype is ctypes.c_int
        assert getattr(lib, cutlass_wq.symbol("e4m3", "rceil", "workspace_bytes", op)).restype is ctypes.c_longlong


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
    code = "from mxmoe.kernels import cutlass_wq as c; print(c._build('e4m3', 'rceil', 'dgrad'))"

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


def test_design_b_weight_copy_and_tables():
    """weight_copy_w8: the codes of the library's quantizers (forward: along K, (E, N, K);
    dgrad: along N, transposed, (E, K, N)) and the E8M0 scales packed two per uint16 (the
    k-tile's first 32-element block in the low byte), (E, Kc / 64, Nout): dequantized by
    that rule they give design (a)'s values exactly. group_tables with the codes (1-byte
    elements) and the scales gives their per-expert addresses."""
    from mxmoe.kernels.group_tables import group_tables
    from mxmoe.ops.quantize import fake_quantize

    torch.manual_seed(0)
    w = (torch.randn(3, 128, 192) * torch.exp2(torch.randint(-20, 20, (3, 128, 1)).float())).to(torch.bfloat16)
    w = w.to(DEV)
    w[1, 5, 7] = float("inf")
    for name in ("mxfp8", "mxfp8-floor"):
        r = get_recipe(name)
        for op, dim in (("forward", 2), ("dgrad", 1)):
            codes, s = cutlass_wq.weight_copy_w8(w, r, op)
            E, nout, kc = codes.shape
            assert (nout, kc) == ((128, 192) if op == "forward" else (192, 128))
            assert s.dtype == torch.uint16 and s.shape == (E, kc // 64, nout) and s.is_contiguous()
            b = s.view(torch.uint8).view(E, kc // 64, nout, 2).permute(0, 2, 1, 3).reshape(E, nout, kc // 32)
            scale = torch.where(b == 255, torch.nan, torch.exp2(b.float() - 127)).repeat_interleave(32, dim=2)
            got = (codes.float() * scale).to(torch.bfloat16)
            want = fake_quantize(w, r, dim=dim, out_dtype=torch.bfloat16)
            want = want if op == "forward" else want.transpose(1, 2)
            assert torch.equal(got.view(torch.int16)[~got.isnan()], want.view(torch.int16)[~got.isnan()])
            assert torch.equal(got.isnan(), want.isnan())
    offs = torch.tensor([10, 10, 40], dtype=torch.int32, device=DEV)
    a = torch.zeros(40, kc, dtype=torch.bfloat16, device=DEV)
    out = torch.zeros(40, nout, dtype=torch.bfloat16, device=DEV)
    problems, pa, pb, ps, pd = group_tables(offs, codes, a, out, s)  # the C entry's order
    assert problems.tolist() == [[nout, n, kc] for n in (10, 0, 30)]
    assert pa.tolist() == [codes[e].data_ptr() for e in range(3)] and ps.tolist() == [s[e].data_ptr() for e in range(3)]
    assert pb.tolist() == [a[i].data_ptr() for i in (0, 10, 10)] and pd.tolist() == [out[i].data_ptr() for i in (0, 10, 10)]


def test_design_b_build_is_one_per_format():
    """The w8 build (VARIANT 4, 128 x 256 tiles, 2-CTA clusters) ignores the scale mode (the pass applies
    it): rceil and floor share one library."""
    a = cutlass_wq.build_command("e4m3", "rceil", "/tmp/x.so", op="w8")
    b = cutlass_wq.build_command("e4m3", "floor", "/tmp/x.so", op="w8")
    assert a == b and "-DVARIANT=4" in a and "-DTN=256" in a and "-DCM=2" in a and "-DNAME=g_e4m3_w8" in a
    assert cutlass_wq.cached_path("e4m3", "rceil", "w8") == cutlass_wq.cached_path("e4m3", "floor", "w8")
    assert cutlass_wq.symbol("e5m2", "floor", cutlass_wq._ENTRY["w8"], "w8") == "g_e5m2_w8_forward_scaled"


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
    code = "from mxmoe.kernels import cutlass_wq as c; c._build('e4m3', 'rceil')"
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
    path = cutlass_wq._build("e4m3", "rceil", "dgrad")
    assert path.exists() and path.read_bytes() == b"lib" and (tmp_path / "runs").read_text() == "x"


def test_design_b_arguments_are_checked():
    """grouped_mm_w8 and weight_copy_w8 refuse operands they were not made for (a wrong
    element size or shape would make the kernel read or write outside them)."""
    r = get_recipe("mxfp8")
    w = torch.randn(2, 64, 128, dtype=torch.bfloat16, device=DEV)
    codes, s = cutlass_wq.weight_copy_w8(w, r, "forward")
    offs = torch.tensor([3, 8], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="CUDA device"):  # aq on the CPU (and, without a GPU, all of them)
        cutlass_wq.grouped_mm_w8(torch.zeros(8, 128, dtype=torch.bfloat16), codes, s, offs, r)
    with pytest.raises(ValueError, match="aq must be bfloat16"):
        cutlass_wq.grouped_mm_w8(torch.zeros(8, 128), codes, s, offs, r)
    with pytest.raises(ValueError, match="aq must be bfloat16"):
        cutlass_wq.grouped_mm_w8(torch.zeros(8, 64, dtype=torch.bfloat16), codes, s, offs, r)
    with pytest.raises(ValueError, match="codes must be torch.float8_e5m2"):
        cutlass_wq.grouped_mm_w8(torch.zeros(8, 128, dtype=torch.bfloat16), codes, s, offs,
                                 get_recipe("mxfp8", fmt="e5m2"))
    with pytest.raises(ValueError, match="scales must be uint16"):
        cutlass_wq.grouped_mm_w8(torch.zeros(8, 128, dtype=torch.bfloat16), codes, s.transpose(1, 2), offs, r)
    with pytest.raises(ValueError, match="multiple of 64"):
        cutlass_wq.weight_copy_w8(torch.randn(2, 64, 96, dtype=torch.bfloat16, device=DEV), r, "forward")
    with pytest.raises(ValueError, match="N = 32"):
        cutlass_wq.weight_copy_w8(torch.randn(2, 32, 128, dtype=torch.bfloat16, device=DEV), r, "dgrad")
    with pytest.raises(ValueError, match="'forward'.*'dgrad'"):
        cutlass_wq.weight_copy_w8(w, r, "wgrad")


def test_design_b_missing_library_warns_once_per_format(monkeypatch, tmp_path):
    """w8 (not dispatched) warns that grouped_mm_w8 returns None, once per format (its one
    build serves both scale modes)."""
    monkeypatch.setenv("MXMOE_CUTLASS_W8_LIB", str(tmp_path / "missing.so"))
    monkeypatch.setattr(cutlass_wq, "_FAILED", {})
    monkeypatch.setattr(cutlass_wq, "_LIBS", {})
    with pytest.warns(RuntimeWarning, match="design \\(b\\) in CUTLASS.*returns None"):
        assert cutlass_wq.library("e4m3", "rceil", "w8") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cutlass_wq.library("e4m3", "floor", "w8") is None
