"""Who arrives last: each rank's arrival at each collective, from the Flight Recorder's entries.

An entry is created when its rank issues the collective, so across ranks the entries of one
collective (same group, same sequence number) are the ranks' arrivals. Times are the ranks' own
clocks moved onto the controller's by the offsets distnb measures on every reply
(:meth:`CollectiveEvidence.local_time`). On gloo a rank blocks in the collective until the last one
arrives, so the gap between its arrival and the last one is time it spent waiting for peers; on
NCCL the arrival is the host's enqueue, which runs ahead of the GPU.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from distnb.analysis.agreement.collectives import CollectiveReport
from distnb.analysis.agreement.evidence import CollectiveEvidence
from distnb.ranks import SUMMARY_ABOVE, format_ranks

__all__ = ["Arrival", "StragglerReport", "arrivals", "stragglers_of", "STRAGGLER_CHANCE", "STRAGGLER_MIN_COLLECTIVES", "STRAGGLER_MIN_LATE",
           "STRAGGLER_NOISE_FACTOR", "STRAGGLER_SHARE",
           "STRAGGLER_STEP_SHARE", "straggler_window"]

#: A rank arriving last at this share of the collectives (or more) is the straggler …
STRAGGLER_SHARE = 0.6
#: … when it is at least this late on median (seconds): below it, the order is noise …
STRAGGLER_MIN_LATE = 0.002
#: … and late by this share of a step (the median time between the group's collectives): 3 ms at
#: steps of 300 ms keeps nobody waiting worth the name …
STRAGGLER_STEP_SHARE = 0.05
#: … and this many times later than the other ranks are spread among themselves (their noise) …
STRAGGLER_NOISE_FACTOR = 3.0
#: … over at least this many collectives (a handful says nothing: on a busy machine any rank is
#: last at 4 of 5 by chance) …
STRAGGLER_MIN_COLLECTIVES = 20
#: … and so often last that chance would do it less than once in this many windows (a binomial
#: tail, every rank equally likely to be last).
STRAGGLER_CHANCE = 1000


@dataclass
class Arrival:
    """One collective as the ranks reached it."""

    group: str
    seq: int
    op: str
    times: dict[int, float]  # rank → arrival, controller clock (seconds)

    # Cached: the report reads them once per rank per collective (times never change once made).
    @functools.cached_property
    def first(self) -> float:
        return min(self.times.values())

    @functools.cached_property
    def last(self) -> float:
        return max(self.times.values())

    @functools.cached_property
    def last_rank(self) -> int:
        last = self.last
        return max(r for r, t in self.times.items() if t == last)  # on a tie, the highest rank

    @property
    def spread(self) -> float:
        return self.last - self.first


def _chance(n: int, k: int, p: float) -> float:
    """P(at least ``k`` of ``n``) for a rank last with probability ``p`` at each collective."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


