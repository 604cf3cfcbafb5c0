"""The tracker and diagnostics through their seam: messages in, state and sent messages out, the
way httpx tests a client through a mock transport. No process, no socket."""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

import pytest

from distnb.config import LaunchConfig
from distnb.controller.session import SessionLog
from distnb.controller.tracker import Tracker
from distnb.errors import NoAnswerError, PoolBrokenError, PoolBusyError
from distnb.launching.remote_nodes import Nodes
from distnb.results import CellEvents, CellResult, RankResult
from distnb.services.inspector import Inspector
from distnb.states import PoolState, RankState
from distnb.wire.peers import control_identity
from distnb.wire.protocol import Msg

from conftest import FakeTransport, feed


def started(world: int = 2) -> tuple[Tracker, FakeTransport]:
    """A tracker whose ranks all said hello and READY: a pool about to turn READY."""
    tracker, transport = Tracker(world), FakeTransport()
    tracker.begin_start(transport, Nodes(0))
    for r in range(world):
        feed(tracker, "s", r, {"t": Msg.SUP_HELLO, "rank": r, "pid": 1000 + r, "host": "h", "local_rank": r, "group_rank": 0, "agent": 0})
        feed(tracker, "x", r, {"t": Msg.HELLO, "rank": r, "local_rank": r, "world_size": world, "pid": 2000 + r, "host": "h", "main_ident": 1})
        feed(tracker, "x", r, {"t": Msg.READY, "rank": r, "device": "cpu", "backend": "gloo"})
    return tracker, transport


def ready(world: int = 2) -> tuple[Tracker, FakeTransport]:
    tracker, transport = started(world)
    assert tracker.mark_ready()
    return tracker, transport


def cell(tracker: Tracker, n: int = 1, ranks: list[int] | None = None, events: CellEvents | None = None) -> CellResult:
    ranks = list(tracker.ranks) if ranks is None else ranks
    result = CellResult(cell=n, code="x = 1\ny = 2", ranks=ranks, results={r: RankResult(r) for r in ranks})
    tracker.begin_cell(result, events or CellEvents())
    return result


def done(rank: int, n: int = 1, status: str = "ok", **extra: Any) -> dict[str, Any]:
    return {"t": Msg.CELL_DONE, "cell": n, "status": status, "value": None, "error": None, "duration": 0.1, "memory": None, **extra}


def exit_report(rank: int, when: float, rc: int = -9) -> dict[str, Any]:
    return {"t": Msg.RANK_EXIT, "rank": rank, "returncode": rc, "stderr_tail": "", "time": when}


def test_start_turns_ready_only_when_every_rank_is_idle() -> None:
    tracker, transport = Tracker(2), FakeTransport()
    tracker.begin_start(transport, Nodes(0))
    assert tracker.state == PoolState.STARTING and not tracker.mark_ready()
    feed(tracker, "s", 0, {"t": Msg.SUP_HELLO, "rank": 0, "pid": 10, "host": "h", "local_rank": 0, "agent": 0})
    assert tracker.stages() == {0: RankState.STARTED, 1: RankState.LAUNCHED}
    assert control_identity(0) not in transport.heartbeat_peers and b"s0" in transport.heartbeat_peers


def test_a_rank_dying_after_ready_fails_the_start_instead_of_a_ready_pool_with_a_dead_rank() -> None:
    tracker, _ = started(2)
    feed(tracker, "s", 1, exit_report(1, time.time()))
    assert not tracker.mark_ready() and tracker.state == PoolState.STARTING
    assert tracker.ranks[1].state == RankState.DEAD and tracker.first_death == 1


def test_a_rank_that_failed_to_start_is_said_by_its_exception_first() -> None:
    # The respawn's note keeps a failure's first line: it must be the exception, not "Traceback …".
    from distnb.transport.torchrun_ranks import _start_failure

    class Launcher:  # the failure is the rank's: torchrun is not asked
        def returncode(self) -> None:
            return None

    tracker, transport = Tracker(2), FakeTransport()
    tracker.begin_start(transport, Nodes(0))
    trace = "Traceback (most recent call last):\n  File \"rank.py\", line 1\nRuntimeError: Connection reset by peer\n"
    feed(tracker, "x", 1, {"t": Msg.START_FAILED, "rank": 1, "error": trace, "summary": "RuntimeError: Connection reset by peer"})
    failure = _start_failure(tracker, Launcher(), None)  # type: ignore[arg-type]
    assert failure is not None and failure.rank == 1
    first, *rest = str(failure).splitlines()
    assert first == "rank 1 failed to start: RuntimeError: Connection reset by peer", str(failure)
    assert rest[0] == "Traceback (most recent call last):"  # the whole traceback after it


