"""Issue 27 at 1,024 synthetic ranks (tests/synthetic.py drives the real tracker, log and
diagnostics): the summarised views name the outliers and drop no rank, the live watch asks the
ranks nothing while their logs show progress, and the wire carries each rank's groups once.
Speed is benchmarks/bench_scale.py's; here only what the user reads is checked."""

from __future__ import annotations

import socket

import pytest

from distnb.analysis.agreement.collective_table import PAGE_RANKS
from distnb.controller.collective_log import CollectiveLog
from distnb.display.html import collectives_html
from distnb.ranks import SUMMARY_ABOVE, group_by, parse_ranks
from distnb.services.watch import CellWatch
from distnb.wire.protocol import Msg

from synthetic import SyntheticPool, healthy_cell, hung_cell

WORLD = 1024


def asked(pool: SyntheticPool, kind: str) -> int:
    return sum(1 for _, m in pool.transport.sent if m["t"] == kind)


def test_the_watch_of_a_healthy_cell_asks_the_ranks_nothing() -> None:
    pool = SyntheticPool(WORLD, hang_after=60.0)
    result = healthy_cell(pool)
    watch = CellWatch(pool.tracker, pool.inspector, result, 60.0)  # the cell began 100 s ago; no collective waited 60 s
    before = asked(pool, Msg.STACKS)
    assert watch.look() is None and watch.look() is None
    assert asked(pool, Msg.STACKS) == before and watch.full_looks == 0


def test_the_watch_diagnoses_in_full_once_a_collective_waits_past_hang_after() -> None:
    pool = SyntheticPool(WORLD, hang_after=1.0)
    result = hung_cell(pool, odd=17)
    watch = CellWatch(pool.tracker, pool.inspector, result, 1.0)
    diag = watch.look()
    assert diag is not None and diag.state == "hang" and diag.culprits == [17], diag and diag.text()
    assert watch.full_looks == 1 and asked(pool, Msg.STACKS) >= 1
    # The text stays a few lines at any size: ranks waiting alike are one line.
    assert len(diag.text().splitlines()) <= 6, diag.text()


def test_a_thousand_ranks_on_other_machines_show_no_false_straggler_but_a_real_one_is_named() -> None:
    pool = SyntheticPool(WORLD)
    # Rank 79's only push was read 30 ms late (a queue of replies, a GC pause): alone, its clock
    # would look 30 ms behind and it would arrive last at every collective.
    result = healthy_cell(pool, queued={79: 0.03})
    assert pool.inspector.straggler(result, 20) is None, "clock estimates made a straggler of a healthy cell"
    slow = SyntheticPool(WORLD)
    result = slow.cell("for step in range(100):\n    dist.all_reduce(x)")
    base = slow.now
    for r in range(WORLD):
        for s in range(1, 31):
            slow.collective(r, s, result.cell, base - 100 + s * 0.3 + (0.03 if r == 613 else (r % 7) * 1e-4))
        slow.push(r)
    found = slow.inspector.straggler(result, 20)
    assert found is not None and found.culprits == [613], found and found.text()
    timeline = slow.inspector.stragglers(last=30).text()
    lines = timeline.splitlines()
    assert "rank 613 arrives last at 100%" in lines[0] and len(lines) <= 16, timeline
    assert any(line.split()[:1] == ["613"] for line in lines[2:]), "the straggler's own row"
    assert "over 1024 ranks" in timeline


def test_collectives_lead_with_the_majority_and_name_every_odd_rank() -> None:
    pool = SyntheticPool(WORLD)
    hung_cell(pool, steps=5, odd=17)
    # Rank 900 issued its 3rd all_reduce with another shape.
    odd_entry = next(e for e in pool.ranks[900].entries if e["seq"] == 3)
    odd_entry["sizes"] = [[512]]
    pool.ranks[900].entries.append({**odd_entry, "id": 999})  # re-sent, as a rank re-sends a changed entry
    pool.push(900)
    report = pool.inspector.collectives()
    text = report.text()
    lines = text.splitlines()
    assert len(lines) <= 12 and max(map(len, lines)) < 200, text
    assert "5 on rank 17" in text and "6 collectives on ranks 0-16,18-1023" in text
    row3 = next(line for line in lines if line.strip().startswith("3 "))
    assert "rank 900: ✗ all_reduce [512] f32 c1" in row3 and "ranks 0-899,901-1023" in row3 and "first divergence" in row3, row3
    row6 = next(line for line in lines if line.strip().startswith("6 "))
    assert "rank 17: —" in row6, row6
    html = collectives_html(report)
    assert "rank 900: ✗ all_reduce [512] f32 c1" in html and len(html) < 20_000
    # The per-rank view on request, a page at a time.
    page = report.paged(3).text()
    assert f"page 3 of {WORLD // PAGE_RANKS}: ranks 16-23" in page and "rank 17" in page and "rank 24 " not in page
    assert "✗ all_reduce [512]" in report.paged(113).text()  # rank 900's page
    with pytest.raises(ValueError, match="from 1"):
        report.paged(0)


def test_a_few_ranks_keep_a_column_each() -> None:
    pool = SyntheticPool(4)
    hung_cell(pool, steps=3, odd=1)
    text = pool.inspector.collectives().text()
    assert "    #  rank 0" in text and "rank 3" in text and "most ranks" not in text


