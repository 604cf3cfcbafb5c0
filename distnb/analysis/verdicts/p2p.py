"""Point-to-point pairs: who sends to whom, who waits on whom, and which side is wrong.

Unlike a collective, a ``send``/``recv`` needs only its peer: ranks outside the pair are not late,
and a rank that finished the cell is guilty only if someone waits to hear from it. Input is each
rank's position with its open point-to-point calls (``Position.peers``); output is the sentences
and the ranks to blame.
"""

from __future__ import annotations

from dataclasses import dataclass

from distnb.analysis.agreement.evidence import peer_of
from distnb.analysis.verdicts.position import Place, Position, p2p_text
from distnb.wire.record_types import P2P_OPS, CallRecord

__all__ = ["P2PFinding", "match_p2p"]


@dataclass
class P2PFinding:
    sentences: list[str]
    culprits: list[int]
    matched: list[tuple[int, int]]  # (sender, receiver) pairs that match and should complete
    explicit: list[int]  # ranks whose call names the wrong peer or tag (not merely blocked)


def _tag(call: CallRecord) -> int:
    return int(call.get("args", {}).get("tag") or 0)


def _elsewhere(p: Position | None) -> str:
    if p is None:
        return "not part of this cell"
    if p.state == Place.COLLECTIVE and not p.peers:
        return f"waits in {p.collective()}"
    if p.state == Place.COLLECTIVE:
        return "is itself " + " and ".join(p2p_text(c) for c in p.peers)
    return {"finished": "finished the cell", "computing": "is running Python code", "idle": "is not part of this cell",
            "failed": f"raised {p.detail}", "dead": "died"}.get(p.state, p.state)


def match_p2p(positions: list[Position]) -> P2PFinding:
    """Pair every open send with a receive on its peer (same tag; a receive from any rank takes
    any sender) and explain every call left without a partner."""
    by_rank = {p.rank: p for p in positions}
    sends = [(p.rank, c) for p in positions for c in p.peers if P2P_OPS[c["op"]] == "send"]
    recvs = [(p.rank, c) for p in positions for c in p.peers if P2P_OPS[c["op"]] == "recv"]
    matched: list[tuple[int, int]] = []
    free_recvs = list(recvs)
    lonely_sends = []
    for i, s in sends:
        j = peer_of(s)
        partner = next((rc for rc in free_recvs if rc[0] == j and peer_of(rc[1]) in (i, None) and _tag(rc[1]) == _tag(s)), None)
        if partner is None:
            lonely_sends.append((i, s))
        else:
            free_recvs.remove(partner)
            matched.append((i, j))  # type: ignore[arg-type]
    sentences: list[str] = []
    culprits: set[int] = set()
    explicit: set[int] = set()
    explained_sends: set[int] = set()
    for j, r in free_recvs:
        peer = peer_of(r)
        # Someone sends to j, just not what j asked for: j's src (or tag) is the likely mistake.
        to_me = [(k, s) for k, s in lonely_sends if peer_of(s) == j]
        if peer is None:
            if not to_me:
                sentences.append(f"rank {j} waits to receive from any rank, and no rank sends to it")
                culprits.add(j)
            continue
        i = peer
        if any(k == i for k, _ in to_me):
            k, s = next((k, s) for k, s in to_me if k == i)
            sentences.append(f"rank {j} receives from rank {i} with tag {_tag(r)}, but rank {i} sends to it with tag {_tag(s)}: "
                             "the tags must match")
            culprits.update((i, j))
            explicit.update((i, j))
            explained_sends.add(id(s))
            continue
        if to_me:
            senders = sorted(k for k, _ in to_me)
            sentences.append(
                f"rank {j} waits to receive from rank {i}, which {_elsewhere(by_rank.get(i))}, while "
                f"rank{'s' if len(senders) > 1 else ''} {', '.join(map(str, senders))} send{'s' if len(senders) == 1 else ''} to rank {j}: "
                f"rank {j}'s recv most likely names the wrong peer (src={i})"
            )
            culprits.add(j)
            explicit.add(j)
            explained_sends.update(id(s) for _, s in to_me)
            continue
        # Nobody sends to j. If i sends to someone else, i's dst is the likely mistake.
        theirs = [s for k, s in lonely_sends if k == i]
        if theirs:
            sentences.append(f"rank {j} waits to receive from rank {i}, which is sending to rank {peer_of(theirs[0])} instead: "
                             f"rank {i}'s send most likely names the wrong peer (dst={peer_of(theirs[0])})")
            explained_sends.update(id(s) for s in theirs)
            explicit.add(i)
        else:
            sentences.append(f"rank {j} waits to receive from rank {i}, which {_elsewhere(by_rank.get(i))} without sending to it")
        culprits.add(i)
    for i, s in lonely_sends:
        dst = peer_of(s)
        if id(s) in explained_sends or dst is None:
            continue
        sentences.append(f"rank {i} sends to rank {dst}, which {_elsewhere(by_rank.get(dst))} without receiving from it")
        culprits.add(dst)
    return P2PFinding(sentences, sorted(culprits), matched, sorted(explicit))
