"""The diagnosis of a cell: an ordered list of rules, each taking the records and returning a
verdict or nothing; the first verdict wins.

The order is the order of causes. A debugger pause is no fault; nothing is judged before the
hang threshold. Group creation out of step, a collective pairing calls of different cells and
the first broken agreement between a group's members come before what follows from them (a rank
left behind, an abort). A rank that raised or died before a call it never made is the cause of
the waits it leaves. What the log cannot explain is judged from where the ranks are: ranks the
cell does not run on, a rank with no stack, ranks still computing, ranks that finished while
others wait, a group's sequence numbers where Flight Recorder dumps are all a job left, ranks
waiting in different places, and every rank in the same collective. Last, in a cell where nothing
is wrong, a rank that keeps the others waiting.
"""

from __future__ import annotations

from typing import Callable

from distnb.analysis.agreement.collectives import CollectiveReport
from distnb.analysis.verdicts import event_rules, flow_rules, log_rules, straggler_rule
from distnb.analysis.verdicts.agreement_rule import agreement
from distnb.analysis.verdicts.position import Position
from distnb.analysis.verdicts.records import Records
from distnb.analysis.verdicts.verdict import Kind, Verdict, VerdictState

__all__ = ["RULES", "diagnose", "judge"]

Rule = Callable[[Records], "Verdict | None"]

RULES: list[tuple[str, Rule]] = [
    ("paused", flow_rules.paused),
    ("quiet", flow_rules.quiet),
    ("creation", log_rules.creation_out_of_step),
    ("cross_cell", log_rules.paired_across_cells),
    ("wrong_group", log_rules.wrong_group),
    ("agreement", agreement),
    ("victim", event_rules.victim_of_mismatch),
    ("p2p_departure", log_rules.p2p_departure),
    ("died", event_rules.died),
    ("raised", event_rules.raised),
    ("p2p", log_rules.p2p_unmatched),
    ("finished_early", flow_rules.finished_early),
    ("not_in_cell", flow_rules.not_in_cell),
    ("unresponsive", flow_rules.unresponsive),
    ("computing", flow_rules.computing),
    ("new_group_wait", flow_rules.new_group_wait),
    ("seq_blame", log_rules.by_sequence_numbers),
    ("disagree", flow_rules.disagree),
    ("same_collective", flow_rules.same_collective),
    ("straggler", straggler_rule.straggler),  # a calm cell: "quiet" asks it too, before calling the cell calm
]


def judge(rec: Records) -> Verdict:
    """The first rule's verdict; nothing wrong found when none has one."""
    for name, rule in RULES:
        verdict = rule(rec)
        if verdict is not None:
            verdict.rule = verdict.rule or name
            return verdict
    return Verdict(VerdictState.OK, Kind.NONE, "no rank is waiting in a collective." if not rec.waiting else "collectives in progress.",
                   positions=rec.positions, rule="none")


def diagnose(
    positions: list[Position],
    hang_after: float,
    elapsed: float,
    log: CollectiveReport | None = None,
    first_death: int | None = None,
    sources: dict[int, str] | None = None,
    cell: int | None = None,
    dumps_only: frozenset[int] = frozenset(),
) -> Verdict:
    """Judge the ranks of a cell: where each is (``positions``), how long the cell has run, the
    ranks' collective logs, the rank that died first, the cells' code (by cell number) as
    evidence, the cell judged (default: the one the positions say the ranks run), and the ranks
    known by Flight Recorder dumps alone (a loaded job's)."""
    return judge(Records(positions, hang_after, elapsed, log, first_death, sources or {}, cell, dumps_only))
