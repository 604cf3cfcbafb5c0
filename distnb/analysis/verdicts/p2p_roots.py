"""Which rank a tangle of point-to-point waits starts from.

A send or a receive waits for one peer; a rank blocked in one blocks the peers waiting for it in
turn, so on a ring or a pipeline one missing send leaves every rank waiting, each on the next.
The pairs without a partner (:func:`distnb.analysis.verdicts.p2p.match_p2p`) name every link of that chain;
the cause is where it ends: a rank the others wait for that waits for no one (it finished, raised,
died, or computes). When the waits close into a cycle (every rank waits), the cause is a call
that names the wrong peer or tag, else the rank whose point-to-point calls in the cell depart
from the other ranks' at the same call site: another count, or another peer relative to itself
(``dst = rank + 1`` on every rank but one).

Before the end of the chain is trusted, the channels are counted (:func:`channel_counts`): every
pair of ranks that talk has a sender's end and a receiver's end, and in an SPMD program of
ring or pipeline shape each end makes as many calls in a cell as every other end. Where one
rank's ends alone stand apart from a clear majority of ends, that rank made the calls nobody
matched (an extra send, a skipped receive, one more step), even when the chain of waits ends
elsewhere: a rank that finished the cell because its partner asked for less is where the waits
end, not why.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from distnb.analysis.agreement.evidence import CollectiveEvidence, odd_ones, peer_of
from distnb.analysis.verdicts.position import Place, Position
from distnb.wire.record_types import P2P_OPS, CallRecord, called_in

__all__ = ["P2PRoot", "SiteDeparture", "channel_counts", "p2p_roots", "site_departure"]


@dataclass
class P2PRoot:
    culprits: list[int]
    how: str  # how they were found, in words
    site: tuple[int, int] | None  # (cell, line) of the call the culprits made or did not make
    loop: bool = False  # the culprit repeated every one of its calls another number of times


#: Held calls of a rank from which its window may have dropped the oldest: each rank keeps its
#: last 4,000 (worker/torch_hooks/call_log.py) and the controller 5,000; a regroup clears both,
#: so a call's number says nothing of what came before it.
WINDOW_NEAR = 3500

#: A channel's end: (rank, its peer, "send" or "recv").
End = tuple[int, int, str]


def _waits(positions: list[Position]) -> dict[int, set[int]]:
    """rank → the ranks its open sends and receives wait for."""
    recv_from = {(p.rank, peer_of(c)) for p in positions for c in p.peers if P2P_OPS[c["op"]] == "recv"}
    out: dict[int, set[int]] = {}
    for p in positions:
        for c in p.peers:
            peer = peer_of(c)
            if peer is None:
                continue
            if P2P_OPS[c["op"]] == "recv" or (peer, p.rank) not in recv_from and (peer, None) not in recv_from:
                out.setdefault(p.rank, set()).add(peer)
    return out


def p2p_roots(positions: list[Position], log: CollectiveEvidence | None, cell: int | None, explicit: list[int]) -> P2PRoot | None:
    """The ranks the point-to-point waits start from; ``explicit``: the ranks a pairing found
    naming a wrong peer or tag (used when the waits form a cycle)."""
    by_rank = {p.rank: p for p in positions}
    waits = _waits(positions)
    if not waits:
        return None
    ranks = [p.rank for p in positions if p.state != Place.IDLE]
    if log is not None and cell is not None:
        # First the call sites: a rank whose sends (or receives) at a line go to another peer
        # relative to itself, or carry another tensor, than the other ranks' that send there.
        found = site_departure(log, cell, ranks, only=("shape", "peer"))
        if found is not None:
            return P2PRoot(found.odd, "its point-to-point calls depart from the other ranks' at the same call site", found.site)
    if explicit:
        return P2PRoot(_relative_odd(positions, explicit), "a call that names the wrong peer or tag", None)
    finished = {p.rank for p in positions if p.state == Place.FINISHED}
    if log is not None and cell is not None and (counted := _count_root(log, cell, ranks, finished)) is not None:
        return counted
    waited = {q for targets in waits.values() for q in targets}
    sinks = sorted(q for q in waited if q not in waits and (p := by_rank.get(q)) is not None and p.state != Place.COLLECTIVE)
    if sinks:
        waiters = sorted(waits)
        if len(waiters) < len(sinks) and all(by_rank[q].state == Place.FINISHED for q in sinks):
            # One rank asks several that finished alike for more: it made the extra calls.
            return P2PRoot(waiters, "it waits for ranks that all finished alike: it made more calls than they did", None)
        return P2PRoot(sinks, "the rank the chain of waits ends at", _their_site(positions, log, cell, sinks))
    if log is None or cell is None:
        return None
    odd, site = _site_majority(log, cell, ranks, capable=False)
    if odd:
        return P2PRoot(odd, "its point-to-point calls depart from the other ranks' at the same call site", site)
    return None


def channel_counts(log: CollectiveEvidence, cell: int, ranks: list[int]) -> dict[End, int] | None:
    """Calls each channel end made in the cell, open ones included; an end whose partner made
    none counts 0. None when counting can't be trusted: a receive from any rank (its channel is
    not known), or a rank whose held calls may not reach back to the cell's start (the log keeps
    a window of each rank's calls)."""
    ends: Counter[End] = Counter()
    for r in ranks:
        held = log.calls_of(r)
        if len(held) >= WINDOW_NEAR and called_in(held[0]) == cell:
            return None  # the window starts inside this cell: its first calls may be gone
        for c in held:
            if called_in(c) != cell or c["op"] not in P2P_OPS:
                continue
            peer = peer_of(c)
            if peer is None:
                return None
            ends[(r, peer, P2P_OPS[c["op"]])] += 1
    out = dict(ends)
    for r, peer, kind in ends:
        if peer in ranks:
            out.setdefault((peer, r, "recv" if kind == "send" else "send"), 0)
    return out


