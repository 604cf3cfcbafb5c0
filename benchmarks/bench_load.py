"""Load and leaks: 10,000 trivial cells at N = 4, and 50 launch/shutdown cycles.

    python benchmarks/bench_load.py [--cells 10000] [--cycles 50] [--out benchmarks/results/load.json]

Reports controller and worker memory growth and open file descriptors over the cells (target:
under 10 MB growth, no fd growth), and what launch/shutdown cycles leave behind (target: nothing).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import distnb
from distnb import _processes


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cells(n: int) -> dict[str, object]:
    with distnb.Pool(nproc=4, backend="gloo") as pool:
        for _ in range(200):
            pool.run("1")
        pids = {"controller": os.getpid(), **{f"rank {s.rank}": s.pid for s in pool.status().ranks}}
        before = {k: (rss(p), fds(p)) for k, p in pids.items()}
        times = []
        for _ in range(n):
            t = time.perf_counter()
            pool.run("1")
            times.append(time.perf_counter() - t)
        after = {k: (rss(p), fds(p)) for k, p in pids.items()}
    return {
        "cells": n,
        "median_ms": statistics.median(times) * 1e3,
        "rss_growth_mb": {k: (after[k][0] - before[k][0]) / 2**20 for k in pids},
        "fd_growth": {k: after[k][1] - before[k][1] for k in pids},
    }


def cycles(n: int) -> dict[str, object]:
    tmp = tempfile.gettempdir()
    pattern = os.path.join(tmp, f"distnb-{os.getpid()}-*")  # this process's pools only
    dirs_before = set(glob.glob(pattern)) | set(glob.glob(os.path.join(tmp, "torchelastic_*")))
    fd_before = fds(os.getpid())
    pids: list[int] = []
    ports: list[int] = []
    t0 = time.perf_counter()
    for _ in range(n):
        pool = distnb.launch(nproc=2, backend="gloo")
        pids += pool.pids()
        ports.append(int(pool.status().address.rsplit(":", 1)[1]))
        pool.run("x = torch.ones(1); dist.all_reduce(x)")
        pool.shutdown()
    dirs_after = set(glob.glob(pattern)) | set(glob.glob(os.path.join(tmp, "torchelastic_*")))
    return {
        "cycles": n,
        "seconds_per_cycle": (time.perf_counter() - t0) / n,
        "processes_left": [p for p in pids if _processes.pid_alive(p)],
        "temp_dirs_left": sorted(dirs_after - dirs_before),
        "controller_ports_still_listening": sorted(set(ports) & _processes.listening_ports()),
        "controller_fd_growth": fds(os.getpid()) - fd_before,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", type=int, default=10_000)
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "load.json"))
    args = parser.parse_args()
    out = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": sys.version.split()[0]}
    out["cells"] = cells(args.cells)
    print(json.dumps(out["cells"]), flush=True)
    out["cycles"] = cycles(args.cycles) if args.cycles else None
    print(json.dumps(out["cycles"]), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
