"""The ranks' debugpy, as one debug target for the notebook's debugger panel.

Each rank runs debugpy in-process (worker/process/panel_link.py); its control thread relays DAP over the
pool's own connection. This service speaks to all of them at once: it attaches the ranks, keeps the
panel's breakpoints and replays them to ranks that attach later, and joins their answers into one
view — the ranks' threads named ``rank 2 · MainThread``, and one call stack holding every paused
rank's frames. Each rank's debugpy numbers its threads, frames and variables from 1, so every id
the panel sees is this service's own (:class:`_Ids`), mapped back to (rank, id) on the way in.

What the panel selects decides where commands go: the rank of the frame it last asked scopes for
(the frame the user clicked) is the one continue / next / step act on.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from distnb.analysis.agreement.groups import GroupInfo
from distnb.analysis.verdicts.next_calls import NextCall, compare_next
from distnb.cell_names import cell_name
from distnb.controller.requests import Requests
from distnb.ranks import format_ranks
from distnb.states import RankState
from distnb.status import RankStatus
from distnb.wire.peers import control_identity
from distnb.wire.protocol import Msg

__all__ = ["ANSWER_TIMEOUT", "RankDebug"]

#: Seconds a rank's debugpy has to answer one request (it answers from its own thread, paused
#: rank or not; a rank stuck in C code holding the GIL is the exception — it is left out).
ANSWER_TIMEOUT = 10.0
#: Seconds to start debugpy in a rank and attach to it (an import and a loopback connection).
ATTACH_TIMEOUT = 60.0
#: The first id the panel sees for a rank's thread, frame or variable: far above the kernel's own.
FIRST_ID = 1_000_000_000
#: Above this many paused ranks, ranks whose stacks are alike share one entry in the Callstack
#: (``ranks 0-62 · MainThread · <module>``), the majority first; a step on it steps them all.
ALIKE_ABOVE = 8
#: Events the panel needs from a rank; the rest (threads starting, modules, output) are debugpy's
#: chatter about the rank's own process.
_EVENTS = {"stopped", "continued"}


class _Ids:
    """The panel's ids for (rank, kind, debugpy's id); kinds: thread, frame, ref (variables, sources)."""

    def __init__(self) -> None:
        self._next = itertools.count(FIRST_ID)
        self._to: dict[tuple[int, str, int], int] = {}
        self._from: dict[int, tuple[int, str, int]] = {}
        self._lock = threading.Lock()  # the pool's I/O thread and the kernel's control thread both map

    def out(self, rank: int, kind: str, local: int) -> int:
        if not local:
            return 0  # "no children" stays 0
        key = (rank, kind, local)
        with self._lock:
            if key not in self._to:
                self._to[key] = n = next(self._next)
                self._from[n] = key
            return self._to[key]

    def back(self, panel_id: Any) -> tuple[int, str, int] | None:
        with self._lock:
            return self._from.get(panel_id) if isinstance(panel_id, int) else None

    def forget(self, rank: int) -> None:
        """A rank moved on: its frames and variables are gone (its threads stay)."""
        with self._lock:
            for key in [k for k in self._to if k[0] == rank and k[1] != "thread"]:
                del self._from[self._to.pop(key)]


@dataclass
class _Rank:
    pid: int | None  # the process attached (a restart makes a new one, to attach again)
    seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    waiting: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # request seq → [response]
    paused: list[int] = field(default_factory=list)  # debugpy's ids of its stopped threads, in order
    before: dict[int, dict[str, Any]] = field(default_factory=dict)  # thread → the collective it stopped before
    names: dict[int, str] = field(default_factory=dict)  # thread id → name


class RankDebug:
    """The ranks' debuggers behind one DAP target (built from the requests table and the live ranks)."""

    def __init__(self, requests: Requests, statuses: Callable[[], list[RankStatus]]) -> None:
        """``statuses``: the ranks as the tracker knows them (their processes: a restart makes new ones)."""
        self._requests = requests
        self._statuses = statuses
        self._ids = _Ids()
        self._ranks: dict[int, _Rank] = {}
        self._breakpoints: dict[str, list[dict[str, Any]]] = {}  # the panel's file → its breakpoints
        self._exceptions: dict[str, Any] | None = None  # the panel's "pause on exceptions" (setExceptionBreakpoints' arguments)
        self._stops = False  # the panel's "before each collective"
        self._cond = threading.Condition()
        self.selected: int | None = None
        self._alike: dict[int, list[int]] = {}  # a shared entry's frame id → the ranks it stands for
        self._selected_all: list[int] = []  # the ranks of the shared entry the user selected
        #: Called with each event for the panel (ids already the panel's), from the pool's I/O thread.
        self.on_event: Callable[[dict[str, Any]], None] | None = None

    # -- attaching -----------------------------------------------------------------------------
    @property
    def attached(self) -> list[int]:
        return sorted(self._ranks)

    def attach(self, breakpoints: dict[str, list[dict[str, Any]]] | None = None, exceptions: dict[str, Any] | None = None,
               stops: bool | None = None, timeout: float = ATTACH_TIMEOUT) -> str:
        """Start debugpy in every live rank not yet attached, and give it the panel's breakpoints
        (``breakpoints``: the panel's, by file, and ``exceptions``, its "pause on exceptions", when
        they are known). Returns what went wrong, in words ("" when every rank is attached)."""
        if breakpoints is not None:
            self._breakpoints = {path: [dict(b) for b in points] for path, points in breakpoints.items() if points}
        if exceptions is not None:
            self._exceptions = dict(exceptions)
        if stops is not None:
            self._stops = stops
        live = {s.rank: s.pid for s in self._statuses() if s.state is not RankState.DEAD and s.pid is not None}
        for rank in [r for r, link in self._ranks.items() if live.get(r, -1) != link.pid]:
            self._drop(rank)  # a restarted or dead rank: its debugpy is gone
        todo = sorted(r for r in live if r not in self._ranks)
        if not todo:
            return ""
        with self._cond:
            for r in todo:
                self._ranks[r] = _Rank(live[r])
        problems = []
        init = {"clientID": "distnb", "adapterID": "distnb", "pathFormat": "path", "linesStartAt1": True, "columnsStartAt1": True}
        seqs = {r: [self._seq(r, "initialize"), self._seq(r, "attach"), self._seq(r, "configurationDone")] for r in todo}
        msgs = {r: [_request(s[0], "initialize", init), _request(s[1], "attach", {}), _request(s[2], "configurationDone", {})]
                for r, s in seqs.items()}
        acks = self._send(todo, msgs, timeout)
        for r in todo:
            if "error" in acks.get(r, {"error": "no answer"}):
                problems.append(f"rank {r}: {acks.get(r, {}).get('error', 'no answer')}")
                self._drop(r)
        attached = [r for r in todo if r in self._ranks]
        deadline = time.monotonic() + timeout
        for r in attached:
            reply = self._wait(r, seqs[r][1], max(0.1, deadline - time.monotonic()))
            if not reply.get("success"):
                problems.append(f"rank {r}: debugpy refused to attach ({reply.get('message', 'no answer')})")
                self._drop(r)
        for path, points in self._breakpoints.items():
            self._each([r for r in attached if r in self._ranks], "setBreakpoints", {"source": {"path": path}, "breakpoints": points})
        if self._exceptions is not None:
            self._each([r for r in attached if r in self._ranks], "setExceptionBreakpoints", self._exceptions)
        if self._stops:
            self._send([r for r in attached if r in self._ranks], {r: [] for r in attached}, ANSWER_TIMEOUT, stops=True)
        return "; ".join(problems)

    def detach(self) -> None:
        """The panel's debugger was turned off: no breakpoint stays in the ranks, and no rank stays
        paused (debugpy itself stays, idle: it can be started once per process)."""
        paths, self._breakpoints = list(self._breakpoints), {}
        for path in paths:
            self._each(self.attached, "setBreakpoints", {"source": {"path": path}, "breakpoints": []})
        if self._exceptions is not None:
            self._exceptions = None
            self._each(self.attached, "setExceptionBreakpoints", {"filters": []})
        if self._stops:
            self.set_collective_stops(False)
        for r in self.attached:
            for tid in list(self._ranks[r].paused):
                self.request(r, "continue", {"threadId": tid})

    def _drop(self, rank: int) -> None:
        with self._cond:
            link = self._ranks.pop(rank, None)
            if link is not None and link.paused and self.selected == rank:
                self.selected = None
            self._cond.notify_all()
        self._ids.forget(rank)

    # -- what the panel asks -------------------------------------------------------------------
    def set_breakpoints(self, path: str, breakpoints: list[dict[str, Any]]) -> None:
        """The panel's breakpoints in one file (a cell), for every rank now and later."""
        if breakpoints:
            self._breakpoints[path] = [dict(b) for b in breakpoints]
        else:
            self._breakpoints.pop(path, None)
        self._each(self.attached, "setBreakpoints", {"source": {"path": path}, "breakpoints": breakpoints})

    def set_exception_breakpoints(self, arguments: dict[str, Any]) -> None:
        """The panel's "pause on exceptions" filters, for every rank now and later (a rank's error
        in a cell is "user uncaught": distnb's frames, which catch it, are not the user's)."""
        self._exceptions = dict(arguments)
        self._each(self.attached, "setExceptionBreakpoints", self._exceptions)

    def set_collective_stops(self, on: bool) -> None:
        """The panel's "before each collective" (a "pause on exceptions" filter distnb adds): every
        rank stops in the panel before each collective it calls, nothing issued, and the stack names
        what each is about to call — a desync seen before it hangs."""
        self._stops = on
        self._send(self.attached, {r: [] for r in self.attached}, ANSWER_TIMEOUT, stops=on)

    def verdict(self) -> str:
        """The paused ranks' next collectives compared (analysis/next_calls.py), when they stopped before one."""
        with self._cond:
            befores = {r: link.before[t] for r, link in self._ranks.items() for t in link.paused[:1] if t in link.before}
        if not befores:
            return ""
        calls = {r: _next_call(r, b) for r, b in befores.items()}
        report = compare_next(calls, unknown={r: "is still running" for r in self.attached if r not in befores})
        width = max(len(format_ranks(rs)) for rs, _ in report.rows)
        lines = ["[distnb] next collectives of the ranks the debugger panel holds (nothing issued yet):"]
        lines += [f"  {format_ranks(rs):<{width}}  {text}" for rs, text in report.rows]
        lines += [f"[distnb] {p}" for p in report.problems] or ["[distnb] they match: Continue on each rank issues it, Terminate continues them all."]
        return "\n".join(lines + [f"  {n}" for n in report.notes])

    def paused(self) -> dict[int, list[int]]:
        """The paused ranks and the panel's ids of their stopped threads."""
        with self._cond:
            return {r: [self._ids.out(r, "thread", t) for t in link.paused] for r, link in sorted(self._ranks.items()) if link.paused}

    def threads(self) -> list[dict[str, Any]]:
        """Every attached rank's threads the panel has seen stop, named ``rank R · name``."""
        with self._cond:
            return [{"id": self._ids.out(r, "thread", t), "name": f"rank {r} · {link.names.get(t, 'MainThread')}"}
                    for r, link in sorted(self._ranks.items()) for t in sorted({*link.names, *link.paused})]

    def owner(self, panel_id: Any) -> tuple[int, str, int] | None:
        """(rank, kind, debugpy's id) behind one of this service's ids, or None."""
        return self._ids.back(panel_id)

    def stack(self) -> list[dict[str, Any]]:
        """Every paused rank's frames, rank by rank, each frame named ``rank R · thread · function``."""
        paused = {r: list(link.paused) for r, link in self._ranks.items() if link.paused}
        seqs = {(r, t): self._seq(r, "stackTrace") for r, ts in paused.items() for t in ts}
        unnamed = {r: self._seq(r, "threads") for r, ts in paused.items() if any(t not in self._ranks[r].names for t in ts)}
        self._send(sorted(paused), {r: [_request(seqs[r, t], "stackTrace", {"threadId": t}) for t in ts]
                                    + ([_request(unnamed[r], "threads", {})] if r in unnamed else []) for r, ts in paused.items()},
                   ANSWER_TIMEOUT)
        for r, seq in unnamed.items():  # the threads' names, once: asked here, never on the I/O thread
            names = {t["id"]: t["name"] for t in self._wait(r, seq, ANSWER_TIMEOUT).get("body", {}).get("threads", [])}
            if r in self._ranks:
                self._ranks[r].names.update(names)
        stacks = []
        for (r, t), seq in sorted(seqs.items()):
            reply = self._wait(r, seq, ANSWER_TIMEOUT)
            name = self._ranks[r].names.get(t, "MainThread") if r in self._ranks else "MainThread"
            before = self._ranks[r].before.get(t) if r in self._ranks else None
            stacks.append((r, name, before, reply.get("body", {}).get("stackFrames", [])))
        self._alike = {}
        if len(paused) <= ALIKE_ABOVE:
            return [self._frame_out(r, name, f, before if i == 0 else None) for r, name, before, fs in stacks for i, f in enumerate(fs)]
        # Many ranks: those stopped alike (same thread, places, next collective) share one entry.
        alike: dict[Any, list[tuple[int, str, Any, list[dict[str, Any]]]]] = {}
        for st in stacks:
            key = (st[1], json.dumps(st[2], sort_keys=True), tuple((f.get("name"), (f.get("source") or {}).get("path"), f.get("line")) for f in st[3]))
            alike.setdefault(key, []).append(st)
        frames = []
        for members in sorted(alike.values(), key=lambda m: (-len(m), m[0][0])):
            r, name, before, fs = members[0]
            ranks = [m[0] for m in members]
            for i, f in enumerate(fs):
                out = self._frame_out(r, name, f, before if i == 0 else None, who=format_ranks(ranks))
                if len(ranks) > 1:
                    self._alike[out["id"]] = ranks
                frames.append(out)
        return frames

    def forward(self, rank: int, msg: dict[str, Any]) -> dict[str, Any]:
        """One of the panel's requests about rank ``rank``'s frames or variables, its ids turned into
        the rank's on the way in and back into the panel's on the way out."""
        args = dict(msg.get("arguments") or {})
        for key in ("frameId", "variablesReference", "threadId"):
            if key in args and (owner := self._ids.back(args[key])) is not None:
                args[key] = owner[2]
        if isinstance(args.get("source"), dict) and (owner := self._ids.back(args["source"].get("sourceReference"))):
            args["source"] = {**args["source"], "sourceReference": owner[2]}
        if msg["command"] in ("scopes", "evaluate") and "frameId" in msg.get("arguments", {}):
            self.selected, self._selected_all = rank, self._alike.get(msg["arguments"]["frameId"], [])
        reply = self.request(rank, msg["command"], args)
        return {**reply, "seq": msg.get("seq", 0), "request_seq": msg.get("seq", 0), "body": self._body_out(rank, reply.get("body") or {})}

    def step(self, command: str, thread: int | None = None) -> dict[str, Any]:
        """continue / next / stepIn / stepOut / pause on the selected rank (else ``thread``'s rank)."""
        owner = self._ids.back(thread)
        paused = [r for r, link in sorted(self._ranks.items()) if link.paused]
        # The rank the user selected; else the one the panel names; else the first paused.
        rank = next((r for r in (self.selected, owner[0] if owner else None) if r in paused), paused[0] if paused else None)
        if rank is None:
            return {"success": False, "message": "no rank is paused"}
        group = [r for r in self._selected_all if r in paused] if rank == self.selected else []
        for other in [r for r in group if r != rank]:  # a shared entry: its ranks step together
            self.request(other, command, {"threadId": self._ranks[other].paused[0]})
        link = self._ranks[rank]
        tid = link.paused[0]
        reply = self.request(rank, command, {"threadId": tid})
        if command == "continue":
            reply["body"] = {"allThreadsContinued": False}
        return reply

    def running(self) -> bool:
        """Whether an attached rank runs a cell now (a pause then means the ranks)."""
        return any(s.state is RankState.RUNNING and s.rank in self._ranks for s in self._statuses())

    def pause_all(self) -> dict[str, Any]:
        """The panel's pause while a cell runs on the ranks: every attached rank running it stops
        where it is (in Python: a rank inside a collective stops when the collective returns)."""
        running = sorted(s.rank for s in self._statuses() if s.state is RankState.RUNNING and s.rank in self._ranks)
        seqs = {r: self._seq(r, "threads") for r in running}
        self._send(running, {r: [_request(seq, "threads", {})] for r, seq in seqs.items()}, ANSWER_TIMEOUT)
        paused = []
        for r, seq in seqs.items():
            threads = self._wait(r, seq, ANSWER_TIMEOUT).get("body", {}).get("threads", [])
            main = next((t["id"] for t in threads if t.get("name") == "MainThread"), None)
            if main is not None and self.request(r, "pause", {"threadId": main}).get("success"):
                paused.append(r)
        if not paused:
            return {"success": False, "message": "no rank runs a cell to pause"}
        return {"success": True, "body": {}}

    def request(self, rank: int, command: str, arguments: dict[str, Any], timeout: float = ANSWER_TIMEOUT) -> dict[str, Any]:
        """Send one request to rank ``rank``'s debugpy and wait for its response (ids as debugpy's)."""
        if rank not in self._ranks:
            return {"success": False, "message": f"rank {rank} is not attached to the debugger"}
        seq = self._seq(rank, command)
        ack = self._send([rank], {rank: [_request(seq, command, arguments)]}, timeout).get(rank, {"error": "no answer"})
        if "error" in ack:
            return {"success": False, "message": f"rank {rank}: {ack['error']}"}
        return self._wait(rank, seq, timeout)

    # -- what the ranks send (the pool's I/O thread) ---------------------------------------------
    def deliver(self, rank: int, msgs: list[dict[str, Any]]) -> None:
        for msg in msgs:
            if msg.get("type") == "response":
                with self._cond:
                    link = self._ranks.get(rank)
                    if link is not None and msg.get("request_seq") in link.waiting:
                        link.waiting[msg["request_seq"]].append(msg)
                        self._cond.notify_all()
            elif msg.get("event") == "distnb_link_closed":
                self._drop(rank)
            elif msg.get("event") == "distnb_cell_done":
                # The cell ended while debugpy held the rank (an interrupt, a death): it holds nothing now.
                link = self._ranks.get(rank)
                if link is not None and link.paused:
                    self._on_event(rank, {"type": "event", "event": "continued",
                                          "body": {"threadId": link.paused[0], "allThreadsContinued": True}})
            elif msg.get("event") in _EVENTS:
                self._on_event(rank, msg)

    def _on_event(self, rank: int, msg: dict[str, Any]) -> None:
        body = msg.get("body") or {}
        tid = body.get("threadId")
        with self._cond:
            link = self._ranks.get(rank)
            if link is None or not isinstance(tid, int):
                return
            if msg["event"] == "stopped":
                if tid not in link.paused:
                    link.paused.append(tid)
                before = body.pop("distnbBefore", None)
                if before is not None:
                    link.before[tid] = before
                why = f"before {before.get('op')}" if before is not None else body.get("reason", "stopped")
                event = {**msg, "body": {**body, "threadId": self._ids.out(rank, "thread", tid), "allThreadsStopped": False,
                                         "description": f"rank {rank} {why}"}}
            else:
                link.paused = [t for t in link.paused if t != tid] if not body.get("allThreadsContinued") else []
                link.before = {t: b for t, b in link.before.items() if t in link.paused}
                still = [(r, ln.paused[0]) for r, ln in sorted(self._ranks.items()) if ln.paused]
                if still:
                    # The panel shows one thread's stack and forgets it on "continued": while other
                    # ranks are paused it is told about one of them instead, so it keeps them in view.
                    r, t = still[0]
                    event = {"type": "event", "event": "stopped", "body": {"reason": "pause", "threadId": self._ids.out(r, "thread", t),
                             "allThreadsStopped": False, "description": f"{format_ranks([x for x, _ in still])} still paused"}}
                else:
                    event = {**msg, "body": {"threadId": self._ids.out(rank, "thread", tid), "allThreadsContinued": False}}
        if msg["event"] == "continued":
            self._ids.forget(rank)
        if self.on_event is not None:
            self.on_event(event)

    # -- plumbing ------------------------------------------------------------------------------
    def _seq(self, rank: int, command: str) -> int:
        with self._cond:
            link = self._ranks[rank]
            seq: int = next(link.seq)
            link.waiting[seq] = []
            return seq

    def _send(self, ranks: list[int], msgs: dict[int, list[dict[str, Any]]], timeout: float, stops: bool | None = None) -> dict[int, dict[str, Any]]:
        """Give each rank its requests (and the panel's "before each collective", ``stops``); the
        acknowledgements (the link is up), by rank."""
        acks: dict[int, dict[str, Any]] = {}
        dead = {s.rank for s in self._statuses() if s.state is RankState.DEAD}
        for r in [r for r in ranks if r in dead]:
            acks[r] = {"error": "the rank has died"}
            self._drop(r)
        for r in [r for r in ranks if r not in dead]:  # one message per rank: each carries its own requests
            ask: dict[str, Any] = {"t": Msg.DAP, "msgs": msgs[r]} if stops is None else {"t": Msg.DAP, "msgs": msgs[r], "stops": stops}
            acks.update(self._requests.ask(control_identity, [r], ask, timeout, partial=True))
        return acks

    def _wait(self, rank: int, seq: int, timeout: float) -> dict[str, Any]:
        with self._cond:
            def answered() -> bool:
                link = self._ranks.get(rank)
                return link is None or bool(link.waiting.get(seq))

            self._cond.wait_for(answered, timeout)
            link = self._ranks.get(rank)
            got = link.waiting.pop(seq, []) if link is not None else []
        if got:
            return got[0]
        why = "it left the debugger" if link is None else f"no answer within {timeout:g} s"
        return {"success": False, "message": f"rank {rank}: {why}"}

    def _each(self, ranks: list[int], command: str, arguments: dict[str, Any]) -> None:
        seqs = {r: self._seq(r, command) for r in ranks if r in self._ranks}
        self._send(list(seqs), {r: [_request(s, command, arguments)] for r, s in seqs.items()}, ANSWER_TIMEOUT)
        for r, s in seqs.items():
            self._wait(r, s, ANSWER_TIMEOUT)

    def _frame_out(self, rank: int, thread: str, frame: dict[str, Any], before: dict[str, Any] | None = None,
                   who: str | None = None) -> dict[str, Any]:
        name = f"{who or f'rank {rank}'} · {thread} · {frame.get('name', '?')}"
        if before is not None:  # side by side in the Callstack: what each rank is about to call
            call = _next_call(rank, before)
            name += f" · before {call.what()} on {call.label}"
        out = {**frame, "id": self._ids.out(rank, "frame", frame["id"]), "name": name}
        source = frame.get("source")
        if isinstance(source, dict) and source.get("sourceReference"):
            out["source"] = {**source, "sourceReference": self._ids.out(rank, "ref", source["sourceReference"])}
        return out

    def _body_out(self, rank: int, body: dict[str, Any]) -> dict[str, Any]:
        body = dict(body)
        if "variablesReference" in body:
            body["variablesReference"] = self._ids.out(rank, "ref", body["variablesReference"])
        for key in ("scopes", "variables"):
            if key in body:
                body[key] = [{**v, "variablesReference": self._ids.out(rank, "ref", v.get("variablesReference", 0))} for v in body[key]]
        return body


def _next_call(rank: int, before: dict[str, Any]) -> NextCall:
    """What a rank stopped before (the wrapper's account of it, carried with the stop)."""
    group = GroupInfo(str(before.get("group", "?")), before.get("desc"), tuple(before["members"]) if before.get("members") else None)
    return NextCall.stopped_before(rank, before, group, f"{cell_name(before.get('cell'))} line {before.get('line')}")


def _request(seq: int, command: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"seq": seq, "type": "request", "command": command, "arguments": arguments}
