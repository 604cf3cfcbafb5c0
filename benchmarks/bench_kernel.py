"""The notebook path as a user meets it: a real ipykernel driven through jupyter_client, each cell
timed from its execute_request to the kernel going idle, with the CPU the kernel and everything it
started (ranks, supervisors, torchrun, ipyparallel's engines) spent on it.

In one kernel, one pool of N ranks and (when ipyparallel is installed) an ipyparallel cluster of N
engines; interleaved round-robin, so that this VM's drift hits every kind alike:

- ``x = 1`` — the kernel's own floor;
- ``pool.run("x = 1")`` in a plain cell — the pool's round trip;
- ``%%on_ranks`` — the magic with its view;
- ``%%px --block`` — ipyparallel's peer.

Then: the idle CPU of the pool and of the ipyparallel cluster, a long session of ``%%on_ranks``
cells (live widgets, the kernel's GC-tracked objects and RSS every so often, p99/median), and
``%dist_restart`` (and ``--replay``) times, beside ``%dist_restart --full`` (torchrun started anew,
as every restart did before spares).

    python benchmarks/bench_kernel.py [--ranks 8] [--cells 200] [--session 2000] [--out benchmarks/results/kernel.json]

Reported, not asserted: figures go to stdout and the JSON file; README.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

CLK = os.sysconf("SC_CLK_TCK")


def tree(root: int) -> set[int]:
    """``root`` and every process descended from it."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                frontier.append(pid)
    return found


