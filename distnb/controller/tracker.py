"""The controller's picture of its pool, fed by messages: the pool's and each rank's lifecycle.

Every change of :class:`PoolState` and :class:`RankState` happens here, in :meth:`Tracker._move`
and :meth:`Tracker._set_rank`, under the tracker's one lock. The I/O thread feeds it messages
(:meth:`Tracker.on_message`) and ticks (:meth:`Tracker.on_tick`); the pool asks it to start,
stop and begin cells. It sends through a :class:`~distnb.controller.requests.Transport`: a test
feeds it messages and reads what it sent, with no process or socket.

Pool::

    NEW ─► STARTING ─► READY ◄─► (BROKEN: a rank died) ─► STOPPING ─► STOPPED ─► STARTING …
               └──────────────────────────────────────────►┘
    READY, BROKEN ─► STARTING: a respawn (fresh rank processes, torchrun and supervisors kept)

Rank::

    LAUNCHED ─► STARTED ─► CONNECTED ─► IDLE ◄─► RUNNING       (any) ─► DEAD
    (torchrun)  (supervisor) (hello)    (ready)  (a cell)
"""

from __future__ import annotations

import collections
import pickle
import threading
import time
from typing import Any, Callable, TypeVar, cast

from distnb import _processes
from distnb.analysis.agreement.desync import CountMismatch, carry_over, count_mismatches
from distnb.controller.asks import Asks
from distnb.controller.cell_run import CellRun
from distnb.controller.channel import FollowUp
from distnb.controller.collective_log import CollectiveLog
from distnb.controller.deaths import Deaths
from distnb.controller.liveness import Liveness, gone_without_report, lost_machines, supervisor_gone
from distnb.controller.prompts import Prompt
from distnb.controller.rank_record import RankRecord
from distnb.controller.requests import Requests, Transport
from distnb.errors import NoPoolError, PoolBrokenError, PoolBusyError
from distnb.launching.remote_nodes import Nodes
from distnb.results import CellEvents, CellResult, RankResult
from distnb.states import POOL_MOVES, RANK_MOVES, CellStatus, PoolState, RankState
from distnb.status import RankStatus
from distnb.wire.peers import Peer, PeerKind, control_identity, supervisor_identity
from distnb.wire.protocol import CellDone, FromNode, Inbound, Msg, RankEvent, SupHello, accept_event

__all__ = ["OUTPUT_KEEP_BYTES", "Tracker"]

T = TypeVar("T")

#: Runs of recent cells kept for :meth:`Tracker.run_of` (more while cells still run).
_RUNS_KEPT = 64

#: Output kept per rank, per stream, per cell; the rest is counted, not stored.
OUTPUT_KEEP_BYTES = 1 << 20
#: Seconds after a death before a cell whose remaining ranks all wait for a dead one ends (the
#: tick comes once a second: the notebook hears within ~2 s).
STRAND_AFTER = 1.0
#: A cell still running this long wakes its ranks' control threads to watch its collectives
#: (distnb.worker.process.control); quicker cells wake nothing but the ranks' main threads.
WATCH_AFTER = 0.05



