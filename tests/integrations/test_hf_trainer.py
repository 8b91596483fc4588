"""A converted transformers MoE model under the Hugging Face Trainer: its experts run
through mxmoe's backend on every step and the loss is finite."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

from hf_models import VOCAB, causal_lm

import mxmoe
import mxmoe.integrations.transformers as mxt

STEPS, BATCH, SEQ = 4, 4, 32


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_converted_model_trains_under_the_hf_trainer(tmp_path, monkeypatch):
    from transformers import Trainer, TrainingArguments

    model = causal_lm("qwen3_moe", seed=3, dtype=torch.bfloat16)
    mxmoe.convert_to_mxfp8(model)
    assert model.config._experts_implementation == "mxfp8"
    calls = []
    real = mxt.experts_forward
    monkeypatch.setattr(mxt, "experts_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=STEPS,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-3)
    out = Trainer(model=model, args=args, train_dataset=_Tokens(STEPS * BATCH)).train()
    assert out.global_step == STEPS and math.isfinite(out.training_loss)
    n_moe_layers = model.config.num_hidden_layers
    assert len(calls) == STEPS * n_moe_layers, "the experts did not run through mxmoe's backend on every step"
