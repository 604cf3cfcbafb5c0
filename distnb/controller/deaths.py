"""Deaths in order, and what a death says in its cell's result.

Which rank died first is the root cause a post-mortem leads with; reports of deaths arrive out of
order (a rank killed first may be reported last), so the order is by each supervisor's time of
death. A death in a cell fills the rank's result: its exit, its cause, and the collective it died
in, as the rank last pushed it, or from the stack faulthandler printed on the fatal signal.
"""

from __future__ import annotations

import time

from distnb.analysis.agreement.entry_words import describe
from distnb.analysis.agreement.evidence import same_op
from distnb.analysis.verdicts.position import position_at_death
from distnb.controller.collective_log import CollectiveLog
from distnb.controller.rank_record import RankRecord
from distnb.results import RankResult
from distnb.states import CellStatus
from distnb.wire.record_types import P2P_OPS, CallRecord, CollectiveEntry

__all__ = ["Deaths"]

#: Reports of deaths may be late by this much at most, as far as ordering them goes: a machine
#: whose clock is off can't reorder deaths by more.
_TRUST_LATE = 5.0


class Deaths:
    """The first death of a set of rank processes, and the results deaths are written into."""

    def __init__(self, log: CollectiveLog) -> None:
        self._log = log
        self.first: int | None = None
        self._first_result: RankResult | None = None

    def reset(self) -> None:
        self.first, self._first_result = None, None

    @staticmethod
    def stamp(info: RankRecord, when: float | None) -> None:
        """``info``'s time of death, once: ``when`` is the supervisor's wall clock at its exit
        report (None: now), trusted only _TRUST_LATE back."""
        if info.died_at is None:
            late = min(max(0.0, time.time() - when), _TRUST_LATE) if when is not None else 0.0
            info.died_at = time.monotonic() - late

    def order(self, info: RankRecord, ranks: dict[int, RankRecord]) -> None:
        """Make ``info`` (stamped) the first death if it died before the first so far."""
        assert info.died_at is not None
        first = ranks.get(self.first) if self.first is not None else None
        if first is None or first.died_at is None or info.died_at < first.died_at:
            if self._first_result is not None:
                # Its post-mortem already said "died first": the report of an earlier death came later.
                self._first_result.first_death = False
                self._first_result = None
            self.first = info.rank

    def conclude(self, info: RankRecord, res: RankResult, cell: int) -> None:
        """Write the death of ``info`` into its result for ``cell``, which was still running."""
        res.status = CellStatus.DEAD
        res.returncode = info.returncode
        res.stderr_tail = info.stderr_tail
        res.first_death = self.first == info.rank
        if res.first_death:
            self._first_result = res
        res.cause = info.cause
        res.finished_at = time.monotonic()
        self._log.died_during[info.rank] = cell
        self._from_black_box(info.rank, info.last_calls, cell)
        # As the rank last pushed it (within ~50 ms of entering) or the pool last polled it; the
        # rank itself tells which cell an entry belongs to (no cross-machine clocks).
        pending = self._log.pending(info.rank, cell)
        if pending is not None:
            res.collective = f"{describe(pending)} ({self._log.at(pending)})"
            return
        # Died before the log could hear of it (gloo aborts within ms of a mismatch): the stack
        # faulthandler printed on the fatal signal still says where.
        died_in = position_at_death(info.stderr_tail, info.main_ident)
        res.collective = died_in.death_words() if died_in is not None else ""
        if died_in is not None and died_in.op:
            self._log.died_in[info.rank] = died_in.op
            self._log.died_at[info.rank] = (died_in.line_cell, died_in.line)

    def _from_black_box(self, rank: int, calls: list[CallRecord], cell: int) -> None:
        """The dead rank's last calls from its black box (wire/black_box.py) into the log: the
        watched calls as if it had pushed them, and the collective it died in — its newest call
        still open — as the entry its recorder never sent (shapes, group and place in the group's
        sequence as the rank read them when it issued the call)."""
        if not calls:
            return
        self._log.keep_calls(rank, calls)
        open_ = [c for c in calls if c.get("end") is None and c["op"] not in P2P_OPS and c["op"] != "new_group"
                 and c.get("seq") is not None and c.get("group") not in (None, "?")]
        if not open_:
            return
        c = open_[-1]
        group, seq = str(c["group"]), int(c["seq"])  # type: ignore[arg-type]
        if seq in self._log.seqs(rank, group):
            return  # its recorder's entry arrived after all
        # The recorder's name for the op where the group's other ranks recorded this position
        # (``all_gather`` for ``all_gather_into_tensor``), so only a real difference differs.
        theirs = (e["op"] for r in self._log.groups.get(group, ()) if r != rank
                  if (e := self._log.seqs(r, group).get(seq)) is not None and same_op(e["op"], c["op"]))
        entry: CollectiveEntry = {
            "id": self._log.last_id(rank) + 1, "rec": "black box", "group": group, "seq": seq, "p2p": False,
            "op": next(theirs, c["op"]), "sizes": c.get("sizes", []), "dtypes": c.get("dtypes", []), "t": c["t"] / 1e9,
            "done": False, "state": "started", "cell": cell, "args": {k: v for k, v in (c.get("args") or {}).items() if v is not None},
        }
        if c.get("line") is not None:
            entry["line"], entry["func"], entry["call_cell"] = c["line"], c.get("func") or "", c["cell"]
            if c.get("in_line") is not None:
                entry["in_line"] = c["in_line"]
        self._log.keep(rank, entry)
