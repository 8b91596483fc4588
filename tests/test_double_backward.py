"""Second-order gradients through every ``torch.autograd.Function`` of mxmoe.

Each Function is found by walking the package, so a new one without a case here fails
``test_every_autograd_function_has_a_case``. A Function whose backward runs on MXFP8
copies refuses double backward with an error naming it and what to use instead (never
silently zero second-order gradients); one whose backward is differentiable torch math
(straight-through, exchanges, the float32 router GEMM) gives the second-order gradients
of the same computation written in plain torch ops.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mxmoe
from mxmoe.distributed.collectives import AllToAllRows, AllToAllStart, AllToAllWait, ExchangeTicket
from mxmoe.distributed.ep import _CombineExchange, _MXDispatch, pack_mx_rows
from mxmoe.distributed.mx_gather import _GatherExpertsMX
from mxmoe.nn.moe import _Float32Linear
from mxmoe.ops.autograd import DOUBLE_BACKWARD_ERROR
from mxmoe.ops.combine import combine_rows, mx_round_rows
from mxmoe.ops.grouped_mm import mx_grouped_mm
from mxmoe.ops.linear import mx_linear
from mxmoe.ops.moe_experts import mx_moe_experts
from mxmoe.ops.quantize import fake_quantize_operand
from mxmoe.recipe import get_recipe

MX = get_recipe("mxfp8")


def project_functions() -> dict[str, type]:
    """Every torch.autograd.Function subclass defined in a module of mxmoe, by qualified name."""
    found = {}
    for info in pkgutil.walk_packages(mxmoe.__path__, "mxmoe."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, torch.autograd.Function) and obj.__module__ == info.name:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def _leaf(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype).requires_grad_(True)


def _routing(T: int, k: int, E: int):
    """src_A (A,) int64 sorted by expert, offsets_E (E,) int32, order_A (A,) int64 (the
    assignment t * k + j of each sorted row): every token to k distinct experts."""
    experts_Tk = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    flat = experts_Tk.reshape(-1)
    order_A = torch.argsort(flat, stable=True)
    src_A = order_A // k
    offsets_E = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    return src_A, offsets_E, order_A


# ---- the Functions whose double backward is refused: (call, differentiated inputs) --------

def case_linear():
    x, w = _leaf(8, 64), _leaf(16, 64)
    return (lambda: mx_linear(x, w, MX)), [x, w]


def case_grouped_mm():
    x, w = _leaf(12, 64), _leaf(3, 32, 64)
    offsets = torch.tensor([4, 4, 12], dtype=torch.int32)  # an empty expert
    return (lambda: mx_grouped_mm(x, w, offsets, MX)), [x, w]


def case_moe_experts():
    T, k, E, D, F_ = 6, 2, 3, 64, 32
    src_A, offsets_E, _ = _routing(T, k, E)
    x, w13, w2 = _leaf(T, D, dtype=torch.bfloat16), _leaf(E, 2 * F_, D, scale=0.1), _leaf(E, D, F_, scale=0.1)
    return (lambda: mx_moe_experts(x, src_A, offsets_E, w13, w2, MX)), [x, w13, w2]


def case_gathered_experts(monkeypatch):
    """The bf16 experts on QuACK's GEMMs, the GEMMs replaced by their torch reference
    (tests/ops/gathered_reference.py) as in tests/ops/test_moe_experts_gathered.py."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "ops"))
    from gathered_reference import REF_ENGINE

    from mxmoe.kernels import quack_moe
    from mxmoe.ops.moe_experts_gathered import gathered_moe_experts

    for fn_name, fn in REF_ENGINE.items():
        monkeypatch.setattr(quack_moe, fn_name, fn)
    monkeypatch.setattr(quack_moe, "supports", lambda x, d, f: True)
    T, k, E, D, F_ = 6, 2, 3, 32, 16
    _, offsets_E, order_A = _routing(T, k, E)
    x, scores = _leaf(T, D, dtype=torch.bfloat16), _leaf(T, k)
    w13, w2 = _leaf(E, 2 * F_, D, scale=0.1), _leaf(E, D, F_, scale=0.1)
    return (lambda: gathered_moe_experts(x, scores, w13, w2, order_A, offsets_E, get_recipe("bf16"))), [x, scores, w13, w2]


def case_combine_rows():
    T, k, E, D = 5, 2, 3, 64
    _, _, order_A = _routing(T, k, E)
    y, weights = _leaf(T * k, D), _leaf(T, k)
    return (lambda: combine_rows(y, order_A, weights, MX)), [y]


def case_gather_experts_mx(group):
    shard = _leaf(2, 64, 64)  # (experts of this rank, N, K)
    return (lambda: _GatherExpertsMX.apply(shard, MX, group, {}, torch.float32)), [shard]


