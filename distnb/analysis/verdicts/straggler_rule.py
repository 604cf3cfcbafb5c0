"""The straggler rule: among ranks that still run a cell without a hang, one that keeps the others
waiting at most of the cell's collectives, read from their arrival times (:mod:`.stragglers`).

It judges a calm cell only — where the other rules found nothing wrong — so a straggler never
takes the place of a hang, a failure or a desync. The live watch asks it between its full looks
(:func:`straggler_verdict`, the log alone: no stacks round)."""

from __future__ import annotations

from distnb.analysis.agreement.evidence import CollectiveEvidence
from distnb.analysis.verdicts.position import Place, Position
from distnb.analysis.verdicts.records import Records
from distnb.analysis.verdicts.stragglers import StragglerReport, arrivals, straggler_window
from distnb.analysis.verdicts.verdict import Kind, Verdict, VerdictState

__all__ = ["straggler", "straggler_verdict"]


def straggler_verdict(log: CollectiveEvidence, ranks: list[int], cell: int | None, last: int,
                      positions: list[Position] | None = None) -> Verdict | None:
    """A SLOW verdict naming the rank that arrives last at most of ``cell``'s last ``last``
    collectives on the default group, late beyond the step and the others' noise; None when
    no rank does."""
    report = StragglerReport("0", ranks, arrivals(log, "0", ranks, last, cell))
    rank = report.straggler()
    if rank is None:
        return None
    # The figures go under the headline, which must not change while nothing else does.
    return Verdict(VerdictState.SLOW, Kind.STRAGGLER, f"rank {rank} is a straggler: it arrives last at most collectives of this cell, late "
                   "beyond the step and the other ranks' noise (see %dist_timeline).", [rank], positions=positions or [],
                   details=[f"  {report.summary()}"], reason="from the arrival times of the cell's collectives", rule="straggler")


def straggler(rec: Records) -> Verdict | None:
    """A cell still running, with nothing else wrong, whose collectives wait for one rank."""
    cell = rec.judged_cell
    if rec.log is None or not rec.running or cell is None:  # a job's ranks (attached, loaded) run no cell
        return None
    ranks = [p.rank for p in rec.positions if p.state != Place.IDLE]
    return straggler_verdict(rec.log.log, ranks, cell, straggler_window(len(ranks)), rec.positions)
