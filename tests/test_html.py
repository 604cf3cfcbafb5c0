"""HTML twins of the reports: tables with the rows that matter highlighted."""

from __future__ import annotations

from distnb.checks import compare
from distnb.collectives import CollectiveLog
from distnb.display.html import BAD, WARN, check_html, collectives_html, env_html, memory_html, register, stacks_html, status_html
from distnb.memory import MemoryReport
from distnb.results import EnvReport, PoolStatus, RankState, RankStatus
from distnb.stacks import Frame, RankStack, StackReport, ThreadStack
from distnb.worker.checksum import checksum


def entry(rid: int, seq: int, op: str, size: int, done: bool = True) -> dict:
    return {"id": rid, "group": "0", "desc": "default_pg", "seq": seq, "p2p": False, "op": op, "sizes": [[size]],
            "dtypes": ["Float"], "t": float(rid), "done": done, "cell": 1}


def test_status_highlights_dead_and_running_ranks() -> None:
    status = PoolStatus("broken", "gloo", 3, [RankStatus(0, RankState.IDLE, pid=1), RankStatus(1, RankState.DEAD, returncode=-9),
                                              RankStatus(2, RankState.RUNNING, cell=4, elapsed=2.0)])
    out = status_html(status)
    assert out.count("<tr") == 4 and BAD in out and "killed (SIGKILL" in out and "running cell 4" in out


def test_collectives_mark_the_first_divergence() -> None:
    log = CollectiveLog()
    log.merge(0, {"entries": [entry(0, 1, "all_reduce", 3), entry(1, 2, "all_reduce", 3, done=False)], "groups": {"0": [0, 1]}})
    log.merge(1, {"entries": [entry(0, 1, "all_reduce", 3)], "groups": {"0": [0, 1]}})
    out = collectives_html(log.report([0, 1]))
    assert "first divergence" in out and f"<tr style='{BAD}'>" in out and "⏳" in out and "—" in out


def test_check_env_memory_and_stacks_tables() -> None:
    import torch

    report = compare("w", {0: checksum(torch.ones(3)), 1: checksum(torch.ones(3)), 2: checksum(torch.zeros(3))})
    assert "odd rank: 2" in check_html(report) and "<table" in check_html(report)
    env = EnvReport({0: {"RANK": "0", "NCCL_IB_DISABLE": "1"}, 1: {"RANK": "1", "NCCL_IB_DISABLE": "0"}})
    assert f"<tr style='{BAD}'><td style='text-align:left;padding:2px 8px;vertical-align:top'>NCCL_IB_DISABLE" in env_html(env)
    mem = MemoryReport({0: {"rss": 200 << 20}, 1: {"rss": 600 << 20}}, [(1, {0: {"rss_peak": 200 << 20}, 1: {"rss_peak": 600 << 20}})])
    assert "rank 1 peaks at" in memory_html(mem) and BAD in memory_html(mem)
    stacks = StackReport([RankStack(0, "running cell 2 for 3.0 s", "control thread",
                                    [ThreadStack("MainThread", True, [Frame("<cell-2>", 3, "<module>", "dist.all_reduce(x)")])],
                                    annotation="in all_reduce [3] f32 (#1 on group 0) for 3.0 s")])
    out = stacks_html(stacks)
    assert "dist.all_reduce(x)" in out and "in all_reduce [3] f32" in out and WARN not in out


def test_register_installs_formatters() -> None:
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython() or get_ipython()  # the one test shell of this process
    register(shell)
    status = PoolStatus("ready", "gloo", 1, [RankStatus(0, RankState.IDLE)])
    html_formatter = shell.display_formatter.formatters["text/html"]
    # A terminal shell renders only text/plain; a kernel also asks this formatter for text/html.
    assert "<table" in html_formatter.lookup_by_type(PoolStatus)(status)
    data, _ = shell.display_formatter.format(status)
    assert data["text/plain"].startswith("pool ready")