def _count_root(log: CollectiveEvidence, cell: int, ranks: list[int], finished: set[int]) -> P2PRoot | None:
    """The one rank whose channel ends alone depart from the count a clear majority of ends
    share; else the one rank that made more calls on an end than any end of the ranks that
    finished (blocking only ever leaves a rank short, never over)."""
    ends = channel_counts(log, cell, ranks)
    if not ends or len(ends) < 4:
        return None  # two ranks, one channel: two ends apart say nothing of which is wrong
    return _by_majority(log, cell, ranks, ends) or _by_surplus(ends, finished)


def _said(odd: dict[End, int]) -> str:
    return ", ".join(f"{v} {kind}{'s' if v != 1 else ''} {'to' if kind == 'send' else 'from'} rank {peer}"
                     for (_, peer, kind), v in sorted(odd.items()))


def _by_surplus(ends: dict[End, int], finished: set[int]) -> P2PRoot | None:
    done = {v for e, v in ends.items() if e[0] in finished}
    if len(done) != 1 or (count := done.pop()) == 0:
        return None  # no finished rank, or finished ranks that made different counts: no measure
    over = {e: v for e, v in ends.items() if v > count}
    if len({r for r, _, _ in over}) != 1:
        return None
    rank = next(iter(over))[0]
    return P2PRoot([rank], f"it made {_said(over)}, more than the {count} calls each channel end of the ranks that finished made", None)


def _by_majority(log: CollectiveEvidence, cell: int, ranks: list[int], ends: dict[End, int]) -> P2PRoot | None:
    usual, n = Counter(ends.values()).most_common(1)[0]
    if usual == 0 or n * 2 <= len(ends):
        return None
    odd = {e: v for e, v in ends.items() if v != usual}
    world = max(ranks) + 1
    for (r, peer, kind), v in list(odd.items()):
        # An end that made no call, on a channel only its partner uses: if no other rank talks to
        # that relative peer that way, the channel is the partner's invention (a send backwards
        # down a pipeline), not this rank's omission.
        partner = (peer, r, "send" if kind == "recv" else "recv")
        shared = any(e != partner and e[2] == partner[2] and (e[1] - e[0]) % world == (r - peer) % world and calls > 0
                     for e, calls in ends.items())
        if v == 0 and not shared:
            del odd[(r, peer, kind)]
    owners = {r for r, _, _ in odd}
    if len(owners) != 1:
        return None  # ranks blocked one by another stand apart too: the chain of waits tells those apart
    rank = owners.pop()
    mine = {e: v for e, v in ends.items() if e[0] == rank}
    shifts = {v - usual for v in mine.values()}
    loop = len(shifts) == 1 and 0 not in shifts and _same_lines(log, cell, rank)
    how = (f"it made {_said(odd)}, where every other channel end made {usual} in the cell"
           + (": the same calls another number of times, likely a loop of another length on it" if loop else ""))
    return P2PRoot([rank], how, None, loop)


def _same_lines(log: CollectiveEvidence, cell: int, rank: int) -> bool:
    """Every line the rank's point-to-point calls came from made the same number of them (one
    more turn of a loop), rather than one line more than the others (an extra call)."""
    per_line = Counter(c.get("line") for c in log.calls_of(rank) if called_in(c) == cell and c["op"] in P2P_OPS)
    return len(set(per_line.values())) == 1


def _relative_odd(positions: list[Position], explicit: list[int]) -> list[int]:
    """Of the ranks a pairing found naming a wrong peer, those not cleared by the other ranks'
    calls: a rank whose every open call has the peer, relative to itself, that most calls of its
    kind have (one wrong send makes its receiver's recv look wrong too) is left out."""
    world = max((p.rank for p in positions), default=0) + 1
    rel: dict[int, list[tuple[str, int | None]]] = {}
    for p in positions:
        for c in p.peers:
            peer = peer_of(c)
            rel.setdefault(p.rank, []).append((P2P_OPS[c["op"]], (peer - p.rank) % world if peer is not None else None))
    counts = {kind: Counter(v for calls in rel.values() for k, v in calls if k == kind) for kind in ("send", "recv")}
    usual = {kind: c.most_common(1)[0] for kind, c in counts.items() if c}

    def cleared(r: int) -> bool:
        calls = rel.get(r, [])
        return bool(calls) and all(kind in usual and usual[kind][1] > 1 and v == usual[kind][0] for kind, v in calls)

    kept = [r for r in sorted(explicit) if not cleared(r)]
    return kept if kept and len(kept) < len(explicit) else sorted(explicit)


