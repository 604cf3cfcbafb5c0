"""HTML twins of the reports: tables with the rows that matter highlighted."""

from __future__ import annotations

import re

from distnb.analysis.reports.checks import compare
from distnb.analysis.reports.env import EnvReport
from distnb.analysis.reports.memory import MemoryReport
from distnb.analysis.verdicts.stacks import Frame, RankStack, StackReport, ThreadStack
from distnb.controller.collective_log import CollectiveLog
from distnb.display.html import BAD, WARN, check_html, collectives_html, env_html, memory_html, register, stacks_html, status_html
from distnb.states import RankState
from distnb.status import PoolStatus, RankStatus
from distnb.worker.recorders.checksum import checksum


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
    assert row_styles(check_html(report)) == [("w", "ranks 0,1", WARN), ("w", "rank 2", BAD)]
    env = EnvReport({0: {"RANK": "0", "NCCL_IB_DISABLE": "1"}, 1: {"RANK": "1", "NCCL_IB_DISABLE": "0"}})
    assert f"<tr style='{BAD}'><td style='text-align:left;padding:2px 8px;vertical-align:top'>NCCL_IB_DISABLE" in env_html(env)
    mem = MemoryReport({0: {"rss": 200 << 20}, 1: {"rss": 600 << 20}}, [(1, {0: {"rss_peak": 200 << 20}, 1: {"rss_peak": 600 << 20}})])
    assert "rank 1 peaks at" in memory_html(mem) and BAD in memory_html(mem)
    stacks = StackReport([RankStack(0, "running cell 2 for 3.0 s", "control thread",
                                    [ThreadStack("MainThread", True, [Frame("<cell-2>", 3, "<module>", "dist.all_reduce(x)")])],
                                    annotation="in all_reduce [3] f32 (#1 on group 0) for 3.0 s")])
    out = stacks_html(stacks)
    assert "dist.all_reduce(x)" in out and "in all_reduce [3] f32" in out and WARN not in out


def row_styles(out: str) -> list[tuple[str, str, str]]:
    """(entry, ranks, row style) of each body row of an HTML table."""
    rows = re.findall(r"<tr style='([^']*)'><td[^>]*>(.*?)</td><td[^>]*>(.*?)</td>", out)
    return [(entry, ranks, style) for style, entry, ranks in rows]


def test_check_rows_are_coloured_by_status_and_majority() -> None:
    import torch

    ones, zeros = torch.ones(3), torch.zeros(3)
    # Rank 0 is the odd one: the first row shown is the odd group, not the majority.
    per_rank = {0: checksum({"w": zeros, "b": ones}), 1: checksum({"w": ones, "b": ones}), 2: checksum({"w": ones, "b": ones})}
    out = check_html(compare("model", per_rank))
    assert row_styles(out) == [
        ("w", "rank 0", BAD),  # odd group: red
        ("w", "ranks 1,2", WARN),  # majority of a differing entry: yellow
        ("b", "ranks 0-2", ""),  # identical: not coloured
    ]
    # No majority among three: the reference group (lowest rank) yellow, the others red.
    three = {0: checksum({"w": zeros}), 1: checksum({"w": ones}), 2: checksum({"w": ones * 2})}
    assert [s for _, _, s in row_styles(check_html(compare("model", three)))] == [WARN, BAD, BAD]
    same = check_html(compare("w", {0: checksum(ones), 1: checksum(ones)}))
    assert BAD not in same and WARN not in same


def test_memory_html_has_the_text_forms_columns() -> None:
    mb = 1 << 20
    cell = {r: {"rss": 900 * mb, "rss_start": 600 * mb, "rss_peak": 950 * mb, "cuda_allocated": (300 + 200 * r) * mb,
                "cuda_allocated_start": 100 * mb, "cuda_reserved": 1024 * mb, "cuda_reserved_start": 512 * mb,
                "cuda_peak": (400 + 900 * r) * mb, "device_used": 2048 * mb, "device_total": 80 << 30} for r in (0, 1)}
    report = MemoryReport({r: dict(s) for r, s in cell.items()}, [(4, cell)])
    out = memory_html(report)
    cols, rows = report.table()
    for col in ("Δ RSS (last cell)", "CUDA alloc", "Δ CUDA alloc (last cell)", "reserved", "CUDA peak (last cell)", "GPU used/total (NVML)"):
        assert col in cols and f">{col}</th>" in out
        assert col in report.text()  # the text form has the same columns
    assert "+300 MiB" in out and "+400 MiB" in out  # RSS and rank 1's CUDA allocated change over the cell
    assert "1.00 GiB" in out and "2.00 GiB / 80.00 GiB" in out
    assert f"<tr style='{BAD}'><td style='text-align:left;padding:2px 8px;vertical-align:top'>1</td>" in out  # rank 1 peaks high
    # CPU-only data: no CUDA or device columns, in either form.
    cpu = MemoryReport({0: {"rss": 200 * mb}}, [(1, {0: {"rss": 200 * mb, "rss_start": 100 * mb, "rss_peak": 250 * mb}})])
    assert "CUDA" not in memory_html(cpu) and "device" not in memory_html(cpu) and "+100 MiB" in memory_html(cpu)


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


def test_comms_table_highlights_the_rows_where_ranks_differ() -> None:
    from distnb.analysis.reports.comms import CommsReport
    from distnb.display.html import BAD, comms_html

    rec = {"module": "model.2", "bw": False, "op": "all_reduce", "group": "3", "desc": "mesh_tp", "bytes": 128}
    report = CommsReport.of(4, {0: {"records": [rec]}, 1: {"records": [rec]}, 2: {"records": [rec, rec]}})
    html = comms_html(report)
    assert "communication of cell 4 on ranks 0-2" in html and f"<tr style='{BAD}'>" in html and "✗ rank 2 differ" in html
    assert "per dimension: tp 1 call 128 B" in html and "✗ rank 2: model.2 fwd all_reduce over tp: 2 calls, 256 B" in html
