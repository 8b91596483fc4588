"""Acceptance example: MXFP8 training of a plain PyTorch transformer.

A user's own model (nn.Linear attention and MLP, one ``mxmoe.nn.MoE`` block built in
bf16) is converted with ``convert_to_mxfp8`` and trained; the same model written directly
with mxmoe modules (``MXLinear(recipe="mxfp8")``, ``MoE(recipe="mxfp8")``) from the same
weights trains to the same losses, bit for bit.

Precision of the plain parts: the whole model in one dtype, no casts (so it runs as
written, before and after conversion). float32: float32 parameters (AdamW master weights)
and activations; ``mx_linear`` and the experts' grouped GEMMs quantize the float32
operands to MXFP8. bfloat16 (``model.to(torch.bfloat16)``): bf16 parameters and
activations; the MoE then runs its fused MXFP8 expert op. Tiny sizes (width 64, 2 blocks,
4 experts, 128 tokens) keep the runs on the CPU within seconds.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mxmoe import MoE, MXLinear, convert_to_mxfp8


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int, linear=nn.Linear):
        super().__init__()
        self.n_heads = n_heads
        self.q, self.k, self.v, self.o = (linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = (m(x).view(B, S, self.n_heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(B, S, D))


class MLP(nn.Module):
    def __init__(self, d: int, linear=nn.Linear):
        super().__init__()
        self.up, self.down = linear(d, 4 * d, bias=True), linear(4 * d, d, bias=True)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d: int, ffn: nn.Module, linear=nn.Linear):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.ffn = nn.LayerNorm(d), Attention(d, 2, linear), nn.LayerNorm(d), ffn

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        y = self.ffn(self.norm2(x))
        if isinstance(self.ffn, MoE):  # MoE returns (y, aux): add the load-balancing loss
            y, aux = y
            return x + y, aux.aux_loss
        return x + y, x.new_zeros(())


class TinyLM(nn.Module):
    """Embedding, an MLP block, an MoE block, LM head. ``linear`` builds the attention and
    MLP projections; the LM head is always nn.Linear (kept in high precision)."""

    def __init__(self, vocab=256, d=64, linear=nn.Linear, moe_recipe="bf16"):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        moe = MoE(d_model=d, n_experts=4, top_k=2, d_expert=64, n_layers=2, recipe=moe_recipe)
        self.blocks = nn.ModuleList([Block(d, MLP(d, linear), linear), Block(d, moe, linear)])
        self.norm, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x, aux = self.embed(idx), 0.0
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + 0.01 * aux


def train(model: nn.Module, steps: int = 20) -> list[torch.Tensor]:
    """20 AdamW steps on one fixed batch (4 x 32 tokens); the loss of each step."""
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (4, 33), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_converted_user_model_trains_like_the_model_built_with_mxmoe_modules(dtype):
    # the user's model, converted: every nn.Linear but the LM head -> MXLinear, the MoE -> mxfp8
    torch.manual_seed(0)
    model = TinyLM().to(dtype)
    init = copy.deepcopy(model.state_dict())
    convert_to_mxfp8(model, module_filter_fn=lambda module, fqn: fqn != "lm_head")
    converted = train(model)

    # the same model written with mxmoe modules, from the same seed and weights
    torch.manual_seed(0)
    direct = TinyLM(linear=functools.partial(MXLinear, recipe="mxfp8"), moe_recipe="mxfp8").to(dtype)
    assert all(torch.equal(v, init[k]) for k, v in direct.state_dict().items())  # same init as nn.Linear
    direct.load_state_dict(init)
    built = train(direct)

    assert all(torch.equal(a, b) for a, b in zip(converted, built)), [(a.item(), b.item()) for a, b in
                                                                     zip(converted, built)]
    assert built[-1] < 0.8 * built[0], [x.item() for x in built]  # it learns
    assert sum(isinstance(m, MXLinear) for m in model.modules()) == 4 + 2 + 4  # q k v o twice, up and down
    assert type(model.lm_head) is nn.Linear and model.blocks[1].ffn.recipe.name == "mxfp8"
    assert model.blocks[1].ffn.last_ran_fused is direct.blocks[1].ffn.last_ran_fused is (dtype == torch.bfloat16)
    # and MXFP8 is really used: the unconverted model's first loss differs
    plain = TinyLM().to(dtype)
    plain.load_state_dict(init)
    assert not torch.equal(train(plain, steps=1)[0], converted[0])
