"""The exposed-communication arithmetic of benchmarks/expert_parallel.py (its GPU run reads
kernel intervals from a profiler trace; here hand-made intervals)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from expert_parallel import exposed_communication  # noqa: E402


def test_exposed_time_is_the_all_to_all_not_covered_by_compute():
    kernels = [
        ("ncclDevKernel_SendRecv", 0.0, 10.0),      # all-to-all 0-10, compute covers 2-6: 6 us exposed
        ("sm90_xmma_gemm_bf16", 2.0, 5.0),
        ("triton_quantize", 4.0, 6.0),              # overlaps the GEMM: the union counts once
        ("ncclDevKernel_SendRecv", 8.0, 12.0),      # overlaps the first SendRecv: union 0-12
        ("ncclDevKernel_AllReduce_Sum_f32", 20.0, 24.0),  # not an all-to-all; fully exposed
        ("elementwise_kernel", 30.0, 31.0),
    ]
    e = exposed_communication(kernels)
    assert e["a2a_us"] == pytest.approx(12.0)
    assert e["a2a_exposed_us"] == pytest.approx(12.0 - 4.0)
    assert e["nccl_us"] == pytest.approx(16.0) and e["nccl_exposed_us"] == pytest.approx(12.0)
    assert e["compute_us"] == pytest.approx(5.0)
    assert exposed_communication([("ncclDevKernel_SendRecv", 0.0, 3.0), ("gemm", 0.0, 3.0)])["a2a_exposed_us"] == 0
