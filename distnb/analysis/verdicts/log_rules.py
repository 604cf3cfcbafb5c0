"""Rules that read the calls beyond one group's sequence: group creation out of step, a collective
that paired calls of different cells, point-to-point calls left without a partner, and how far
each rank got on a group where Flight Recorder dumps are all there is."""

from __future__ import annotations

from distnb.analysis.agreement.evidence import peer_of, same_op
from distnb.analysis.agreement.group_creation import creation_mismatch
from distnb.analysis.agreement.pairing import cross_cell, cross_group
from distnb.analysis.agreement.sequence_numbers import seq_blame as blame_by_seq
from distnb.analysis.root_cause import RootCause
from distnb.analysis.verdicts.p2p import match_p2p
from distnb.analysis.verdicts.p2p_roots import SiteDeparture, p2p_roots, site_departure
from distnb.analysis.verdicts.position import Place
from distnb.analysis.verdicts.records import Records
from distnb.analysis.verdicts.verdict import Certainty, Evidence, Kind, Site, Verdict, VerdictState
from distnb.cell_names import cell_name
from distnb.ranks import format_ranks
from distnb.wire.record_types import P2P_OPS, CollectiveEntry, called_in, issued_in

__all__ = ["creation_out_of_step", "p2p_departure", "p2p_unmatched", "by_sequence_numbers", "paired_across_cells", "wrong_group"]


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
             (p.rank in gone or any(cell is None or called_in(c) == cell for c in rec.log.log.calls_of(p.rank)))}
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
    return Verdict(VerdictState.HANG, Kind.CROSS_CELL, found.said(), odd, [r for r in found.by_rank if r not in odd], [],
                   Evidence("a collective pairs the same call on every member", {r: cell_name(issued_in(e))
                                                                                  for r, e in found.by_rank.items()}, found.group, found.seq),
                   Certainty.LIKELY, "by majority over the cells that issued the paired calls", positions=rec.positions, rule="cross_cell",
                   root=found.root())


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
    return Verdict(VerdictState.HANG, Kind.WRONG_GROUP, found.said(), odd, [r for r in found.waits_for if r not in odd], sites,
                   Evidence("ranks in step call over groups of the same role", {r: found.labels[r] for r in found.by_rank}),
                   Certainty.LIKELY, "by majority over the roles of the ranks' calls at that point of the cell", positions=rec.positions,
                   rule="wrong_group", root=found.root())


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
            "peer": f"{who}'s {verb} at {cell_name(found.site[0])} line {line} {_peers_apart(found, max(ranks) + 1)}",
            "presence": f"{who} {verb} at {cell_name(found.site[0])} line {line}, where no other rank does"}[found.what]
    kind = Kind.MISMATCH if found.what == "shape" else Kind.P2P_UNMATCHED
    return Verdict(rec.state(), kind, f"point-to-point: {said}.", found.odd,
                   [p.rank for p in rec.waiting if p.rank not in found.odd], [Site(found.site[0], line, "", "", "the call")],
                   Evidence("a send is matched by a receive of the same tensor, from the peer it names",
                            {r: ", ".join(f"{n}× to {'+' if rel is not None else ''}{rel} {shape[0] if shape else ''}".strip()
                                          for (rel, shape), n in c.items()) or "none" for r, c in found.by_rank.items()}),
                   Certainty.LIKELY, "by majority over the ranks that make such calls at that line", positions=rec.positions,
                   rule="p2p_departure", root=RootCause.of(found.odd))


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


def _peers_apart(found: SiteDeparture, world: int) -> str:
    """``come from rank 3 (the next rank), where the other ranks' there come from the previous
    rank (rank 1, for rank 2)``: the peer the odd rank used and the one the others' pattern gives it."""
    rank = found.odd[0]
    usual_rank = next(r for r in found.by_rank if r not in found.odd)
    mine = sorted({rel for rel, _ in found.by_rank[rank] if rel is not None})
    usual = sorted({rel for rel, _ in found.by_rank[usual_rank] if rel is not None})
    if not mine or not usual:
        return "go to another peer (relative to the rank) than the other ranks' there"
    verb = "go to" if found.kind == "send" else "come from"

    def relative(rel: int) -> str:
        return "the next rank" if rel == 1 else "the previous rank" if rel == world - 1 else f"{rel} ranks on"

    def ranks(rels: list[int]) -> str:
        return ", ".join(f"rank {(rank + rel) % world}" for rel in rels)

    return (f"{verb} {ranks(mine)} ({', '.join(map(relative, mine))}), where the other ranks' there {verb} "
            f"{', '.join(map(relative, usual))} ({ranks(usual)}, for rank {rank})")


def p2p_unmatched(rec: Records) -> Verdict | None:
    """Open sends and receives without a partner (every open call with its partner: a transfer)."""
    if not any(p.peers for p in rec.waiting):
        return None
    found = match_p2p(rec.positions)
    if found.sentences:
        root = p2p_roots(rec.positions, rec.log.log if rec.log is not None else None, rec.judged_cell, found.explicit)
        culprits = root.culprits if root is not None else found.culprits
        sites = [Site(root.site[0], root.site[1], "", "", "the call")] if root is not None and root.site else _p2p_sites(rec, culprits)
        kind = Kind.LOOP_COUNT if root is not None and root.loop else Kind.P2P_UNMATCHED
        return Verdict(VerdictState.HANG, kind, "point-to-point calls without a partner: " + "; ".join(dict.fromkeys(found.sentences)) + ".",
                       culprits, [p.rank for p in rec.waiting if p.rank not in culprits], sites,
                       Evidence("a send is matched by a receive on its peer, with the same tag"), Certainty.LIKELY,
                       "which side of an unmatched pair is wrong is inferred from the other calls", positions=rec.positions, rule="p2p",
                       root=RootCause.of(culprits, how=root.how) if root is not None else None)
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


def by_sequence_numbers(rec: Records) -> Verdict | None:
    """Every rank known by its Flight Recorder dump alone, every entry completed (NCCL's abort
    completes them all): where the ranks "are" says nothing; how far each got on a group does —
    a rank whose last sequence number is lower never issued the call the others reached."""
    if rec.log is None or not rec.dumps_only or len(rec.dumps_only) != len(rec.positions):
        return None
    entries = {r: list(rec.log.log.entries.get(r, {}).values()) for r in rec.dumps_only}
    if any(not e["done"] for es in entries.values() for e in es):
        return None
    marks = {r: [(e["group"], e["seq"], e["op"].split(":")[-1]) for e in es if not e.get("p2p")] for r, es in entries.items()}
    blames = blame_by_seq(marks, rec.log.log.groups or None)
    if not blames:
        return None
    b = blames[0]
    return Verdict(VerdictState.HANG, Kind.CALL_MISSING, b.said(), sorted(b.never), b.ahead, [],
                   Evidence("every member of a group reaches its n-th collective",
                            {r: f"last #{seq}" if seq is not None else "none" for r, seq in b.never.items()}, b.group, b.seq),
                   Certainty.LIKELY, "from the ranks' sequence numbers on the group: a dump says how far a rank got, not where it waits",
                   positions=rec.positions, rule="seq_blame", root=b.root())