def straggler_window(world: int) -> int:
    """How many recent collectives a live straggler check compares: 200 up to 50 ranks, then
    fewer, so one check reads about 10,000 arrivals (never fewer than the collectives a verdict
    needs)."""
    return max(STRAGGLER_MIN_COLLECTIVES, min(200, 10_000 // max(world, 1)))


def arrivals(log: CollectiveEvidence, group: str, ranks: list[int], last: int | None = 200, cell: int | None = None) -> list[Arrival]:
    """The last ``last`` collectives of ``group`` that every one of ``ranks`` reached (issued
    in ``cell``, when given)."""
    if not ranks:
        return []
    rows = [(r, log.seqs(r, group), log.offset(r)) for r in ranks]
    # Newest first from the rank with the fewest: only ``last`` of them are read, however long the history.
    fewest = min(rows, key=lambda row: len(row[1]))[1]
    out = []
    for seq in sorted(fewest, reverse=True):
        own = fewest[seq].get("cell")
        if cell is not None and isinstance(own, int) and own < cell:
            break  # a rank's cells only grow with its sequence numbers: the rest is older
        try:
            entries = [held[seq] for _, held, _ in rows]
        except KeyError:
            continue  # a rank has not reached it (or its log let it go)
        # Lists counted at C speed: the watch runs this for thousands of ranks every second.
        if cell is not None and [e.get("cell") for e in entries].count(cell) != len(entries):
            continue
        ops = [e["op"] for e in entries]
        if ops.count(ops[0]) != len(ops):
            continue  # ranks in different calls at one number: a mismatch, not one collective to arrive at
        out.append(Arrival(group, seq, ops[0], {r: e["t"] - off for (r, _, off), e in zip(rows, entries)}))
        if last is not None and len(out) >= last:
            break
    out.reverse()
    return out


@dataclass
class StragglerReport:
    """Arrival order over recent collectives of one group: the straggler, if any, with figures."""

    group: str
    ranks: list[int]
    collectives: list[Arrival] = field(default_factory=list)
    label: str = ""  # the group as the user built it (``tp (ranks 0,1)``); empty: ``group <name>``

    @property
    def on(self) -> str:
        return self.label or f"group {self.group}"

    # Every per-rank figure comes from one pass over the collectives (ranks × collectives), kept:
    # a report is built for one look and its collectives are not changed after.
    @functools.cached_property
    def _lasts(self) -> dict[int, list[float]]:
        """Per rank, its lateness (spread) at each collective it arrived last at."""
        out: dict[int, list[float]] = {r: [] for r in self.ranks}
        for a in self.collectives:
            out.setdefault(a.last_rank, []).append(a.spread)
        return out

    def last_share(self) -> dict[int, float]:
        """Per rank, the share of collectives it arrived last at."""
        n = len(self.collectives) or 1
        lasts = self._lasts
        return {r: len(lasts[r]) / n for r in self.ranks}

    def lateness(self, rank: int) -> float:
        """Median seconds ``rank`` arrived after the first, over the collectives it was last at."""
        late = self._lasts.get(rank)
        return statistics.median(late) if late else 0.0

    def span(self) -> float:
        if not self.collectives:
            return 0.0
        return max(a.last for a in self.collectives) - self.collectives[0].first

    @functools.cached_property
    def _waiting(self) -> dict[int, float]:
        out = dict.fromkeys(self.ranks, 0.0)
        for a in self.collectives:
            for r, t in a.times.items():
                if r in out:
                    out[r] += a.last - t
        return out

    def waiting(self) -> dict[int, float]:
        """Per rank, seconds spent between its arrival and the last one's, summed."""
        return dict(self._waiting)

    def waiting_share(self) -> dict[int, float]:
        """Per rank, the share of the window's wall time it spent waiting for the last arrival."""
        span = self.span()
        if span <= 0:
            return {r: 0.0 for r in self.ranks}
        return {r: w / span for r, w in self.waiting().items()}

    def step(self) -> float:
        """Median seconds between the group's successive collectives (first arrivals)."""
        firsts = [a.first for a in self.collectives]
        gaps = [b - a for a, b in zip(firsts, firsts[1:]) if b > a]
        return statistics.median(gaps) if gaps else 0.0

    def noise(self, rank: int) -> float:
        """Median spread of the other ranks' arrivals among themselves, over the collectives
        ``rank`` was last at: how late is merely late on this machine."""
        spreads = []
        for a in self.collectives:
            if a.last_rank == rank and len(a.times) > 2:
                others = [t for r, t in a.times.items() if r != rank]
                spreads.append(max(others) - min(others))
        return statistics.median(spreads) if spreads else 0.0

    @functools.cached_property
    def _candidate(self) -> int | None:
        share = self.last_share()
        n = len(self.collectives)
        if n < STRAGGLER_MIN_COLLECTIVES or not share:
            return None
        rank = max(share, key=lambda r: share[r])
        if share[rank] < STRAGGLER_SHARE or _chance(n, round(share[rank] * n), 1 / len(self.ranks)) * STRAGGLER_CHANCE > 1:
            return None
        return rank

    def candidate(self) -> int | None:
        """The rank that arrives last most often, when that is most of the time."""
        return self._candidate

    def straggler(self) -> int | None:
        """The candidate, when it is late beyond noise: absolutely, relative to the step, and
        relative to how spread the other ranks are among themselves."""
        rank = self.candidate()
        if rank is None:
            return None
        late = self.lateness(rank)
        if late >= STRAGGLER_MIN_LATE and late >= STRAGGLER_STEP_SHARE * self.step() and late >= STRAGGLER_NOISE_FACTOR * self.noise(rank):
            return rank
        return None

    def measures(self, rank: int) -> str:
        """``40 ms after the first on median, 13% of a step of 300 ms; the others within 1 ms of each other``."""
        step, noise = self.step(), self.noise(rank)
        parts = [f"{self.lateness(rank) * 1000:.0f} ms after the first on median"]
        if step > 0:
            parts.append(f"{self.lateness(rank) / step:.0%} of a step of {step * 1000:.0f} ms")
        if len(self.ranks) > 2:
            parts.append(f"the others within {noise * 1000:.1f} ms of each other")
        return ", ".join(parts)

    def ops(self) -> str:
        names = sorted({a.op for a in self.collectives})
        return "/".join(names) if len(names) <= 2 else "collective"

    def summary(self) -> str:
        n = len(self.collectives)
        if n == 0:
            return f"no collective on {self.on} that all of {format_ranks(self.ranks)} reached yet."
        rank = self.straggler()
        candidate = self.candidate()
        if rank is None and candidate is not None:
            return (f"no straggler on {self.on}: rank {candidate} arrives last at {self.last_share()[candidate]:.0%} of the "
                    f"last {n} {self.ops()}s, but only {self.measures(candidate)} — within the noise, nobody waits for it to speak of.")
        if rank is None:
            return f"no straggler on {self.on}: over the last {n} {self.ops()}s no rank arrives last consistently."
        waits = self.waiting_share()
        others = [r for r in self.ranks if r != rank]
        avg = sum(waits[r] for r in others) / len(others) if others else 0.0
        return (f"rank {rank} arrives last at {self.last_share()[rank]:.0%} of the last {n} {self.ops()}s on {self.on}, "
                f"{self.measures(rank)}; {format_ranks(others)} spend {avg:.0%} of their time waiting for it.")

    def named(self, count: int = 5) -> list[int]:
        """The ranks a summary names: those arriving last most often (the straggler first), then
        those waiting least for peers (a slow rank waits least), in that order, ``count`` each."""
        share, waits = self.last_share(), self.waiting_share()
        often = sorted((r for r in self.ranks if share[r] > 0), key=lambda r: (-share[r], r))[:count]
        least = sorted(self.ranks, key=lambda r: (waits[r], r))[:count]
        return list(dict.fromkeys(often + least))

    def text(self) -> str:
        lines = [f"[distnb] {self.summary()}"]
        if self.collectives:
            share, waits = self.last_share(), self.waiting_share()
            many = len(self.ranks) > SUMMARY_ABOVE
            shown = self.named() if many else self.ranks
            if many:
                spread = sorted(waits.values())
                lines.append(f"  time waiting for peers over {len(self.ranks)} ranks: least {spread[0]:.0%}, median "
                             f"{spread[len(spread) // 2]:.0%}, most {spread[-1]:.0%}; the ranks that arrive last most often, and "
                             "those that wait least:")
            lines.append("  rank  arrives last  median late when last  time waiting for peers")
            for r in shown:
                lines.append(f"  {r:>4}  {share[r]:>12.0%}  {self.lateness(r) * 1000:>19.1f} ms  {waits[r]:>22.0%}")
            lines.append(f"  ({len(self.collectives)} collectives over {self.span():.2f} s; arrival = when the rank issued it)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    def plot(self) -> Any:
        """Each rank's arrival after the first, per collective (ms): the straggler's line on top."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.5, 3.0))
        ax = fig.add_subplot()
        xs = [a.seq for a in self.collectives]
        shown = self.ranks
        if len(self.ranks) > SUMMARY_ABOVE:
            # A line per rank is a smear at scale: the band every rank arrived in, the median, and
            # the named ranks' own lines on top.
            skews = [sorted((t - a.first) * 1000 for t in a.times.values()) for a in self.collectives]
            ax.fill_between(xs, [s[0] for s in skews], [s[-1] for s in skews], alpha=0.25, label=f"all {len(self.ranks)} ranks")
            ax.plot(xs, [s[len(s) // 2] for s in skews], linewidth=1, color="grey", label="median rank")
            shown = self.named(3)
        for r in shown:
            ax.plot(xs, [(a.times[r] - a.first) * 1000 for a in self.collectives], marker=".", linewidth=1, label=f"rank {r}")
        ax.set_xlabel(f"collective # on {self.on}")
        ax.set_ylabel("arrival after the first (ms)")
        rank = self.straggler()
        ax.set_title(f"arrival skew per rank — straggler: rank {rank}" if rank is not None else "arrival skew per rank")
        if self.ranks:
            ax.legend(loc="best", fontsize="small", ncol=2)
        fig.tight_layout()
        return fig


def stragglers_of(report: CollectiveReport, group: str, last: int) -> StragglerReport:
    """``%dist_timeline`` over a pool's, an attached job's or a loaded job's collectives: who arrives
    last at the recent ``last`` collectives of ``group``. ValueError (in words) for a bad count or a
    group with no collective recorded."""
    if last < 1:
        raise ValueError(f"last must be a positive count of collectives, not {last}; e.g. last=200.")
    if group not in report.group_names():
        known = ", ".join(report.group_names()) or "none yet"
        raise ValueError(f"no collective recorded on group {group!r} (groups with collectives: {known}); run some first, "
                         "or pick one of those.")
    members = report.members(group) if group in report.log.groups else report.ranks
    return StragglerReport(group, members, arrivals(report.log, group, members, last), report.label(group))
