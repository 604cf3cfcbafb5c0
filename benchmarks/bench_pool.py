"""Pool speed: trivial-cell round trip (API, magic in a terminal shell with --quiet, and magic in a
real ipykernel with its live view), launch to first all_reduce beside bare torchrun (medians of
three each, alternated, both timed to the moment the result exists), output throughput.

    python benchmarks/bench_pool.py [--sizes 1,2,4,8] [--cells 200] [--out benchmarks/results/pool.json]

Reported, not asserted: figures go to stdout and a JSON file; README.md quotes them.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout

import distnb

BARE_SCRIPT = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.ones(2); dist.all_reduce(x)
if dist.get_rank() == 0:
    print("RESULT_AT", time.time(), flush=True)  # the moment the result exists, as distnb's is timed
dist.destroy_process_group()
"""


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def bare_torchrun(n: int) -> float:
    """Seconds from starting torchrun to rank 0 holding the all_reduce result (its exit is not
    counted: a distnb pool stays up)."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(BARE_SCRIPT)
    try:
        t0 = time.time()
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), f.name],
            check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        at = next(float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("RESULT_AT"))
        return at - t0
    finally:
        os.unlink(f.name)


def distnb_launch(n: int) -> tuple[float, distnb.Pool]:
    """Seconds from %dist_launch to the first all_reduce result in the notebook; the pool stays up."""
    t0 = time.time()
    pool = distnb.launch(nproc=n, backend="gloo")
    first = pool.run("x = torch.ones(2); dist.all_reduce(x); x")
    took = time.time() - t0
    assert first.ok, first.text()
    return took, pool


def kernel_round_trips(n: int, cells: int) -> list[float]:
    """``%%on_ranks`` as a notebook user meets it: executed by a real ipykernel, where each cell is
    a live widget view, timed from the execute request to the kernel going idle."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")

    def execute(code: str) -> float:
        t = time.perf_counter()
        msg_id = kc.execute(code)
        while True:
            msg = kc.get_iopub_msg(timeout=300)
            if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "idle"):
                break
        reply = kc.get_shell_msg(timeout=300)
        assert reply["content"]["status"] == "ok", reply["content"]
        return time.perf_counter() - t

    try:
        execute(f"%load_ext distnb\n%dist_launch -n {n} --backend gloo")
        for _ in range(20):
            execute("%%on_ranks\n1")
        times = [execute("%%on_ranks\n1") for _ in range(cells)]
        execute("%dist_shutdown")
        return times
    finally:
        kc.stop_channels()
        km.shutdown_kernel()


def magic_round_trips(cells: int) -> list[float]:
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython() or get_ipython()  # one shell per process: reuse it for every size
    if "on_ranks" not in ip.magics_manager.magics["cell"]:
        ip.run_line_magic("load_ext", "distnb")
    times = []
    sink = io.StringIO()
    with redirect_stdout(sink), redirect_stderr(sink):
        for _ in range(cells):
            t0 = time.perf_counter()
            ip.run_cell_magic("on_ranks", "--quiet", "1")
            times.append(time.perf_counter() - t0)
    return times


def throughput(pool: distnb.Pool, lines: int) -> dict[str, float]:
    t0 = time.perf_counter()
    result = pool.run(f"for i in range({lines}):\n    print(f'{{rank}} line {{i}}')", timeout=300)
    dt = time.perf_counter() - t0
    lost = 0
    for r, res in result.results.items():
        got = res.stdout.splitlines()
        expected = [f"{r} line {i}" for i in range(lines)]
        lost += len(expected) - sum(1 for a, b in zip(got, expected) if a == b)
    total = lines * pool.world_size
    return {"lines": total, "seconds": dt, "lines_per_s": total / dt, "lines_lost": lost}


def bench(n: int, cells: int) -> dict[str, object]:
    row: dict[str, object] = {"nproc": n}
    # Three of each, alternating which goes first (the first start after a pause finds colder
    # caches); the last distnb pool stays up for the cell timings.
    bare, launch, pool = [], [], None
    for i in range(3):
        for side in (("bare", "distnb") if i % 2 == 0 else ("distnb", "bare")):
            if side == "bare":
                bare.append(bare_torchrun(n))
            else:
                if pool is not None:
                    pool.shutdown()
                took, pool = distnb_launch(n)
                launch.append(took)
    assert pool is not None
    row["bare_torchrun_s"] = statistics.median(bare)
    row["launch_to_first_all_reduce_s"] = statistics.median(launch)
    row["launch_runs_s"] = {"distnb": launch, "bare": bare}
    try:
        for _ in range(20):  # warm-up
            pool.run("1")
        api = []
        for _ in range(cells):
            t = time.perf_counter()
            pool.run("1")
            api.append(time.perf_counter() - t)
        row["api_cell_ms_median"] = statistics.median(api) * 1e3
        row["api_cell_ms_p90"] = pct(api, 0.9) * 1e3
        magic = magic_round_trips(cells)
        row["magic_cell_ms_median"] = statistics.median(magic) * 1e3
        row["magic_cell_ms_p90"] = pct(magic, 0.9) * 1e3
        if n == max(ARGS.sizes):
            row["output"] = throughput(pool, 20_000)
        t = time.perf_counter()
        pool.stacks()
        row["stacks_ms"] = (time.perf_counter() - t) * 1e3
    finally:
        pool.shutdown()
    kernel = kernel_round_trips(n, cells)
    row["kernel_cell_ms_median"] = statistics.median(kernel) * 1e3
    row["kernel_cell_ms_p90"] = pct(kernel, 0.9) * 1e3
    row["launch_vs_bare"] = row["launch_to_first_all_reduce_s"] / row["bare_torchrun_s"]  # type: ignore[operator]
    return row


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--cells", type=int, default=200)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "pool.json"))
    ARGS = parser.parse_args()
    rows = []
    for n in ARGS.sizes:
        row = bench(n, ARGS.cells)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'N':>3} {'API ms (med/p90)':>18} {'magic ms (med/p90)':>20} {'kernel ms (med/p90)':>20} "
          f"{'launch s':>9} {'bare s':>7} {'ratio':>6} {'stacks ms':>10}")
    for r in rows:
        print(f"{r['nproc']:>3} {r['api_cell_ms_median']:>8.2f}/{r['api_cell_ms_p90']:<8.2f} {r['magic_cell_ms_median']:>9.2f}/{r['magic_cell_ms_p90']:<9.2f} "
              f"{r['kernel_cell_ms_median']:>9.2f}/{r['kernel_cell_ms_p90']:<9.2f} "
              f"{r['launch_to_first_all_reduce_s']:>9.2f} {r['bare_torchrun_s']:>7.2f} {r['launch_vs_bare']:>6.2f} {r['stacks_ms']:>10.1f}")
    os.makedirs(os.path.dirname(ARGS.out), exist_ok=True)
    with open(ARGS.out, "w") as f:
        json.dump({"machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": sys.version.split()[0], "rows": rows}, f, indent=2)


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
