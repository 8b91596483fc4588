"""The padded (host-sync-free) dispatch and the MXFP8 combine gradient of the expert-parallel
MoE layer, on the CPU with gloo, 2 and 4 processes (``ep_dispatch_worker.py`` per rank).

Tolerances: layer output, input gradient and expert weight gradients are **bit-exact**
against one process (same seed and global batch) for the padded and the host-splits
dispatch, the worst-case capacity hit by a skewed routing, and the MXFP8 combine
gradient with a frozen w2. The router weight gradient is a float32 sum partial per rank,
then all-reduced: reassociation only (allowed 1e-6, as test_expert_parallel.py).

Capacity overflow (capacity factor 0.75, every token routed to one rank): the dropped rows
reported by the layer equal a count made here from the routing, and the output equals one
process in which the dropped assignments contribute nothing (their combine weight zeroed),
bit for bit; the gradients are those of a capacity-factor MoE and are not compared.

Overlap: with a shared expert, the combine all-to-all is issued with ``async_op=True`` and
the shared expert runs before the wait, forward and backward; the order is logged and the
results are bit-identical to the layer without overlap.

Host sync: :class:`ep_dispatch_worker.HostSyncRecorder` records, during forward and
backward, every op that would make the host wait for a CUDA device; the padded dispatch
must record none, and the host-splits dispatch (which reads its split sizes) must record
some (the check can fail).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "ep_dispatch_worker.py"
WORKER_TIMEOUT_S = 240
ROUTER_TOL = 1e-6
TOKENS, K, D, E = 40, 2, 64, 8
MODES = ["modes_mxfp8", "modes_mxfp8_mx_dispatch", "modes_bf16"]


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def group(request, tmp_path_factory):
    P = request.param
    out = tmp_path_factory.mktemp(f"epd{P}")
    (out / "task.json").write_text(json.dumps({"out": str(out)}))
    results = run_ranks(WORKER, out / "task.json", P, out, WORKER_TIMEOUT_S)
    return P, results


def _exact(c: dict, where: str) -> None:
    assert c["y_equal"], f"{where}: output differs from one process"
    assert c["dx_equal"], f"{where}: input gradient differs"
    assert c["experts_equal"], f"{where}: expert weight gradients differ"
    assert c["router_rel"] <= ROUTER_TOL, f"{where}: router gradient {c['router_rel']:.2e}"


@pytest.mark.parametrize("case", MODES)
@pytest.mark.parametrize("mode", ["padded", "host-splits"])
def test_both_dispatch_modes_match_single_process(group, case, mode):
    P, results = group
    for rank, res in enumerate(results):
        c = res[case][mode]
        _exact(c, f"P={P} rank {rank} {case} {mode}")
        # the fused path sends each row's combine weight too (one float), and its gradient back
        weights = ["weights", "weights.grad"] if "mxfp8" in case else []
        assert c["dropped"] == 0 and c["kinds"] == ["combine", "combine.grad", "counts", "dispatch",
                                                   "dispatch.grad"] + weights


@pytest.mark.parametrize("case", MODES)
def test_padded_dispatch_does_not_sync_with_the_host(group, case):
    P, results = group
    for rank, res in enumerate(results):
        assert res[case]["padded"]["sync_events"] == [], (P, rank, res[case]["padded"]["sync_events"])
        # the recorder sees the host-splits dispatch's reads: the check can fail
        assert {"Tensor.tolist", "Tensor.cpu"} <= set(res[case]["host-splits"]["sync_events"])


@pytest.mark.parametrize("case", MODES)
def test_dispatch_bytes(group, case):
    """Padded: P buffers of C = T * min(k, L) rows; host-splits: exactly the T * k routed rows."""
    P, results = group
    row = 66 if case == "modes_mxfp8_mx_dispatch" else 2 * D  # MXFP8: D codes + D / 32 scales
    for res in results:
        assert res[case]["padded"]["dispatch_bytes_total"] == P * TOKENS * min(K, E // P) * row
        assert res[case]["host-splits"]["dispatch_bytes_total"] == TOKENS * K * row


def test_skewed_routing_fills_the_worst_case_capacity_exactly(group):
    P, results = group
    for rank, res in enumerate(results):
        c = res["skewed_exact"]
        assert c["capacity"] == TOKENS * K and c["rows_to_last_rank"] == c["capacity"]  # the bound is reached
        assert c["dropped"] == 0 == c["dropped_expected"]
        _exact(c, f"P={P} rank {rank} skewed")


def test_capacity_overflow_is_counted_and_drops_whole_assignments(group):
    P, results = group
    for rank, res in enumerate(results):
        c = res["skewed_capacity"]
        assert c["capacity"] < TOKENS * K
        assert c["dropped"] == c["dropped_expected"] > 0  # the same on every rank (global count)
        assert c["y_equals_single_without_dropped"], f"P={P} rank {rank}"
        assert not c["y_equal"]  # it is not the dropless layer


@pytest.mark.parametrize("case", ["mx_backward_frozen_w2", "mx_backward_floor_frozen_w2"])
def test_mxfp8_combine_gradient_with_frozen_w2_is_exact(group, case):
    P, results = group
    for rank, res in enumerate(results):
        c = res[case]
        _exact(c, f"P={P} rank {rank} {case}")
        assert c["mx_backward"] and c["w13_has_grad"] and c["same_as_bf16_wire"]
        assert c["combine_grad_bytes_total"] == c["combine_bytes_total"] * 66 // (2 * D)


def test_mxfp8_combine_gradient_stays_bf16_while_w2_trains(group):
    """w2 trains: the layer keeps the gradient in bf16 (exact); forcing MXFP8 changes w2's
    weight gradient (its wgrad quantizes the gradient along tokens, needing unrounded rows),
    not the forward: the reason the rule exists."""
    P, results = group
    for rank, res in enumerate(results):
        c = res["mx_backward_trained_w2"]
        _exact(c, f"P={P} rank {rank} trained w2")
        assert c["mx_backward"] is False and c["combine_grad_bytes_total"] == c["combine_bytes_total"]
        assert c["forced_y_equal"]
    # some rank's w2 gradient changes (a rank whose experts' token blocks hold no outlier row may not)
    assert not all(res["mx_backward_trained_w2"]["forced_w2_equal"] for res in results)


@pytest.mark.parametrize("case", ["overlap_padded", "overlap_host_splits"])
def test_shared_expert_runs_while_the_combine_is_in_flight(group, case):
    """Forward: combine issued, shared expert, wait; backward: the combine's gradient
    issued, the shared expert's backward, wait. Bit-identical to the layer without overlap."""
    P, results = group
    for rank, res in enumerate(results):
        c = res[case]
        assert c["overlapped"] and c["plain_overlapped"] is False
        assert c["events"] == ["issue combine", "shared forward", "wait combine",
                               "issue combine.grad", "shared backward", "wait combine.grad"], (P, rank, c["events"])
        assert c["same_as_without_overlap"], f"P={P} rank {rank} {case}"
