"""The train step module (mxmoe.training.step) and the sync-free expert counts, on the CPU.

The CUDA-graph path itself needs a GPU: benchmarks/check_cuda_graph.py checks it on the
H200 (graphed == eager within eager's run-to-run spread; resume; speed).
"""

import copy

import pytest
import torch

from mxmoe.cli import build_parser, config_from_args
from mxmoe.model import ModelConfig, MoETransformer
from mxmoe.moe.layer import tokens_per_expert
from mxmoe.training.step import TrainStep, configure_optimizer, set_lr
from mxmoe.training.trainer import RESUME_MAY_CHANGE, TrainConfig, make_optimizer


@pytest.mark.parametrize("E", [1, 3, 8, 257])
@pytest.mark.parametrize("n", [0, 1, 5, 1000])
def test_tokens_per_expert_equals_bincount(E, n):
    g = torch.Generator().manual_seed(E * 1000 + n)
    experts = torch.randint(0, E, (n, 2) if n else (0, 2), generator=g)
    got = tokens_per_expert(experts, E)
    assert got.dtype == torch.int64 and got.shape == (E,)
    assert torch.equal(got, torch.bincount(experts.reshape(-1), minlength=E))


def _tiny():
    cfg = TrainConfig(batch_size=2, seq_len=16, steps=4, model=ModelConfig(
        d_model=64, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_expert=32, max_seq_len=16))
    torch.manual_seed(0)
    return cfg, MoETransformer(cfg.model, "bf16")


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)


def test_eager_step_is_the_plain_loop():
    """TrainStep on the CPU: forward, backward, clip, AdamW, zero_grad, as the loop was written."""
    cfg, model = _tiny()
    ref = copy.deepcopy(model)
    opt, ref_opt = make_optimizer(model, cfg), make_optimizer(ref, cfg)
    step = TrainStep(model, opt, cfg.grad_clip, torch.device("cpu"), cuda_graph=True)  # ignored on the CPU
    assert not step.graphed
    for i in range(3):
        x, y = _batch(i)
        outs = step(x, y, 1e-3 * (i + 1))
        for gr in ref_opt.param_groups:
            gr["lr"] = 1e-3 * (i + 1)
        out = ref(x, y)
        out.loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.grad_clip)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert outs.ce_loss.item() == out.ce_loss.item() and outs.grad_norm.item() == norm.item()
        assert outs.ce_loss.grad_fn is None  # detached: the step's autograd graph is not kept alive
        assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_capturable_optimizer_needs_cuda():
    cfg, model = _tiny()
    with pytest.raises(ValueError, match="CUDA"):
        configure_optimizer(make_optimizer(model, cfg), torch.device("cpu"), capturable=True)


def test_graph_mode_checkpoint_loads_into_an_eager_run():
    """A checkpoint written by a graphed run (lr as a tensor, capturable, device step counts)
    resumes in an eager run exactly as that run's own checkpoint would."""
    cfg, model = _tiny()
    opt = make_optimizer(model, cfg)
    step = TrainStep(model, opt, cfg.grad_clip, torch.device("cpu"), cuda_graph=False)
    step(*_batch(0), 1e-3)
    state = copy.deepcopy(opt.state_dict())
    graph_like = copy.deepcopy(state)  # what a graphed run saves (its device is the CPU here)
    for g in graph_like["param_groups"]:
        g["lr"], g["capturable"] = torch.tensor(g["lr"]), True
    runs = []
    for saved in (state, graph_like):
        m = copy.deepcopy(model)
        o = make_optimizer(m, cfg)
        o.load_state_dict(saved)
        s = TrainStep(m, o, cfg.grad_clip, torch.device("cpu"), cuda_graph=True)
        assert all(isinstance(g["lr"], float) and not g["capturable"] for g in o.param_groups)
        runs.append([s(*_batch(i), 1e-3).ce_loss.item() for i in range(1, 4)] + [list(m.parameters())])
    assert runs[0][:3] == runs[1][:3]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][3], runs[1][3]))


def test_set_lr_writes_tensors_in_place():
    cfg, model = _tiny()
    opt = make_optimizer(model, cfg)
    t = torch.tensor(0.0)
    opt.param_groups[0]["lr"] = t
    set_lr(opt, 0.25)
    assert opt.param_groups[0]["lr"] is t and t.item() == 0.25 and opt.param_groups[1]["lr"] == 0.25


def test_cli_flag_and_resume():
    args = build_parser().parse_args(["train", "--no-cuda-graph"])
    assert config_from_args(args, 256).cuda_graph is False
    assert config_from_args(build_parser().parse_args(["train"]), 256).cuda_graph is True
    assert "cuda_graph" in RESUME_MAY_CHANGE  # a speed setting: a resumed run may change it
