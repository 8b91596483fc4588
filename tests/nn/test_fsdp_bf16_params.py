"""The bf16-parameter mode of the MoE layer and MXLinear as FSDP2 gives it: float32 sharded
master parameters, ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``
casting them to bf16 for forward and backward. One process, gloo, on the CPU: the layer's
output and gradients equal those of the same layer holding bf16 parameters (the gradients
arrive in float32, for the optimizer's float32 master weights)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mxmoe.nn import MoE, MXLinear

pytest.importorskip("torch.distributed.fsdp")


@pytest.fixture
def process_group(tmp_path):
    if not dist.is_gloo_available():
        pytest.skip("no gloo backend in this torch build")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _layers():
    torch.manual_seed(0)
    return {
        "MoE": (lambda: MoE(d_model=64, n_experts=4, top_k=2, d_expert=64, recipe="mxfp8"),
                lambda m, x: m(x)[0]),
        "MXLinear": (lambda: MXLinear(64, 96, recipe="mxfp8"), lambda m, x: m(x)),
    }


@pytest.mark.parametrize("name", ["MoE", "MXLinear"])
def test_fsdp2_bf16_params_equal_a_bf16_layer(process_group, name):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    make, forward = _layers()[name]
    sharded = make()  # float32 parameters: the master weights
    bf16 = make()
    bf16.load_state_dict(sharded.state_dict())
    bf16 = bf16.to(torch.bfloat16)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))  # on the CPU also where CUDA is (fully_shard would move to it)
    fully_shard(sharded, mesh=mesh,
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y_sharded, y_bf16 = forward(sharded, x), forward(bf16, x)
    assert y_sharded.dtype == torch.bfloat16 and torch.equal(y_sharded, y_bf16)
    y_sharded.float().square().mean().backward()
    y_bf16.float().square().mean().backward()
    for (n, p), (_, q) in zip(sharded.named_parameters(), bf16.named_parameters()):
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, n  # master weights and their grads
        assert torch.equal(p.grad.full_tensor(), q.grad.float()), n