def test_a_late_ready_never_revives_a_dead_rank() -> None:
    tracker, _ = ready(2)
    feed(tracker, "s", 0, exit_report(0, time.time()))
    feed(tracker, "x", 0, {"t": Msg.READY, "rank": 0, "device": "cpu", "backend": "gloo"})
    assert tracker.ranks[0].state == RankState.DEAD and tracker.state == PoolState.BROKEN
    with pytest.raises(PoolBrokenError, match="rank 0 died") as info:
        cell(tracker)
    assert info.value.dead == [0] and info.value.first_death == 0
    assert tracker.ranks[1].state == RankState.IDLE, "a refused cell must not mark ranks running"


def test_first_death_follows_the_supervisors_clock_not_arrival_order() -> None:
    tracker, _ = ready(2)
    result = cell(tracker)
    now = time.time()
    feed(tracker, "s", 1, exit_report(1, now))
    assert tracker.first_death == 1 and result[1].first_death
    # The earlier death is reported last (its supervisor waited for pipes a child kept open).
    feed(tracker, "s", 0, exit_report(0, now - 1.5))
    assert tracker.first_death == 0 and result[0].first_death and not result[1].first_death
    assert "rank 0 died first" in result.text() and "rank 1 died first" not in result.text()
    assert tracker.state == PoolState.BROKEN and not result.running


def test_output_goes_to_the_running_cell_and_a_done_finishes_each_rank() -> None:
    tracker, _ = ready(2)
    heard: list[tuple[int, str, str]] = []
    finished: list[int] = []
    result = cell(tracker, events=CellEvents(on_output=lambda r, s, t: heard.append((r, s, t)),
                                             on_rank_done=lambda res: finished.append(res.rank)))
    assert tracker.busy() == {0: 1, 1: 1}
    with pytest.raises(PoolBusyError) as info:
        tracker.ensure_idle([1])
    assert info.value.busy == {1: 1}
    feed(tracker, "s", 0, {"t": Msg.OUTPUT, "stream": "stdout", "data": "h\xe9".encode()[:2]})
    feed(tracker, "s", 0, {"t": Msg.OUTPUT, "stream": "stdout", "data": "h\xe9\n".encode()[2:]})
    feed(tracker, "s", 0, {"t": Msg.EVENT, "body": pickle.dumps(done(0, value={"text/plain": "3"}))})
    assert result[0].stdout == "h\xe9\n" and result[0].status == "ok" and finished == [0]
    assert tracker.ranks[0].state == RankState.IDLE and tracker.ranks[1].state == RankState.RUNNING
    # A silent cell's DONE comes straight from the rank's main thread.
    feed(tracker, "x", 1, done(1))
    assert not result.running and tracker.busy() == {}
    assert not result[0].direct and result[1].direct, "which path each result took"
    assert [h[0] for h in heard] == [0, 0]


def test_a_done_for_another_cell_is_ignored() -> None:
    tracker, _ = ready(1)
    result = cell(tracker, n=5)
    feed(tracker, "x", 0, done(0, n=4))
    assert result.running == [0]


def test_replies_are_routed_by_table_and_late_ones_dropped() -> None:
    tracker, transport = ready(2)

    def answer(identity: bytes, msg: dict[str, Any]) -> None:
        rank = int(identity[1:])
        feed(tracker, "c", rank, {"t": Msg.REPLY, "id": msg["id"], "rank": rank, "env": {"RANK": str(rank)}})

    transport.on_send = answer
    replies = tracker.requests.ask(control_identity, [0, 1], {"t": Msg.ENV}, 1.0)
    assert {r: m["env"]["RANK"] for r, m in replies.items()} == {0: "0", 1: "1"}
    assert len(tracker.requests) == 0, "a finished request leaves nothing in the table"
    # A reply nobody waits for any more is dropped, not mistaken for another request's.
    assert not tracker.requests.deliver(0, {"t": Msg.REPLY, "id": "999"})


