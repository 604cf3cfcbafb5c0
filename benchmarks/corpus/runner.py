"""Run programs and their mutants on a real pool and score the verdicts distnb gives.

Each mutant: the program's setup (fresh models, meshes and groups), then the mutated step cell,
watched as the notebook watches it — ``Pool.diagnose`` once the hang threshold has passed, until a
verdict names a hang or a failure, or the cell ends (then the ended cell's verdict). The cell is
then interrupted if it still runs, and the pool restarted if a rank died or it would not stop.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import distnb
from distnb.analysis.verdicts.verdict import Certainty, Kind, Verdict, VerdictState

from corpus.mutations import PRELUDE, Mutant
from corpus.programs import Program

__all__ = ["Outcome", "Runner", "score_table"]

HANG_AFTER = 1.0
#: How long a mutant may take to show its verdict before the last one is taken.
VERDICT_WITHIN = 20.0
SETUP_TIMEOUT = 180.0


@dataclass
class Outcome:
    name: str
    program: str
    operator: str
    healthy: bool
    culprit: list[int]
    kinds: list[str]
    lines: list[int]
    state: str = ""
    kind: str = ""
    culprits: list[int] = field(default_factory=list)
    sites: list[tuple[int | None, int | None]] = field(default_factory=list)
    certainty: str = ""
    rule: str = ""
    summary: str = ""
    culprit_right: bool = False
    kind_right: bool = False
    site_right: bool = False
    false_claim: bool = False
    false_alarm: bool = False
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # setup, watch, stop: where the seconds went
    error: str = ""
    report: str = ""  # the cell's own end report (root cause, notes), for reading a miss
    positions: list[str] = field(default_factory=list)  # where each rank was when judged
    log: str = ""  # %dist_collectives at the verdict, for reading a miss

    def row(self) -> dict[str, Any]:
        return asdict(self)


class Runner:
    """One pool for the whole run; ``pool`` is reused across programs and restarted when broken."""

    def __init__(self, pool: distnb.Pool | None = None, log: Callable[[str], None] = print) -> None:
        self._own = pool is None
        self.pool = pool or distnb.launch(nproc=4, backend="gloo", hang_after=HANG_AFTER)
        self._log = log
        self._ready_for: str | None = None

    def close(self) -> None:
        if self._own:
            self.pool.shutdown()

    # -- one cell -----------------------------------------------------------------------------
    def _usable(self) -> None:
        pool = self.pool
        if pool.state != distnb.PoolState.READY or any(s.state == distnb.RankState.RUNNING for s in pool.status().ranks):
            pool.restart()

    def _setup(self, program: Program) -> None:
        self._usable()
        code = PRELUDE + (program.values + "\n" if program.values else "") + program.setup
        res = self.pool.run(code, timeout=SETUP_TIMEOUT)
        if res.failed or res.running:
            raise RuntimeError(f"{program.name}: setup failed:\n{res.text()}")

    def _watch(self, code: str) -> tuple[distnb.CellResult, Verdict]:
        """The verdict a user reads: the live watch's once it names a hang or a failure and says the
        same at the next look half a second later (the notebook shows a diagnosis until it
        changes; a rank aborting in between changes it), else the ended cell's."""
        pool = self.pool
        res = pool.submit(code)
        t0 = time.monotonic()
        verdict: Verdict | None = None
        last: tuple[object, ...] | None = None
        while True:
            pool.wait(res, timeout=0.5, ask=None)
            if not res.running:
                break
            elapsed = time.monotonic() - t0
            if elapsed >= HANG_AFTER + 0.5:
                verdict = pool.diagnose(res, hang_after=HANG_AFTER)
                said = (verdict.state, verdict.kind, tuple(verdict.culprits))
                if verdict.state in (VerdictState.HANG, VerdictState.FAILED) and said == last or elapsed > VERDICT_WITHIN:
                    break
                last = said
        if not res.running:
            verdict = pool.diagnose(res, hang_after=HANG_AFTER)
        assert verdict is not None
        return res, verdict

    def _stop(self, res: distnb.CellResult) -> None:
        pool = self.pool
        if res.running:
            pool.interrupt()
            pool.wait(res, timeout=15.0, ask=None)
        if res.running or pool.state != distnb.PoolState.READY:
            pool.restart()
        elif res.desync_note:
            # The cell ended with the ranks' calls out of step (an async op one rank issued and
            # nobody waited for): the next mutant would pair its calls with that one — a true
            # verdict about the pool, not about the mutant. A user reads the note and regroups.
            pool.regroup()

    # -- programs and mutants -----------------------------------------------------------------
    def healthy(self, program: Program) -> Outcome:
        out = Outcome(f"{program.name}:healthy", program.name, "healthy", True, [], [Kind.NONE.value], [])
        t0 = time.monotonic()
        try:
            self._setup(program)
            res, verdict = self._watch(program.step_code())
            self._stop(res)
        except Exception as exc:  # a program that can't run is a finding of the run, not its end
            out.error = f"{type(exc).__name__}: {exc}"
            out.false_alarm = True
            return out
        _fill(out, verdict, res)
        notes = [n for n in (res.root_cause, res.desync_note, res.path_note) if n]
        out.false_alarm = bool(res.failed or res.running or verdict.is_problem or notes)
        out.report = "\n".join(notes) if notes else ""
        out.seconds = time.monotonic() - t0
        return out

    def mutant(self, m: Mutant) -> Outcome:
        out = Outcome(m.name, m.program.name, m.operator, False, sorted(m.blamed), sorted(k.value for k in m.kinds), sorted(m.lines))
        t0 = time.monotonic()
        try:
            self._setup(m.program)
            t1 = time.monotonic()
            res, verdict = self._watch(m.step)
            t2 = time.monotonic()
            report = res.text()
            out.log = self.pool.collectives(refresh=False).text()[-4000:]
            self._stop(res)
            out.phases = {"setup": round(t1 - t0, 2), "watch": round(t2 - t1, 2), "stop": round(time.monotonic() - t2, 2)}
        except Exception as exc:
            out.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
            try:
                self.pool.restart()
            except Exception:
                self.pool = distnb.launch(nproc=4, backend="gloo", hang_after=HANG_AFTER)
            return out
        _fill(out, verdict, res)
        out.culprit_right = set(verdict.culprits) == m.blamed
        out.kind_right = verdict.kind in m.kinds
        out.site_right = any(s.cell == res.cell and s.line in m.lines for s in verdict.sites)
        out.false_claim = verdict.certainty == Certainty.CERTAIN and not (out.culprit_right and out.kind_right)
        out.report = report[-3000:]
        out.seconds = time.monotonic() - t0
        return out


