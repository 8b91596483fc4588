"""The weight-copy cache (mxmoe.ops.weight_cache): weight copies made once per optimizer
step are bit for bit the per-call copies, are reused while the weight is unchanged and
never after it changes, and are freed with the context. Every op that quantizes a weight
(mx_linear, mx_grouped_mm, the fused MoE experts op) is checked, on the reference backend
and on the Triton backend (the interpreter on the CPU)."""

from __future__ import annotations

import gc

import pytest
import torch

import mxmoe
from mxmoe.nn.moe import MoELayer
from mxmoe.ops import weight_cache as wc
from mxmoe.ops.quantize import fake_quantize_operand, fake_quantize_rowcol
from mxmoe.recipe import get_recipe

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ["reference", "triton"]


def spread(*shape, seed):
    """Values with power-of-two spreads along every axis, so a copy blocked along the
    wrong axis (or from a stale weight) gives different bytes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    for d, n in enumerate(shape):
        s = [1] * len(shape)
        s[d] = n
        x = x * torch.exp2(torch.randint(-5, 6, s, generator=g).float())
    return x.to(DEV)


def bits(t):
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).cpu()


def same(a, b):
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def run_grouped(x, w, offsets, recipe, steps=1):
    """out, dx, dw of mx_grouped_mm over ``steps`` micro-batches (grads accumulated)."""
    x = x.clone().requires_grad_(True)
    outs = []
    for i in range(steps):
        out = mxmoe.mx_grouped_mm(x, w, offsets, recipe)
        (out.float() * (i + 1)).pow(2).sum().backward()
        outs.append(out.detach())
    return outs, x.grad, w.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(3, 64, 96), (4, 40, 70)])  # (E, N, K); N, K not multiples of 32 in the second
def test_rowcol_of_expert_weights_equals_two_single_copies(backend, shape):
    """The one-read copy of a 3-D weight: each expert blocked along its own N (blocks never
    straddle experts, partial last blocks zero padded) and along K."""
    r = get_recipe("mxfp8", backend=backend)
    for dtype in (torch.float32, torch.bfloat16):
        w = spread(*shape, seed=1).to(dtype)
        rows, cols = fake_quantize_rowcol(w, r, out_dtype=torch.bfloat16)
        assert same(rows, fake_quantize_operand(w, r, dim=2, out_dtype=torch.bfloat16))
        assert same(cols, fake_quantize_operand(w, r, dim=1, out_dtype=torch.bfloat16))
        per_expert = torch.stack([fake_quantize_operand(w[e], r, dim=0, out_dtype=torch.bfloat16) for e in range(shape[0])])
        assert same(cols, per_expert)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mm_cached_equals_per_call_and_is_reused(backend):
    """Two micro-batches in one context: out, dx and the accumulated dw are bit for bit the
    uncached ones; the weight is quantized once (one pass makes both copies: 2 misses)
    and its copies are reused by the second micro-batch (2 hits)."""
    r = get_recipe("mxfp8", backend=backend)
    E, N, K = 3, 64, 96
    x = spread(50, K, seed=2)
    offsets = torch.tensor([20, 20, 45], dtype=torch.int32, device=DEV)  # an empty expert; rows 45..49 unrouted
    w_plain = spread(E, N, K, seed=3).requires_grad_(True)
    w_cached = w_plain.detach().clone().requires_grad_(True)
    want = run_grouped(x, w_plain, offsets, r, steps=2)
    with mxmoe.weight_copy_cache() as cache:
        got = run_grouped(x, w_cached, offsets, r, steps=2)
        assert (cache.misses, cache.hits, len(cache)) == (2, 2, 2)
    assert len(cache) == 0  # leaving the context frees the copies
    for a, b in zip(want[0], got[0]):
        assert same(a, b)
    assert same(want[1], got[1]) and same(want[2], got[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_optimizer_step_inside_the_context_is_never_served_stale_copies(backend):
    """After an in-place update of the weight (an optimizer step, a copy_ under no_grad,
    a new tensor at the same place) the next forward quantizes again and equals a fresh
    uncached computation with the new weight."""
    r = get_recipe("mxfp8", backend=backend)
    x = spread(40, 96, seed=4)
    offsets = torch.tensor([10, 40], dtype=torch.int32, device=DEV)
    w = spread(2, 64, 96, seed=5).requires_grad_(True)
    opt = torch.optim.SGD([w], lr=0.5)
    with mxmoe.weight_copy_cache() as cache:
        for step in range(3):
            opt.zero_grad()
            out = mxmoe.mx_grouped_mm(x, w, offsets, r)
            out.float().pow(2).sum().backward()
            with torch.no_grad():  # the same values in a different tensor: no cache entry
                want = mxmoe.mx_grouped_mm(x, w.detach().clone(), offsets, r)
            assert same(out, want), step
            opt.step()  # bumps w's version counter: the copies of this step are stale
        assert cache.misses == 6 and cache.hits == 0
        with torch.no_grad():
            w.copy_(spread(2, 64, 96, seed=6))
            out = mxmoe.mx_grouped_mm(x, w, offsets, r)
            assert same(out, mxmoe.mx_grouped_mm(x, w.detach().clone(), offsets, r))


def test_bf16_recipe_caches_the_weight_cast():
    """Under the bf16 recipe the cached copy is the weight's bf16 cast, one for both GEMMs
    (a like-for-like BF16 baseline for gradient accumulation); a bf16 weight needs no copy."""
    r = get_recipe("bf16")
    x = spread(50, 96, seed=14)
    offsets = torch.tensor([20, 20, 45], dtype=torch.int32, device=DEV)
    w = spread(3, 64, 96, seed=15).requires_grad_(True)
    want = run_grouped(x, w, offsets, r, steps=2)
    w.grad = None
    with mxmoe.weight_copy_cache() as cache:
        got = run_grouped(x, w, offsets, r, steps=2)
        assert (cache.misses, cache.hits, len(cache)) == (1, 1, 1)  # one cast, reused by the second micro-batch
    assert all(same(a, b) for a, b in zip(want[0] + [want[1], want[2]], got[0] + [got[1], got[2]]))
    wb = w.detach().bfloat16().requires_grad_(True)
    with mxmoe.weight_copy_cache() as cache:
        run_grouped(x, wb, offsets, r, steps=1)
        assert len(cache) == 0


def test_backward_after_the_context_closed_uses_the_forward_copy():
    r = get_recipe("mxfp8", backend="reference")
    x = spread(33, 64, seed=7).requires_grad_(True)
    offsets = torch.tensor([33], dtype=torch.int32, device=DEV)
    w = spread(1, 40, 64, seed=8).requires_grad_(True)
    with mxmoe.weight_copy_cache():
        out = mxmoe.mx_grouped_mm(x, w, offsets, r)
    out.float().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    mxmoe.mx_grouped_mm(x2, w.detach().clone().requires_grad_(True), offsets, r).float().sum().backward()
    assert same(x.grad, x2.grad)


def test_nested_contexts_share_one_cache_and_dead_weights_are_dropped():
    r = get_recipe("mxfp8", backend="reference")
    x = spread(8, 64, seed=9)
    with mxmoe.weight_copy_cache() as outer:
        w = spread(32, 64, seed=10).requires_grad_(True)
        mxmoe.mx_linear(x.requires_grad_(True), w, r)
        with mxmoe.weight_copy_cache() as inner:
            assert inner is outer
            mxmoe.mx_linear(x, w, r)
        assert len(outer) == 2 and outer.hits == 2  # the inner exit did not free them
        del w
        gc.collect()
        assert len(outer) == 0  # the weight died: its copies went with it
        # a weight that is a new tensor on every call (a cast per forward) never hits
        w32 = spread(32, 64, seed=11)
        for _ in range(3):
            mxmoe.mx_linear(x, w32.to(torch.bfloat16).requires_grad_(True), r)
        gc.collect()
        assert outer.hits == 2 and len(outer) <= 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_cached_equals_per_call(backend):
    """mx_linear: forward, dx and dw bit for bit; under no_grad only the forward copy."""
    r = get_recipe("mxfp8", backend=backend)
    x = spread(24, 96, seed=12)
    w = spread(40, 96, seed=13)
    grads = []
    for cached in (False, True):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        with mxmoe.weight_copy_cache() if cached else torch.enable_grad():
            y = mxmoe.mx_linear(xi, wi, r)
            y.float().pow(2).sum().backward()
        grads.append((y, xi.grad, wi.grad))
    assert all(same(a, b) for a, b in zip(*grads))
    with mxmoe.weight_copy_cache() as cache, torch.no_grad():
        wi = w.clone().requires_grad_(True)
        y = mxmoe.mx_linear(x, wi, r)  # evaluation: only the forward copy is made
        assert (cache.misses, cache.hits) == (1, 0) and same(y, grads[0][0])
        mxmoe.mx_linear(x, wi, r)
        assert (cache.misses, cache.hits) == (1, 1)


def test_fused_moe_layer_cached_equals_per_call():
    """The fused MXFP8 experts op (w13, w2) over two micro-batches: the layer output, x's
    gradient and both accumulated weight gradients bit for bit; 4 copies made, 4 reused."""
    torch.manual_seed(0)
    r = get_recipe("mxfp8", backend="reference")
    base = MoELayer(64, 4, 2, 96, 2, r, fused=True).to(DEV)
    xs = [torch.randn(2, 12, 64, device=DEV).bfloat16() for _ in range(2)]
    results = []
    for cached in (False, True):
        m = MoELayer(64, 4, 2, 96, 2, r, fused=True).to(DEV)
        m.load_state_dict(base.state_dict())
        outs, xgrads = [], []
        with mxmoe.weight_copy_cache() if cached else torch.enable_grad() as cache:
            for x in xs:
                x = x.clone().requires_grad_(True)
                y, _ = m(x)
                y.float().pow(2).sum().backward()
                outs.append(y.detach())
                xgrads.append(x.grad)
            if cached:
                assert (cache.misses, cache.hits) == (4, 4)
        results.append((outs, xgrads, m.experts.w13.grad, m.experts.w2.grad))
    (o1, g1, a1, b1), (o2, g2, a2, b2) = results
    assert all(same(a, b) for a, b in zip(o1 + g1, o2 + g2))
    assert same(a1, a2) and same(b1, b2)


def test_the_cache_is_skipped_while_a_cuda_graph_is_captured(monkeypatch):
    """A replayed graph would keep reading copies made before the optimizer's update: while
    the current stream is capturing, no cache is active (every call quantizes)."""
    with mxmoe.weight_copy_cache() as cache:
        assert wc.active_cache() is cache
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert wc.active_cache() is None
    assert wc.active_cache() is None


def test_bf16_and_mxfp8_recipes_do_not_share_copies_and_edges():
    """Breaker findings: the two recipes on one weight get their own copies; a dtype change
    at the same address invalidates; inference tensors bypass the cache; re-entering one
    instance frees the copies at the outermost exit."""
    x = spread(64, 64, seed=20).bfloat16()
    w = spread(2, 64, 64, seed=21)
    offs = torch.tensor([32, 64], dtype=torch.int32, device=DEV)
    for first, second in (("mxfp8", "bf16"), ("bf16", "mxfp8")):
        want = mxmoe.mx_grouped_mm(x, w, offs, second)
        with mxmoe.weight_copy_cache():
            mxmoe.mx_grouped_mm(x, w, offs, first)
            assert same(mxmoe.mx_grouped_mm(x, w, offs, second), want), (first, second)
    with torch.inference_mode():
        wi = spread(32, 64, seed=22)
        with mxmoe.weight_copy_cache() as cache:
            mxmoe.mx_linear(x, wi, "mxfp8")
            assert cache.misses == 0
    cm = mxmoe.weight_copy_cache()
    wl = spread(32, 64, seed=23)
    with cm as c:
        with cm:
            mxmoe.mx_linear(x, wl, "mxfp8")
        assert len(c) == 1
    assert len(c) == 0
    assert wc.active_cache() is None
