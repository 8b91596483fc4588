"""benchmarks/ep_scaling_model.py (the DeepSeek-V3 scaling model of docs/EXPERT_PARALLEL.md):
it runs, writes its JSON, and its numbers match a hand computation of the 8- and 64-GPU rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_scaling_model_runs_and_matches_hand_arithmetic(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ep_scaling_model.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "| 1024 | 256x4 |" in proc.stdout
    rows = {r["gpus"]: r for r in json.loads((tmp_path / "ep_scaling_model.json").read_text())["rows"]}
    assert sorted(rows) == [8, 16, 32, 64, 128, 256, 512, 1024]
    r8 = rows[8]  # one node: 8192 tokens x 8 choices, 7/8 leave the GPU, all over NVLink at 153 GB/s
    remote = 8192 * 8 * 7 / 8
    assert r8["a2a_mb_bf16"] == pytest.approx(remote * 14336 / 1e6)
    assert r8["a2a_mb_mxfp8"] == pytest.approx(remote * (7168 + 224) / 1e6)
    assert r8["a2a_ms_bf16"] == pytest.approx(remote * 14336 / 153e9 * 1e3)
    assert r8["padding_factor_worst_case"] == 8  # 8 ranks x min(8, 32 local experts) / 8
    gemm_flops = 18 * 7168 * 2048 * (8192 * 8 + 8192)
    assert r8["layer_compute_ms"] == pytest.approx(gemm_flops / 450e12 * 1e3)
    r64 = rows[64]  # 8 nodes: 7 of 63 peers on NVLink, 56 over InfiniBand at 43 GB/s (the bound)
    remote = 8192 * 8 * 63 / 64
    assert r64["a2a_ms_bf16"] == pytest.approx(remote * 56 / 63 * 14336 / 43e9 * 1e3)
    assert r64["padding_factor_worst_case"] == 32  # 64 x min(8, 4) / 8
