"""On the CPU a run takes one thread per core that other processes leave free (measured once
at start-up from /proc/stat), unless OMP_NUM_THREADS or MKL_NUM_THREADS chooses; the log
says which and why."""

from __future__ import annotations

import pytest
import torch

from mxmoe.train import cpu

FLAGS = ["--width", "64", "--layers", "1", "--heads", "2", "--experts", "4", "--top-k", "2", "--expert-width", "64",
         "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--warmup-steps", "1", "--device", "cpu",
         "--no-progress", "--recipe", "bf16", "--steps", "1"]


@pytest.fixture(autouse=True)
def keep_threads(monkeypatch):
    for v in cpu.THREAD_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def fake_machine(monkeypatch, cores: int, busy: float, threads: int) -> None:
    """``cores`` CPUs in the affinity mask, ``busy`` of them kept busy by others; torch at ``threads``."""
    samples = iter([(0, 0), (int(busy * 100), cores * 100)])
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(cpu, "_cpu_times", lambda cpus: next(samples))
    torch.set_num_threads(threads)


# (cores, busy, torch's threads) -> threads chosen
CASES = {"idle": (2, 0.0, 2, 2), "one of two busy": (2, 1.0, 2, 1), "both busy": (2, 2.0, 2, 1),
         "a third busy": (2, 0.3, 2, 2), "most of one busy": (2, 0.7, 2, 1), "8 cores, 3 busy": (8, 3.0, 8, 5),
         "never more than torch's": (8, 0.0, 4, 4)}


@pytest.mark.parametrize("case", CASES)
def test_threads_follow_the_free_cores(monkeypatch, case):
    cores, busy, threads, want = CASES[case]
    fake_machine(monkeypatch, cores, busy, threads)
    note = cpu.set_threads_for_free_cores(sample_s=0)
    assert torch.get_num_threads() == want
    assert note.startswith(f"CPU threads: {want}") and f"{busy:.1f} of {cores} cores busy" in note
    assert "OMP_NUM_THREADS overrides" in note


@pytest.mark.parametrize("variable", cpu.THREAD_VARIABLES)
def test_the_users_thread_count_stands(monkeypatch, variable):
    fake_machine(monkeypatch, 2, 1.0, 2)
    monkeypatch.setenv(variable, "2")
    assert cpu.set_threads_for_free_cores(sample_s=0) is None
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("failure", ["no affinity", "no /proc/stat"])
def test_a_machine_that_does_not_say_keeps_torchs_count(monkeypatch, failure):
    torch.set_num_threads(2)
    if failure == "no affinity":
        def no_affinity(pid):
            raise OSError("not supported")
        monkeypatch.setattr(cpu.os, "sched_getaffinity", no_affinity)
    else:
        monkeypatch.setattr(cpu, "_cpu_times", lambda cpus: None)
    assert cpu.set_threads_for_free_cores(sample_s=0) is None
    assert torch.get_num_threads() == 2


def test_cpu_times_reads_only_the_affinity_cpus(monkeypatch, tmp_path):
    stat = ("cpu  40 0 40 120 0 0 0 0 0 0\ncpu0 10 0 10 30 0 0 0 0 0 0\ncpu1 30 0 30 90 0 0 0 0 0 0\n"
            "intr 1 2 3\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(tmp_path / "stat", *a, **k)
                        if p == "/proc/stat" else real_open(p, *a, **k))
    (tmp_path / "stat").write_text(stat)
    assert cpu._cpu_times({0}) == (20, 50)
    assert cpu._cpu_times({0, 1}) == (80, 200)


def test_mxmoe_train_logs_the_choice(monkeypatch, tmp_path, corpus, capsys):
    from mxmoe.cli import main

    fake_machine(monkeypatch, 2, 1.0, 2)
    assert main(["train", *FLAGS, "--data", str(corpus), "--out-dir", str(tmp_path / "r"), "--dtype", "float32"]) == 0
    assert "CPU threads: 1 of 2 (1.0 of 2 cores busy with other processes" in capsys.readouterr().out
