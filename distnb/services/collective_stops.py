"""The console's stops before collectives, on the notebook's side.

* :meth:`CollectiveStops.report`: every paused rank's next collective (from its prompt: worker/torch_hooks/call_log.py
  paused it before the call) beside what the cell's other ranks do — already waiting in one, done
  with the cell, still running — compared by :mod:`distnb.analysis.verdicts.next_calls`.
* :meth:`CollectiveStops.hold`: when a rank opens post-mortem (``%%on_ranks --pdb``), the cell's other running
  ranks pause before their next collective (HOLD to their control threads), so the whole pool is
  inspected at one consistent point instead of running on into a hang; ranks already inside a
  collective are named as such.
* :meth:`CollectiveStops.release`: when ranks leave the cell from their debugger (``q``, the end of a
  post-mortem), the others never wait for them: a rank already waiting in a collective that needs
  one is interrupted (the pool's interrupt: a gloo or NCCL wait is unblocked after ESCALATE_AFTER,
  the group rebuilt once the cell has ended), and the rest raise before such a collective instead of
  issuing it (worker/torch_hooks/call_log.py's ``LeftCell``).
"""

from __future__ import annotations

from typing import Any

from distnb.analysis.agreement.groups import GroupInfo
from distnb.analysis.verdicts.next_calls import NextCall, NextReport, compare_next
from distnb.analysis.verdicts.position import Place, Position
from distnb.cell_names import cell_name
from distnb.controller.collective_log import CollectiveLog
from distnb.controller.prompts import Prompt
from distnb.controller.tracker import Tracker
from distnb.ranks import format_ranks, group_by
from distnb.results import CellResult
from distnb.states import CellStatus
from distnb.wire.peers import control_identity
from distnb.wire.protocol import Msg
from distnb.worker.torch_hooks.group_abort import ESCALATE_AFTER

__all__ = ["HOLD_TIMEOUT", "CollectiveStops", "left_words"]

#: Seconds the control threads have to answer a HOLD (they answer in milliseconds while a cell runs).
HOLD_TIMEOUT = 5.0


def left_words(res: Any) -> str:
    """How a rank left the cell, for ``…, which <words>``."""
    error = res.error or {}
    if res.status == CellStatus.OK:
        return "finished the cell without another collective"
    if error.get("ename") == "BdbQuit":
        return "quit its debugger (q)"
    if res.status == CellStatus.ERROR:
        return f"raised {error.get('ename', 'an error')} and left the cell"
    return {"dead": "died", "interrupted": "was interrupted", "stranded": "was stranded"}.get(res.status, f"ended the cell ({res.status})")


