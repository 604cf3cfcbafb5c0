"""Load and leaks, short versions (the long ones are benchmarks/bench_load.py): many cells in a row
keep memory and file descriptors flat; launch/shutdown cycles leave no process, port or temp file."""

from __future__ import annotations

import glob
import os
import tempfile
from pathlib import Path

import pytest

import distnb
from distnb import _processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_500_cells_keep_memory_and_fds_flat() -> None:
    with distnb.Pool(nproc=4, backend="gloo") as pool:
        for _ in range(100):  # warm-up: allocator pools, caches, lazily created sockets
            pool.run("1")
        ranks = [s.pid for s in pool.status().ranks]
        me = os.getpid()
        pids = [me, *ranks]
        samples = [{p: (rss(p), fds(p)) for p in pids}]
        for i in range(500):
            res = pool.run(f"x{i % 10} = {i}\nprint({i})")
            assert res.ok
            if i in (249, 499):
                samples.append({p: (rss(p), fds(p)) for p in pids})
        before, half, after = samples
        for p in pids:
            grew = after[p][0] - before[p][0]
            assert grew < 10 << 20, f"pid {p} grew by {grew / 2**20:.1f} MB over 500 cells"
            # A leak grows with every cell; allocator warm-up is a step. The second 250 cells may
            # add at most 2 MB (8 KB a cell; the full 10,000-cell run is in benchmarks/bench_load.py).
            late = after[p][0] - half[p][0]
            assert late < 2 << 20, f"pid {p} grew by {late / 2**20:.2f} MB over cells 250-500 (still growing: a leak?)"
            assert after[p][1] <= before[p][1], f"pid {p} opened {after[p][1] - before[p][1]} more fds"
        assert len(pool.history) == 600


def test_launch_shutdown_cycles_leave_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = os.path.join(tempfile.gettempdir(), f"distnb-{os.getpid()}-*")  # run folders of this process's pools
    run_dirs_before = set(glob.glob(mine))
    # torchrun makes its torchelastic_* folder under its TMPDIR: one of this test's own, so that
    # another torchrun on the machine (a test beside this one) makes none of those looked at.
    elastic = tmp_path / "tmp"
    elastic.mkdir()
    monkeypatch.setenv("TMPDIR", str(elastic))
    fds_before = fds(os.getpid())
    seen: list[int] = []
    for _ in range(5):
        pool = distnb.launch(nproc=2, backend="gloo")
        seen += pool.pids()
        port = int(pool.status().address.rsplit(":", 1)[1])
        assert port in _processes.listening_ports()
        assert pool.run("x = torch.ones(1); dist.all_reduce(x); x.item()").values == {0: "2.0", 1: "2.0"}
        pool.shutdown()
        assert port not in _processes.listening_ports()
    assert [p for p in seen if _processes.pid_alive(p)] == []
    assert set(glob.glob(mine)) == run_dirs_before
    assert list(elastic.glob("torchelastic_*")) == []
    assert fds(os.getpid()) <= fds_before + 2  # the ZMQ context may keep an fd or two warm
