"""A converted transformers MoE block under torch.compile: the experts backend runs eagerly
(one graph break on each side of it, no other), the router, attention and the rest
compile, and the results are eager's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import D, causal_lm, moe_block

import mxmoe


def _run(fn, block, x):
    x = x.clone().requires_grad_(True)
    out = fn(x)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_converted_block_compiles_with_breaks_only_at_the_experts(family):
    model = causal_lm(family, dtype=torch.bfloat16)
    mxmoe.convert_to_mxfp8(model)
    block = moe_block(model)
    x = torch.randn(1, 48, D, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ref = _run(block, block, x)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(x)
    reasons = [str(b.reason) for b in explained.break_reasons]
    assert all("torch.compiler.disable" in r for r in reasons), reasons
    torch._dynamo.reset()
    got = _run(torch.compile(block, backend="aot_eager"), block, x)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2], strict=True))
