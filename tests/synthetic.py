"""Synthetic ranks: the controller driven through its seam (messages in, the magics' own calls on
top) by as many ranks as a test or benchmark asks for, with no process. Used by the scale tests
(tests/analysis/test_scale.py) and by benchmarks/bench_scale.py, so the views a test checks for
correctness are the ones the benchmark times.

Each synthetic rank answers the control thread's requests (STACKS, COLLECTIVES, MEMORY) the way a
real one does, from what the test told it: its collective entries, its stack, its memory.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Any

from distnb.config import LaunchConfig
from distnb.controller.session import SessionLog
from distnb.controller.tracker import Tracker
from distnb.launching.remote_nodes import Nodes
from distnb.results import CellEvents, CellResult, RankResult
from distnb.services.inspector import Inspector
from distnb.wire.protocol import Msg
from distnb.worker.torch_hooks.flight_recorder import SentGroups

from conftest import FakeTransport, feed

__all__ = ["SyntheticPool", "healthy_cell", "hung_cell"]

C10D = ("/torch/distributed/distributed_c10d.py", 2800, "all_reduce", "work.wait()")


@dataclass
class _Rank:
    entries: list[dict[str, Any]] = field(default_factory=list)
    frames: list[tuple[str, int, str, str]] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    groups: SentGroups | None = None  # the rank side's own logic: members sent once, as a real rank does


class SyntheticPool:
    """A ready pool of ``world`` synthetic ranks: a real Tracker, SessionLog and Inspector."""

    def __init__(self, world: int, hang_after: float = 1.0, per_node: int = 8) -> None:
        self.world = world
        self.tracker = Tracker(world)
        self.transport = FakeTransport()
        self.session = SessionLog()
        nodes = world // per_node if world > per_node and world % per_node == 0 else 1
        self.config = LaunchConfig(nproc=world // nodes, nnodes=nodes, local_nodes=nodes > 1, backend="gloo", hang_after=hang_after)
        self.inspector = Inspector(self.tracker, self.config, self.session, run_dir=lambda: None)
        self.ranks = {r: _Rank() for r in range(world)}
        self.reply_bytes = 0
        self.tracker.begin_start(self.transport, Nodes(0))
        for r in range(world):
            host = f"node{r // per_node}"
            feed(self.tracker, "s", r, {"t": Msg.SUP_HELLO, "rank": r, "pid": 10000 + r, "host": host, "local_rank": r % per_node,
                                        "group_rank": r // per_node, "agent": 0})
            feed(self.tracker, "x", r, {"t": Msg.HELLO, "rank": r, "local_rank": r % per_node, "world_size": world,
                                        "pid": 20000 + r, "host": host, "main_ident": 1})
            feed(self.tracker, "x", r, {"t": Msg.READY, "rank": r, "device": "cpu", "backend": "gloo"})
        assert self.tracker.mark_ready()
        self.transport.on_send = self._answer
        self._ids = {r: 0 for r in range(world)}

    @property
    def now(self) -> float:
        """The ranks' clock: running, an hour behind the controller's (another machine's clock;
        the controller must measure every age against the rank's own)."""
        return time.time() - 3600.0

    # -- a cell ----------------------------------------------------------------------------------
    def cell(self, code: str = "x = 1", ranks: list[int] | None = None) -> CellResult:
        ranks = list(range(self.world)) if ranks is None else ranks
        n = len(self.session.history) + 1
        result = CellResult(cell=n, code=code, ranks=ranks, results={r: RankResult(r) for r in ranks})
        self.tracker.begin_cell(result, CellEvents())
        self.session.add_cell(result)
        self.tracker.run_of(result).started -= 100  # long enough to be looked at as a hang
        return result

    def output(self, rank: int, text: str) -> None:
        feed(self.tracker, "s", rank, {"t": Msg.OUTPUT, "stream": "stdout", "data": text.encode()})

    def done(self, rank: int, result: CellResult, status: str = "ok", error: dict[str, Any] | None = None,
             duration: float = 0.1, memory: dict[str, Any] | None = None) -> None:
        msg = {"t": Msg.CELL_DONE, "cell": result.cell, "status": status, "value": None, "error": error,
               "duration": duration, "memory": memory}
        feed(self.tracker, "s", rank, {"t": Msg.EVENT, "body": pickle.dumps(msg)})

    # -- what each rank reports when asked ------------------------------------------------------
    def collective(self, rank: int, seq: int, cell: int, t: float, op: str = "all_reduce", done: bool = True,
                   group: str = "0", sizes: list[list[int]] | None = None) -> dict[str, Any]:
        """Record one Flight Recorder entry on ``rank`` (pushed with the next answer)."""
        self._ids[rank] += 1
        entry = {"id": self._ids[rank], "rec": "fr", "group": group, "desc": "default_pg", "seq": seq, "p2p": False, "op": op,
                 "sizes": sizes or [[1024]], "dtypes": ["Float"], "t": t, "done": done, "state": "completed" if done else "started",
                 "started": None, "ended": None, "queued": False, "cell": cell}
        self.ranks[rank].entries.append(entry)
        return entry

    def push(self, rank: int, queued: float = 0.0) -> None:
        """The rank's control thread pushes its new entries unasked, as after a collective;
        ``queued``: seconds the push waited in the controller before it was read (its ``now`` is
        that much older than the controller's clock at reading)."""
        reply = self._collectives(rank, -1)
        reply["now"] -= queued
        feed(self.tracker, "c", rank, {"t": Msg.COLLECTIVES_PUSH, "rank": rank, **reply})

    def in_collective(self, rank: int, line: int = 2, code: str = "dist.all_reduce(x)") -> None:
        self.ranks[rank].frames = [("<cell-1>", line, "<module>", code), C10D]

    def computing(self, rank: int, line: int = 1, code: str = "y = model(x)") -> None:
        self.ranks[rank].frames = [("<cell-1>", line, "<module>", code)]

    def _collectives(self, rank: int, since: int, force: bool = False) -> dict[str, Any]:
        state = self.ranks[rank]
        if state.groups is None:
            world = list(range(self.world))
            state.groups = SentGroups(key=lambda: 1, read=lambda: ({"0": world}, {"0": "default_pg"}))
        return {"entries": [e for e in state.entries if e["id"] > since or not e["done"]], "now": self.now, "calls": [],
                **state.groups.fields(force)}

    def _answer(self, identity: bytes, msg: dict[str, Any]) -> None:
        kind, rank = identity[:1], int(identity[1:])
        if kind != b"c" or "id" not in msg:
            return
        reply: dict[str, Any] = {"t": Msg.REPLY, "id": msg["id"], "rank": rank, "now": self.now}
        if msg["t"] == Msg.STACKS:
            frames = self.ranks[rank].frames or [("/distnb/worker/rank.py", 1, "serve", "")]
            reply.update(stacks=[{"thread": "MainThread", "main": True, "frames": frames}],
                         collectives=self._collectives(rank, int(msg.get("collectives_since", -1)), bool(msg.get("groups"))))
        elif msg["t"] == Msg.COLLECTIVES:
            reply.update(self._collectives(rank, int(msg.get("since", -1)), bool(msg.get("groups"))))
        elif msg["t"] == Msg.MEMORY:
            reply.update(memory=self.ranks[rank].memory or {"rss": 1 << 30})
        else:
            return
        self.reply_bytes += len(pickle.dumps(reply))
        feed(self.tracker, "c", rank, reply)


def healthy_cell(pool: SyntheticPool, steps: int = 50, step_s: float = 0.3, queued: dict[int, float] | None = None) -> CellResult:
    """A cell still running on every rank after ``steps`` all_reduces that every rank completed,
    arriving in a rank-dependent but small spread (nobody straggles); each rank has just entered
    the next one (the watch sees collectives in progress, not a hang). ``queued``: ranks whose
    push the controller read that late (seconds)."""
    result = pool.cell("for step in range(100):\n    dist.all_reduce(x)\n    y = model(x)")
    base = pool.now  # one instant for every rank: building thousands of ranks takes a while
    for r in range(pool.world):
        for s in range(1, steps + 1):
            pool.collective(r, s, result.cell, base - 100 + s * step_s + ((r * 7919 + s * 31) % 13) * 1e-4)
        pool.collective(r, steps + 1, result.cell, base - 0.01, done=False)
        pool.in_collective(r, line=2)
        pool.push(r, (queued or {}).get(r, 0.0))
    return result


def hung_cell(pool: SyntheticPool, steps: int = 50, odd: int = 17) -> CellResult:
    """A cell hung after ``steps`` all_reduces: every rank but ``odd`` waits in the next one;
    ``odd`` computes and never entered it."""
    result = pool.cell("for step in range(100):\n    dist.all_reduce(x)\n    y = model(x)")
    base = pool.now  # one instant for every rank: building thousands of ranks takes a while
    for r in range(pool.world):
        for s in range(1, steps + 1):
            pool.collective(r, s, result.cell, base - 100 + s * 0.3 + ((r * 7919 + s * 31) % 13) * 1e-4)
        if r == odd:
            pool.computing(r, line=3)
        else:
            pool.collective(r, steps + 1, result.cell, base - 80, done=False)
            pool.in_collective(r, line=2)
        pool.push(r)
    return result