def cpu_seconds(pids: set[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except OSError:
            continue
    return total / CLK


class Kernel:
    """One ipykernel; :meth:`execute` returns (seconds to idle, CPU seconds of its tree, stdout)."""

    def __init__(self) -> None:
        from jupyter_client.manager import start_new_kernel

        self.km, self.kc = start_new_kernel(kernel_name="python3", env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.pid = self.km.provisioner.pid  # type: ignore[union-attr]
        self.pids = tree(self.pid)

    def refresh(self) -> None:
        self.pids = tree(self.pid)

    def execute(self, code: str, timeout: float = 300) -> tuple[float, float, str]:
        cpu0 = cpu_seconds(self.pids)
        t = time.perf_counter()
        msg_id = self.kc.execute(code)
        out: list[str] = []
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        took = time.perf_counter() - t
        cpu = cpu_seconds(self.pids) - cpu0
        reply = self.kc.get_shell_msg(timeout=timeout)
        assert reply["content"]["status"] == "ok", (code, reply["content"], "".join(out))
        return took, cpu, "".join(out)

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summary(times: list[float], cpus: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(times) * 1e3, "p99_ms": pct(times, 0.99) * 1e3, "cpu_ms_per_cell": statistics.mean(cpus) * 1e3}


def interleaved(k: Kernel, kinds: dict[str, str], cells: int) -> dict[str, dict[str, float]]:
    for code in kinds.values():  # warm-up
        for _ in range(20):
            k.execute(code)
    times: dict[str, list[float]] = {name: [] for name in kinds}
    cpus: dict[str, list[float]] = {name: [] for name in kinds}
    names = list(kinds)
    for i in range(cells):
        for name in names[i % len(names):] + names[: i % len(names)]:  # rotate who goes first
            took, cpu, _ = k.execute(kinds[name])
            times[name].append(took)
            cpus[name].append(cpu)
    return {name: summary(times[name], cpus[name]) for name in kinds}


PROBE = ("import gc, json, resource\nfrom ipywidgets.widgets.widget import _instances\n"
         "print(json.dumps({'widgets': len(_instances), 'gc_objects': len(gc.get_objects()), "
         "'rss_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))")


def session(k: Kernel, cells: int, every: int = 250) -> dict[str, Any]:
    samples, times = [], []
    for i in range(cells + 1):
        if i % every == 0:
            samples.append({"cells": i, **json.loads(k.execute(PROBE)[2])})
        if i < cells:
            times.append(k.execute("%%on_ranks\nx = 1")[0])
    return {"samples": samples, "median_ms": statistics.median(times) * 1e3, "p99_ms": pct(times, 0.99) * 1e3,
            "max_ms": max(times) * 1e3, "p99_over_median": pct(times, 0.99) / statistics.median(times)}


def quiet(pids: set[int], below: float = 0.05, limit: float = 120.0) -> None:
    """Wait until ``pids`` use under ``below`` s of CPU in a second (or ``limit`` s passed)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        before = cpu_seconds(pids)
        time.sleep(1.0)
        if cpu_seconds(pids) - before < below:
            return


def idle_cpu(k: Kernel, roots: list[int], seconds: float) -> float:
    """CPU milliseconds per second spent by ``roots`` and their descendants while nothing runs."""
    pids: set[int] = set().union(*(tree(r) for r in roots))
    cpu0 = cpu_seconds(pids)
    time.sleep(seconds)
    return (cpu_seconds(pids) - cpu0) / seconds * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--cells", type=int, default=200)
    parser.add_argument("--session", type=int, default=2000)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--settle", type=float, default=10.0, help="Seconds idle before a timed restart (spares import torch meanwhile).")
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--no-ipyparallel", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernel.json"))
    args = parser.parse_args()

    k = Kernel()
    report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "ranks": args.ranks}
    try:
        k.execute(f"%load_ext distnb\n%dist_launch -n {args.ranks} --backend gloo\nimport distnb\npool = distnb.current_pool()")
        kinds = {"plain": "x = 1", "pool.run": 'pool.run("x = 1");', "on_ranks": "%%on_ranks\nx = 1"}
        ipp = False
        if not args.no_ipyparallel:
            try:
                k.execute(f"import ipyparallel as ipp\ncluster = ipp.Cluster(n={args.ranks}, log_level=40)\n"
                          "rc = cluster.start_and_connect_sync()\nrc.activate()", timeout=600)
                kinds["px"] = "%%px --block\nx = 1"
                ipp = True
            except AssertionError as exc:
                report["ipyparallel"] = f"not measured: {exc}"
        k.refresh()
        # The spares (one per rank) import torch once the pool is ready: start-up, not cells.
        agent = json.loads(k.execute("import json\nprint(json.dumps(pool._transport.agent_pid))")[2])
        quiet(tree(agent))
        cells = interleaved(k, kinds, args.cells)
        report["cells"] = cells
        floor = cells["plain"]["median_ms"]
        report["ratios"] = {"on_ranks_over_plain": cells["on_ranks"]["median_ms"] / floor,
                            "pool_run_over_plain": cells["pool.run"]["median_ms"] / floor}
        if ipp:
            report["ratios"]["px_over_on_ranks"] = cells["px"]["median_ms"] / cells["on_ranks"]["median_ms"]
        report["idle_cpu_ms_per_s"] = {"distnb_pool": idle_cpu(k, [agent], args.idle)}
        if ipp:  # the rest of the kernel's tree: ipyparallel's controller and engines
            pool_pids = tree(agent)
            report["idle_cpu_ms_per_s"]["ipyparallel"] = idle_cpu(k, [p for p in tree(k.pid) - pool_pids - {k.pid}], args.idle)
        if args.session:
            report["session"] = session(k, args.session)
        # Restarts alternated with full ones (torchrun started anew), each after a pause in which
        # the spares finish importing torch; then one right after another (spares still importing).
        quick, full, back_to_back = [], [], []
        for _ in range(args.restarts):
            time.sleep(args.settle)
            quick.append(k.execute("%dist_restart")[0])
            time.sleep(args.settle)
            full.append(k.execute("%dist_restart --full")[0])
            back_to_back.append(k.execute("%dist_restart")[0])
        report["restart_s"] = {"quick": quick, "full": full, "quick_right_after_a_restart": back_to_back}
        k.execute("%%on_ranks\ny = rank")
        replays = []
        for _ in range(args.restarts):
            time.sleep(args.settle)
            replays.append(k.execute("%dist_restart --replay")[0])
        report["restart_replay_s"] = replays
        if ipp:
            k.execute("cluster.stop_cluster_sync()")
        k.execute("%dist_shutdown")
    finally:
        k.close()
    print(json.dumps(report, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
