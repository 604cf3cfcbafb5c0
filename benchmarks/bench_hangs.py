"""Hang tooling speed: %dist_stacks on blocked ranks, collective-tracking cost, time to a hang report.

    python benchmarks/bench_hangs.py [--nproc 8] [--out benchmarks/results/hangs.json]

* stacks: median latency of ``pool.stacks()`` over 8 ranks, 7 blocked in an all_reduce that the
  8th never joins (target ≤ 50 ms; py-spy on 8 PIDs takes 0.1–0.2 s here).
* tracking: a 2-rank DDP loop (8 Linear layers, 64- and 1024-wide) with the Flight Recorder, distnb's
  collective log, on (default) and off (TORCH_FR_BUFFER_SIZE=0) in two pools alive together, runs
  alternated, the median paired ratio with its quartiles; the cost per collective of a tiny
  all_reduce on one rank (recorder alone, and with the control thread's pushes); and the estimate
  collectives per step × cost per collective ÷ step time (target < 3% on the DDP step).
* hang report: from the start of a rank-conditional all_reduce to the diagnosis, at default settings
  (the magic checks once a second after hang_after = 3 s; target ≤ 5 s).
* watch (``--only-watch``, ~1 min): the cost of each rank pushing its new Flight Recorder entries
  within ~50 ms of a collective — a look at the groups' sequence numbers (µs), a recorder read by
  the number of entries it holds (ms), and the DDP loop with the pushes on and off, interleaved in
  one pool (``DISTNB_FR_WATCH=0`` turns them off for a whole pool).
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


WATCH_PROBE = """
import threading
from distnb.worker.torch_hooks.flight_recorder import SeqWatch, read_collectives, CellClock
def _control():
    return next(t for t in threading.enumerate() if t.name == "distnb-control")
def look_us(n=20000):
    w = SeqWatch(); w.snapshot()
    t = time.perf_counter()
    for _ in range(n):
        w.snapshot()
    return (time.perf_counter() - t) / n * 1e6
def read_ms(n=10):
    t = time.perf_counter()
    for _ in range(n):
        read_collectives(-1, CellClock())
    return (time.perf_counter() - t) / n * 1e3
def watched(on, fn, *args):
    c = _control()
    c.seqs = SeqWatch() if on else None  # the control thread's next look sees the switch
    time.sleep(0.1)
    d0, s0 = c.watch_dumps, c.watch_seconds
    t = time.perf_counter(); out = fn(*args); wall = time.perf_counter() - t
    return (out, c.watch_dumps - d0, (c.watch_seconds - s0) / wall * 100)
"""


def watch_cost(rounds: int = 3) -> dict[str, object]:
    """What the control thread's pushes cost on a 2-rank pool: a look, a recorder read by the
    entries it holds, and the DDP loop with the pushes on and off, interleaved in one pool (this
    machine's run-to-run noise between pools is ±20%)."""
    out: dict[str, object] = {}
    with distnb.Pool(nproc=2, backend="gloo") as pool:
        pool.run(DDP_BENCH)
        pool.run(WATCH_PROBE)
        out["look_us"] = float(pool.run("look_us()").values[0] or "nan")
        out["read_ms_by_entries"] = {}
        for n in (50, 500, 2000):  # the recorder keeps the last 2000 (TORCH_FR_BUFFER_SIZE)
            pool.run(f"per_collective({n})")
            out["read_ms_by_entries"][n] = float(pool.run("read_ms()").values[0] or "nan")
        rows: dict[str, list[tuple[float, int, float]]] = {f"{m}{w}": [] for m in ("on", "off") for w in (64, 1024)}
        for i in range(rounds):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):  # alternate: load drifts
                r = pool.run(f"(watched({mode == 'on'}, bench, 64, 300), watched({mode == 'on'}, bench, 1024, 10))", timeout=600)
                assert r.ok, r.text()
                w64, w1024 = eval(r.values[0])  # noqa: S307 - our own tuple of numbers
                rows[f"{mode}64"].append(w64)
                rows[f"{mode}1024"].append(w1024)
        for width in (64, 1024):
            on, off = rows[f"on{width}"], rows[f"off{width}"]
            step_on, step_off = statistics.median(x[0] for x in on), statistics.median(x[0] for x in off)
            out[f"ddp{width}"] = {
                "step_ms_on": step_on * 1e3, "step_ms_off": step_off * 1e3, "overhead_pct": (step_on / step_off - 1) * 100,
                "reads_per_run": statistics.median(x[1] for x in on), "read_share_pct": statistics.median(x[2] for x in on),
            }
    return out


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


