"""CPU settings a training run picks for the machine it runs on: the number of threads,
from the cores other processes leave free.

A step's matmuls split over torch's intra-op threads (OpenMP), which wait for each other
at the end of every parallel region. With as many threads as cores and another process
busy on one of them, every region waits for the thread that shares its core: on a 2-core
EPYC a step of the default model took 3.0x the idle step with two threads and 1.6x with
one (docs/BENCHMARKS.md, "CPU training"). So a run on the CPU takes one thread per core
left free, measured once at start-up.
"""

from __future__ import annotations

import os
import time

import torch

# environment variables by which the user has chosen the thread count; then it is theirs
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _cpu_times(cpus: set[int]) -> tuple[int, int] | None:
    """(busy, total) jiffies summed over ``cpus`` from /proc/stat, None where unreadable."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(values)
        busy += sum(values) - values[3] - values[4]
    return (busy, total) if total else None


def busy_cores(sample_s: float = 0.3) -> tuple[int, float] | None:
    """The cores this process may run on and how many of them other processes keep busy.

    Reads /proc/stat twice, ``sample_s`` seconds apart, over the CPUs of this process's
    affinity mask (so a container's cpuset counts only its own CPUs); this process sleeps
    in between, so the busy time is other processes'.

    Returns:
        ``(cores, busy)``: cores in the affinity mask and the busy ones (a float, 0.0 to
        ``cores``); None where /proc/stat or the affinity mask is unavailable (not Linux).
    """
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None
    first = _cpu_times(cpus)
    time.sleep(sample_s)
    second = _cpu_times(cpus)
    if first is None or second is None or second[1] <= first[1]:
        return None
    return len(cpus), len(cpus) * (second[0] - first[0]) / (second[1] - first[1])


def set_threads_for_free_cores(sample_s: float = 0.3) -> str | None:
    """Set torch's intra-op threads to the cores other processes leave free (at least one,
    never more than torch would use), unless the user chose a count (``OMP_NUM_THREADS``
    or ``MKL_NUM_THREADS`` set). A core counts as busy when other processes keep it at
    least half busy.

    Returns:
        One line saying what was chosen and why, for the run's log; None when the user's
        setting stands or the machine does not say (not Linux).
    """
    if any(os.environ.get(v) for v in THREAD_VARIABLES):
        return None
    sample = busy_cores(sample_s)
    if sample is None:
        return None
    cores, busy = sample
    current = torch.get_num_threads()
    threads = max(1, min(current, cores - round(busy)))
    if threads == current:
        return f"CPU threads: {threads} ({busy:.1f} of {cores} cores busy with other processes; OMP_NUM_THREADS overrides)"
    torch.set_num_threads(threads)
    return (f"CPU threads: {threads} of {current} ({busy:.1f} of {cores} cores busy with other processes, whose "
            f"threads would wait on them; OMP_NUM_THREADS overrides)")