def test_a_rank_that_does_not_answer_is_named() -> None:
    tracker, _ = ready(2)
    with pytest.raises(NoAnswerError, match="ranks 0,1 did not answer within 0.05 s") as info:
        tracker.requests.ask(control_identity, [0, 1], {"t": Msg.ENV}, 0.05)
    assert info.value.ranks == [0, 1]
    assert tracker.requests.ask(control_identity, [0], {"t": Msg.ENV}, 0.05, partial=True) == {}


def test_pushed_collective_entries_reach_the_log_without_a_request() -> None:
    tracker, _ = ready(2)
    entry = {"id": 0, "op": "all_reduce", "group": "0", "seq": 1, "done": False, "cell": 1, "sizes": [[2]],
             "dtypes": ["Float"], "t": 1.0}
    feed(tracker, "c", 1, {"t": Msg.COLLECTIVES_PUSH, "rank": 1, "entries": [entry], "now": 2.0, "groups": {"0": [0, 1]}})
    assert tracker.collective_log.last_id(1) == 0 and tracker.collective_log.pending(1, 1)["op"] == "all_reduce"


def test_a_push_from_the_process_a_restart_replaced_is_not_merged() -> None:
    tracker, _ = ready(2)
    pid = tracker.ranks[1].pid
    assert pid is not None
    entry = {"id": 0, "op": "all_reduce", "group": "0", "seq": 1, "done": False, "cell": 1, "sizes": [[2]],
             "dtypes": ["Float"], "t": 1.0}
    # Queued by the old process before it was killed, read after the new one said hello.
    feed(tracker, "c", 1, {"t": Msg.COLLECTIVES_PUSH, "rank": 1, "pid": pid + 1, "entries": [entry], "now": 2.0, "groups": {"0": [0, 1]}})
    assert tracker.collective_log.pending(1, 1) is None
    feed(tracker, "c", 1, {"t": Msg.COLLECTIVES_PUSH, "rank": 1, "pid": pid, "entries": [entry], "now": 2.0, "groups": {"0": [0, 1]}})
    assert tracker.collective_log.pending(1, 1) is not None


def test_the_tick_polls_ranks_that_ran_a_cell_and_merges_their_answers() -> None:
    tracker, transport = ready(2)
    cell(tracker, ranks=[1])
    tracker.on_tick()
    polls = [(i, m) for i, m in transport.sent if m["t"] == Msg.COLLECTIVES]
    assert [i for i, _ in polls] == [control_identity(1)]
    entry = {"id": 3, "op": "broadcast", "group": "0", "seq": 1, "done": True, "cell": 1, "t": 1.0}
    feed(tracker, "c", 1, {"t": Msg.REPLY, "id": polls[0][1]["id"], "rank": 1, "entries": [entry], "now": 2.0})
    assert tracker.collective_log.last_id(1) == 3


def test_a_supervisor_gone_without_a_report_is_found_dead_on_the_tick() -> None:
    tracker, _ = ready(2)

    class Launcher:
        class known_pids:  # noqa: N801 - stands in for KnownProcesses
            @staticmethod
            def is_alive(pid: int) -> bool:
                return pid != 1001

            @staticmethod
            def add(pid: int) -> None: ...

        @staticmethod
        def returncode() -> int | None:
            return None

    tracker.watch(Launcher())  # type: ignore[arg-type]
    tracker.on_tick()
    assert tracker.stages() == {0: RankState.IDLE, 1: RankState.DEAD} and tracker.state == PoolState.BROKEN


