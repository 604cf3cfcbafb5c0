"""Where each rank of a running cell is, as the verdict rules read it: from its result when it
left the cell (finished, raised, died, stranded), else from its last stack and its collective log
(the call it waits in, an async work it syncs on, its open send/recv) — and whether a reading caught
a rank between two places."""

from __future__ import annotations

from typing import Callable

from distnb import _processes
from distnb.analysis.agreement.collectives import issued_words
from distnb.analysis.agreement.entry_words import describe
from distnb.analysis.verdicts.failures import cut_message
from distnb.analysis.verdicts.position import Place, Position, position_from_stack, position_paused
from distnb.analysis.verdicts.stacks import RankStack, StackReport
from distnb.controller.collective_log import CollectiveLog
from distnb.results import CellResult
from distnb.states import CellStatus
from distnb.wire.record_types import P2P_OPS, ThreadError

__all__ = ["position_of", "unsettled"]


def position_of(r: int, result: CellResult, stacks: StackReport | None, elapsed: float, log: CollectiveLog,
                why_silent: Callable[[int], str], threads: dict[int, list[ThreadError]] | None = None) -> Position:
    """Where rank ``r`` is in ``result``'s cell: from its result when it left the cell, else from its
    stack (``stacks``: the last round) and its collective log; with what its other threads raised
    (from its result, or ``threads``: the last stacks round's, while it runs)."""
    pos = _position(r, result, stacks, elapsed, log, why_silent)
    res = result.results.get(r)
    raised = (res.threads if res is not None else []) or (threads or {}).get(r, [])
    pos.threads = [t for t in raised if t.get("during") in (None, result.cell)]
    return pos


def _position(r: int, result: CellResult, stacks: StackReport | None, elapsed: float, log: CollectiveLog,
              why_silent: Callable[[int], str]) -> Position:
    res = result.results.get(r)
    if res is None:
        return Position(r, Place.IDLE)
    if res.status == CellStatus.OK:
        return Position(r, Place.FINISHED, seqs=dict(res.sync["seqs"]) if res.sync and "seqs" in res.sync else None)
    if res.status in (CellStatus.ERROR, CellStatus.INTERRUPTED) and res.error:
        lines = result.code.splitlines()
        line = res.error.get("line")
        return Position(r, Place.FAILED, line=line, code=lines[line - 1] if line and line <= len(lines) else "",
                        detail=f"{res.error['ename']}: {cut_message(res.error['evalue'], 200)}")
    if res.status == CellStatus.DEAD:
        return Position(r, Place.DEAD, detail=_processes.signal_meaning(res.returncode))
    if res.status != CellStatus.RUNNING or stacks is None:
        # Over without an error of its own: stranded by a death, or interrupted.
        return Position(r, Place.STRANDED if res.status == CellStatus.STRANDED else Place.FINISHED, detail=res.collective or "")
    if not stacks[r].threads:
        return Position(r, Place.UNRESPONSIVE, since=elapsed, detail=why_silent(r))
    if (paused := stacks[r].paused) is not None:
        return position_paused(r, paused, result.cell)
    pos = position_from_stack(stacks[r], result.cell)
    # The rank tells which cell an entry belongs to by its own clock: no cross-machine clock comparison.
    pending = log.pending(r, result.cell)
    stuck = log.stuck(r) if pos.state == Place.COMPUTING else None
    if stuck is not None:
        # Not in torch.distributed by its stack, with a collective still open: NCCL (or an
        # async_op work) returned to the host at enqueue, and the host now waits at a sync.
        pos.state, pos.op, pos.seq, pos.group = Place.COLLECTIVE, stuck["op"], stuck["seq"], stuck["group"]
        pos.shapes, pos.sizes, pos.dtypes, pos.args = describe(stuck, with_op=False), stuck.get("sizes"), stuck.get("dtypes"), stuck.get("args")
        pos.issued = issued_words(stuck)
        pos.since = log.age(r, stuck)
    elif pending is not None:
        pos.state, pos.op, pos.seq, pos.group = Place.COLLECTIVE, pending["op"], pending["seq"], pending["group"]
        pos.shapes = describe(pending, with_op=False)
        pos.sizes, pos.dtypes, pos.args = pending.get("sizes"), pending.get("dtypes"), pending.get("args")
        pos.since = log.age(r, pending)
    elif pos.state == Place.COLLECTIVE:
        # In a collective by its stack, with no open entry: one torch does not record (new_group),
        # or the stack was taken as the rank went from one collective to the next. Its wait is
        # the call's (when watched), or just began — never the whole cell's.
        call = next((c for c in reversed(log.open_calls(r)) if c["op"] == pos.op), None)
        if call is not None:
            pos.since = log.age(r, {"t": call["t"] / 1e9})
            pos.group = call["group"] if call.get("group") not in (None, "?") else pos.group
        elif log.entries.get(r):
            pos.since = 0.0
    # Point-to-point calls have no recorder entry on gloo: the rank's own record of the call.
    peers = [c for c in log.open_calls(r) if c["op"] in P2P_OPS]
    if peers and (pos.op in P2P_OPS or pos.state == Place.COMPUTING and _waits_on_work(stacks[r], pos)):
        pos.state, pos.op, pos.peers = Place.COLLECTIVE, peers[-1]["op"], peers
        pos.since = log.age(r, {"t": peers[0]["t"] / 1e9})
    pos.since = pos.since if pos.since is not None else elapsed
    if pos.group is not None:
        pos.label = log.group(pos.group).label()
    return pos


def _waits_on_work(stack: RankStack, pos: Position) -> bool:
    """Whether the main thread waits on a work (``work.wait()``) — in the cell, or in a library's
    schedule that issued the calls for it (pipelining's ``_wait_batch_p2p``, any p2p helper):
    its innermost frame is the wait."""
    if ".wait(" in pos.code:
        return True
    main = next((t for t in stack.threads if t.main), None)
    inner = main.frames[-1] if main is not None and main.frames else None
    return inner is not None and ".wait(" in inner.line


def unsettled(positions: list[Position]) -> bool:
    """Whether a reading caught a rank between two places (:meth:`Position.between`)."""
    return any(p.between() for p in positions)
