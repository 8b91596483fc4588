"""The README's main command on the CPU: ``mxmoe train --recipe mxfp8`` (the default model,
200 steps of 16 x 256 byte tokens, evaluation every 50 steps), run as a user runs it, in a
new process per case, with the machine idle and with one core kept busy by another
process.

Cases, each the whole command with its defaults (activation dtype and thread count chosen
by mxmoe at start-up, :func:`mxmoe.train.trainer.default_activation_dtype` and
:func:`mxmoe.train.cpu.set_threads_for_free_cores`):

- ``native``: the CPU as it is;
- ``avx2``: the same CPU with its AVX-512 switched off for torch
  (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``: ATen's kernels and oneDNN's
  matmuls then run the AVX2 code an AVX2-only CPU runs), standing in for an AVX2-only CPU;

each idle and with one core busy (a Python busy loop in another process for the whole
run). The baseline of a busy case is the idle case on the same ISA ("x idle" = busy
ms/step / idle ms/step; the bound asked is 2.5; in the JSON rows the ratio is its inverse, idle / busy); ``--with-old-threads`` adds, per ISA, a
busy run with ``OMP_NUM_THREADS`` at the core count (torch's own default, what mxmoe did
before choosing threads), ``--old-threads-steps`` steps long.

Reported per case: wall seconds of the whole command, median ms/step over steps 5 and
later, the last validation loss, and the dtype and thread lines mxmoe printed.

    python3 benchmarks/cpu_train.py [--cases native,avx2] [--steps 200] [--with-old-threads]
    python3 benchmarks/cpu_train.py --smoke        # a tiny model, 3 steps: the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

SUBJECT = "cpu_train"
ISAS = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
SMOKE_FLAGS = ["--width", "64", "--layers", "1", "--heads", "2", "--experts", "4", "--top-k", "2",
               "--expert-width", "64", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1",
               "--eval-interval", "2", "--warmup-steps", "1"]
SPIN = "while True:\n    pass\n"


def run_case(name: str, env_extra: dict[str, str], busy: bool, steps: int, smoke: bool, workdir: Path) -> dict:
    """Run the README command once in a new process; returns the case's figures."""
    out = workdir / name
    cmd = [sys.executable, "-m", "mxmoe", "train", "--recipe", "mxfp8", "--out-dir", str(out), "--no-progress",
           "--steps", str(steps), *(SMOKE_FLAGS if smoke else [])]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(env_extra)
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    try:
        time.sleep(1.0 if busy else 0.0)  # the busy loop is running when mxmoe samples the cores
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if proc.returncode != 0:
        raise SystemExit(f"{name}: mxmoe train exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ms = [m["ms_per_step"] for m in lines if m["kind"] == "train" and m["step"] >= (1 if smoke else 5)]
    val = [m["val_loss"] for m in lines if m["kind"] == "eval"]
    notes = [line for line in proc.stdout.splitlines() if line.startswith(("activation dtype", "CPU threads"))]
    return {"case": name, "busy_core": busy, "env": env_extra, "steps": steps, "wall_s": wall,
            "ms_per_step": statistics.median(ms), "last_val_loss": val[-1] if val else None, "log": notes}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="native,avx2", help=f"comma-separated, from {', '.join(ISAS)}")
    p.add_argument("--steps", type=int, default=200, help="steps per run (default: the README's %(default)s)")
    p.add_argument("--with-old-threads", action="store_true",
                   help="also a busy run per ISA with OMP_NUM_THREADS = the core count (torch's default)")
    p.add_argument("--old-threads-steps", type=int, default=30, help="steps of those runs (default: %(default)s)")
    harness.add_common_args(p, timing=None)
    args = p.parse_args()
    names = args.cases.split(",")
    if unknown := [n for n in names if n not in ISAS]:
        p.error(f"unknown case(s) {unknown}; use {', '.join(ISAS)}")
    steps = 3 if args.smoke else args.steps
    env = harness.environment()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            for busy in (False, True):
                label = f"{name}, {'one core busy' if busy else 'idle'}"
                runs.append(run_case(label, ISAS[name], busy, steps, args.smoke, Path(tmp)))
                print(f"{label}: {runs[-1]['wall_s']:.0f} s, {runs[-1]['ms_per_step']:.0f} ms/step", flush=True)
            if args.with_old_threads:
                label = f"{name}, one core busy, OMP_NUM_THREADS={cores}"
                runs.append(run_case(label, {**ISAS[name], "OMP_NUM_THREADS": str(cores)}, True,
                                     3 if args.smoke else args.old_threads_steps, args.smoke, Path(tmp)))
    idle = {r["case"].split(",")[0]: r["ms_per_step"] for r in runs if not r["busy_core"]}
    for r in runs:
        r["x_idle"] = r["ms_per_step"] / idle[r["case"].split(",")[0]]
    body = [[r["case"], str(r["steps"]), harness.fmt(r["wall_s"], ".0f"), harness.fmt(r["ms_per_step"], ".0f"),
             harness.fmt(r["x_idle"], ".2f"), harness.fmt(r["last_val_loss"], ".3f"),
             "; ".join(s.split("(")[0].strip() for s in r["log"])] for r in runs]
    timing = f"{cpu}, {cores} cores; each case the whole command in a new process, median ms/step of steps >= 5"
    print(harness.title(SUBJECT, env, args, timing=timing))
    print(harness.format_table(["case", "steps", "wall s", "ms/step", "x idle", "last val loss", "chosen"], body))
    rows = [harness.Row(case=r["case"], shape=f"{r['steps']} steps", us=r["ms_per_step"] * 1e3,
                        baseline_us=idle[r["case"].split(",")[0]] * 1e3, note="; ".join(r["log"]),
                        extra={k: r[k] for k in ("wall_s", "last_val_loss", "busy_core", "env", "x_idle")})
            for r in runs]
    harness.write_results(SUBJECT, args, env, rows, extra={"cpu": cpu, "cores": cores, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
