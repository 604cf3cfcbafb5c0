"""What the analyses read of the ranks' collective logs (the data, not the controller's object
that keeps it), and the words every comparison shares: a point-to-point call's peer, whether two
names are one collective, and who stands out by majority."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Protocol

from distnb.analysis.agreement.groups import GroupInfo
from distnb.ranks import group_by
from distnb.wire.record_types import P2P_OPS, UNRECORDED, CallRecord, CollectiveEntry, called_in, issued_in

__all__ = ["ROOT_INPUT_ONLY", "CollectiveEvidence", "groups_in_cell", "odd_ones", "op_stem", "peer_of", "peer_words", "same_op", "unrecorded_calls"]


class CollectiveEvidence(Protocol):
    """What the analyses read of the ranks' collective logs: the data, not the object that keeps
    it (the controller's :class:`~distnb.controller.collective_log.CollectiveLog` is one)."""

    entries: dict[int, dict[int, CollectiveEntry]]  # rank -> id -> Flight Recorder entry
    groups: dict[str, list[int]]  # group name -> member ranks
    unavailable: str | None
    missing: dict[str, str]  # recorders some rank could not read, and why
    died_in: dict[int, str]  # ranks that died inside a collective before its entry came: op
    died_at: dict[int, tuple[int | None, int | None]]  # … and its (cell, line), from the stack at death
    died_during: dict[int, int]  # every rank that died: the cell it died in

    def sequence(self, rank: int, group: str) -> list[CollectiveEntry]: ...

    def seqs(self, rank: int, group: str) -> dict[int, CollectiveEntry]: ...

    def groups_of(self, rank: int) -> dict[str, dict[int, CollectiveEntry]]: ...

    def keys(self, rank: int, group: str) -> dict[int, tuple[Any, ...]]: ...

    def group(self, name: str) -> GroupInfo: ...

    def open_calls(self, rank: int) -> list[CallRecord]: ...

    def local_time(self, rank: int, entry: CollectiveEntry) -> float: ...

    def offset(self, rank: int) -> float: ...

    def last_seq(self, rank: int, group: str) -> int | None: ...

    def pending(self, rank: int, cell: int | None = None) -> CollectiveEntry | None: ...

    def creations(self, rank: int) -> dict[int, CallRecord]: ...

    def p2p(self, rank: int) -> list[CallRecord]: ...

    def calls_of(self, rank: int) -> list[CallRecord]: ...



def unrecorded_calls(log: CollectiveEvidence, rank: int, cell: int, entries: list[CollectiveEntry]) -> list[CollectiveEntry]:
    """The collective ``rank`` is in, issued in ``cell``, as an entry, when its recorder has none
    for it yet among ``entries`` (NCCL connecting a group's communicator): op, group and site
    from the watched call, no sequence number, no shapes."""
    out: list[CollectiveEntry] = []
    for c in log.open_calls(rank):
        if called_in(c) != cell or c["op"] in _NOT_COLLECTIVE or c.get("group") in (None, "?"):
            continue
        t = c["t"] / 1e9
        if any(e["group"] == c["group"] and e["t"] >= t - 1e-3 for e in entries):
            continue  # its entry is in
        entry: CollectiveEntry = {"id": UNRECORDED, "group": c["group"], "op": c["op"], "done": False, "cell": cell, "call_cell": c["cell"],
                                  "line": c.get("line"), "func": c.get("func") or "", "p2p": False, "t": t, "args": c.get("args") or {}}
        if c.get("in_line") is not None:
            entry["in_line"] = c["in_line"]
        out.append(entry)
    return out


_NOT_COLLECTIVE = {"new_group", *P2P_OPS}


def groups_in_cell(log: CollectiveEvidence, ranks: Iterable[int], cell: int, open_calls: bool = False) -> set[str]:
    """The groups any of ``ranks`` issued a collective on in ``cell`` (not point-to-point), by
    their recorders' entries and, with ``open_calls``, the calls they are in that have no entry
    yet. Each group's entries are read newest first, and the first of ``cell`` ends the search:
    a cell's own are the latest, so a diagnosis reads a few entries per group, not every one."""
    out: set[str] = set()
    for r in ranks:
        for g, by_seq in log.groups_of(r).items():
            if g not in out and any(issued_in(e) == cell for e in reversed(by_seq.values())):
                out.add(g)
        if open_calls:
            out.update(str(c["group"]) for c in log.open_calls(r)
                       if called_in(c) == cell and c["op"] not in _NOT_COLLECTIVE and c.get("group") not in (None, "?"))
    return out


def peer_of(call: Mapping[str, Any]) -> int | None:
    """The global rank a send goes to or a recv takes from (None: any rank, or only a group rank)."""
    peer = call.get("args", {}).get("dst" if P2P_OPS[call["op"]] == "send" else "src")
    return int(peer) if peer is not None else None


def peer_words(call: Mapping[str, Any]) -> str:
    """``rank 1``, ``group rank 2``, ``any rank``: a send/recv call's peer."""
    peer = peer_of(call)
    local = call.get("args", {}).get("group_dst" if P2P_OPS[call["op"]] == "send" else "group_src")
    return f"rank {peer}" if peer is not None else f"group rank {local}" if local is not None else "any rank"


_FORMS = ("_into_tensor", "_single", "_base", "_tensor", "_coalesced")
#: Ops whose input exists on the root alone (the recorder shows the scattered tensor on the
#: source rank and nothing on the others): their shapes are not compared.
ROOT_INPUT_ONLY = frozenset({"scatter"})


def op_stem(op: str) -> str:
    """``all_gather`` for ``all_gather_into_tensor``, ``_all_gather_base``, ``all_gather_single``."""
    op = op.lstrip("_")
    for form in _FORMS:
        op = op.removesuffix(form)
    return op


def same_op(a: str | None, b: str | None) -> bool:
    """The function a stack names and the op its recorder entry names are one collective
    (``all_gather_single``, ``_all_gather_base`` and ``all_gather_into_tensor`` record as ``all_gather``)."""
    return a is not None and b is not None and op_stem(a) == op_stem(b)


def odd_ones(values: dict[int, Any]) -> list[int]:
    """Ranks whose value differs from the one most ranks share; every rank on a tie (nothing
    says which side is wrong)."""
    groups = group_by((r, repr(v)) for r, v in sorted(values.items()))
    sizes = sorted((len(rs) for rs, _ in groups), reverse=True)
    if len(groups) < 2:
        return []
    if sizes[0] == sizes[1]:
        return sorted(values)
    majority = next(rs for rs, _ in groups if len(rs) == sizes[0])
    return sorted(r for r in values if r not in majority)
