"""Rules that read the calls beyond one group's sequence: group creation out of step, a collective
that paired calls of different cells, and point-to-point calls left without a partner."""

from __future__ import annotations

from distnb.analysis.agreement.evidence import peer_of, same_op
from distnb.analysis.agreement.group_creation import creation_mismatch
from distnb.analysis.agreement.pairing import cross_cell, cross_group
from distnb.analysis.verdicts.p2p import match_p2p
from distnb.analysis.verdicts.p2p_roots import p2p_roots, site_departure
from distnb.analysis.verdicts.position import Place
from distnb.analysis.verdicts.records import Records
from distnb.analysis.verdicts.verdict import Certainty, Evidence, Kind, Site, Verdict, VerdictState
from distnb.cell_names import cell_name
from distnb.ranks import format_ranks
from distnb.wire.records import P2P_OPS, CollectiveEntry

__all__ = ["creation_out_of_step", "p2p_departure", "p2p_unmatched", "paired_across_cells", "wrong_group"]


def creation_out_of_step(rec: Records) -> Verdict | None:
    """new_group out of step: every rank must create every group, in the same order."""
    if rec.log is None or not (rec.waiting or not rec.running):
        return None
    moving = {p.rank for p in rec.of(Place.COMPUTING)}
    cell = rec.judged_cell
    # A rank whose calls of this cell never reached distnb (its reply lost) made "none" only in
    # the log: it is left out unless it left the cell.
    gone = {p.rank for p in rec.of(Place.FINISHED, Place.FAILED, Place.DEAD, Place.STRANDED)}
    heard = {p.rank for p in rec.positions if p.state != Place.IDLE and
             (p.rank in gone or any(cell is None or c.get("cell") == cell for c in rec.log.log.calls_of(p.rank)))}
    found = creation_mismatch(rec.log.log, sorted(heard), moving)
    if found is None:
        return None
    odd = found.odd
    left = {p.rank for p in rec.raised} | {p.rank for p in rec.dead}
    if odd and all(found.by_rank.get(r) is None and r in left for r in odd):
        return None  # they raised or died before creating it: the event rules say so
    calls = [c for r, c in sorted(found.by_rank.items()) if r in odd and c is not None]
    sites = [Site(c.get("cell"), c.get("line"), c.get("func") or "", "", "the new_group call") for c in calls[:1] if c.get("line")]
    return Verdict(VerdictState.HANG if rec.running else VerdictState.FAILED, Kind.GROUP_CREATION, found.text(), odd,
                   [p.rank for p in rec.waiting if p.rank not in odd], sites,
                   Evidence("every rank creates the same groups in the same order", {r: "none" if c is None else str(c.get("args"))
                                                                                      for r, c in found.by_rank.items()}),
                   Certainty.LIKELY, "by majority over the ranks' new_group calls", positions=rec.positions, rule="creation")


def paired_across_cells(rec: Records) -> Verdict | None:
    """A collective that paired calls of different cells (a call left pending in an earlier one)."""
    cell = rec.judged_cell
    if rec.log is None or cell is None or not rec.waiting:
        return None
    ranks = [p.rank for p in rec.positions if p.state != Place.IDLE]
    found = cross_cell(rec.log.log, ranks, cell)
    if found is None:
        return None
    odd = found.odd
    return Verdict(VerdictState.HANG, Kind.CROSS_CELL, found.text(), odd, [r for r in found.by_rank if r not in odd], [],
                   Evidence("a collective pairs the same call on every member", {r: cell_name(e.get('call_cell', e.get('cell')))
                                                                                  for r, e in found.by_rank.items()}, found.group, found.seq),
                   Certainty.LIKELY, "by majority over the cells that issued the paired calls", positions=rec.positions, rule="cross_cell")


def wrong_group(rec: Records) -> Verdict | None:
    """Ranks in step by group but not by meaning: the n-th collective of the cell over a group of
    another role (mesh dimension, new_group site) than the majority's, with a rank waiting for it.
    A tie between roles is no evidence (``mine = lo if rank < 2 else hi`` is a healthy program)."""
    cell = rec.judged_cell
    if rec.log is None or cell is None or not rec.waiting:
        return None
    ranks = [p.rank for p in rec.positions if p.state != Place.IDLE]
    found = cross_group(rec.log.log, ranks, cell, frozenset(p.rank for p in rec.waiting))
    if found is None or not found.waits_for or not found.odd or len(found.odd) * 2 >= len(found.by_rank):
        return None
    odd = found.odd
    theirs = [e for r, e in found.by_rank.items() if r not in odd]
    if not all(_same_call(found.by_rank[r], theirs[0]) for r in odd):
        return None  # another call, not the same call over another group: the agreement rule says which
    e = found.by_rank[odd[0]]
    sites = [Site(e.get("call_cell", e.get("cell")), e["line"], e.get("func") or "", "", "the call")] if e.get("line") else []
    return Verdict(VerdictState.HANG, Kind.WRONG_GROUP, found.text(), odd, [r for r in found.waits_for if r not in odd], sites,
                   Evidence("ranks in step call over groups of the same role", {r: found.labels[r] for r in found.by_rank}),
                   Certainty.LIKELY, "by majority over the roles of the ranks' calls at that point of the cell", positions=rec.positions,
                   rule="wrong_group")


def _same_call(a: CollectiveEntry, b: CollectiveEntry) -> bool:
    """The same op, from the same line when the call log saw both."""
    lines = (a.get("line"), b.get("line")) if a.get("call_cell") is not None and b.get("call_cell") is not None else (None, None)
    return same_op(a["op"], b["op"]) and lines[0] == lines[1]