def test_a_machine_declared_lost_keeps_its_ranks_dead() -> None:
    """Ranks 2,3 run on a second machine. Its agent goes silent; before that is noticed, rank 3
    reports the error its dying neighbour caused ("Connection reset"). Once the machine is
    declared lost, both ranks are dead with the machine named, and nothing said late revives them."""
    from distnb import __version__

    tracker, transport = Tracker(4), FakeTransport()
    nodes = Nodes(1)
    tracker.begin_start(transport, nodes)
    assert nodes.hello(1, "hostb", 4711, __version__, accepting=True) is None
    for r in range(4):
        agent = 1 if r >= 2 else 0
        feed(tracker, "s", r, {"t": Msg.SUP_HELLO, "rank": r, "pid": 1000 + r, "host": "b" if agent else "a", "local_rank": r % 2,
                               "group_rank": agent, "agent": agent})
        feed(tracker, "x", r, {"t": Msg.HELLO, "rank": r, "local_rank": r % 2, "world_size": 4, "pid": 2000 + r, "host": "h", "main_ident": 1})
        feed(tracker, "x", r, {"t": Msg.READY, "rank": r, "device": "cpu", "backend": "gloo"})
    assert tracker.mark_ready()
    result = cell(tracker)
    nodes.agents[1].last_beat = time.monotonic() - 10  # silent since: lost at the next tick
    error = {"ename": "RuntimeError", "evalue": "Connection reset by peer", "traceback": "RuntimeError: Connection reset by peer\n"}
    feed(tracker, "x", 3, done(3, status="error", error=error))
    assert result.results[3].status == "error"
    tracker.on_tick()
    assert tracker.stages() == {0: RankState.RUNNING, 1: RankState.RUNNING, 2: RankState.DEAD, 3: RankState.DEAD}
    assert [result.results[r].status for r in (2, 3)] == ["dead", "dead"]
    assert "lost with its machine: the node agent on hostb (pid 4711) stopped answering" in result.results[3].cause
    assert any("stopped answering" in n for n in tracker.take_notes())
    feed(tracker, "x", 2, done(2, status="error", error=error))  # heard late: changes nothing
    feed(tracker, "x", 3, {"t": Msg.READY, "rank": 3, "device": "cpu", "backend": "gloo"})
    assert result.results[2].status == "dead" and tracker.stages()[3] == RankState.DEAD


def test_an_error_before_the_machine_went_silent_stays_an_error() -> None:
    from distnb import __version__

    tracker, transport = Tracker(2), FakeTransport()
    nodes = Nodes(1)
    tracker.begin_start(transport, nodes)
    nodes.hello(1, "hostb", 4711, __version__, accepting=True)
    for r in range(2):
        feed(tracker, "s", r, {"t": Msg.SUP_HELLO, "rank": r, "pid": 1000 + r, "host": "h", "local_rank": 0, "group_rank": r, "agent": r})
        feed(tracker, "x", r, {"t": Msg.HELLO, "rank": r, "local_rank": 0, "world_size": 2, "pid": 2000 + r, "host": "h", "main_ident": 1})
        feed(tracker, "x", r, {"t": Msg.READY, "rank": r, "device": "cpu", "backend": "gloo"})
    assert tracker.mark_ready()
    result = cell(tracker)
    feed(tracker, "x", 1, done(1, status="error", error={"ename": "ValueError", "evalue": "bad batch", "traceback": ""}))
    nodes.agents[1].last_beat = time.monotonic() + 1 - 10  # its last beat came after the error
    result.results[1].finished_at = time.monotonic() - 20
    tracker.on_tick()
    assert result.results[1].status == "error" and tracker.stages()[1] == RankState.DEAD


def test_out_of_memory_asks_the_waiting_ranks_for_their_memory() -> None:
    tracker, transport = ready(3)
    result = cell(tracker)
    error = {"ename": "torch.OutOfMemoryError", "evalue": "CUDA out of memory", "traceback": "", "line": 1}
    feed(tracker, "x", 0, done(0, status="error", error=error))
    asked = [(i, m) for i, m in transport.sent if m["t"] == Msg.MEMORY]
    assert [i for i, _ in asked] == [control_identity(1), control_identity(2)]
    feed(tracker, "c", 2, {"t": Msg.REPLY, "id": asked[0][1]["id"], "rank": 2, "memory": {"rss": 5}})
    assert result.live_memory == {2: {"rss": 5}}


def test_stop_ends_waiting_cells_and_the_pool_can_start_again() -> None:
    tracker, _ = ready(2)
    result = cell(tracker)
    waiter = threading.Thread(target=lambda: tracker.run_of(result).finished.wait(5))
    waiter.start()
    assert tracker.begin_stop() and not tracker.begin_stop()
    tracker.stopped()
    waiter.join(5)
    assert tracker.state == PoolState.STOPPED and not result.running and {r.status for r in result.results.values()} == {"dead"}
    tracker.begin_start(FakeTransport(), Nodes(0))
    assert tracker.state == PoolState.STARTING and tracker.first_death is None


def test_illegal_pool_moves_are_bugs() -> None:
    tracker = Tracker(1)
    with pytest.raises(RuntimeError, match="can't go from new to ready"):
        tracker._move(PoolState.READY)


