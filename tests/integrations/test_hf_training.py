"""A tiny converted transformers MoE model trains in a plain PyTorch loop: the loss falls and
stays within LOSS_TOLERANCE of the bf16 run; save_pretrained, reload and resume continue
the same run exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import VOCAB, causal_lm
from transformers import AutoModelForCausalLM

import mxmoe
from mxmoe.integrations.transformers import register

STEPS, BATCH, SEQ, LR = 30, 8, 64, 3e-3
LOSS_TOLERANCE = 0.03
"""Mean loss of the last 5 steps under mxfp8, relative to the bf16 run's (measured: about 0.3%)."""


def batch(step: int) -> torch.Tensor:
    """(BATCH, SEQ) token ids of a learnable stream: t[i + 1] = (t[i] * 5 + 3) mod 61, random starts."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, 61, (BATCH, 1), generator=gen)
    ids = [start]
    for _ in range(SEQ - 1):
        ids.append((ids[-1] * 5 + 3) % 61)
    return torch.cat(ids, dim=1) % VOCAB


def train(model, steps: range, opt) -> list[float]:
    losses = []
    for step in steps:
        ids = batch(step)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def make(recipe: str | None):
    """bf16 parameters; recipe None: transformers as it is (grouped_mm experts)."""
    model = causal_lm("qwen3_moe", seed=3, dtype=torch.bfloat16)
    if recipe is not None:
        mxmoe.convert_to_mxfp8(model, recipe)
    return model


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)


def test_mxfp8_training_follows_bf16_and_resumes(tmp_path):
    base = make(None)
    base_losses = train(base, range(STEPS), adamw(base))
    model = make("mxfp8")
    opt = adamw(model)
    first = train(model, range(STEPS // 2), opt)
    model.save_pretrained(tmp_path / "ckpt")
    torch.save(opt.state_dict(), tmp_path / "ckpt" / "optimizer.pt")
    rest = train(model, range(STEPS // 2, STEPS), opt)
    losses = first + rest
    print("bf16", [round(x, 3) for x in base_losses], "\nmxfp8", [round(x, 3) for x in losses])
    assert losses[-1] < 0.5 * losses[0], "the loss falls"
    tail = sum(losses[-5:]) / 5
    base_tail = sum(base_losses[-5:]) / 5
    assert abs(tail - base_tail) <= LOSS_TOLERANCE * base_tail, (tail, base_tail)
    # reload the step-15 checkpoint and resume: the same losses, bit for bit
    register()
    resumed = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", experts_implementation="mxfp8",
                                                   dtype=torch.bfloat16)
    mxmoe.convert_to_mxfp8(resumed)
    opt2 = adamw(resumed)
    opt2.load_state_dict(torch.load(tmp_path / "ckpt" / "optimizer.pt", map_location="cpu", weights_only=True))
    assert train(resumed, range(STEPS // 2, STEPS), opt2) == rest
