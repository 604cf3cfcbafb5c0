"""Waiting for a cell from the notebook: the live view's ticks, a deadline, the prompts of ranks
paused in the debugger or in ``input()``, and Ctrl-C — the first interrupts the ranks, the second
stops waiting and leaves them running (a rank blocked in C++ or a collective may not answer).

A rank whose interrupt can't land because it waits in a collective is unblocked by its control
thread after ESCALATE_AFTER seconds (gloo: its connections shut down; NCCL: its communicators
aborted; ``worker/process/control.py``). The group is unusable after that: once the cell has ended on every
rank, :func:`rebuild_after_unblock` gives every rank a fresh one (``Pool.regroup``), namespaces kept.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Iterable

from distnb.analysis.verdicts.verdict import Verdict
from distnb.cell_names import cell_name
from distnb.controller.cell_run import CellRun
from distnb.controller.internal_errors import InternalErrors
from distnb.controller.tracker import Tracker
from distnb.errors import DistnbError
from distnb.ranks import format_ranks, group_by
from distnb.results import CellResult
from distnb.services.debugger import Ask, Debugger
from distnb.services.fail_fast import FailFast
from distnb.services.inspector import PATHS_HINT
from distnb.states import CellStatus
from distnb.status import Regrouped
from distnb.wire.peers import control_identity
from distnb.wire.protocol import Msg
from distnb.wire.record_types import CellError
from distnb.worker.torch_hooks.group_abort import ESCALATE_AFTER

__all__ = ["PROBE_TIMEOUT", "interrupt_words", "rebuild_after_unblock", "wait_for_cell", "why_still_running"]

#: Seconds to wait for the control threads' word on whether they unblocked an interrupted cell.
PROBE_TIMEOUT = 5.0


def wait_for_cell(
    result: CellResult,
    run: CellRun,
    debugger: Debugger,
    interrupt: Callable[[Iterable[int]], object],
    timeout: float | None,
    on_tick: Callable[[CellResult], None] | None,
    tick: float,
    ask: Ask | None,
    say: Callable[[str], None] | None = None,
    tracker: Tracker | None = None,
    fail_fast: FailFast | None = None,
) -> None:
    """Return when the cell has finished, ``timeout`` has passed (``result.timed_out``) or a second
    interrupt came (``result.detached``). With ``fail_fast``, a cell whose running ranks wait for
    one that left it is interrupted as soon as that is certain (services/fail_fast.py); where they
    wait for ranks that finished it (``FailFast(finished=True)``), it ends as its timeout would."""
    # From this call, not the cell's start: %dist_wait --timeout on an old background cell waits.
    deadline = None if timeout is None else time.monotonic() + timeout
    interrupted = False
    say = say or _stderr
    while not run.finished.is_set():
        try:
            if ask is not None and not interrupted and debugger.pending(result):
                debugger.console(result, ask, before_prompt=None if on_tick is None else lambda: on_tick(result))
            wait_for = tick if deadline is None else max(0.0, min(tick, deadline - time.monotonic()))
            if run.finished.wait(wait_for):
                return
            if on_tick is not None:
                on_tick(result)
            if fail_fast is not None and not interrupted and (doom := fail_fast.check()) is not None:
                result.notes.append(doom.text())  # said with the result: the cell ends within seconds
                if doom.hang:  # (only where asked: FailFast(finished=True)) the timeout's end, reached sooner
                    result.timed_out = True
                    return
                interrupt(list(doom.waiting))
            if deadline is not None and time.monotonic() >= deadline:
                result.timed_out = True
                return
        except KeyboardInterrupt:
            if interrupted:
                result.detached = True
                result.notes.append(
                    f"Stopped waiting after a second interrupt; {format_ranks(result.running)} did not respond "
                    "(likely blocked in C++ or a collective). They keep running: see them with %dist_stacks, interrupt them again with "
                    "%dist_interrupt, or %dist_restart."
                )
                return
            interrupted = result.user_interrupted = True
            running = list(result.running)
            interrupt(running)
            say(interrupt_words(result.cell, running, tracker))


def interrupt_words(cell: int, ranks: list[int], tracker: Tracker | None) -> str:
    """What the first interrupt does, said at once: the ranks, and those known to wait in a
    collective (from the log the ranks push), which are unblocked after ESCALATE_AFTER."""
    one = len(ranks) == 1
    head = (f"[distnb] interrupting {cell_name(cell)} on {format_ranks(ranks)}: {'it stops' if one else 'they stop'} "
            f"at {'its' if one else 'their'} next Python line")
    blocked: dict[int, tuple[str, str]] = {}
    if tracker is not None:
        nccl_pool = "nccl" in str(tracker.backend())
        with tracker.lock:
            log = tracker.collective_log
            for r in ranks:
                words = log.blocked_on(r, cell, set(range(tracker.world_size)))
                entry = log.pending(r, cell)
                if words and words != "new_group":  # (group creation waits on the store: nothing to abort)
                    nccl = entry.get("rec") == "nccl" if entry is not None else nccl_pool
                    blocked[r] = (words, "NCCL communicators aborted" if nccl else "gloo connections shut down")
    after = f"{ESCALATE_AFTER:.0f} s"
    if not blocked:
        return (f"{head} (one blocked in a collective is unblocked after {after}: its group aborted, then rebuilt, namespaces kept). "
                f"A second interrupt stops waiting and leaves {'it' if one else 'them'} running.")
    waits = "; ".join(f"{format_ranks(rs)} {'is' if len(rs) == 1 else 'are'} blocked in {what}" for rs, (what, _) in group_by(sorted(blocked.items())))
    hows = " or ".join(sorted({how for _, how in blocked.values()}))
    them = "if it is still there in {}, it gets its" if len(blocked) == 1 else "if they are still there in {}, they get their"
    return (f"{head}. {waits[0].upper()}{waits[1:]}: {them.format(after)} {hows} so the cell can stop (namespaces stay; the "
            f"process group is then rebuilt). A second interrupt stops waiting and leaves {'it' if one else 'them'} running.")


def rebuild_after_unblock(result: CellResult, tracker: Tracker, regroup: Callable[[], Regrouped],
                          say: Callable[[str], None] | None = None) -> None:
    """After a cell ended on every rank: if a rank's control thread unblocked it (its interrupt
    could not land in a collective), the process group is unusable — give every rank a fresh one
    (namespaces kept) and say so in the result's notes; if that can't happen now, say what to run."""
    if not any(res.status == CellStatus.INTERRUPTED or _broken_collective(res.error) for res in result.results.values()):
        return  # an unblocked rank's cell ends interrupted, its peers' with the collective's error
    alive = tracker.alive([r for r, res in result.results.items() if res.status != CellStatus.DEAD])
    replies = tracker.requests.ask(control_identity, alive, {"t": Msg.STACKS, "all_threads": False}, PROBE_TIMEOUT, partial=True)
    done: dict[int, dict[str, Any]] = {r: u for r, m in replies.items() if isinstance(u := m.get("unblocked"), dict) and u.get("cell") == result.cell}
    if not done:
        return
    their = "its" if len(done) == 1 else "their"
    how = " and ".join(sorted({f"shut down {their} gloo connections" if u.get("backend") == "gloo" else f"aborted {their} NCCL communicators"
                               for u in done.values()}))
    waits = group_by(sorted((r, str(u.get("waiting", "a collective"))) for r, u in done.items()))
    what = waits[0][1] if len(waits) == 1 else "; ".join(f"{format_ranks(rs)} in {w}" for rs, w in waits)
    told = f"The interrupt could not land on {format_ranks(done)}, blocked in {what}, so distnb {how}"
    (say or _stderr)(f"[distnb] {told}: rebuilding the process group on every rank (namespaces stay) …")
    try:
        regrouped = regroup()
    except DistnbError as exc:
        result.notes.append(f"{told}; the process group is now unusable, and rebuilding it failed ({exc}). Run %dist_regroup once "
                            "every rank is idle, or %dist_restart.")
        return
    result.notes.append(f"{told}. {regrouped.text()[0].upper()}{regrouped.text()[1:]}")
    # What the old group's counts foretold (a rank a call ahead: "the next synchronisation will
    # hang") no longer holds: the new group starts every rank at #1.
    result.desync, result.desync_note = [], ""
    if result.path_note == f"why: {PATHS_HINT}":
        result.path_note = ""


def why_still_running(result: CellResult, diagnose: Callable[[CellResult], Verdict], errors: InternalErrors) -> None:
    """A cell ended at its timeout: the diagnosis of the ranks still running, kept on the result
    (``verdict``) and said in its notes — the live watch may not have spoken yet (a busy
    machine, a --timeout shorter than --hang-after). A diagnosis that fails is distnb's bug, kept
    in ``errors`` (``%dist_status`` says it); the timeout is said regardless."""
    if not result.timed_out or not result.running or any(n.startswith("[distnb] why ") for n in result.notes):
        return
    try:
        verdict = diagnose(result)
    except Exception:
        errors.caught("the diagnosis of ranks still running at a timeout")
        return
    result.verdict = verdict
    one = len(result.running) == 1
    result.notes.append(f"[distnb] why {format_ranks(result.running)} still {'runs' if one else 'run'}: " + verdict.text().removeprefix("[distnb] "))


def _broken_collective(error: CellError | None) -> bool:
    """The error of a rank whose peer shut down its gloo connections, or aborted its NCCL group."""
    return error is not None and (error.get("ename") == "DistBackendError" or "Connection closed by peer" in str(error.get("evalue")))


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