REFUSED = {
    "mxmoe.ops.linear._MXLinearFunction": (case_linear, "mx_linear"),
    "mxmoe.ops.grouped_mm._MXGroupedMMFunction": (case_grouped_mm, "mx_grouped_mm"),
    "mxmoe.ops.moe_experts._MXExpertsFunction": (case_moe_experts, "mx_moe_experts"),
    "mxmoe.ops.combine._CombineRows": (case_combine_rows, "the fused MoE combine"),
    "mxmoe.ops.moe_experts_gathered._GatheredExpertsFunction": (case_gathered_experts, "the gathered bf16 MoE experts"),
    "mxmoe.distributed.mx_gather._GatherExpertsMX": (case_gather_experts_mx, "the MXFP8 expert-weight gather"),
}


# ---- the Functions that support it: (call, plain-torch reference, inputs) ------------------

def _ste(x, q):  # the value of q, the gradient of the identity
    return x + (q - x).detach()


def case_float32_linear():
    x, w = _leaf(8, 32), _leaf(6, 32)
    return (lambda: _Float32Linear.apply(x, w)), (lambda: F.linear(x.float(), w.float())), [x, w]


def case_round_rows():
    x = _leaf(4, 64)
    return (lambda: mx_round_rows(x, MX)), (lambda: _ste(x, fake_quantize_operand(x.detach(), MX, dim=1, out_dtype=x.dtype))), [x]


def case_all_to_all(group):
    x = _leaf(5, 8)
    return (lambda: AllToAllRows.apply(x, [5], [5], group, None, "rows")), (lambda: x * 1), [x]


def case_mx_dispatch(group):
    x = _leaf(5, 64)
    packed = pack_mx_rows(x, MX)
    return ((lambda: _MXDispatch.apply(x, packed, 64, MX, [5], [5], group, None)),
            (lambda: _ste(x, fake_quantize_operand(x.detach(), MX, dim=1, out_dtype=x.dtype))), [x])


def case_overlapped_all_to_all(group):
    x = _leaf(5, 8)

    def call():
        ticket = ExchangeTicket()
        return AllToAllWait.apply(AllToAllStart.apply(x, [5], [5], group, None, "rows", ticket), ticket)

    return call, (lambda: x * 1), [x]


def case_mx_combine_gradient(group):
    """Identity forward; the gradient rounded to MXFP8 rows, straight through."""
    x = _leaf(5, 64)

    def ref():
        y = x * 1
        y.register_hook(lambda g: _ste(g, fake_quantize_operand(g.detach(), MX, dim=1, out_dtype=g.dtype)))
        return y

    return (lambda: _CombineExchange.apply(x, [5], [5], group, None, MX)), ref, [x]


SUPPORTED = {
    "mxmoe.nn.moe._Float32Linear": case_float32_linear,
    "mxmoe.ops.combine._MXRoundRows": case_round_rows,
    "mxmoe.distributed.collectives.AllToAllRows": case_all_to_all,
    "mxmoe.distributed.ep._MXDispatch": case_mx_dispatch,
    "mxmoe.distributed.collectives.AllToAllStart": case_overlapped_all_to_all,
    "mxmoe.distributed.collectives.AllToAllWait": case_overlapped_all_to_all,
    "mxmoe.distributed.ep._CombineExchange": case_mx_combine_gradient,
}


def test_every_autograd_function_has_a_case():
    found = set(project_functions())
    assert found == set(REFUSED) | set(SUPPORTED), (
        f"without a case: {sorted(found - set(REFUSED) - set(SUPPORTED))}; "
        f"cases of no Function: {sorted((set(REFUSED) | set(SUPPORTED)) - found)}")


def _first_order(y, inputs, loss):
    out = y.float()
    total = (out.square() if loss == "square" else out).sum()
    return torch.autograd.grad(total, inputs, create_graph=True)


@pytest.mark.parametrize("loss", ["square", "sum"])  # "sum": the incoming gradient does not require grad
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_double_backward_through_mxfp8_ops_is_refused(name, loss, group, monkeypatch):
    torch.manual_seed(0)
    build, op = REFUSED[name]
    call, inputs = build(group) if "distributed" in name else build(monkeypatch) if "gathered" in name else build()
    y = call()
    first_plain = torch.autograd.grad((y.float().square() if loss == "square" else y.float()).sum(), inputs)
    grads = _first_order(call(), inputs, loss)
    for g, want in zip(grads, first_plain):  # the first-order gradients are unchanged
        assert torch.equal(g.detach(), want)
    penalty = sum(g.float().square().sum() for g in grads)  # a gradient penalty
    with pytest.raises(RuntimeError, match=f"{op}.* {DOUBLE_BACKWARD_ERROR} .*silently wrong; .+") as err:
        penalty.backward()
    assert "\n" not in str(err.value).strip()


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_double_backward_where_supported_matches_plain_torch(name, group):
    torch.manual_seed(0)
    build = SUPPORTED[name]
    call, ref, inputs = build(group) if "distributed" in name else build()
    results = []
    for fn in (call, ref):
        grads = _first_order(fn(), inputs, "square")
        penalty = sum(g.float().square().sum() for g in grads)
        results.append(torch.autograd.grad(penalty, inputs))
    for got, want in zip(*results):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
