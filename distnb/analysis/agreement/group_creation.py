"""Group creation in step: every rank must call ``new_group`` for every group, in the same order,
even for groups it is not in (torch numbers groups by a per-rank counter, so a rank that skips
one pairs its later groups with the wrong ones). The Flight Recorder does not see group creation;
each rank's watched calls (worker/torch_hooks/call_log.py) do, keyed by torch's own counter.
"""

from __future__ import annotations

from dataclasses import dataclass

from distnb.analysis.agreement.evidence import CollectiveEvidence, odd_ones
from distnb.cell_names import cell_name
from distnb.ranks import format_ranks, group_by
from distnb.wire.record_types import CallRecord

__all__ = ["CreationMismatch", "creation_mismatch"]


def _members(call: CallRecord) -> str:
    ranks = call.get("args", {}).get("ranks")
    # torch sorts the members (sort_ranks=True): [1, 0] and [0, 1] are the same group.
    return "all ranks" if ranks is None else f"[{', '.join(map(str, sorted(ranks)))}]"


def _where(call: CallRecord) -> str:
    if call.get("line") is None:
        return ""
    func = f" in {call['func']}()" if call.get("func") not in (None, "", "<module>") else ""
    return f" ({cell_name(call['cell'])} line {call['line']}{func})"


@dataclass
class CreationMismatch:
    count: int  # torch's group counter where the ranks part ways
    by_rank: dict[int, CallRecord | None]  # each rank's call there (None: it made none)
    totals: dict[int, int]  # groups each rank has asked for so far

    @property
    def odd(self) -> list[int]:
        return odd_ones({r: None if c is None else _members(c) for r, c in self.by_rank.items()})

    def text(self) -> str:
        calls = group_by((r, "made no new_group call" if c is None else f"called new_group({_members(c)}){_where(c)}")
                         for r, c in sorted(self.by_rank.items()))
        what = "; ".join(f"{format_ranks(rs)} {d}" for rs, d in calls)
        counts = group_by((r, n) for r, n in sorted(self.totals.items()))
        tally = ", ".join(f"{format_ranks(rs)} {n}" for rs, n in counts)
        odd = self.odd
        blame = (f" The odd one{'s' if len(odd) > 1 else ''} out: {format_ranks(odd)}." if odd and len(odd) < len(self.by_rank)
                 else " No majority to tell which side went wrong.")
        return (f"group creation out of step at process group #{self.count}: {what}. Every rank must call new_group for every "
                f"group, in the same order, even for groups it is not in (groups created so far: {tally}).{blame}")


def creation_mismatch(log: CollectiveEvidence, ranks: list[int], moving: set[int] = frozenset()) -> CreationMismatch | None:  # type: ignore[assignment]
    """The first group creation where the ranks' calls differ (members, or made at all).

    A rank in ``moving`` (still running Python code) may yet make a call it has not made: only
    different members count against it there."""
    made = {r: log.creations(r) for r in ranks}
    if not any(made.values()):
        return None
    # Counts start after the newest creation every rank still holds (older ones may have been let go).
    low = max((min(m) for m in made.values() if m), default=1)
    top = max(max(m) for m in made.values() if m)
    totals = {r: max(m) if m else 0 for r, m in made.items()}
    for count in range(low, top + 1):
        at = {r: made[r].get(count) for r in ranks}
        behind = {r for r, c in at.items() if c is None and r in moving and totals[r] < count}
        if len({None if c is None else _members(c) for r, c in at.items() if r not in behind}) > 1:
            return CreationMismatch(count, {r: c for r, c in at.items() if r not in behind}, totals)
    return None
