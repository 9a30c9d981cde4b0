#!/usr/bin/env python3
"""Runs the target benchmarks of softverbs-perf in --loopback mode (two processes, RoCEv2 over UDP
on lo) and prints every run and the medians.

    crates/perf/scripts/targets.py [-n RUNS] [--max-others PCT] [-- extra softverbs-perf options]

On a small shared machine other work skews the figures, so each run is timed against the
machine's CPU counters: a run during which other processes kept more than --max-others percent
of the machine busy is reported, marked "noisy" and repeated (at most 3 * RUNS attempts); the
medians are over quiet runs only (or over all runs if too few were quiet).
"""
import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BIN = os.path.join(ROOT, "target", "release", "softverbs-perf")

# name, {figure: CSV column (0-based)}, options
TARGETS = [
    ("write BW 64 KiB, 1 QP", {"BW average [Gb/s]": 3, "BW peak [Gb/s]": 2}, ["--test", "write", "--bw", "-s", "65536"]),
    ("send ping-pong 8 B", {"one-way typical [us]": 4, "one-way min [us]": 2, "one-way avg [us]": 5},
     ["--test", "send", "--lat", "-s", "8"]),
    ("write 64 B, 4 QPs", {"message rate [Mmsg/s]": 4}, ["--test", "write", "--bw", "-s", "64", "-q", "4"]),
    ("idle 5 s", {"client CPU [% of a core]": 1, "server CPU [% of a core]": 2}, ["--idle-cpu", "5"]),
]


def cpu_times():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return sum(v), v[3] + v[4]  # total, idle + iowait


def busy_now(interval=0.5):
    t1, i1 = cpu_times()
    time.sleep(interval)
    t2, i2 = cpu_times()
    return 100.0 * ((t2 - t1) - (i2 - i1)) / max(t2 - t1, 1)


def run_once(opts):
    """Runs one benchmark; returns (CSV row, percent of the machine other processes used)."""
    for _ in range(60):  # wait (up to ~30 s) for a quiet moment
        if busy_now() < 15:
            break
    hz = os.sysconf("SC_CLK_TCK")
    ncpu = os.cpu_count() or 1
    t1, i1 = cpu_times()
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([BIN, "--loopback", *opts, "--csv"], capture_output=True, text=True,
                         env={**os.environ, "SOFTVERBS_INTERFACES": os.environ.get("SOFTVERBS_INTERFACES", "lo")})
    r2 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t2, i2 = cpu_times()
    if out.returncode != 0:
        sys.exit(f"softverbs-perf {' '.join(opts)} failed:\n{out.stderr}")
    mine = (r2.ru_utime - r1.ru_utime) + (r2.ru_stime - r1.ru_stime)
    busy = ((t2 - t1) - (i2 - i1)) / hz
    wall = (t2 - t1) / hz / ncpu
    others = max(0.0, busy - mine) / max(wall * ncpu, 1e-9) * 100
    return out.stdout.strip().splitlines()[-1], others


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--runs", type=int, default=5)
    ap.add_argument("--max-others", type=float, default=10.0)
    ap.add_argument("--only", help="run only targets whose name contains this")
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "softverbs-perf"], cwd=ROOT, check=True)
    for name, cols, opts in TARGETS:
        if a.only and a.only not in name:
            continue
        quiet, noisy = [], []
        attempts = 0
        while len(quiet) < a.runs and attempts < 3 * a.runs:
            attempts += 1
            row, others = run_once(opts + a.extra)
            ok = others <= a.max_others
            (quiet if ok else noisy).append([float(x) for x in row.split(",")])
            print(f"  {name}: {row}   (others: {others:4.1f}%{'' if ok else ', noisy'})", flush=True)
        rows = quiet if len(quiet) >= max(1, a.runs // 2) else quiet + noisy
        print(f"{name} ({' '.join(opts + a.extra)}): {len(rows)} runs ({len(quiet)} quiet, {len(noisy)} noisy)")
        for fig, col in cols.items():
            print(f"    median {fig}: {statistics.median(r[col] for r in rows):.4g}")
        print(flush=True)


if __name__ == "__main__":
    main()
