"""A real pool at scale on one machine (issue 27): 64 gloo ranks on 8 simulated nodes
(``local_nodes``: 8 torchruns, 7 node agents, one c10d rendezvous) launch, run cells on every
rank, have a hang named, and shut down leaving no process. One pool for the module: a launch of
64 ranks is about a minute on 2 cores. The figures (launch, per rank, cells, diagnosis, shutdown)
are printed at the end of the module; benchmarks/bench_real_scale.py measures them properly.

Spare rank processes are off: each would be a second Python with torch per rank, doubling the
torch processes to 128, which does not fit in memory beside the ranks on a small machine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import distnb
from distnb import PoolState, RankState, _processes
from distnb.ranks import format_ranks

from conftest import cmdline, pool_processes, run_processes, track, usable, wait_gone

NNODES, NPROC = 8, 8
WORLD = NNODES * NPROC
#: The product's own bound on a start, given to the launch (it is ~70 s here on 2 cores, idle).
START_TIMEOUT = 600.0
#: Seconds the module waits for the memory it needs before skipping (CI, whose other legs run beside
#: the suite, gives them longer: each finishes the test file it runs, and starts no other while
#: $DISTNB_HEAVY_FLAG exists).
MEMORY_WAIT = float(os.environ.get("DISTNB_SCALE_MEMORY_WAIT") or 300)
#: The pool's hang threshold (the default).
HANG_AFTER = 3.0
#: Bound on any one cell (tens of ms here) or on naming the hang past HANG_AFTER, for a loaded machine.
CELL_TIMEOUT = 120.0
#: Bound on a shutdown: the product waits at most ~5 s for the agents, then grace, SIGTERM and SIGKILL
#: (~15 s); the rest is margin for 143 processes exiting on 2 cores (~8 s here).
SHUTDOWN_BOUND = 60.0
#: A test may restart the pool (usable(): a start and a shutdown), then run its cells; the first
#: test carries the launch, the last the shutdown.
TEST_TIMEOUT = int(MEMORY_WAIT + START_TIMEOUT + SHUTDOWN_BOUND + HANG_AFTER + 4 * CELL_TIMEOUT)

#: Memory: a rank and a torchrun are each a Python with torch: ~280 MiB RSS, of which ~150 MiB is
#: their own (anonymous) and the rest torch's libraries, mapped from files and shared by every
#: process; a rank's cells and recorders add ~10 MiB of its own (measured 2026-11-30: 151 MiB
#: anonymous after the import, 159 in a running rank). A supervisor and a node agent ~12 MiB of
#: their own. Rounded up.
TORCH_PROCESS_MIB, RANK_WORK_MIB, SMALL_PROCESS_MIB = 150, 40, 20
NEED_MIB = (WORLD + NNODES) * (TORCH_PROCESS_MIB + RANK_WORK_MIB) + 200 + (WORLD + NNODES - 1) * SMALL_PROCESS_MIB

ODD = 45  # the rank that skips the collective: node 5, local rank 5 (not on the controller's node)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT)]

#: What the module measured, printed at its end.
FIGURES: dict[str, float] = {}


def mem_available_mib(field: str = "MemAvailable") -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return float("inf")


def needed_mib() -> float:
    """NEED_MIB, or more where this torch's import is heavier (a CUDA build's own memory is about
    twice the CPU build's): measured in a Python of its own — the memory it made its own, per
    process, and its libraries' pages once (RSS counts those in every process: 72 of them would
    ask for ~20 GiB where ~15 is used)."""
    import subprocess
    import sys

    probe = ("import torch, torch.distributed\n"
             "f = {l.split()[0]: int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.split()[1:2] and l.split()[1].isdigit()}\n"
             "print(f['Anonymous:'] / 1024, (f['Rss:'] - f['Anonymous:']) / 1024)")
    try:
        own, shared = map(float, subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120).stdout.split())
    except (ValueError, subprocess.SubprocessError):
        return NEED_MIB
    per_torch = max(TORCH_PROCESS_MIB, own) + RANK_WORK_MIB
    return (WORLD + NNODES) * per_torch + shared + (WORLD + NNODES - 1) * SMALL_PROCESS_MIB


def kind_of(pid: int) -> str:
    cmd = cmdline(pid)
    # torchrun's command line names the supervisor it runs: it is looked for first.
    for needle, kind in (("torch.distributed.run", "torchrun"), ("distnb.worker.process.rank", "rank"), ("-m distnb.worker", "supervisor"),
                         ("distnb.node", "node agent")):
        if needle in cmd:
            return kind
    return cmd


def seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def timed_run(pool: distnb.Pool, code: str, ranks=None) -> tuple[distnb.CellResult, float]:
    t0 = time.perf_counter()
    res = pool.run(code, ranks, timeout=CELL_TIMEOUT)
    return res, time.perf_counter() - t0


@pytest.fixture(scope="module")
def big_pool(leak_check, request: pytest.FixtureRequest):
    """64 ranks on 8 local nodes, with the processes the launch added (for the shutdown check)."""
    flag = Path(os.environ["DISTNB_HEAVY_FLAG"]) if os.environ.get("DISTNB_HEAVY_FLAG") else None
    if flag is not None:
        flag.write_text(str(os.getpid()))  # other test runs beside this one start nothing new while it runs
    request.addfinalizer(lambda: flag.unlink(missing_ok=True) if flag is not None else None)
    need = needed_mib()
    # Other processes' pools and kernels come and go (another pytest-xdist worker, CI's other legs):
    # their memory is waited for, a while, before the test says it cannot run here — unless the
    # machine has not that much memory at all (torch's CUDA build on 24 GiB), which no wait changes.
    deadline = time.monotonic() + (MEMORY_WAIT if need < mem_available_mib("MemTotal") else 0)
    while (available := mem_available_mib()) < need and time.monotonic() < deadline:
        time.sleep(2)
    if available < need and os.environ.get("DISTNB_REQUIRE_SCALE"):  # CI's scale leg: here it must run
        pytest.fail(f"{WORLD} ranks on {NNODES} local nodes need ~{need / 1024:.1f} GiB of memory with this torch; "
                    f"{available / 1024:.1f} GiB is available after {MEMORY_WAIT:.0f} s")
    if available < need:
        total = mem_available_mib("MemTotal")
        pytest.skip(f"{WORLD} ranks on {NNODES} local nodes need ~{need / 1024:.1f} GiB of memory with this torch; "
                    + (f"this machine has {total / 1024:.1f} GiB in all" if need >= total else f"{available / 1024:.1f} GiB is available"))
    before = set(run_processes())
    pool = track(distnb.Pool(nproc=NPROC, nnodes=NNODES, local_nodes=True, backend="gloo", spares=False,
                             start_timeout=START_TIMEOUT, hang_after=HANG_AFTER))
    try:
        t0 = time.perf_counter()
        pool.start()
        FIGURES["launch_s"] = time.perf_counter() - t0
        track(pool)
        pool.launched = (set(run_processes()) - before) | pool_processes(pool)  # type: ignore[attr-defined]
        yield pool
    finally:
        pool.shutdown()
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and capture is not None and FIGURES:
            with capture.global_and_fixture_disabled():  # what capsys.disabled() does: to the terminal, not the capture
                reporter.write_line(f"{WORLD} ranks on {NNODES} local nodes: "
                                    + ", ".join(f"{k[:-2]} {seconds(v)}" for k, v in FIGURES.items()))


def test_64_ranks_on_8_nodes_launch(big_pool: distnb.Pool) -> None:
    pool = big_pool
    FIGURES["launch_per_rank_s"] = FIGURES["launch_s"] / WORLD
    status = pool.status()
    assert status.state == "ready" and status.world_size == WORLD and status.nnodes == NNODES and status.backend == "gloo"
    assert [r.rank for r in status.ranks] == list(range(WORLD))
    assert all(r.state == RankState.IDLE for r in status.ranks), status.text()
    # torchrun numbers ranks node by node: RANK = GROUP_RANK * nproc + LOCAL_RANK.
    assert [(r.node, r.local_rank) for r in status.ranks] == [divmod(r, NPROC) for r in range(WORLD)], status.text()
    pids = [r.pid for r in status.ranks]
    assert len(set(pids)) == WORLD and all(p is not None and _processes.pid_alive(p) for p in pids)
    # Every process of the launch: a supervisor per rank, a torchrun per node, an agent per other
    # node; no spare rank processes (spares=False).
    kinds: dict[str, int] = {}
    for pid in pool.launched:  # type: ignore[attr-defined]
        if _processes.pid_alive(pid):
            kinds[kind_of(pid)] = kinds.get(kind_of(pid), 0) + 1
    assert kinds == {"rank": WORLD, "supervisor": WORLD, "torchrun": NNODES, "node agent": NNODES - 1}, kinds
    assert f"{WORLD} ranks on {NNODES} nodes" in status.text()


def test_cells_run_on_every_rank(big_pool: distnb.Pool) -> None:
    pool = usable(big_pool)
    res, took = timed_run(pool, "1")
    assert res.ok and res.values == {r: "1" for r in range(WORLD)}, res.text()
    FIGURES["trivial_cell_s"] = took
    FIGURES["trivial_cell_per_rank_s"] = took / WORLD
    code = ("import os\nsr_x = torch.ones(1) * (rank + 1)\ndist.all_reduce(sr_x)\n"
            "print(f'rank {rank} of node {os.environ[\"GROUP_RANK\"]}')\n"
            "(int(sr_x.item()), int(os.environ['GROUP_RANK']), int(os.environ['LOCAL_RANK']))")
    res, took = timed_run(pool, code)
    assert res.ok, res.text()
    total = WORLD * (WORLD + 1) // 2  # 1 + 2 + ... + 64, exact in float32
    assert res.values == {r: str((total, *divmod(r, NPROC))) for r in range(WORLD)}, res.text()
    assert {r: res[r].stdout for r in range(WORLD)} == {r: f"rank {r} of node {r // NPROC}\n" for r in range(WORLD)}
    FIGURES["all_reduce_cell_s"] = took
    FIGURES["all_reduce_cell_per_rank_s"] = took / WORLD
    # State persists between cells on every rank.
    res, _ = timed_run(pool, "int(sr_x.item()) - rank")
    assert res.values == {r: str(total - r) for r in range(WORLD)}, res.text()


def test_a_rank_that_skips_the_all_reduce_is_named(big_pool: distnb.Pool) -> None:
    pool = usable(big_pool)
    t0 = time.perf_counter()
    hung = pool.submit(f"sr_h = torch.ones(1)\nif rank != {ODD}:\n    dist.all_reduce(sr_h)\n")
    deadline = time.monotonic() + HANG_AFTER + CELL_TIMEOUT
    diag = pool.diagnose(hung)
    while diag.state != "hang" and time.monotonic() < deadline:
        time.sleep(0.3)
        diag = pool.diagnose(hung)
    FIGURES["hang_named_after_s"] = time.perf_counter() - t0  # HANG_AFTER of it is the threshold
    t1 = time.perf_counter()
    again = pool.diagnose(hung)
    FIGURES["diagnose_s"] = time.perf_counter() - t1
    assert diag.state == "hang", diag.text()
    assert diag.culprits == [ODD], diag.text()
    summary = diag.summary
    others = [r for r in range(WORLD) if r != ODD]
    # The kind of hang, the 63 waiting ranks (in the product's own rank notation), the odd rank and
    # the line that let it skip the collective.
    assert "rank-conditional" in summary and f"{format_ranks(others)} entered all_reduce" in summary, summary
    assert f"rank {ODD} finished the cell" in summary and f"`if rank != {ODD}:`" in summary, summary
    assert again.state == "hang" and again.culprits == [ODD] and again.summary == summary, again.text()
    assert hung[ODD].status == "ok" and sorted(hung.running) == others, hung.text()
    # The odd rank makes the missing all_reduce in a cell of its own: the hang resolves, and the
    # pool goes on without a restart.
    rescue, _ = timed_run(pool, "dist.all_reduce(sr_h)\nint(sr_h.item())", ranks=[ODD])
    pool.wait(hung, timeout=CELL_TIMEOUT)
    assert rescue.ok and rescue.values == {ODD: str(WORLD)}, rescue.text()
    assert hung.ok and not hung.running, hung.text()
    assert pool.state == PoolState.READY
    res, _ = timed_run(pool, "sr_y = torch.ones(1); dist.all_reduce(sr_y); (int(sr_h.item()), int(sr_y.item()))")
    assert res.ok and res.values == {r: str((WORLD, WORLD)) for r in range(WORLD)}, res.text()


def test_shutdown_leaves_no_process(big_pool: distnb.Pool) -> None:
    pool = big_pool
    everything = pool.launched | pool_processes(pool) | set(pool.pids())  # type: ignore[attr-defined]
    run_dir, key_file = pool.run_dir, pool.key_file
    port = int((pool.status().address or "").rsplit(":", 1)[1])
    assert run_dir and os.path.isdir(run_dir) and key_file and os.path.exists(key_file)
    t0 = time.perf_counter()
    pool.shutdown()
    FIGURES["shutdown_s"] = time.perf_counter() - t0
    assert pool.state == PoolState.STOPPED and pool.pids() == []
    left = wait_gone(everything, 5.0)
    assert left == [], "processes outlived the shutdown:\n  " + "\n  ".join(f"{p}: {cmdline(p)}" for p in left)
    assert not os.path.exists(run_dir), "torchrun's log folder was left behind"
    assert not os.path.exists(key_file), "the pool's key file was left behind"
    assert port not in _processes.listening_ports()