def _fill(out: Outcome, verdict: Verdict, res: distnb.CellResult) -> None:
    out.positions = [f"{p.rank}: {p.where([])}" for p in verdict.positions]
    out.state = str(verdict.state)
    out.kind = str(verdict.kind)
    out.culprits = list(verdict.culprits)
    out.sites = [(s.cell, s.line) for s in verdict.sites]
    out.certainty = str(verdict.certainty)
    out.rule = verdict.rule
    out.summary = verdict.summary


def score_table(outcomes: list[Outcome]) -> dict[str, Any]:
    """The figures: over mutants, culprit and kind right, site right, false claims; over healthy
    programs, false alarms; per operator and per program the same."""
    mutants = [o for o in outcomes if not o.healthy]
    healthy = [o for o in outcomes if o.healthy]

    def figures(rows: list[Outcome]) -> dict[str, Any]:
        n = len(rows)
        return {
            "mutants": n,
            "culprit_right": sum(o.culprit_right for o in rows),
            "kind_right": sum(o.kind_right for o in rows),
            "culprit_and_kind_right": sum(o.culprit_right and o.kind_right for o in rows),
            "site_right": sum(o.site_right for o in rows),
            "false_claims": sum(o.false_claim for o in rows),
            "errors": sum(bool(o.error) for o in rows),
        }

    by_op: dict[str, list[Outcome]] = {}
    by_program: dict[str, list[Outcome]] = {}
    for o in mutants:
        by_op.setdefault(o.operator, []).append(o)
        by_program.setdefault(o.program, []).append(o)
    total = figures(mutants)
    confusion: dict[str, dict[str, int]] = {}
    for o in mutants:
        want = "|".join(o.kinds)
        confusion.setdefault(want, {})
        confusion[want][o.kind or "error"] = confusion[want].get(o.kind or "error", 0) + 1
    return {
        "mutants": len(mutants),
        "culprit_and_kind_right": round(total["culprit_and_kind_right"] / len(mutants), 4) if mutants else None,
        "culprit_right": round(total["culprit_right"] / len(mutants), 4) if mutants else None,
        "kind_right": round(total["kind_right"] / len(mutants), 4) if mutants else None,
        "site_right": round(total["site_right"] / len(mutants), 4) if mutants else None,
        "false_claims": total["false_claims"],
        "false_alarms_on_healthy": sum(o.false_alarm for o in healthy),
        "healthy_programs": len(healthy),
        "errors": total["errors"],
        "by_operator": {k: figures(v) for k, v in sorted(by_op.items())},
        "by_program": {k: figures(v) for k, v in sorted(by_program.items())},
        "confusion": confusion,
    }
