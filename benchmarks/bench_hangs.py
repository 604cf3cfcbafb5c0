"""Hang tooling speed: %dist_stacks on blocked ranks, collective-tracking cost, time to a hang report.

    python benchmarks/bench_hangs.py [--nproc 8] [--out benchmarks/results/hangs.json]

* stacks: median latency of ``pool.stacks()`` over 8 ranks, 7 blocked in an all_reduce that the
  8th never joins (target ≤ 50 ms; py-spy on 8 PIDs takes 0.1–0.2 s here).
* tracking: a 2-rank DDP loop (8 Linear layers, 64- and 1024-wide) with the Flight Recorder, distnb's
  collective log, on (default) and off (TORCH_FR_BUFFER_SIZE=0), interleaved; and the cost per
  collective of a tiny all_reduce (target < 3% on the DDP step).
* hang report: from the start of a rank-conditional all_reduce to the diagnosis, at default settings
  (the magic checks once a second after hang_after = 3 s; target ≤ 5 s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import distnb

DDP_BENCH = """
import time, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
def bench(width, steps):
    torch.manual_seed(0)
    m = DDP(nn.Sequential(*[nn.Linear(width, width) for _ in range(8)]))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(32, width)
    for _ in range(5):
        opt.zero_grad(); m(x).sum().backward(); opt.step()
    ts = []
    for _ in range(steps):
        t = time.perf_counter(); opt.zero_grad(); m(x).sum().backward(); opt.step(); ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]
def per_collective(n):
    x = torch.ones(4)
    for _ in range(50):
        dist.all_reduce(x)
    t = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x)
    return (time.perf_counter() - t) / n
"""


def stacks_latency(nproc: int, repeats: int = 30) -> dict[str, float]:
    with distnb.Pool(nproc=nproc, backend="gloo") as pool:
        pool.submit(f"x = torch.ones(1)\nif rank != {nproc - 1}:\n    dist.all_reduce(x)\n")
        time.sleep(1.0)
        pool.stacks()  # warm-up
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            report = pool.stacks()
            ts.append(time.perf_counter() - t)
        assert "all_reduce" in report.text()
    return {"nproc": nproc, "median_ms": statistics.median(ts) * 1e3, "p90_ms": sorted(ts)[int(0.9 * (len(ts) - 1))] * 1e3}


def tracking_cost(rounds: int) -> dict[str, object]:
    rows: dict[str, list[float]] = {"on64": [], "off64": [], "on1024": [], "off1024": [], "on_coll": [], "off_coll": []}
    for _ in range(rounds):
        for mode, env in (("on", {}), ("off", {"TORCH_FR_BUFFER_SIZE": "0"})):
            with distnb.Pool(nproc=2, backend="gloo", env=env) as pool:
                pool.run(DDP_BENCH)
                r = pool.run("(bench(64, 300), bench(1024, 20), per_collective(2000))", timeout=600)
                assert r.ok, r.text()
                s64, s1024, coll = eval(r.values[0])  # noqa: S307 - our own tuple of floats
                rows[f"{mode}64"].append(s64)
                rows[f"{mode}1024"].append(s1024)
                rows[f"{mode}_coll"].append(coll)
    # Per-collective cost is clearest on one rank, where a tiny all_reduce takes ~10 µs.
    rows["on_solo"], rows["off_solo"] = [], []
    for _ in range(rounds):
        for mode, env in (("on", {}), ("off", {"TORCH_FR_BUFFER_SIZE": "0"})):
            with distnb.Pool(nproc=1, backend="gloo", env=env) as pool:
                pool.run(DDP_BENCH)
                r = pool.run("per_collective(20000)", timeout=600)
                rows[f"{mode}_solo"].append(float(r.values[0]))
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "ddp64_ms": {"on": med["on64"] * 1e3, "off": med["off64"] * 1e3, "overhead_pct": (med["on64"] / med["off64"] - 1) * 100},
        "ddp1024_ms": {"on": med["on1024"] * 1e3, "off": med["off1024"] * 1e3, "overhead_pct": (med["on1024"] / med["off1024"] - 1) * 100},
        "tiny_all_reduce_us": {"on": med["on_coll"] * 1e6, "off": med["off_coll"] * 1e6, "per_collective_us": (med["on_coll"] - med["off_coll"]) * 1e6},
        "one_rank_all_reduce_us": {"on": med["on_solo"] * 1e6, "off": med["off_solo"] * 1e6, "per_collective_us": (med["on_solo"] - med["off_solo"]) * 1e6},
        "rounds": rounds,
    }


def hang_report_time() -> float:
    """Seconds from the hang's start to the magic's diagnosis, with default settings."""
    import contextlib
    import io

    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "distnb")
    with contextlib.redirect_stdout(io.StringIO()):
        ip.run_line_magic("dist_launch", "-n 3 --backend gloo")
    err = io.StringIO()

    class Stamped(io.StringIO):
        first: float | None = None

        def write(self, s: str) -> int:
            if "[distnb]" in s and self.first is None:
                self.first = time.perf_counter()
            return super().write(s)

    err = Stamped()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        ip.run_cell_magic("on_ranks", "--timeout 10", "x = torch.ones(2)\nif rank == 0:\n    dist.all_reduce(x)")
    ip.run_line_magic("dist_shutdown", "")
    assert err.first is not None, err.getvalue()
    return err.first - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "hangs.json"))
    parser.add_argument("--only-tracking", action="store_true")
    args = parser.parse_args()
    if args.only_tracking:
        print(json.dumps(tracking_cost(args.rounds)))
        return
    out: dict[str, object] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": sys.version.split()[0]}
    out["stacks"] = stacks_latency(args.nproc)
    print(json.dumps(out["stacks"]), flush=True)
    out["hang_report_s"] = hang_report_time()
    print(json.dumps({"hang_report_s": out["hang_report_s"]}), flush=True)
    out["tracking"] = tracking_cost(args.rounds)
    print(json.dumps(out["tracking"]), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
