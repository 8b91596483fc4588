"""The widening cast of mxmoe.kernels.cast (Triton; the interpreter on the CPU) and rule 4
of mxmoe.ops.backend that picks it for weight gradients."""

import pytest
import torch

from mxmoe.recipe import get_recipe

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytest.importorskip("triton")


def test_widen_every_bf16_bit_pattern():
    """Every bfloat16 bit pattern (NaN payloads, infs, subnormals, -0) widens to the float32
    bits of Tensor.to; a 2-D shape; a length that is not a multiple of the block."""
    from mxmoe.kernels.cast import BLOCK, widen

    bits = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    assert x.numel() % BLOCK == 0
    x = torch.cat([x, x[:123]]).to(DEV)  # a partial last block
    assert torch.equal(widen(x, torch.float32).view(torch.int32).cpu(), x.to(torch.float32).view(torch.int32).cpu())
    m = x[:1000].reshape(8, 125)
    got = widen(m, torch.float32)
    assert got.shape == (8, 125) and torch.equal(got.view(torch.int32).cpu(), m.to(torch.float32).view(torch.int32).cpu())
    assert widen(torch.empty(0, 5, dtype=torch.bfloat16, device=DEV), torch.float32).shape == (0, 5)


@pytest.mark.parametrize("src,dst,contiguous", [(torch.float32, torch.bfloat16, True),
                                                (torch.bfloat16, torch.float16, True), (torch.float16, torch.float32, True),
                                                (torch.float32, torch.float32, True),
                                                (torch.bfloat16, torch.float32, False)])
def test_widen_refuses_what_it_does_not_do(src, dst, contiguous):
    """Narrowing or same-dtype casts and strided input are refused with a message that says
    what it casts (rounding casts belong to Tensor.to)."""
    from mxmoe.kernels.cast import widen

    x = torch.zeros(4, 6, dtype=src, device=DEV)
    if not contiguous:
        x = x.t()
    with pytest.raises(ValueError, match="widen"):
        widen(x, dst)


@pytest.mark.parametrize("backend,device_ok", [("reference", False), ("triton", True), ("auto", DEV == "cuda")])
def test_weight_grad_widening_rule(backend, device_ok):
    """Rule 4: the Triton cast for a contiguous bf16 gradient of float32 weights unless the
    recipe's backend is "reference" ("auto": CUDA only); the same bits either way; a
    gradient already in the weights' dtype is returned as is."""
    from mxmoe.ops.backend import use_triton_widen, widen_weight_grad

    r = get_recipe("mxfp8", backend=backend)
    dw = torch.randn(3, 40, 33, device=DEV).to(torch.bfloat16)
    with torch.no_grad():  # as in a backward that builds no graph
        assert use_triton_widen(dw, torch.float32, r) is device_ok
        assert not use_triton_widen(dw.transpose(1, 2), torch.float32, r)  # strided: Tensor.to
        assert not use_triton_widen(dw.float(), torch.float32, r)
        assert not use_triton_widen(dw.half(), torch.float32, r)
        assert torch.equal(widen_weight_grad(dw, torch.float32, r), dw.float())
        same = dw.float()
        assert widen_weight_grad(same, torch.float32, r) is same
    assert not use_triton_widen(dw, torch.float32, r)  # grad mode on: Tensor.to, which has a derivative


@pytest.mark.skipif(DEV == "cuda", reason="the CPU without the interpreter")
def test_triton_recipe_on_a_cpu_without_the_interpreter_widens_with_tensor_to(monkeypatch):
    """backend="triton" on CPU tensors without TRITON_INTERPRET: rule 4 keeps Tensor.to (the
    kernel cannot run there); widen itself refuses with a message naming the device."""
    from mxmoe.kernels.cast import widen
    from mxmoe.ops.backend import use_triton_widen, widen_weight_grad

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    r = get_recipe("bf16", backend="triton")
    dw = torch.randn(4, 8).to(torch.bfloat16)
    with torch.no_grad():
        assert not use_triton_widen(dw, torch.float32, r)
        assert torch.equal(widen_weight_grad(dw, torch.float32, r), dw.float())
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        widen(dw, torch.float32)


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8-bf16-wgrad", "mxfp8"])
def test_second_derivative_through_the_weight_gradient_matches_the_reference(recipe):
    """A backward with create_graph=True keeps dW differentiable on every backend (rule 4
    takes Tensor.to there): the double-backward result of the Triton backend is the
    reference backend's (or both refuse alike)."""
    from mxmoe.ops import mx_grouped_mm

    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    w0 = torch.randn(2, 32, 64, generator=g)
    offsets = torch.tensor([40, 64], dtype=torch.int32)
    results = []
    for backend in ("reference", "triton"):
        x, w = x0.clone().to(DEV).requires_grad_(), w0.clone().to(DEV).requires_grad_()
        r = get_recipe(recipe, backend=backend)
        try:
            (gw,) = torch.autograd.grad(mx_grouped_mm(x, w, offsets.to(DEV), r).float().square().sum(), w,
                                        create_graph=True)
            results.append((gw.requires_grad, gw.detach().cpu()))
        except RuntimeError as err:  # refused alike on both backends
            results.append(("refused", type(err).__name__))
    assert results[0][0] == results[1][0], results
    if results[0][0] is True:
        assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("op", ["mx_grouped_mm", "mx_moe_experts"])
def test_a_plain_backward_widens_float32_weight_grads_with_the_kernel(op, monkeypatch):
    """In a backward without create_graph (grad mode off there) the float32 weights'
    gradients go through the Triton cast on the Triton backend, bit-equal to the reference
    backend's Tensor.to."""
    from mxmoe.kernels import cast
    from mxmoe.ops import mx_grouped_mm, mx_moe_experts

    calls = []
    real = cast.widen
    monkeypatch.setattr(cast, "widen", lambda x, dtype: calls.append(x.shape) or real(x, dtype))
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    grads = {}
    for backend in ("reference", "triton"):
        r = get_recipe("mxfp8", backend=backend)
        x = x0.clone().to(DEV).requires_grad_()
        if op == "mx_grouped_mm":
            w = (torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1))).to(DEV).requires_grad_()
            y = mx_grouped_mm(x, w, torch.tensor([40, 64], dtype=torch.int32, device=DEV), r)
            params = [w]
        else:
            gw = torch.Generator().manual_seed(1)
            w13 = (torch.randn(2, 64, 64, generator=gw) / 8).to(DEV).requires_grad_()
            w2 = (torch.randn(2, 64, 32, generator=gw) / 8).to(DEV).requires_grad_()
            src = torch.arange(64, device=DEV).repeat(2)
            y = mx_moe_experts(x, src, torch.tensor([64, 128], dtype=torch.int32, device=DEV), w13, w2, r)
            params = [w13, w2]
        y.float().square().sum().backward()
        grads[backend] = [p.grad.cpu() for p in params]
    assert len(calls) == len(grads["triton"]), "the Triton backend's weight gradients were not widened by the kernel"
    for a, b in zip(grads["reference"], grads["triton"]):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