def test_diagnostics_name_the_rank_that_never_came_from_messages_alone() -> None:
    tracker, transport = ready(2)
    session = SessionLog()
    result = cell(tracker)
    session.add_cell(result)
    tracker.run_of(result).started -= 10
    feed(tracker, "x", 1, done(1))  # rank 1 skipped the collective and finished
    entry = {"id": 0, "op": "all_reduce", "group": "0", "seq": 1, "done": False, "cell": 1, "sizes": [[2]],
             "dtypes": ["Float"], "t": 0.0, "p2p": False, "desc": "default_pg"}
    frame = ("/x/distributed_c10d.py", 10, "all_reduce", "work.wait()")

    def answer(identity: bytes, msg: dict[str, Any]) -> None:
        rank = int(identity[1:])
        reply: dict[str, Any] = {"t": Msg.REPLY, "id": msg["id"], "rank": rank, "now": 10.0}
        if msg["t"] == Msg.STACKS:
            frames = [("<cell-1>", 2, "<module>", "y = 2"), frame] if rank == 0 else [("/x/rank.py", 1, "serve", "")]
            reply.update(stacks=[{"thread": "MainThread", "main": True, "frames": frames}],
                         collectives={"entries": [entry] if rank == 0 else [], "now": 10.0, "groups": {"0": [0, 1]}})
        else:
            reply.update(entries=[], now=10.0, groups={"0": [0, 1]})
        feed(tracker, "c", rank, reply)

    transport.on_send = answer
    config = LaunchConfig(nproc=tracker.world_size, backend="gloo", hang_after=1.0)
    diagnosis = Inspector(tracker, config, session, run_dir=lambda: None).diagnose()
    # Two ranks, one in the call and one gone: no majority says whether rank 0's call is extra or
    # rank 1 skipped it; both are named, the call and the rank that never came among them.
    assert diagnosis.state == "hang" and diagnosis.culprits == [0, 1], diagnosis.text()
    assert "all_reduce #1 [2] f32" in diagnosis.summary and "No majority to tell which side went wrong: rank 0 against rank 1" in diagnosis.summary


def test_ranks_blocked_on_a_dead_rank_end_the_cell_on_the_tick(monkeypatch) -> None:
    import distnb.controller.tracker as tracker_module

    tracker, _ = ready(3)
    result = cell(tracker)
    entry = {"op": "all_reduce", "group": "0", "seq": 1, "done": False, "cell": 1, "sizes": [[2]], "dtypes": ["Float"], "t": 1.0}
    for r in (0, 2):
        feed(tracker, "c", r, {"t": Msg.COLLECTIVES_PUSH, "rank": r, "entries": [{**entry, "id": 0}], "now": 2.0,
                                    "groups": {"0": [0, 1, 2]}})
    feed(tracker, "s", 1, exit_report(1, time.time()))
    assert tracker.state == PoolState.BROKEN and result[1].status == "dead" and result.running == [0, 2]
    tracker.on_tick()
    assert result.running == [0, 2], "ended before STRAND_AFTER: the survivors' own error would be lost"
    monkeypatch.setattr(tracker_module, "STRAND_AFTER", 0.0)
    tracker.on_tick()
    assert result.running == [] and [result[r].status for r in (0, 2)] == ["stranded", "stranded"]
    assert "stranded in all_reduce [2] f32 (#1 on group 0)" in result.text()
    assert "blocked waiting for rank 1" in result.text() and "%dist_restart" in result.text()


def test_a_survivor_still_computing_keeps_the_cell_open(monkeypatch) -> None:
    import distnb.controller.tracker as tracker_module

    monkeypatch.setattr(tracker_module, "STRAND_AFTER", 0.0)
    tracker, _ = ready(3)
    result = cell(tracker)
    entry = {"id": 0, "op": "all_reduce", "group": "0", "seq": 1, "done": False, "cell": 1, "t": 1.0}
    feed(tracker, "c", 0, {"t": Msg.COLLECTIVES_PUSH, "rank": 0, "entries": [entry], "now": 2.0, "groups": {"0": [0, 1, 2]}})
    feed(tracker, "s", 1, exit_report(1, time.time()))
    tracker.on_tick()
    assert result.running == [0, 2]  # rank 2 may still finish or raise on its own
