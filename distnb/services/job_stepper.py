"""debugpy in one rank of an attached job, driven step by step: pause its main thread, next, step,
return, continue, breakpoints (``%dist_debug``'s ``pause``, ``n``, ``s``, ``r``, ``c``, ``b``, ``cl``;
services/job_console.py).

The pool's ranks run the same in-process debugpy for the notebook's debugger panel
(worker/process/panel_link.py, services/rank_debug.py); an attachable rank's control thread relays
it only when the request carries the notebook's consent (worker/process/attachable.py). Here the
DAP client is synchronous: each request waits for its response in what the rank pushed
(:attr:`AttachLink.pushed`), and a step waits for the stop it leads to. Frames and values are not
read through debugpy but by the console's looks (PEEK), the same whether the rank is paused or not.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from distnb.controller.attach_link import AttachLink
from distnb.services.rank_debug import ANSWER_TIMEOUT, ATTACH_TIMEOUT
from distnb.wire.protocol import Msg

__all__ = ["STEP_WAIT", "JobStepper", "Stop"]

#: Seconds a pause or a step waits for the main thread to stop; a thread in native code (a
#: collective, a kernel) stops only when it comes back to Python.
STEP_WAIT = 5.0
_INIT = {"clientID": "distnb", "adapterID": "distnb", "pathFormat": "path", "linesStartAt1": True, "columnsStartAt1": True}


@dataclass(frozen=True)
class Stop:
    """Where debugpy stopped the main thread, and why (pause, step, breakpoint, exception)."""

    reason: str
    text: str = ""  # debugpy's words for an exception stop


class JobStepper:
    """One rank's debugpy over the attach link; build it when the user first asks to pause."""

    def __init__(self, link: AttachLink, rank: int, timeout: float = ANSWER_TIMEOUT) -> None:
        self._link = link
        self.rank = rank
        self.timeout = timeout
        self._seq = itertools.count(1)
        self.thread: int | None = None  # debugpy's id of the main thread
        self.paused = False
        self.pending = False  # a pause or step asked for has not stopped the thread yet
        self.started = False
        self.touched = False  # a DAP request reached the rank (debugpy may have started there, tracing)
        self.breakpoints: dict[str, list[int]] = {}  # file (as the rank sees it) → lines, as debugpy took them

    def start(self) -> str:
        """Start debugpy in the rank (once per process) and attach to it; "" or what went wrong."""
        if self.started:
            return ""
        # debugpy's import and start, on a thread sharing the GIL with a busy main thread: seconds.
        ack = self._relay([], timeout=ATTACH_TIMEOUT)
        if "error" in ack:
            return str(ack["error"])
        if ack.get("fresh"):
            seqs = [next(self._seq) for _ in range(3)]
            msgs = [_request(seqs[0], "initialize", _INIT), _request(seqs[1], "attach", {}), _request(seqs[2], "configurationDone", {})]
            ack = self._relay(msgs)
            if "error" in ack:
                return str(ack["error"])
            reply = self._response(seqs[1], ATTACH_TIMEOUT)
            if not reply.get("success"):
                return f"debugpy refused to attach ({reply.get('message', 'no answer')})"
        threads = self.request("threads", {}).get("body", {}).get("threads", [])
        self.thread = next((t["id"] for t in threads if t.get("name") == "MainThread"), None)
        if self.thread is None:
            return "debugpy lists no MainThread in the rank"
        self.started = True
        return ""

    def request(self, command: str, arguments: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """One DAP request, its response (``success`` False with a ``message`` when none came)."""
        seq = next(self._seq)
        ack = self._relay([_request(seq, command, arguments)])
        if "error" in ack:
            return {"success": False, "message": ack["error"]}
        return self._response(seq, self.timeout if timeout is None else timeout)

    def pause(self, wait: float = STEP_WAIT) -> Stop | None:
        """Ask debugpy to stop the main thread; the stop, or None while it has not come back to Python."""
        why = self.start()
        if why:
            raise RuntimeError(why)
        if self.paused:
            return Stop("pause")
        reply = self.request("pause", {"threadId": self.thread})
        if not reply.get("success"):
            raise RuntimeError(f"debugpy did not pause the rank: {reply.get('message', 'no answer')}")
        self.pending = True
        return self.stopped(wait)

    def step(self, command: str, wait: float = STEP_WAIT) -> Stop | None:
        """next · stepIn · stepOut from the stop: the next stop, or None while the thread runs."""
        reply = self.request(command, {"threadId": self.thread})
        if not reply.get("success"):
            raise RuntimeError(f"debugpy refused {command}: {reply.get('message', 'no answer')}")
        self.paused, self.pending = False, True
        return self.stopped(wait)

    def stopped(self, wait: float) -> Stop | None:
        """The main thread's stop once it comes, within ``wait`` seconds (None: it runs). A stop of
        every thread (a breakpoint another thread hit) counts; a resume the rank made itself (the
        lease) is taken in too."""
        pushed = self._link.pushed[self.rank]
        self._link.listen(self.rank, lambda msgs: self._settle(msgs)[1], wait)
        last, _, self.paused = self._settle(pushed)  # not paused: resumed by the rank itself (the lease), or another notebook
        _forget(pushed, lambda m: m.get("type") == "event")
        if last is None:
            return None
        body = last.get("body") or {}
        self.paused, self.pending = True, False
        return Stop(str(body.get("reason", "pause")), str(body.get("text") or body.get("description") or ""))

    def _settle(self, msgs: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, bool, bool]:
        """The last stop among ``msgs`` still standing, whether they settle anything (a stop, or a
        resume of a thread this client holds paused), and whether the thread is paused after them.
        A resume while a pause or step of its own is under way is its own continue's echo, and
        settles nothing."""
        paused, last, settled = self.paused, None, False
        for m in msgs:
            if _is_stop(m, self.thread):
                paused, last, settled = True, m, True
            elif _is_resume(m, self.thread) and paused:
                paused, last, settled = False, None, True
        return last, settled, paused

    def alive(self) -> str:
        """"" while the rank answers (its lease renewed: a notebook waiting for a breakpoint is not
        a notebook gone quiet), else why not."""
        return str(self._relay([]).get("error", ""))

    def set_breakpoint(self, path: str, line: int) -> str:
        """A breakpoint at ``path``:``line`` in the rank; "" or why debugpy did not take it."""
        why = self.start()
        if why:
            return why
        lines = sorted({*self.breakpoints.get(path, []), line})
        reply = self.request("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": n} for n in lines]})
        if not reply.get("success"):
            return str(reply.get("message", "no answer"))
        taken = [b for b in reply.get("body", {}).get("breakpoints", []) if b.get("line") == line]
        self.breakpoints[path] = lines
        if taken and not taken[0].get("verified", True):
            return str(taken[0].get("message") or "debugpy could not place it there (no code on that line?)")
        return ""

    def clear_breakpoints(self) -> None:
        for path in list(self.breakpoints):
            self.request("setBreakpoints", {"source": {"path": path}, "breakpoints": []})
        self.breakpoints.clear()

    def proceed(self) -> None:
        """Let a paused thread go on, still debugged (its breakpoints stay): ``stopped`` gives the next stop."""
        if self.paused:
            seq = next(self._seq)
            ack = self._relay([_request(seq, "continue", {"threadId": self.thread})])
            if "error" in ack:
                raise RuntimeError(str(ack["error"]))
            self._response(seq, self.timeout)
            self.paused, self.pending = False, True

    def resume(self) -> str:
        """Let the main thread go on, undebugged: its breakpoints cleared, a pause or step not yet
        landed taken back too; "" or what failed."""
        if self.breakpoints:
            self.clear_breakpoints()
        if not (self.paused or self.pending):
            if self.touched:
                self._relay([], leave=True)  # nothing held: the rank untraces its thread (debugpy traced it on starting)
            return ""
        if not self.paused:
            # Taken back (pydevd's resume clears the thread's pending step); pydevd answers a
            # continue only once a thread really resumes, so there is no answer to wait for.
            ack = self._relay([_request(next(self._seq), "continue", {"threadId": self.thread})], leave=True)
            self.pending = False
            return str(ack.get("error", ""))
        seq = next(self._seq)
        ack = self._relay([_request(seq, "continue", {"threadId": self.thread})], leave=True)
        reply = {"success": False, "message": ack["error"]} if "error" in ack else self._response(seq, self.timeout)
        self.paused = self.pending = False
        return "" if reply.get("success") else str(reply.get("message", "no answer"))

    def _relay(self, msgs: list[dict[str, Any]], leave: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """``leave``: the last of them lets the thread go; the rank then stops tracing it."""
        timeout = self.timeout if timeout is None else timeout
        self.touched = True
        replies = self._link.ask([self.rank], {"t": Msg.DAP, "msgs": msgs, "consent": True, "leave": leave}, timeout)
        return replies.get(self.rank, {"error": f"rank {self.rank} did not answer within {timeout:g} s"})

    def _response(self, seq: int, timeout: float) -> dict[str, Any]:
        pushed = self._link.pushed[self.rank]

        def answered(msgs: list[dict[str, Any]]) -> bool:
            return any(m.get("type") == "response" and m.get("request_seq") == seq for m in msgs)

        if not self._link.listen(self.rank, answered, timeout):
            return {"success": False, "message": f"rank {self.rank}'s debugpy gave no answer within {timeout:g} s"}
        reply = next(m for m in pushed if m.get("type") == "response" and m.get("request_seq") == seq)
        _forget(pushed, lambda m: m is reply or (m.get("type") == "response" and m.get("request_seq", seq) < seq))
        return reply


def _is_stop(msg: dict[str, Any], thread: int | None) -> bool:
    body = msg.get("body") or {}
    return msg.get("event") == "stopped" and (body.get("threadId") in (thread, None) or bool(body.get("allThreadsStopped")))


def _is_resume(msg: dict[str, Any], thread: int | None) -> bool:
    body = msg.get("body") or {}
    return msg.get("event") == "continued" and (body.get("threadId") == thread or bool(body.get("allThreadsContinued")))


def _forget(msgs: list[dict[str, Any]], drop: Any) -> None:
    msgs[:] = [m for m in msgs if not drop(m)]


def _request(seq: int, command: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"seq": seq, "type": "request", "command": command, "arguments": arguments}