def p2p_departure(rec: Records) -> Verdict | None:
    """A rank whose sends or receives at a line of the cell go to another peer relative to itself
    or carry another tensor than the other ranks' there, or that sends or receives at a line no
    other rank reaches — while point-to-point calls wait, a rank died or raised, or the cell ended."""
    cell = rec.judged_cell
    if rec.log is None or cell is None:
        return None
    p2p_waits = any(p.peers for p in rec.waiting)
    if rec.running and not p2p_waits and not rec.dead and not rec.of(Place.FAILED):
        return None
    ranks = [p.rank for p in rec.positions if p.state != Place.IDLE]
    # Another tensor or peer among the ranks that make such calls; calls at a line only the odd
    # ranks reach, among all.
    found = site_departure(rec.log.log, cell, ranks, only=("shape", "peer")) or \
        site_departure(rec.log.log, cell, ranks, capable=False, only=("presence",))
    if found is None or found.what == "presence" and not all(_past(rec, r, found.site) for r in ranks if r not in found.odd):
        return None  # the others may not have got there yet: a call they skipped only once they are past it
    if found.what == "presence" and _met(rec, found.odd):
        return None  # a call only it makes (``if rank == 0: send(…, 1)``) that its peer waits to match: who is wrong is in the pairing
    who = format_ranks(found.odd)
    line = found.site[1]
    verb = "sends" if found.kind == "send" else "receives"
    said = {"shape": f"{who}'s {verb} at {cell_name(found.site[0])} line {line} carry another tensor than the other ranks' there",
            "peer": f"{who}'s {verb} at {cell_name(found.site[0])} line {line} go to another peer (relative to the rank) than the other ranks' there",
            "presence": f"{who} {verb} at {cell_name(found.site[0])} line {line}, where no other rank does"}[found.what]
    kind = Kind.MISMATCH if found.what == "shape" else Kind.P2P_UNMATCHED
    return Verdict(rec.state(), kind, f"point-to-point: {said}. Root cause: {who}.", found.odd,
                   [p.rank for p in rec.waiting if p.rank not in found.odd], [Site(found.site[0], line, "", "", "the call")],
                   Evidence("a send is matched by a receive of the same tensor, from the peer it names",
                            {r: ", ".join(f"{n}× to {'+' if rel is not None else ''}{rel} {shape[0] if shape else ''}".strip()
                                          for (rel, shape), n in c.items()) or "none" for r, c in found.by_rank.items()}),
                   Certainty.LIKELY, "by majority over the ranks that make such calls at that line", positions=rec.positions,
                   rule="p2p_departure")


def _met(rec: Records, odd: list[int]) -> bool:
    """An odd rank's open send (receive) names a peer that waits in a receive (send) itself."""
    for r in odd:
        p = rec.by_rank.get(r)
        for call in p.peers if p is not None else []:
            peer = peer_of(call)
            q = rec.by_rank.get(peer) if peer is not None else None
            if q is not None and any(P2P_OPS[c["op"]] != P2P_OPS[call["op"]] for c in q.peers):
                return True
    return False


def _past(rec: Records, rank: int, site: tuple[int, int]) -> bool:
    """The rank left the cell, or stands further down its code than ``site``."""
    p = rec.by_rank.get(rank)
    if p is None or p.state in (Place.FINISHED, Place.FAILED, Place.DEAD, Place.STRANDED):
        return True
    cell = p.line_cell if p.line_cell is not None else p.running
    return cell == site[0] and p.line is not None and p.line > site[1]


def p2p_unmatched(rec: Records) -> Verdict | None:
    """Open sends and receives without a partner (every open call with its partner: a transfer)."""
    if not any(p.peers for p in rec.waiting):
        return None
    found = match_p2p(rec.positions)
    if found.sentences:
        root = p2p_roots(rec.positions, rec.log.log if rec.log is not None else None, rec.judged_cell, found.explicit)
        culprits = root.culprits if root is not None else found.culprits
        sites = [Site(root.site[0], root.site[1], "", "", "the call")] if root is not None and root.site else _p2p_sites(rec, culprits)
        blame = f" Root cause: {format_ranks(culprits)} ({root.how})." if root is not None else ""
        kind = Kind.LOOP_COUNT if root is not None and root.loop else Kind.P2P_UNMATCHED
        return Verdict(VerdictState.HANG, kind, "point-to-point calls without a partner: " + "; ".join(found.sentences) + "." + blame,
                       culprits, [p.rank for p in rec.waiting if p.rank not in culprits], sites,
                       Evidence("a send is matched by a receive on its peer, with the same tag"), Certainty.LIKELY,
                       "which side of an unmatched pair is wrong is inferred from the other calls", positions=rec.positions, rule="p2p")
    if all(p.peers for p in rec.waiting):
        return Verdict(VerdictState.SLOW, Kind.SLOW_COLLECTIVE, "send/recv in progress: every open call has its partner (a large transfer, or a "
                       "slow link).", positions=rec.positions, rule="p2p")
    return None


def _p2p_sites(rec: Records, culprits: list[int]) -> list[Site]:
    out = []
    for r in culprits:
        p = rec.by_rank.get(r)
        if p is not None and p.line:
            out.append(Site(p.line_cell if p.line_cell is not None else rec.judged_cell, p.line, p.func, p.code, "where it is"))
    return out[:1]