def _cell_calls(log: CollectiveEvidence, rank: int, cell: int) -> list[CallRecord]:
    return [c for c in log.p2p(rank) if called_in(c) == cell]


@dataclass
class SiteDeparture:
    """Ranks whose sends (or receives) at one call site depart from the other ranks' there."""

    odd: list[int]
    site: tuple[int, int]  # (cell, line)
    kind: str  # send · recv
    what: str  # shape (another tensor size or dtype), peer (another peer relative to the rank), presence (calls there at all), count
    by_rank: dict[int, Counter[Any]]  # each voter's (relative peer, shape) → calls


def site_departure(log: CollectiveEvidence, cell: int, ranks: list[int], capable: bool = True,
                   only: tuple[str, ...] = ("shape", "peer", "presence", "count")) -> SiteDeparture | None:
    """Per call site of the cell: how many sends or receives each rank made there, to which peers
    relative to itself, with which tensors; the ranks that stand out at the first site where one
    does. With ``capable``, only the ranks that send (or receive) at all in the cell vote on a
    send (or receive) site: a pipeline's first stage receives nothing, by design. ``only``: the
    kinds of departure looked for (a count apart is, while ranks block one another round a ring,
    more often where each got stuck than a cause)."""
    world = max(ranks) + 1 if ranks else 1
    per_site: dict[tuple[int, int, str], dict[int, Counter[Any]]] = {}
    kinds: dict[str, set[int]] = {"send": set(), "recv": set()}
    for r in ranks:
        for c in _cell_calls(log, r, cell):
            line = c.get("line")
            if line is None:
                continue
            key = (cell, line, P2P_OPS[c["op"]])
            peer = peer_of(c)
            rel = (peer - r) % world if peer is not None else None
            shape = (repr(c.get("sizes")), repr(c.get("dtypes"))) if c.get("sizes") is not None else None
            per_site.setdefault(key, {}).setdefault(r, Counter())[(rel, shape)] += 1
            kinds[key[2]].add(r)
    for key in sorted(per_site):
        seen = per_site[key]
        voters = sorted(kinds[key[2]]) if capable else ranks
        if len(voters) < 3:
            continue  # two ranks apart say nothing of which is wrong
        counts = {r: seen.get(r, Counter()) for r in voters}
        # Peers and tensors compared as sets: how many of them a rank made is where it got stuck.
        by_count = "count" in only or "presence" in only
        values = {r: tuple(sorted(counts[r].items(), key=repr)) if by_count else tuple(sorted(map(repr, counts[r]))) for r in voters}
        odd = odd_ones(values)
        if not odd or len(odd) * 2 >= len(voters):
            continue
        usual = next(counts[r] for r in voters if r not in odd)
        mine = counts[odd[0]]
        if not usual or not mine:
            what = "presence"  # only one side calls at that line at all
        elif {k[1] for k in usual} != {k[1] for k in mine}:
            what = "shape"
        elif {k[0] for k in usual} != {k[0] for k in mine}:
            what = "peer"
        else:
            what = "count"
        if what == "presence" and not mine:
            continue  # the odd ranks make no call where the others do: a stage's shape, or a skip the waits will show
        if what in only:
            return SiteDeparture(odd, (key[0], key[1]), key[2], what, counts)
    return None


def _site_majority(log: CollectiveEvidence, cell: int, ranks: list[int], capable: bool) -> tuple[list[int], tuple[int, int] | None]:
    # A call at a line where no other rank calls, or to another peer, before any count apart:
    # counts part wherever ranks blocked one another, whatever line comes first.
    found = site_departure(log, cell, ranks, capable, only=("shape", "peer", "presence")) or site_departure(log, cell, ranks, capable)
    return (found.odd, found.site) if found is not None else ([], None)


def _their_site(positions: list[Position], log: CollectiveEvidence | None, cell: int | None, culprits: list[int]) -> tuple[int, int] | None:
    """The site of the calls the others made towards the culprits (a send the culprit never
    matched is at the same line on every rank of a ring or pipeline)."""
    if log is None or cell is None:
        return None
    for p in positions:
        for c in p.peers:
            if peer_of(c) in culprits:
                kind = "send" if P2P_OPS[c["op"]] == "recv" else "recv"
                # The culprit's matching call, where the others made theirs.
                for q in positions:
                    if q.rank in culprits:
                        continue
                    for call in _cell_calls(log, q.rank, cell):
                        if P2P_OPS[call["op"]] == kind and (line := call.get("line")) is not None:
                            return cell, line
    return None