def test_group_by_groups_many_distinct_and_unhashable_values_in_order() -> None:
    items = [(r, r % 3) for r in range(3000)] + [(3000, [1]), (3001, [1]), (3002, {"a": 1})]
    groups = group_by(items)
    assert [v for _, v in groups] == [0, 1, 2, [1], {"a": 1}]
    assert groups[0][0][:3] == [0, 3, 6] and groups[3][0] == [3000, 3001] and sum(len(rs) for rs, _ in groups) == 3003


def test_each_rank_sends_its_groups_once_and_is_asked_again_when_a_reply_went_missing() -> None:
    log = CollectiveLog()
    assert log.wants_groups([0, 1]), "nothing heard yet"
    log.merge(0, {"entries": [], "gkey": 7, "groups": {"0": list(range(WORLD))}, "now": 0.0})
    log.merge(1, {"entries": [], "gkey": 7, "groups": {"0": list(range(WORLD))}, "now": 0.0})
    log.merge(0, {"entries": [], "gkey": 7, "now": 0.0})
    assert not log.wants_groups([0, 1]) and log.groups["0"][-1] == WORLD - 1
    log.merge(1, {"entries": [], "gkey": 8, "now": 0.0})  # its table changed; the reply with the members was lost
    assert log.wants_groups([1]) and not log.wants_groups([0])
    log.merge(1, {"entries": [], "gkey": 8, "groups": {"0": list(range(WORLD)), "5": [1, 2]}, "now": 0.0})
    assert not log.wants_groups([0, 1]) and log.groups["5"] == [1, 2]
    log.clear()
    assert log.wants_groups([0])


def test_the_rank_side_sends_members_only_when_its_table_changed() -> None:
    from distnb.worker.torch_hooks import flight_recorder

    table = {"0": [0, 1]}
    sent = flight_recorder.SentGroups(key=lambda: hash(tuple(sorted(table))), read=lambda: (dict(table), {}))
    assert sent.fields()["groups"] == {"0": [0, 1]}
    assert "groups" not in sent.fields() and "gkey" in sent.fields()
    assert sent.fields(force=True)["groups"] == {"0": [0, 1]}
    table["5"] = [1]
    assert sent.fields()["groups"] == {"0": [0, 1], "5": [1]}


def test_ranks_on_this_machine_share_its_clock_whatever_their_replies_say() -> None:
    log = CollectiveLog()
    log.place(0, socket.gethostname())
    log.place(1, "elsewhere")
    log.place(2, "elsewhere")
    for r in (0, 1):
        log.merge(r, {"entries": [], "now": 10.0})  # the controller's clock is far ahead of 10 s
    log.merge(2, {"entries": [], "now": 1e12})
    assert log.offset(0) == 0.0
    assert log.offset(1) == log.offset(2) > 1e11, "one machine, one clock: the best sample of any of its ranks"


def test_views_of_a_handful_of_ranks_list_every_rank() -> None:
    assert SUMMARY_ABOVE == 16
    pool = SyntheticPool(8)
    result = pool.cell("for step in range(100):\n    dist.all_reduce(x)")
    base = pool.now
    for r in range(8):
        for s in range(1, 11):
            pool.collective(r, s, result.cell, base - 100 + s * 0.3 + (0.03 if r == 5 else 0.0))
        pool.push(r)
    text = pool.inspector.stragglers().text()
    assert all(any(line.split()[:1] == [str(r)] for line in text.splitlines()) for r in range(8)), text


def test_status_groups_a_thousand_ranks_by_state_and_names_the_dead_one() -> None:
    import time

    from distnb.status import PoolStatus

    from conftest import feed

    pool = SyntheticPool(WORLD)
    feed(pool.tracker, "s", 17, {"t": Msg.RANK_EXIT, "rank": 17, "returncode": -9, "stderr_tail": "", "time": time.time()})
    status = PoolStatus(state=pool.tracker.state.value, backend="gloo", world_size=WORLD, ranks=pool.tracker.rank_statuses(), nnodes=128)
    lines = status.text().splitlines()
    assert lines[1] == "  idle: ranks 0-16,18-1023 on 128 machines (node0 … node127)", lines
    assert lines[2].startswith("  dead: killed (SIGKILL") and lines[2].endswith("rank 17 on node2 (pid 20017)") and len(lines) == 4
    status.every_rank = True
    assert len(status.text().splitlines()) == WORLD + 2


def test_a_diagnosis_of_ranks_in_many_places_lists_the_culprits_and_the_crowded_places() -> None:
    from distnb.analysis.render import MAX_PLACES
    from distnb.analysis.verdicts.position import Position
    from distnb.analysis.verdicts.verdict import Kind, Verdict, VerdictState

    positions = [Position(r, "collective", op="all_reduce", seq=1 + r % 40, group="0", since=5.0) for r in range(WORLD)]
    positions[999] = Position(999, "computing", line=7, code="loss = model(x)", since=5.0)
    text = Verdict(VerdictState.HANG, Kind.STILL_RUNNING, "ranks wait", [999], positions=positions).text()
    lines = text.splitlines()
    assert len(lines) == 1 + MAX_PLACES + 1, text
    assert any(line.startswith("  rank 999:") for line in lines) and "more ranks in" in lines[-1]
    named = sum(len(parse_ranks(line.split(":")[0].strip().split(" ", 1)[1], WORLD)) for line in lines[1:-1])
    left = int(lines[-1].split("and ")[1].split(" ")[0])
    assert named + left == WORLD, "every rank is either listed or counted"
