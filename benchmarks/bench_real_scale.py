"""A real pool at scale on one machine: 64 ranks on 8 simulated nodes (``local_nodes``), gloo.
Launch time (and per rank), a trivial cell, an all_reduce cell, the hang diagnosis when one rank
skips the all_reduce, and shutdown; each rank's memory and the machine's peak. Optionally a
smaller layout beside it for comparison (``--layouts 8x8,2x8``: NODESxRANKS_PER_NODE).

    python benchmarks/bench_real_scale.py [--layouts 8x8] [--cells 20] [--out benchmarks/results/real_scale.json]

Spare rank processes are off (``spares=False``): a spare is a second Python with torch per rank,
which would double the torch processes (64 more here) and not fit in memory beside the ranks on a
small machine. Reported, not asserted: figures go to stdout and a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time

import distnb
from distnb import _processes

ALL_REDUCE = "sr_x = torch.ones(1) * rank; dist.all_reduce(sr_x); int(sr_x.item())"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def mem_available_mib() -> float:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class MemoryWatch:
    """The least MemAvailable seen, sampled every 0.2 s on a thread, against the figure at the start."""

    def __init__(self) -> None:
        self.start = self.low = mem_available_mib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.low = min(self.low, mem_available_mib())

    def stop(self) -> float:
        """MiB the run took at its peak."""
        self._stop.set()
        self._thread.join()
        return self.start - self.low


def process_memory(pid: int) -> dict[str, float]:
    """RSS, PSS (shared pages split among the processes sharing them) and private MiB."""
    out: dict[str, float] = {}
    for line in _read(f"/proc/{pid}/smaps_rollup").splitlines():
        parts = line.split()
        if parts and parts[0] in ("Rss:", "Pss:", "Private_Clean:", "Private_Dirty:"):
            out[parts[0][:-1]] = int(parts[1]) / 1024
    return {"rss": out.get("Rss", 0.0), "pss": out.get("Pss", 0.0),
            "private": out.get("Private_Clean", 0.0) + out.get("Private_Dirty", 0.0)}


def descendants() -> list[int]:
    table = _processes.process_table()
    children: dict[int, list[int]] = {}
    for pid, entry in table.items():
        children.setdefault(entry.ppid, []).append(pid)
    found, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kind_of(pid: int) -> str:
    cmd = _read(f"/proc/{pid}/cmdline").replace("\0", " ")
    # torchrun's command line names the supervisor it runs: it is looked for first.
    for needle, kind in (("torch.distributed.run", "torchrun"), ("distnb.worker.process.rank", "rank"), ("-m distnb.worker", "supervisor"),
                         ("distnb.node", "node_agent")):
        if needle in cmd:
            return kind
    return "other"


def memory_by_kind() -> dict[str, dict[str, float]]:
    """Per kind of process (rank, supervisor, torchrun, node agent): count and mean MiB each."""
    by: dict[str, list[dict[str, float]]] = {}
    for pid in descendants():
        m = process_memory(pid)
        if m["rss"]:
            by.setdefault(kind_of(pid), []).append(m)
    return {kind: {"count": len(ms), **{k: round(statistics.mean(m[k] for m in ms), 1) for k in ("rss", "pss", "private")},
                   "pss_total": round(sum(m["pss"] for m in ms), 1)}
            for kind, ms in sorted(by.items())}


def timed_cells(pool: distnb.Pool, code: str, cells: int, check) -> list[float]:
    times = []
    for _ in range(cells):
        t = time.perf_counter()
        res = pool.run(code, timeout=300)
        times.append(time.perf_counter() - t)
        assert res.ok, res.text()
        check(res)
    return times


def bench(nnodes: int, nproc: int, cells: int, start_timeout: float, hang_after: float) -> dict[str, object]:
    world = nnodes * nproc
    row: dict[str, object] = {"nnodes": nnodes, "nproc_per_node": nproc, "world_size": world}
    watch = MemoryWatch()
    t0 = time.perf_counter()
    pool = distnb.launch(nproc=nproc, nnodes=nnodes, local_nodes=True, backend="gloo", spares=False,
                         start_timeout=start_timeout, hang_after=hang_after)
    launch = time.perf_counter() - t0
    row["launch_s"] = launch
    row["launch_per_rank_s"] = launch / world
    try:
        t = time.perf_counter()
        first = pool.run(ALL_REDUCE, timeout=300)
        row["first_all_reduce_s"] = time.perf_counter() - t
        row["launch_to_first_all_reduce_s"] = time.perf_counter() - t0
        total = str(world * (world - 1) // 2)
        assert first.ok and first.values == {r: total for r in range(world)}, first.text()
        for _ in range(3):  # warm-up
            pool.run("1", timeout=300)
        trivial = timed_cells(pool, "1", cells, lambda res: None)
        row["trivial_cell_ms_median"] = statistics.median(trivial) * 1e3
        row["trivial_cell_ms_p90"] = pct(trivial, 0.9) * 1e3
        row["trivial_cell_per_rank_ms"] = statistics.median(trivial) * 1e3 / world

        def same_sum(res: distnb.CellResult) -> None:
            assert set(res.values.values()) == {total}, res.text()

        reduce = timed_cells(pool, ALL_REDUCE, cells, same_sum)
        row["all_reduce_cell_ms_median"] = statistics.median(reduce) * 1e3
        row["all_reduce_cell_ms_p90"] = pct(reduce, 0.9) * 1e3
        row["all_reduce_cell_per_rank_ms"] = statistics.median(reduce) * 1e3 / world
        row["memory_mib"] = memory_by_kind()

        # One rank on the last node skips the all_reduce; the others wait for it.
        odd = world - 3
        t = time.perf_counter()
        hung = pool.submit(f"sr_h = torch.ones(1)\nif rank != {odd}:\n    dist.all_reduce(sr_h)\n")
        diag, calls = None, []
        while time.perf_counter() - t < hang_after + 120:
            c = time.perf_counter()
            diag = pool.diagnose(hung)
            calls.append(time.perf_counter() - c)
            if diag.kind == "hang":
                break
            time.sleep(0.3)
        assert diag is not None and diag.kind == "hang" and diag.culprits == [odd], diag.text() if diag else "no diagnosis"
        row["hang_named_after_s"] = time.perf_counter() - t  # includes the hang_after threshold
        row["diagnose_ms_median"] = statistics.median(calls) * 1e3
        row["diagnose_ms_last"] = calls[-1] * 1e3
        row["diagnose_calls"] = len(calls)
        row["hang_summary"] = diag.summary
        # The odd rank makes its all_reduce in a cell of its own: the hang resolves, no restart.
        t = time.perf_counter()
        rescue = pool.run("dist.all_reduce(sr_h)", ranks=[odd], timeout=300)
        pool.wait(hung, timeout=300)
        row["hang_resolved_s"] = time.perf_counter() - t
        assert rescue.ok and hung.ok, hung.text()
        after = pool.run(ALL_REDUCE, timeout=300)
        assert after.ok and set(after.values.values()) == {total}, after.text()
    finally:
        pids = set(pool.pids()) | set(descendants())
        t = time.perf_counter()
        pool.shutdown()
        row["shutdown_s"] = time.perf_counter() - t
        left = [p for p in pids if _processes.pid_alive(p)]
        row["left_after_shutdown"] = len(left)
        row["peak_memory_mib"] = watch.stop()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", default="8x8", type=lambda s: [tuple(int(x) for x in part.split("x")) for part in s.split(",")],
                        help="NODESxRANKS_PER_NODE, comma-separated (e.g. 8x8,2x8)")
    parser.add_argument("--cells", type=int, default=20)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--hang-after", type=float, default=3.0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "real_scale.json"))
    args = parser.parse_args()
    rows = []
    for nnodes, nproc in args.layouts:
        row = bench(nnodes, nproc, args.cells, args.start_timeout, args.hang_after)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'ranks':>6} {'nodes':>5} {'launch s':>9} {'s/rank':>7} {'trivial ms':>11} {'all_reduce ms':>14} {'hang named s':>13} "
          f"{'diagnose ms':>12} {'shutdown s':>11} {'rank RSS/PSS MiB':>17} {'peak MiB':>9}")
    for r in rows:
        rank_mem = r["memory_mib"].get("rank", {})  # type: ignore[attr-defined]
        print(f"{r['world_size']:>6} {r['nnodes']:>5} {r['launch_s']:>9.1f} {r['launch_per_rank_s']:>7.2f} "
              f"{r['trivial_cell_ms_median']:>11.1f} {r['all_reduce_cell_ms_median']:>14.1f} {r['hang_named_after_s']:>13.1f} "
              f"{r['diagnose_ms_median']:>12.0f} {r['shutdown_s']:>11.1f} {rank_mem.get('rss', 0):>8.0f}/{rank_mem.get('pss', 0):<8.0f} "
              f"{r['peak_memory_mib']:>9.0f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": f"{platform.machine()}, {os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB",
                   "python": sys.version.split()[0], "torch": _torch_version(), "rows": rows}, f, indent=2)


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


if __name__ == "__main__":
    main()
