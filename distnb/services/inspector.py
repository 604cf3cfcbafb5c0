"""What the pool can tell about its ranks while they run or hang: stacks, diagnoses, collective
logs, memory, environments and checksums.

:class:`Inspector` is built from the parts it uses (the tracker, the session log, the config and
where this launch's folder is), never from the pool, so it can be tested by feeding a tracker
messages and answering its requests, without processes.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable, cast

from distnb import _processes
from distnb.analysis.agreement.cell_source import may_branch
from distnb.analysis.agreement.collectives import CollectiveReport, issued_words
from distnb.analysis.agreement.desync import mismatch_text
from distnb.analysis.agreement.entry_words import describe
from distnb.analysis.agreement.pairing import cross_cell
from distnb.analysis.agreement.sequence_numbers import dump_marks, seq_blame
from distnb.analysis.reports.check_within import WithinReport, agreement_by_dim, compare_within
from distnb.analysis.reports.checks import CheckReport, compare
from distnb.analysis.reports.compiles import CompileReport
from distnb.analysis.reports.env import EnvReport
from distnb.analysis.reports.memory import MemoryReport
from distnb.analysis.reports.nccl_dumps import read_dumps
from distnb.analysis.reports.profile import ProfileReport, RankTime, merge_traces
from distnb.analysis.verdicts.diagnose import diagnose
from distnb.analysis.verdicts.event_rules import victim
from distnb.analysis.verdicts.failures import is_timeout
from distnb.analysis.verdicts.paths import first_difference
from distnb.analysis.verdicts.position import Place, Position
from distnb.analysis.verdicts.stacks import RankStack, StackReport, ThreadStack, frames_from_wire, parse_faulthandler
from distnb.analysis.verdicts.straggler_rule import straggler_verdict
from distnb.analysis.verdicts.stragglers import StragglerReport, arrivals, stragglers_of
from distnb.analysis.verdicts.verdict import Blame, Certainty, Verdict, VerdictState
from distnb.cell_names import cell_name
from distnb.config import LaunchConfig
from distnb.controller.session import SessionLog
from distnb.controller.tracker import Tracker
from distnb.errors import NoCellError, NoPoolError, RemoteError
from distnb.ranks import Ranks, format_ranks, parse_ranks
from distnb.results import CellResult
from distnb.services.native_stacks import py_spy_dumps
from distnb.services.positions import position_of, unsettled
from distnb.states import CellStatus, PoolState, RankState
from distnb.wire.peers import control_identity, exec_identity, supervisor_identity
from distnb.wire.protocol import Msg
from distnb.wire.record_types import CollectivesRead, ThreadError

__all__ = ["Inspector", "FAULT_TIMEOUT", "FAULT_WAIT", "PATHS_HINT", "STACKS_TIMEOUT"]

#: What "why" says when no rank recorded its paths.
PATHS_HINT = ("run the cell again with %%on_ranks --paths to see the first decision the ranks took differently "
              "(recorded by default on Python 3.12+ ranks, or with %env DISTNB_PATHS=1)")

#: How long the control threads have to answer a stacks request; one that can't (its rank holds
#: the GIL in a C loop) is asked of its supervisor through faulthandler instead.
STACKS_TIMEOUT = 0.25
#: faulthandler's dump: how long the supervisor collects it, and how long we wait for the answer.
FAULT_WAIT = 0.15
#: Seconds a diagnosis read mid-move waits before it reads the records again (a rank pushes the
#: collective it enters within ~50 ms).
REREAD_AFTER = 0.3
FAULT_TIMEOUT = 3.0


class Inspector:
    """Asks the ranks (through the tracker's requests) and reads what they pushed; the verdicts
    come from :mod:`distnb.analysis`."""

    def __init__(self, tracker: Tracker, config: LaunchConfig, session: SessionLog, run_dir: Callable[[], str | None]) -> None:
        self._tracker = tracker
        self._config = config
        self._session = session
        self._run_dir = run_dir
        self._world = config.world_size
        # Running ranks' path and compile records, from the last stacks round (by kind, then rank).
        self._live: dict[str, dict[int, dict[str, Any]]] = {"paths": {}, "compiles": {}}
        self._live_threads: dict[int, list[ThreadError]] = {}  # the last stacks round's: running ranks' threads that raised

    def require_pool(self) -> None:
        if self._tracker.state in (PoolState.NEW, PoolState.STOPPED):
            raise NoPoolError("no pool is running; start one with %dist_launch -n 4 (or distnb.launch(nproc=4)).")

    # -- stacks ---------------------------------------------------------------------------------
    def stacks(self, ranks: Ranks = None, all_threads: bool = False, native: bool = False, timeout: float = STACKS_TIMEOUT,
               paths: bool = False) -> StackReport:
        """Where every (or each given) rank is right now; works while cells run or hang.

        The rank's control thread answers even while the main thread waits in a collective. A
        rank whose main thread holds the GIL (a C loop) can't answer; its supervisor then asks
        faulthandler for a dump with SIGUSR1. ``native`` adds py-spy's native frames.
        """
        self.require_pool()
        tracker = self._tracker
        log = tracker.collective_log
        targets = parse_ranks(ranks, self._world)
        alive = tracker.alive(targets)
        # The collective log comes in the same answer: a rank that can't answer (a C loop holding
        # the GIL) then costs one timeout here, not one more per question.
        since = {r: log.cursor(r) for r in alive}
        msg = {"t": Msg.STACKS, "all_threads": all_threads, "collectives_since": min(since.values(), default=-1),
               "calls_since": min((log.last_call(r) for r in alive), default=-1), "groups": log.wants_groups(alive), "paths": paths}
        replies = tracker.requests.ask(control_identity, alive, msg, timeout, partial=True)
        self._live = {kind: {r: m[kind] for r, m in replies.items() if m.get(kind)} for kind in ("paths", "compiles")}
        self._live_threads = {r: m["threads"] for r, m in replies.items() if m.get("threads")}
        self._merge_collectives({r: m["collectives"] for r, m in replies.items() if "collectives" in m}, since)
        # A control thread that answered with an error instead of stacks gave no stack either.
        silent = [r for r in alive if "stacks" not in replies.get(r, {})]
        dumps = tracker.requests.ask(supervisor_identity, silent, {"t": Msg.FAULT_REQUEST, "wait": FAULT_WAIT}, FAULT_TIMEOUT, partial=True)
        sources = self._session.recent_sources()
        status = {rs.rank: rs for rs in tracker.rank_statuses()}
        out = []
        for r in targets:
            st, info = status[r], tracker.ranks[r]
            state = st.describe(with_elapsed=False)
            if replies.get(r, {}).get("busy"):
                state = f"busy in {replies[r]['busy']}"  # idle to the tracker, but its main thread is taken
            if "stacks" in replies.get(r, {}):
                threads = [ThreadStack(t["thread"], t["main"], frames_from_wire(t["frames"])) for t in replies[r]["stacks"]]
                rs = RankStack(r, state, "control thread", threads, paused=replies[r].get("paused"), cpu=replies[r].get("cpu"))
                if rs.paused:
                    rs.annotation = {"pdb": "paused in the debugger", "panel": "paused in the debugger panel"}.get(
                        rs.paused["kind"], "waiting for a line for input()")
            elif dumps.get(r, {}).get("text"):
                threads = parse_faulthandler(dumps[r]["text"], sources, info.main_ident)
                if not all_threads:
                    threads = [t for t in threads if t.main] or threads[:1]
                rs = RankStack(r, state, "faulthandler: the rank holds the GIL", threads)
            elif st.state == RankState.DEAD:
                rs = RankStack(r, state, "dead")
            else:
                rs = RankStack(r, state, f"no answer: {self.why_silent(r)}")
            pending = log.pending(r, st.cell) if st.state == RankState.RUNNING else None
            stuck = log.stuck(r) if pending is None else None
            rs.state_since = st.elapsed
            if pending is not None:
                rs.annotation = f"in {describe(pending)} ({log.at(pending)})"
                rs.annotation_since = log.age(r, pending)  # by the rank's own clock: another machine's may be off
            elif stuck is not None:
                rs.annotation = f"{describe(stuck)} {log.at(stuck)} not completed ({issued_words(stuck)})"
                rs.annotation_since = log.age(r, stuck)
            if native and info.pid and st.state != RankState.DEAD and info.agent:
                # py-spy runs here: a rank on another machine needs it run there.
                rs.native = f"rank {r} runs on {info.host}: run `py-spy dump --native --pid {info.pid}` there."
            out.append(rs)
        if native:
            by_rank = {rs.rank: rs for rs in out}
            local = {r: pid for r in by_rank if (pid := tracker.ranks[r].pid) and not tracker.ranks[r].agent
                     and status[r].state != RankState.DEAD}
            for r, text in py_spy_dumps(local).items():
                by_rank[r].native = text
        return StackReport(out)

    def why_silent(self, rank: int) -> str:
        """Words for a rank that gave no stack at all, neither from its control thread nor from
        faulthandler: its process state when it runs on this machine."""
        info = self._tracker.ranks[rank]
        state = _processes.process_state(info.pid) if info.pid and not info.agent else None
        if state:
            return f"its process (pid {info.pid}) is {state}"
        return "neither its control thread nor faulthandler gave a stack (a process stopped, or stuck in the kernel)"

    # -- diagnosis ------------------------------------------------------------------------------
    def diagnose(self, result: CellResult | None = None, hang_after: float | None = None) -> Verdict:
        """Is the (last) cell hung, and why? Names the ranks, collectives and cell lines involved.
        ``hang_after`` (seconds) overrides the pool's threshold for this call."""
        if result is None:
            last = self._session.last()
            if not isinstance(last, CellResult):
                raise NoCellError("no cell has run on this pool yet; run one with %%on_ranks (pool.run) first.")
            result = last
        threshold = self._config.hang_after if hang_after is None else hang_after
        diag = self._judge(result, threshold)
        if diag.is_problem and unsettled(diag.positions):
            # Read while a rank was on its way into a call (its stack there, its entry not yet
            # pushed): what the next round sees, once the records caught up, is the verdict.
            time.sleep(REREAD_AFTER)
            diag = self._judge(result, threshold)
        if diag.state in (VerdictState.HANG, VerdictState.SLOW, VerdictState.FAILED):
            why = self.why(result, hint=not diag.explained, culprits=diag.culprits)
            if why:
                diag.details.append(f"  why: {why}")
            compiled = self.compiles(cells=[result.cell], live=True, results=[result])
            if compiled.differences():
                diag.details.append(f"  {compiled.summary()}")
        return diag

    def _judge(self, result: CellResult, threshold: float) -> Verdict:
        """One reading of the cell's records, judged."""
        tracker = self._tracker
        elapsed = time.monotonic() - tracker.run_of(result).started
        busy = [r for r in result.ranks if result.results[r].status == CellStatus.RUNNING]
        alive = tracker.alive(list(range(self._world)))
        # One round trip: stacks of every live rank (idle ones answer at once) with their collective
        # logs, so a rank holding the GIL costs one timeout per diagnosis.
        stacks = self.stacks(alive, paths=True) if busy else None
        log = self.collectives(refresh=not busy)
        positions = [position_of(r, result, stacks, elapsed, tracker.collective_log, self.why_silent, self._live_threads)
                     for r in range(self._world)]
        return diagnose(positions, threshold, elapsed, log, tracker.first_death, self._session.codes(), result.cell)

    def compiles(self, ranks: Ranks = None, cells: list[int] | None = None, live: bool = False,
                 results: list[CellResult] | None = None) -> CompileReport:
        """What torch.compile did on each rank — frames compiled, recompiles with the guard that
        failed, graph breaks, collectives in the graphs — over the session's cells (or ``cells``),
        compared across ranks. ``live``: a running cell's ranks as of the last stacks round;
        ``results``: these cells' results instead of the session's."""
        targets = parse_ranks(ranks, self._world)
        events: dict[int, list[dict[str, Any]]] = {r: [] for r in targets}
        breaks: dict[int, dict[str, int]] = {r: {} for r in targets}
        seen = []
        for res in self._session.history if results is None else results:
            if not isinstance(res, CellResult) or (cells is not None and res.cell not in cells):
                continue
            records = self._records(res, "compiles", live)
            for r, record in records.items():
                if r in events:
                    events[r].extend(record.get("compiles", []))
                    for reason, n in record.get("breaks", {}).items():
                        breaks[r][reason] = breaks[r].get(reason, 0) + n
            if records:
                seen.append(res.cell)
        return CompileReport(events, breaks, seen, self._session.codes())

    def why(self, result: CellResult, quiet_expected: bool = False, hint: bool = True, culprits: list[int] | None = None) -> str:
        """The first decision in the notebook's code that the cell's ranks took differently, in
        words (finished ranks' records from their CELL_DONE, running ones' from the last stacks
        round); "" when they decided alike; with ``hint``, how to record them when no rank did.
        ``culprits``: a verdict's — a decision only other ranks took is an effect of what the
        culprits did (a rank leaving its wait loop because its peer finished), not its cause."""
        paths = self._records(result, "paths", live=True)
        if not paths and hint and len(result.ranks) > 1:
            # Only where the lines the ranks ran could tell them apart.
            return PATHS_HINT if may_branch(result.code, self._session.codes().values()) else ""
        if len(paths) < 2:
            return ""  # nothing to compare (and the session's sources are not worth gathering)
        found = first_difference(paths, self._session.codes(), quiet_expected)
        if found is None or culprits and not set(found.odd) & set(culprits):
            return ""
        return found.summary()

    def _records(self, result: CellResult, kind: str, live: bool) -> dict[int, dict[str, Any]]:
        """Each rank's ``kind`` record (``paths``, ``compiles``) of the cell: a finished rank's from
        its CELL_DONE; with ``live``, a running one's as the last stacks round saw it."""
        records = {r: rec for r, res in result.results.items() if (rec := getattr(res, kind))}
        if live:
            records.update({r: rec for r, rec in self._live[kind].items() if r in result.results and result.results[r].status == CellStatus.RUNNING})
        return records

    def straggler(self, result: CellResult, last: int = 200) -> Verdict | None:
        """The straggler rule on the log alone (no stacks round), for the live watch between its
        full looks: a SLOW verdict naming the rank that keeps the others waiting at most of the
        cell's last ``last`` collectives on the default group; None when none does."""
        return straggler_verdict(self._tracker.collective_log, list(result.ranks), result.cell, last)

    def profile(self, result: CellResult, trace_path: str | None = None) -> ProfileReport:
        """Per-rank time of a cell run with ``profile=True``; see :meth:`distnb.Pool.profile`."""
        missing = {r: "the rank did not finish the cell" if res.status == CellStatus.RUNNING else "the cell was not run with profile=True"
                   for r, res in result.results.items() if not res.profile}
        errors = {r: f"the profiler failed: {res.profile['error']}" for r, res in result.results.items()
                  if res.profile and "error" in res.profile}
        profiles = {r: res.profile for r, res in result.results.items() if res.profile and "error" not in res.profile}
        if not profiles:
            raise ValueError(f"{cell_name(result.cell)} has no profile ({next(iter({**missing, **errors}.values()), 'no ranks')}); "
                             "run it with %%on_ranks --profile (pool.run(code, profile=True)).")
        ranks = sorted(profiles)
        log = self.collectives(ranks).log
        waits = StragglerReport("0", ranks, arrivals(log, "0", ranks, None, result.cell)).waiting()
        times = [RankTime(r, result.results[r].duration or 0.0, profiles[r]["collective_s"], min(waits[r], profiles[r]["collective_s"]))
                 for r in ranks]
        path = None
        traces = {r: p["trace"] for r, p in profiles.items() if "trace" in p}
        if traces:
            path = merge_traces(traces, {r: log.offset(r) for r in traces},
                                trace_path or os.path.join("distnb-traces", f"cell-{result.cell}.json"))
        far = {r: f"its trace is too big to send; it is at {p['trace_path']} on {self._tracker.ranks[r].host}"
               for r, p in profiles.items() if "trace_path" in p}
        unaligned = [r for r, p in profiles.items() if not p.get("aligned", True)] if len(ranks) > 1 else []
        return ProfileReport(result.cell, times, {r: p["ops"] for r, p in profiles.items()}, path, {**missing, **errors, **far},
                             sorted(unaligned))

    def stragglers(self, ranks: Ranks = None, group: str = "0", last: int = 200) -> StragglerReport:
        """Who arrives last at the recent collectives of ``group``: per rank, the share of
        collectives it was last at, how late, and the share of time the others waited."""
        return stragglers_of(self.collectives(ranks), group, last)

    def death_note(self, result: CellResult) -> str:
        """For a cell in which a rank died inside a collective whose ranks disagree: the odd rank
        that caused it, in words (a gloo abort kills a neighbour, not the rank that was wrong)."""
        dead = [r for r in result.ranks if result.results[r].status == CellStatus.DEAD]
        if not dead:
            return ""
        first = self._tracker.first_death if self._tracker.first_death in dead else dead[0]
        report = self.collectives(refresh=True)
        found = victim(Position(first, Place.DEAD, detail=_processes.signal_meaning(result.results[first].returncode)), report)
        return found.text() if found else ""

    def conclude(self, result: CellResult) -> None:
        """Once a cell has finished everywhere: the root cause of deaths and timeouts, and the
        words for an end-of-cell desync."""
        if result.failed or result.desync:
            verdict = result.verdict = self.diagnose(result)
            # The deaths and errors are in the report already: the verdict is said when it names
            # a cause they do not (a mismatch that aborted a neighbour, a skipped call, a loop).
            told = not verdict.beyond_report or not verdict.is_problem
            if result.failed:
                if told:  # a timeout's report still lacks who never came
                    result.root_cause, result.blamed = self.timeout_note(result)
                else:
                    result.root_cause = verdict.summary
                    result.blamed = Blame.of(verdict.culprits, verdict.certainty)
                if result.desync:
                    result.desync_note = self.desync_note(result)
            else:
                # Over on every rank, the calls apart: the verdict names who and where, else the counts.
                result.desync_note = verdict.summary if not told else self.desync_note(result)
        if any(rr.compiles for rr in result.results.values()):  # most cells compile nothing: nothing to walk
            compiled = self.compiles(list(result.ranks), cells=[result.cell], results=[result])
            result.compile_note = compiled.summary() if compiled.differences() else ""
        if result.failed or result.desync:
            # Every rank failing alike needs no "why ranks differ"; some failing, or counts apart, does.
            explained = result.verdict is not None and result.verdict.explained
            why = self.why(result, hint=not explained and (bool(result.desync) or len(result.failed) < len(result.ranks)),
                           culprits=result.verdict.culprits if result.verdict is not None else None)
            result.path_note = f"why: {why}" if why else ""
        else:
            # Finished alike everywhere: only a difference nobody asked for (not `if rank == 0:`) is said.
            why = self.why(result, quiet_expected=True, hint=False)
            result.path_note = f"the ranks ran different code, though the cell finished everywhere — {why}" if why else ""

    def timeout_note(self, result: CellResult) -> tuple[str, Blame | None]:
        """After a collective timeout: who never arrived, by sequence numbers — from the Flight
        Recorder dumps NCCL's watchdog wrote into the run folder, else from the collective log —
        in words and as whom it blames. The rank that timed out first waited; it is not the root cause."""
        timed_out = [r for r, res in sorted(result.results.items()) if res.error and is_timeout(res.error)]
        if not timed_out:
            return "", None
        run_dir = self._run_dir()
        dumps = read_dumps(run_dir, newer_than=result.started) if run_dir else {}
        log = self.collectives(refresh=True).log
        if dumps:
            marks = {r: dump_marks(d.get("entries", [])) for r, d in dumps.items()}
            source = f"the Flight Recorder dumps of {format_ranks(dumps)} at the timeout"
        else:
            marks = {r: [(e["group"], e["seq"], e["op"]) for e in log.entries.get(r, {}).values() if not e["p2p"]] for r in result.ranks}
            source = "distnb's collective log"
        paired = cross_cell(log, list(result.ranks), result.cell)
        if paired is not None:  # "never arrived" would blame the ranks whose call was taken
            return f"[distnb] {paired.text()}", Blame.of(paired.blamed, Certainty.CERTAIN)
        blames = seq_blame(marks, log.groups)
        if not blames:
            return "", None
        # Sequence numbers run without gaps: a rank whose last is lower never issued the call.
        return f"[distnb] {blames[0].text(timed_out)} (from {source})", Blame.of(sorted(blames[0].never), Certainty.CERTAIN)

    def desync_note(self, result: CellResult) -> str:
        """The end-of-cell count mismatches in words, with the collectives involved (the log is
        refreshed first: the rank ahead pushed its entry within ~50 ms, maybe not yet)."""
        report = self.collectives(result.ranks, refresh=True)
        paired = cross_cell(report.log, list(result.ranks), result.cell)
        if paired is not None:  # the counts differ because a call paired with another cell's
            return paired.text()
        codes = self._session.codes()
        return " ".join(mismatch_text(m, report.log, codes) for m in result.desync)

    # -- collective log -------------------------------------------------------------------------
    def collectives(self, ranks: Ranks = None, last: int | None = None, refresh: bool = True) -> CollectiveReport:
        """Every rank's collective sequence (from the Flight Recorder), side by side, with the
        first divergence marked. Works while ranks are blocked; dead ranks keep their last log."""
        tracker = self._tracker
        targets = parse_ranks(ranks, self._world)
        if refresh and tracker.state not in (PoolState.NEW, PoolState.STOPPED):
            alive = tracker.alive(targets)
            since = {r: tracker.collective_log.cursor(r) for r in alive}
            floor = min(since.values(), default=-1)
            calls = min((tracker.collective_log.last_call(r) for r in alive), default=-1)
            replies = tracker.requests.ask(control_identity, alive, {"t": Msg.COLLECTIVES, "since": floor, "calls_since": calls,
                                                                     "groups": tracker.collective_log.wants_groups(alive)}, 1.0, partial=True)
            self._merge_collectives(replies, since)
        return tracker.collective_log.report(targets, last)

    def _merge_collectives(self, replies: dict[int, dict[str, Any]], since: dict[int, int]) -> None:
        """Merge the ranks' log replies; each was asked from the lowest ``since`` of the batch, so
        drop what a rank had already sent (entries still open may have changed: keep those)."""
        with self._tracker.lock:
            for r, answer in replies.items():
                reply = cast(CollectivesRead, answer)  # the answer to COLLECTIVES (worker/torch_hooks/flight_recorder.py)
                reply["entries"] = [e for e in reply.get("entries", []) if e["id"] > since.get(r, -1) or not e["done"]]
                self._tracker.collective_log.merge(r, reply)

    # -- memory, environment, checksums ---------------------------------------------------------
    def memory(self, ranks: Ranks = None) -> MemoryReport:
        """Each rank's memory now (asked live, works while cells run) and its peak per cell."""
        self.require_pool()
        targets = self._tracker.alive(parse_ranks(ranks, self._world))
        replies = self._tracker.requests.ask(control_identity, targets, {"t": Msg.MEMORY}, 2.0, partial=True)
        current = {r: m["memory"] for r, m in sorted(replies.items()) if "memory" in m}
        return MemoryReport(current, self._session.memory_timeline(targets))

    def env(self, ranks: Ranks = None) -> EnvReport:
        """RANK, LOCAL_RANK, MASTER_*, CUDA_VISIBLE_DEVICES, NCCL_*/TORCH_* … per rank."""
        self.require_pool()
        targets = self._tracker.alive(parse_ranks(ranks, self._world))
        replies = self._tracker.requests.ask(control_identity, targets, {"t": Msg.ENV}, 5.0)
        return EnvReport({r: m["env"] for r, m in sorted(replies.items())}, {r: self._tracker.ranks[r].host for r in targets})

    def check(self, names: str | Iterable[str], ranks: Ranks = None, dims: Callable[[], dict[str, list[list[int]]]] | None = None,
              within: str | None = None) -> list[CheckReport | WithinReport]:
        """Checksum names (tensors, modules, state dicts, optimizers) on every rank and compare:
        identical, or which entries differ and which ranks are the odd ones out. ``dims`` gives
        the rank groups of each mesh dimension (asked only when needed: a round trip); ``within``:
        compare inside the groups of that dimension (else a name that differs across the world
        says along which dimensions it agrees)."""
        groups = dims() if within is not None and dims is not None else None
        if within is not None and (groups is None or within not in groups):
            have = ", ".join(groups or {}) or "none: the ranks hold no device mesh (init_device_mesh builds one)"
            raise ValueError(f"no mesh has a dimension {within!r} (dimensions: {have}); name one of them, e.g. --within tp.")
        per_rank = self._checksums(names, ranks)
        out: list[CheckReport | WithinReport] = []
        for name, checks in per_rank.items():
            if within is not None and groups is not None:
                out.append(compare_within(name, checks, within, groups[within]))
                continue
            report = compare(name, checks)
            if not report.identical and dims is not None:
                groups = groups if groups is not None else dims()
                note = agreement_by_dim(name, checks, groups)
                if note:
                    report.layout_notes.append(note)
            out.append(report)
        return out

    def _checksums(self, names: str | Iterable[str], ranks: Ranks) -> dict[str, dict[int, dict[str, Any]]]:
        names = [names] if isinstance(names, str) else list(names)
        if not names:
            raise ValueError("name at least one variable to check, e.g. pool.check('model').")
        targets = parse_ranks(ranks, self._world)
        self._tracker.ensure_idle(targets)
        replies = self._tracker.requests.ask(exec_identity, targets, {"t": Msg.CHECK, "names": names}, 120.0)
        errors = {r: m["error"] for r, m in sorted(replies.items()) if m.get("status") != "ok"}
        if errors:
            raise RemoteError(f"check failed on {format_ranks(errors)}: {next(iter(errors.values()))}", errors=errors)
        return {n: {r: replies[r]["checks"][n] for r in targets} for n in names}

