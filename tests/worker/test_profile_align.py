"""A profiled cell starts once every rank of it has its profiler running (worker/recorders/profiling.align)."""

from __future__ import annotations

import threading
import time

from torch.distributed import HashStore

from distnb.analysis.reports.profile import ProfileReport, RankTime
from distnb.worker.recorders.profiling import align


def test_no_rank_starts_before_the_last_one_arrives() -> None:
    store = HashStore()
    started: dict[int, float] = {}
    late = 0.3

    def rank(r: int) -> None:
        if r == 2:
            time.sleep(late)  # its profiler took longer to start
        arrived = time.monotonic()
        assert align("k", 3, 60.0, store)
        started[r] = time.monotonic()
        if r == 2:
            started[-1] = arrived

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(started) == [-1, 0, 1, 2]
    assert all(started[r] >= started[-1] for r in (0, 1)), started


def test_a_peer_that_never_comes_ends_the_wait_unaligned() -> None:
    store = HashStore()
    begin = time.monotonic()
    assert align("k", 2, 0.2, store) is False
    assert time.monotonic() - begin >= 0.2
    assert align("other", 1, 0.2, store) is True  # a cell on one rank needs nobody


def test_no_store_runs_the_cell_unaligned() -> None:
    class Gone:
        def add(self, key: str, n: int) -> int:
            raise RuntimeError("Connection reset by peer")

    assert align("k", 4, 5.0, Gone()) is False


def test_the_report_says_which_ranks_started_unaligned() -> None:
    times = [RankTime(0, 0.5, 0.4, 0.35), RankTime(1, 0.5, 0.1, 0.0)]
    text = ProfileReport(7, times, {0: [], 1: []}, None, {}, [0, 1]).text()
    # (format_ranks writes two ranks as "ranks 0,1")
    assert "ranks 0,1 started the cell before every rank's profiler was running" in text
    assert "started the cell before" not in ProfileReport(7, times, {0: [], 1: []}).text()