class CollectiveStops:
    """Holds, releases and the side-by-side view of the ranks' next collectives, for one pool."""

    def __init__(self, tracker: Tracker, world_size: int) -> None:
        self._tracker = tracker
        self._world = world_size
        self._held: set[int] = set()  # cells whose ranks were held already (once per cell)
        self._released: dict[int, set[int]] = {}  # per cell, the ranks the others do not wait for

    # -- the view ----------------------------------------------------------------------------------
    def report(self, result: CellResult, waiting: list[Prompt], positions: list[Position]) -> NextReport | None:
        """The paused ranks' next collectives beside the others'; None when no rank is paused before one."""
        before = {p.rank: p for p in waiting if p.before is not None}
        if not before:
            return None
        calls = {r: self._paused_call(p) for r, p in before.items()}
        gone: dict[int, str] = {r: "does not run this cell" for r in range(self._world) if r not in result.ranks}
        unknown: dict[int, str] = {}
        released = set(self._released.get(result.cell, ()))
        by_rank = {p.rank: p for p in positions}
        paused = {p.rank: p for p in waiting}
        running = self.running(result)
        for r in result.ranks:
            if r in before:
                continue
            if r in paused and paused[r].mode == "post_mortem":
                gone[r] = "raised (in post-mortem: it calls no other collective in this cell)"
                released.add(r)
            elif r in paused:
                unknown[r] = f"is paused at {paused[r].place()}, not before a collective"
            elif r not in running:
                gone[r] = left_words(result.results[r])
            elif (pos := by_rank.get(r)) is not None and pos.state == Place.COLLECTIVE and pos.op and pos.group:
                calls[r] = self._inside_call(pos, result.cell)
            else:
                unknown[r] = "is still running (not stopped before a collective)"
        return compare_next(calls, gone, unknown, released)

    def _info(self, name: str, desc: str | None, members: list[int] | None) -> GroupInfo:
        log = self._tracker.collective_log
        site, known, described = self._tracker.under_lock(lambda: (log.group(name).site, log.groups.get(name), log.descs.get(name)))
        known = members or known
        return GroupInfo(name, desc or described, tuple(known) if known else None, site)

    def _paused_call(self, prompt: Prompt) -> NextCall:
        b = prompt.before or {}
        return NextCall.stopped_before(prompt.rank, b, self._info(str(b.get("group", "?")), b.get("desc"), b.get("members")), prompt.place())

    def _inside_call(self, pos: Position, cell: int) -> NextCall:
        info = self._info(str(pos.group), None, None)
        place = f"{cell_name(pos.line_cell if pos.line_cell is not None else cell)} line {pos.line}" + (f" ({pos.code.strip()})" if pos.code.strip() else "")
        return NextCall(pos.rank, str(pos.op), info.name, pos.label or info.label(), info.role(), info.ranks,
                        None if pos.args is None else tuple(sorted(pos.args.items())),
                        tuple(tuple(s) for s in pos.sizes or []), tuple(pos.dtypes or []), place if pos.line else "", inside=True)

    def _blocked(self, log: CollectiveLog, rank: int, cell: int, left: set[int]) -> str:
        return self._tracker.under_lock(lambda: log.blocked_on(rank, cell, left))

    def running(self, result: CellResult) -> set[int]:
        """The cell's ranks still running it."""
        run = self._tracker.run_of(result)
        return self._tracker.under_lock(lambda: set(run.waiting_done))

    # -- hold and release --------------------------------------------------------------------------
    def _ask(self, ranks: list[int], msg: dict[str, Any]) -> dict[int, dict[str, Any]]:
        return self._tracker.requests.ask(control_identity, ranks, msg, HOLD_TIMEOUT, partial=True)

    def hold(self, result: CellResult, waiting: list[Prompt]) -> tuple[list[int], str]:
        """Once per cell, when a rank opened post-mortem: its other running ranks pause before their
        next collective. Returns the ranks that will pause and the words that say so."""
        raised = [p.rank for p in waiting if p.mode == "post_mortem"]
        if not raised or result.cell in self._held:
            return [], ""
        self._held = {c for c in self._held if c > result.cell - 16} | {result.cell}
        paused = {p.rank for p in waiting}
        targets = sorted(self.running(result) - paused)
        if not targets:
            return [], ""
        replies = self._ask(targets, {"t": Msg.HOLD, "cell": result.cell, "mode": "hold"})
        held = [r for r in targets if replies.get(r, {}).get("state") == "running"]
        words = [f"[distnb] {format_ranks(raised)} raised and {'is' if len(raised) == 1 else 'are'} in post-mortem: "
                 + (f"holding {format_ranks(held)} before {'its' if len(held) == 1 else 'their'} next collective, so the pool is "
                    "inspected at one point (nothing issued there)" if held else "no other rank is running toward a collective")]
        inside = group_by((r, replies[r]["inside"]) for r in targets if replies.get(r, {}).get("state") == "inside")
        words += [f"{format_ranks(rs)} {'was' if len(rs) == 1 else 'were'} already inside {op}: "
                  f"{'it waits' if len(rs) == 1 else 'they wait'} there" for rs, op in inside]
        silent = [r for r in targets if r not in replies]
        if silent:
            words.append(f"{format_ranks(silent)} did not answer within {HOLD_TIMEOUT:.0f} s (see %dist_stacks)")
        return held, "; ".join(words) + "."

    def release(self, result: CellResult, left: list[int], why: str) -> str:
        """``left`` ranks are leaving the cell from their debugger: the cell's other ranks must not
        wait for them. Those waiting already in a collective that needs one are interrupted; the
        rest raise before such a collective rather than issue it. Returns what was done, in words."""
        self._released.setdefault(result.cell, set()).update(left)
        while len(self._released) > 16:  # recent cells only
            del self._released[min(self._released)]
        others = sorted(self.running(result) - set(left))
        if not others:
            return ""
        replies = self._ask(others, {"t": Msg.HOLD, "cell": result.cell, "mode": "release", "ranks": left, "why": why})
        log = self._tracker.collective_log
        stuck: dict[int, str] = {}
        for r in others:
            reply = replies.get(r, {})
            if reply.get("needs"):
                stuck[r] = str(reply.get("inside"))
            elif reply.get("state") != "paused":  # a collective distnb does not wrap (DDP's), from the log the rank pushed
                blocked = self._blocked(log, r, result.cell, set(left))
                if blocked:
                    stuck[r] = blocked
        transport = self._tracker.transport
        for r in stuck:
            if transport is not None:
                transport.send(control_identity(r), {"t": Msg.INTERRUPT, "cell": result.cell})
        they = "it" if len(left) == 1 else "them"
        words = [f"[distnb] {format_ranks(left)} {'leaves' if len(left) == 1 else 'leave'} the cell ({why})"]
        for rs, what in group_by(sorted(stuck.items())):
            words.append(f"{format_ranks(rs)} {'was' if len(rs) == 1 else 'were'} waiting for {they} in {what}: interrupting "
                         f"{'it' if len(rs) == 1 else 'them'} now (a wait in gloo or NCCL is unblocked within {ESCALATE_AFTER:.0f} s, "
                         "and the process group is rebuilt once the cell has ended; namespaces stay)")
        rest = [r for r in others if r not in stuck and r in replies]
        if rest:
            words.append(f"{format_ranks(rest)} will stop before any collective that needs {they} rather than wait (the cell "
                         "ends there, interrupted, nothing issued); a collective distnb does not wrap (DDP's, torch's functional "
                         "ones) would still wait: interrupt the cell then (Ctrl-C, %dist_interrupt)")
        silent = [r for r in others if r not in replies]
        if silent:
            words.append(f"{format_ranks(silent)} did not answer within {HOLD_TIMEOUT:.0f} s: if {'it waits' if len(silent) == 1 else 'they wait'} "
                         "for a rank that left, interrupt the cell (Ctrl-C, %dist_interrupt)")
        return ": ".join(words[:1]) + (": " + "; ".join(words[1:]) if words[1:] else "") + "."