class Tracker:
    """Pool and rank states, one lock, fed by messages. Read its state; never assign it."""

    def __init__(self, world_size: int, log: CollectiveLog | None = None) -> None:
        self.world_size = world_size
        self.lock = threading.RLock()
        #: Notified on every message and tick: ``start`` and ``shutdown`` wait on it.
        self.changed = threading.Condition(self.lock)
        self.collective_log = log if log is not None else CollectiveLog()
        self.requests = Requests(lambda: self.transport)
        self.nodes = Nodes(0)
        self.transport: Transport | None = None
        self.liveness: Liveness | None = None
        #: ``handler(agent, msg)`` for node agents' messages (multi-node pools), under the lock.
        self.node_handler: Callable[[int, FromNode], None] | None = None
        self.dap_handler: Callable[[int, list[dict[str, Any]]], None] | None = None  # the ranks' debugpy (services/rank_debug.py)
        self.ranks: dict[int, RankRecord] = {}
        self.notes: list[str] = []  # for start()'s on_note, taken on the caller's thread
        self._state = PoolState.NEW
        self._deaths = Deaths(self.collective_log)
        self._last_results: dict[int, RankResult] = {}
        # The live run behind each recent cell result, by cell number: a public result carries no
        # private state; the oldest are forgotten once ended (a forgotten run reads as ended).
        self._runs: collections.OrderedDict[int, CellRun] = collections.OrderedDict()
        self._asks = Asks(self.requests, lambda: self.transport, self.collective_log)
        self.desync: list[CountMismatch] = []  # the last cell's end-of-cell count mismatches

    # -- the one place states change ------------------------------------------------------------
    @property
    def state(self) -> PoolState:
        return self._state

    @property
    def first_death(self) -> int | None:
        """The rank that died first (the root cause), by time of death."""
        return self._deaths.first

    def _move(self, state: PoolState) -> None:
        if state not in POOL_MOVES[self._state]:
            raise RuntimeError(f"distnb bug: the pool can't go from {self._state.value} to {state.value}.")
        self._state = state
        self.changed.notify_all()

    def _set_rank(self, info: RankRecord, state: RankState) -> None:
        if state == info.state:
            return
        if state not in RANK_MOVES[info.state]:
            return  # late or reordered messages (a READY after a death) must not revive a rank
        info.state = state
        if state == RankState.DEAD and self._state == PoolState.READY:
            self._move(PoolState.BROKEN)

    # -- who else hears the ranks (set by the pool) ----------------------------------------------
    def route_debugger(self, handler: Callable[[int, list[dict[str, Any]]], None]) -> None:
        """The ranks' debugpy messages go to ``handler(rank, msgs)`` (services/rank_debug.py)."""
        with self.lock:
            self.dap_handler = handler

    def route_nodes(self, handler: Callable[[int, FromNode], None]) -> None:
        """Node agents' messages (a multi-node pool) go to ``handler(agent, msg)``, under the lock."""
        with self.lock:
            self.node_handler = handler

    def watch(self, liveness: Liveness) -> None:
        """How to tell the rank processes this machine started are alive (the launcher)."""
        with self.lock:
            self.liveness = liveness

    def new_generation(self, ranks: list[int], newest: dict[int, int]) -> None:
        """A regroup made a new default group, named "0" again and counting from #1: the log ignores
        every record the ranks made so far (up to ``newest``, each rank's own), and no mismatch carries over."""
        with self.lock:
            log = self.collective_log
            log.new_generation({r: max(log.last_id(r), newest.get(r, -1)) for r in ranks})
            self.desync = []

    # -- lifecycle (called by the pool) ---------------------------------------------------------
    def begin_start(self, transport: Transport, nodes: Nodes) -> None:
        with self.lock:
            self._move(PoolState.STARTING)
            self.transport, self.liveness, self.nodes = transport, None, nodes
            self._reset({r: RankRecord(r) for r in range(self.world_size)})

    def _reset(self, ranks: dict[int, RankRecord]) -> None:
        """What a new set of rank processes starts from."""
        self.ranks = ranks
        self._deaths.reset()
        self._last_results = {}
        self.notes = []
        self.desync = []
        self.collective_log.clear()

    def begin_respawn(self) -> bool:
        """READY/BROKEN -> STARTING for fresh rank processes under the same supervisors (which
        stay up: their records are kept, the ranks' are new). Cells still running end as dead
        ("its pool was restarted"). False, changing nothing, where a supervisor is gone."""
        with self.lock:
            if self._state not in (PoolState.READY, PoolState.BROKEN):
                return False
            if any(i.supervisor_pid is None or supervisor_gone(i, self.nodes, self.liveness) is not None for i in self.ranks.values()):
                return False
            for info in self.ranks.values():
                if info.run is not None and info.state != RankState.DEAD:
                    info.cause = "its pool was restarted"
                    self._set_rank(info, RankState.DEAD)  # (a READY pool turns BROKEN, then STARTING)
                    self._finish_rank_dead(info)
            self._move(PoolState.STARTING)
            self._reset({r: RankRecord(r, RankState.STARTED, supervisor_pid=i.supervisor_pid, host=i.host, local_rank=i.local_rank,
                                       agent=i.agent, group_rank=i.group_rank, agent_beats=i.agent_beats)
                         for r, i in self.ranks.items()})
            return True

    def mark_ready(self) -> bool:
        """STARTING -> READY, atomically with the check that every rank is idle: a rank that died
        after saying READY and before this must fail the start, not leave a READY pool with a
        dead rank in it. False when not every rank is idle."""
        with self.lock:
            if any(i.state != RankState.IDLE for i in self.ranks.values()):
                return False
            self._move(PoolState.READY)
            return True

    def begin_stop(self) -> bool:
        """-> STOPPING; False when there is nothing to stop (never started, or stopped)."""
        with self.lock:
            if self._state in (PoolState.NEW, PoolState.STOPPED, PoolState.STOPPING):
                return False
            self._move(PoolState.STOPPING)
            return True

    def stopped(self) -> None:
        """Every rank dead, cells still waiting ended with them, -> STOPPED."""
        with self.lock:
            for info in self.ranks.values():
                self._set_rank(info, RankState.DEAD)
                if info.run is not None:
                    self._finish_rank_dead(info)
            self.transport = None
            self._move(PoolState.STOPPED)

    def note(self, text: str) -> None:
        with self.lock:
            self.notes.append(text)
            del self.notes[:-50]

    def take_notes(self) -> list[str]:
        with self.lock:
            notes, self.notes = self.notes, []
            return notes

    # -- cells ----------------------------------------------------------------------------------
    def check_usable(self) -> None:
        """Raise unless the pool can run cells: :class:`PoolBrokenError` naming the first death."""
        if self._state == PoolState.BROKEN:
            dead = sorted(r for r, i in self.ranks.items() if i.state == RankState.DEAD)
            first = self.ranks.get(self._deaths.first if self._deaths.first is not None else (dead[0] if dead else -1))
            why = f"rank {first.rank} died ({_processes.signal_meaning(first.returncode)})" if first else "a rank died"
            raise PoolBrokenError(
                f"the pool is broken: {why}, so collectives can't complete any more. "
                "Run %dist_restart (pool.restart()) for fresh ranks, or %dist_restart --replay to re-run the cells that succeeded.",
                dead=dead, first_death=first.rank if first else None,
            )
        if self._state != PoolState.READY:
            raise NoPoolError(f"the pool is {self._state.value}; start one with %dist_launch (distnb.launch()).")

    def busy(self, ranks: list[int] | None = None) -> dict[int, int]:
        """``{rank: cell}`` of the given (default: all) ranks still running a cell."""
        with self.lock:
            chosen = self.ranks if ranks is None else ranks
            return {r: run.result.cell for r in chosen if (run := self.ranks[r].run) is not None}

    def raise_if_busy(self, ranks: list[int]) -> None:
        busy = self.busy(ranks)
        if busy:
            raise PoolBusyError.of(busy)

    def ensure_idle(self, ranks: list[int]) -> None:
        """For requests that need the ranks' main threads: the pool usable and these ranks free."""
        with self.lock:
            self.check_usable()
            self.raise_if_busy(ranks)

    def run_of(self, result: CellResult) -> CellRun:
        """The live run behind a result the pool returned; an old one's run reads as ended."""
        with self.lock:
            run = self._runs.get(result.cell)
            if run is not None and run.result is result:
                return run
        return CellRun.ended(result)

    def prompts_waiting(self, result: CellResult) -> list[Prompt]:
        """Ranks of this cell waiting for a line now (pdb, ``input()``), in rank order."""
        run = self.run_of(result)
        with self.lock:
            return [p for r, p in sorted(run.prompts.items()) if r in run.waiting_done and not p.answered]

    def answer_prompt(self, prompt: Prompt, to: bytes, msg: dict[str, Any]) -> None:
        """Mark ``prompt`` answered and send the answer (a STDIN_REPLY) to ``to``."""
        if self.transport is None:
            raise NoPoolError("the pool is not running; start one with %dist_launch.")
        with self.lock:
            prompt.answered = True
        self.transport.send(to, msg)

    def wait_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until ``done()``, judged under the lock at every change."""
        with self.changed:
            return self.changed.wait_for(done, timeout)

    def under_lock(self, read: Callable[[], T]) -> T:
        """``read()`` with the state held still."""
        with self.lock:
            return read()

    def begin_cell(self, result: CellResult, events: CellEvents) -> CellRun:
        """Mark the result's ranks RUNNING (raising if the pool can't run it) and return its run."""
        with self.lock:
            self.ensure_idle(result.ranks)
            run = CellRun(result, events)
            self._runs[result.cell] = run
            while len(self._runs) > _RUNS_KEPT and next(iter(self._runs.values())).finished.is_set():
                self._runs.popitem(last=False)
            for r in result.ranks:
                info = self.ranks[r]
                info.run = run
                self._set_rank(info, RankState.RUNNING)
                self._last_results[r] = result.results[r]
            self._asks.ran_cell(result.ranks)
            return run

    def watch_follow_up(self, run: CellRun) -> FollowUp:
        """For the cell's EXEC: once it has run WATCH_AFTER, the control threads of the ranks it
        still runs on start watching its collectives."""
        def watch() -> None:
            with self.lock:
                ranks = sorted(run.waiting_done)
            if self.transport is not None:
                self.transport.send_many(map(control_identity, ranks), {"t": Msg.WATCH})

        return FollowUp(WATCH_AFTER, watch, lambda: bool(run.waiting_done))

    # -- views ----------------------------------------------------------------------------------
    def alive(self, ranks: list[int]) -> list[int]:
        with self.lock:
            return [r for r in ranks if r in self.ranks and self.ranks[r].state != RankState.DEAD]

    def stages(self) -> dict[int, RankState]:
        with self.lock:
            return {r: info.state for r, info in self.ranks.items()}

    def ranks_by_agent(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        with self.lock:
            for r, info in sorted(self.ranks.items()):
                if info.agent and info.supervisor_pid is not None:
                    out.setdefault(info.agent, []).append(r)
        return out

    def rank_statuses(self) -> list[RankStatus]:
        now = time.monotonic()
        with self.lock:
            return [
                RankStatus(
                    rank=r, state=info.state, pid=info.pid, host=info.host, device=info.device,
                    cell=info.run.result.cell if info.run else None,
                    elapsed=now - info.run.started if info.run else None,
                    returncode=info.returncode, local_rank=info.local_rank, node=info.group_rank, cause=info.cause,
                )
                for r, info in sorted(self.ranks.items())
            ]

    def backend(self) -> str | None:
        with self.lock:
            return next((i.backend for i in self.ranks.values() if i.backend), None)

    # -- messages (the I/O thread) --------------------------------------------------------------
    def on_message(self, peer: Peer, msg: Inbound) -> None:
        """A message the channel accepted (:func:`~distnb.wire.protocol.accept`: its kind is one
        this peer may send, with its fields), dispatched by peer and kind."""
        with self.lock:
            if peer.kind is PeerKind.NODE:  # accept() let through only a node agent's kinds
                if self.node_handler is not None:
                    self.node_handler(peer.number, cast(FromNode, msg))
            elif (info := self.ranks.get(peer.number)) is not None:
                if msg["t"] == Msg.REPLY:  # its fields depend on the request: read as a plain dict, not copied
                    self.requests.deliver(info.rank, cast(dict[str, Any], msg))
                elif msg["t"] == Msg.COLLECTIVES_PUSH:
                    if "pid" not in msg or msg["pid"] == info.pid:  # not one the replaced process queued
                        self.collective_log.merge(info.rank, msg)
                elif msg["t"] == Msg.DAP_PUSH and self.dap_handler is not None:
                    self.dap_handler(info.rank, msg["msgs"])
                elif msg["t"] == Msg.SUP_HELLO:
                    self._on_sup_hello(info, msg)
                elif msg["t"] == Msg.OUTPUT:
                    text = info.decode(msg["stream"], msg["data"])
                    if text:
                        self._route_output(info, msg["stream"], text)
                elif msg["t"] == Msg.EVENT:
                    # Unsigned inside, but it reached us in a frame signed by the rank's supervisor,
                    # which read it from a pipe only its own child can write.
                    self._on_event(info, accept_event(pickle.loads(msg["body"])), direct=False)
                elif msg["t"] == Msg.RANK_EXIT:
                    info.learn_exit(msg)
                    self._mark_dead(info, msg.get("time"))
                elif msg["t"] == Msg.CELL_DONE:  # a silent cell's, straight from the rank
                    self._cell_done(info, msg, direct=True)
                elif msg["t"] == Msg.HELLO:
                    info.learn_hello(msg)
                    self.collective_log.place(info.rank, msg["host"])
                    if info.state in (RankState.LAUNCHED, RankState.STARTED):
                        self._set_rank(info, RankState.CONNECTED)
                elif msg["t"] == Msg.READY:
                    info.learn_ready(msg)
                    self._set_rank(info, RankState.IDLE)
                elif msg["t"] == Msg.START_FAILED:
                    info.learn_start_failure(msg)
            self.changed.notify_all()

    def _on_sup_hello(self, info: RankRecord, msg: SupHello) -> None:
        info.learn_supervisor(msg)
        if "pid" in msg:
            if info.agent:
                node = self.nodes.agents.get(info.agent)
                info.agent_beats = node.beats if node else 0
            elif self.liveness is not None:
                self.liveness.known_pids.add(msg["pid"])
            if self.transport is not None:
                self.transport.heartbeat_peers.add(supervisor_identity(info.rank))
            if info.state == RankState.LAUNCHED:
                self._set_rank(info, RankState.STARTED)
        if "child_pid" in msg and self.liveness is not None and not info.agent:
            self.liveness.known_pids.add(msg["child_pid"])

    def _on_event(self, info: RankRecord, event: RankEvent, direct: bool) -> None:
        """What a rank wrote into its events pipe, forwarded by its supervisor after its output."""
        if event["t"] == Msg.CELL_DONE:
            self._cell_done(info, event, direct)
        elif event["t"] == Msg.STDIN_REQUEST:
            if (run := info.run) is not None and run.result.cell == event["cell"]:
                run.prompts[info.rank] = Prompt.of(info.rank, event)
        elif event["t"] == Msg.DISPLAY:
            if (run := info.run) is not None and run.result.cell == event["cell"]:
                run.result.results[info.rank].displays.append(event["data"])
                if run.events.on_display:
                    run.events.on_display(info.rank, event["data"])
            else:
                info.log.append(event["data"].get("text/plain", ""))

    def _cell_done(self, info: RankRecord, msg: CellDone, direct: bool) -> None:
        run = info.run
        if run is None or run.result.cell != msg["cell"]:
            return  # a cell the controller stopped waiting for (restart, detach)
        res = run.done(info.rank, msg, direct)
        if res.error and "OutOfMemoryError" in str(res.error.get("ename")) and run.waiting_done:
            self._asks.memory_of(run.result.live_memory, sorted(run.waiting_done))
        self._maybe_finish(info)

    def _route_output(self, info: RankRecord, stream: str, text: str) -> None:
        run = info.run
        if run is None or info.rank not in run.waiting_done:
            info.log.append(text)
            del info.log[:-200]
            return
        run.add_output(info.rank, stream, text, OUTPUT_KEEP_BYTES)

    def _maybe_finish(self, info: RankRecord) -> None:
        run = info.run
        if run is None or not run.rank_finished(info.rank):
            return
        info.run = None
        if self.dap_handler is not None:  # a rank the debugger panel held when its cell ended (interrupted, died)
            self.dap_handler(info.rank, [{"type": "event", "event": "distnb_cell_done"}])
        if info.state == RankState.RUNNING:
            self._set_rank(info, RankState.IDLE)
        if run.events.on_rank_done:
            run.events.on_rank_done(run.result.results[info.rank])
        if not run.waiting_done:  # the last of its ranks
            run.result.elapsed = time.monotonic() - run.started
            found = count_mismatches({r: res.sync for r, res in run.result.results.items() if res.status != CellStatus.DEAD})
            run.result.desync = self.desync = carry_over(found, self.desync, run.result.cell)
            run.events = CellEvents()  # let go of the caller's callbacks (views, printers)
            run.finished.set()

    def _mark_dead(self, info: RankRecord, when: float | None = None) -> None:
        self._deaths.stamp(info, when)
        if self._state in (PoolState.READY, PoolState.STARTING, PoolState.BROKEN):
            self._deaths.order(info, self.ranks)
        self._set_rank(info, RankState.DEAD)
        self._finish_rank_dead(info)

    def _finish_rank_dead(self, info: RankRecord) -> None:
        run = info.run
        if run is None:
            return
        res = run.result.results[info.rank]
        if res.status == CellStatus.RUNNING:
            self._deaths.conclude(info, res, run.result.cell)
        run.waiting_done.discard(info.rank)
        self._maybe_finish(info)

    # -- the tick (the I/O thread, once a second) -----------------------------------------------
    def on_tick(self) -> None:
        with self.lock:
            self.requests.prune()
            if self._state in (PoolState.READY, PoolState.STARTING, PoolState.BROKEN):
                for note in lost_machines(self.nodes, self.ranks, self._last_results):
                    self.note(note)
                for info in gone_without_report(self.ranks, self.nodes, self.liveness):
                    self._mark_dead(info)
                self._asks.poll_collectives({r for r, i in self.ranks.items() if i.run is not None},
                                            {r for r, i in self.ranks.items() if i.state == RankState.DEAD})
            if self._state == PoolState.BROKEN:
                self._end_stranded_cells()
            self.changed.notify_all()

    def _end_stranded_cells(self) -> None:
        """Ranks waiting for a dead one stay blocked until the group's timeout (or forever): once
        every rank the cell still waits for is, end the cell for the notebook (STRAND_AFTER after
        the first death, so an error the survivors raise themselves comes first)."""
        deaths = [i.died_at for i in self.ranks.values() if i.died_at is not None]
        if not deaths or time.monotonic() - min(deaths) < STRAND_AFTER:
            return
        dead = {r for r, i in self.ranks.items() if i.state == RankState.DEAD}
        for run in {id(i.run): i.run for i in self.ranks.values() if i.run is not None}.values():
            blocked = {r: why for r in sorted(run.waiting_done) if (why := self.collective_log.blocked_on(r, run.result.cell, dead))}
            if blocked and len(blocked) == len(run.waiting_done):
                run.strand(blocked, sorted(dead), time.monotonic() - min(deaths))