def _paired(pools: dict[str, distnb.Pool], code: str, rounds: int) -> dict[str, list]:
    """Run ``code`` on each pool in turn, ``rounds`` times, alternating which goes first: both
    pools live through the same drift of this machine's load, so their ratio per round is fair
    (separate pools started one after the other differ by ±20% here)."""
    out: dict[str, list] = {name: [] for name in pools}
    for i in range(rounds):
        for name in (list(pools) if i % 2 == 0 else list(reversed(pools))):
            r = pools[name].run(code, timeout=600)
            assert r.ok, r.text()
            out[name].append(eval(r.values[0]))  # noqa: S307 - our own numbers
    return out


def _ratio_stats(on: list[float], off: list[float]) -> dict[str, float]:
    pct = sorted((a / b - 1) * 100 for a, b in zip(on, off))
    q = lambda f: pct[min(len(pct) - 1, int(round(f * (len(pct) - 1))))]  # noqa: E731
    return {"on": statistics.median(on), "off": statistics.median(off),
            "overhead_pct_median": statistics.median(pct), "overhead_pct_q25": q(0.25), "overhead_pct_q75": q(0.75)}


def tracking_cost(rounds: int) -> dict[str, object]:
    """The Flight Recorder (distnb's collective log) on vs off (TORCH_FR_BUFFER_SIZE=0): the DDP
    loop on 2 ranks (64- and 1024-wide), and a tiny all_reduce on 1 rank for the cost per
    collective; plus the estimate collectives-per-step × cost-per-collective ÷ step time."""
    out: dict[str, object] = {"rounds": rounds}
    off = {"TORCH_FR_BUFFER_SIZE": "0"}
    # One rank, a tiny all_reduce in a loop: the recorder alone, and with the control thread's
    # pushes (DISTNB_FR_WATCH, on by default), against no recorder; three pools interleaved.
    with (distnb.Pool(nproc=1, backend="gloo") as full, distnb.Pool(nproc=1, backend="gloo", env={"DISTNB_FR_WATCH": "0"}) as rec,
          distnb.Pool(nproc=1, backend="gloo", env=off) as none):
        for p in (full, rec, none):
            p.run(DDP_BENCH)
        solo = _paired({"default": full, "recorder_only": rec, "off": none}, "per_collective(20000)", rounds)
        diff = {k: statistics.median((a - b) * 1e6 for a, b in zip(solo[k], solo["off"])) for k in ("default", "recorder_only")}
        per_coll_us = diff["default"]
        out["one_rank_all_reduce_us"] = {**{k: statistics.median(v) * 1e6 for k, v in solo.items()},
                                         "per_collective_us": per_coll_us, "recorder_only_per_collective_us": diff["recorder_only"]}
    with distnb.Pool(nproc=2, backend="gloo") as on2, distnb.Pool(nproc=2, backend="gloo", env=off) as off2:
        for p in (on2, off2):
            p.run(DDP_BENCH)
        # Collectives one DDP step issues, read from the recorder itself.
        counts = on2.run("from distnb.worker.torch_hooks.flight_recorder import read_collectives, CellClock\n"
                         "def _n(): return max((e['id'] for e in read_collectives(-1, CellClock())['entries']), default=0)\n"
                         "def per_step(width):\n    a = _n(); bench(width, 20); return (_n() - a) / 25\n"
                         "(per_step(64), per_step(1024))")
        per_step = eval(counts.values[0])  # noqa: S307
        for width, steps in ((64, 300), (1024, 10)):
            rows = _paired({"on": on2, "off": off2}, f"bench({width}, {steps})", rounds)
            stats = _ratio_stats(rows["on"], rows["off"])
            n = per_step[0 if width == 64 else 1]
            step_off_us = stats["off"] * 1e6
            stats.update(step_ms_on=stats.pop("on") * 1e3, step_ms_off=stats.pop("off") * 1e3, collectives_per_step=n,
                         estimate_pct=n * per_coll_us / step_off_us * 100)
            out[f"ddp{width}"] = stats
    return out


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
        ip.run_cell_magic("on_ranks", "--timeout 10 --keep-going", "x = torch.ones(2)\nif rank == 0:\n    dist.all_reduce(x)")
    ip.run_line_magic("dist_shutdown", "")
    assert err.first is not None, err.getvalue()
    return err.first - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "hangs.json"))
    parser.add_argument("--only-tracking", action="store_true")
    parser.add_argument("--only-watch", action="store_true")
    args = parser.parse_args()
    if args.only_tracking:
        print(json.dumps(tracking_cost(args.rounds)))
        return
    if args.only_watch:
        print(json.dumps(watch_cost(args.rounds), indent=1))
        return
    out: dict[str, object] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": sys.version.split()[0]}
    out["stacks"] = stacks_latency(args.nproc)
    print(json.dumps(out["stacks"]), flush=True)
    out["hang_report_s"] = hang_report_time()
    print(json.dumps({"hang_report_s": out["hang_report_s"]}), flush=True)
    out["tracking"] = tracking_cost(args.rounds)
    print(json.dumps(out["tracking"]), flush=True)
    out["watch"] = watch_cost(args.rounds)
    print(json.dumps(out["watch"]), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
