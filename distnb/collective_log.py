"""The ranks' collective logs side by side, and the first place where they disagree.

Times in the log are the ranks' own wall clocks. Ranks on another machine may be seconds off the
controller's, so the log never compares an entry's time with the controller's clock: each reply
carries the rank's ``now``, and :meth:`CollectiveLog.age` measures against that.
"""

from __future__ import annotations

import collections
import heapq
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from distnb.ranks import format_ranks
from distnb.results import group_by

__all__ = ["CollectiveLog", "CollectiveReport", "Divergence", "P2P_OPS", "args_text", "describe", "odd_ones", "peer_of", "peer_words",
           "issued_words", "signature", "state_mark", "RECORDER_NAMES"]

P2P_OPS = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}

_DTYPE_SHORT = {"Float": "f32", "Double": "f64", "Half": "f16", "BFloat16": "bf16", "Long": "i64", "Int": "i32",
                "Byte": "u8", "Bool": "bool", "Char": "i8", "Short": "i16"}


def args_text(args: dict[str, Any] | None) -> str:
    """``src=1``, ``op=MAX``: the arguments a call was given, the usual reduce op (SUM) left out."""
    return " ".join(f"{k}={v}" for k, v in (args or {}).items() if v is not None and not (k == "op" and v == "SUM"))


def peer_of(call: dict[str, Any]) -> int | None:
    """The global rank a send goes to or a recv takes from (None: any rank, or only a group rank)."""
    return call.get("args", {}).get("dst" if P2P_OPS[call["op"]] == "send" else "src")


def peer_words(call: dict[str, Any]) -> str:
    """``rank 1``, ``group rank 2``, ``any rank``: a send/recv call's peer."""
    peer = peer_of(call)
    local = call.get("args", {}).get("group_dst" if P2P_OPS[call["op"]] == "send" else "group_src")
    return f"rank {peer}" if peer is not None else f"group rank {local}" if local is not None else "any rank"


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


def describe(entry: dict[str, Any], with_op: bool = True) -> str:
    """``all_reduce [3] f32`` (shapes and dtypes of the inputs), ``broadcast [2] f32 src=1``."""
    shapes = " ".join("[" + ",".join(map(str, s)) + "]" for s in entry.get("sizes", [])[:4])
    if len(entry.get("sizes", [])) > 4:
        shapes += f" +{len(entry['sizes']) - 4}"
    dtypes = sorted({_DTYPE_SHORT.get(d, d) for d in entry.get("dtypes", [])})
    args = args_text(entry.get("args"))
    parts = ([entry["op"]] if with_op else []) + ([shapes] if shapes else []) + ([",".join(dtypes)] if dtypes else []) + ([args] if args else [])
    return " ".join(parts)


#: distnb's recorder names (worker/flight_recorder.py) in words.
RECORDER_NAMES = {"nccl": "NCCL", "fr": "gloo (and other non-NCCL)"}


def state_mark(entry: dict[str, Any]) -> str:
    """`` ⏳`` for an entry not completed, `` ⏸`` for an NCCL one still queued behind other GPU
    work (its kernel has not started: the stream is busy before it), ``""`` when done."""
    if entry["done"]:
        return ""
    return " ⏸" if entry.get("queued") else " ⏳"


def issued_words(entry: dict[str, Any]) -> str:
    """``issued in cell 3, line 4`` (the call's own cell and line when the call log matched it),
    ``issued in cell 3``, or ``issued outside distnb's cells``."""
    cell = entry.get("call_cell", entry.get("cell"))
    if cell is None:
        return "issued outside distnb's cells"
    return f"issued in cell {cell}" + (f", line {entry['line']}" if entry.get("line") and entry.get("call_cell") is not None else "")


def signature(entry: dict[str, Any]) -> tuple[Any, ...]:
    """What must match across ranks at one position of a group's sequence."""
    return (entry["op"], tuple(tuple(s) for s in entry.get("sizes", [])), tuple(entry.get("dtypes", [])),
            tuple(sorted((k, repr(v)) for k, v in (entry.get("args") or {}).items())))


@dataclass
class CollectiveLog:
    """Every rank's Flight Recorder entries as the controller last saw them (kept after death)."""

    entries: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # rank -> id -> entry
    groups: dict[str, list[int]] = field(default_factory=dict)
    unavailable: str | None = None
    # Recorders some rank could not read (e.g. NCCL's on a torch without it), and why: the log
    # then lacks those collectives, and says so.
    missing: dict[str, str] = field(default_factory=dict)
    # Per rank, the watched calls (worker/call_log.py) by number: point-to-point, group creation,
    # and the arguments of rooted and reducing collectives.
    calls: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)
    # Ranks that died inside a collective (by the stack they printed) before its entry reached
    # the controller: op name. Their missing entry is not "never entered".
    died_in: dict[int, str] = field(default_factory=dict)
    # Per rank, the record id below which entries belong to process groups that no longer exist
    # (a regroup names its new default group "0" again and restarts its sequence at 1).
    floors: dict[int, int] = field(default_factory=dict)
    # Per rank, recent (rank's clock − controller's clock) samples; each is low by the reply's
    # transit and queueing time, so the largest recent one is the best estimate of the offset.
    _skew: dict[int, collections.deque[float]] = field(default_factory=dict)

    def last_id(self, rank: int) -> int:
        ids = self.entries.get(rank)
        return max(max(ids) if ids else -1, self.floors.get(rank, -1))

    def cursor(self, rank: int) -> int:
        """Where the next read of the rank's recorder starts: after the newest record held, or
        before the oldest one still held as open among the recent ones — the rank re-sends open
        entries only while they are open, so one that completed after its last read would stay
        "entered, not completed" here for good."""
        ids = self.entries.get(rank, {})
        open_ = sorted(i for i in heapq.nlargest(200, ids) if not ids[i]["done"])
        return min(self.last_id(rank), open_[0] - 1) if open_ else self.last_id(rank)

    def last_call(self, rank: int) -> int:
        calls = self.calls.get(rank)
        return max(calls) if calls else -1

    def merge(self, rank: int, reply: dict[str, Any]) -> None:
        if reply.get("calls"):
            mine_calls = self.calls.setdefault(rank, {})
            for c in reply["calls"]:
                mine_calls[c["n"]] = c
            if len(mine_calls) > 5000:
                for n in sorted(mine_calls)[: len(mine_calls) - 5000]:
                    del mine_calls[n]
        if "unavailable" in reply:
            self.unavailable = reply["unavailable"]
            return
        self.unavailable = None
        self.missing.update(reply.get("missing", {}))
        if "now" in reply:
            self._skew.setdefault(rank, collections.deque(maxlen=16)).append(float(reply["now"]) - time.time())
        floor = self.floors.get(rank, -1)
        mine = self.entries.setdefault(rank, {})
        for e in reply.get("entries", []):
            if e["id"] > floor:
                mine[e["id"]] = e
        self.groups.update(reply.get("groups", {}))
        if len(mine) > 5000:  # the recorder itself keeps 2000; keep a bounded history
            for rid in sorted(mine)[: len(mine) - 5000]:
                del mine[rid]

    def clear(self) -> None:
        """Forget everything (a fresh launch: new processes, record ids from 0 again)."""
        self.entries.clear()
        self.groups.clear()
        self.calls.clear()
        self.died_in.clear()
        self.floors.clear()
        self._skew.clear()
        self.unavailable = None
        self.missing.clear()

    def new_generation(self, floors: dict[int, int]) -> None:
        """The ranks replaced their process groups (regroup): forget the old groups' entries and
        ignore records up to ``floors[rank]`` should a rank send them again (an old collective
        that never completed stays in its recorder)."""
        self.entries.clear()
        self.groups.clear()
        self.calls.clear()  # the ranks cleared theirs: group names and counts start over
        self.floors.update(floors)

    def age(self, rank: int, entry: dict[str, Any]) -> float:
        """Seconds since the rank recorded ``entry``, by the rank's own clock."""
        return max(0.0, time.time() + self.offset(rank) - entry["t"])

    def offset(self, rank: int) -> float:
        """The rank's clock minus the controller's, seconds (0 until a reply says otherwise)."""
        samples = self._skew.get(rank)
        return max(samples) if samples else 0.0

    def local_time(self, rank: int, entry: dict[str, Any]) -> float:
        """When the rank recorded ``entry``, on the controller's clock (to order ranks' entries)."""
        return entry["t"] - self.offset(rank)

    def pending(self, rank: int, cell: int | None = None) -> dict[str, Any] | None:
        """The collective the rank entered most recently and has not completed (in ``cell``, when
        given: the rank attributed it to that cell by its own clock)."""
        open_ = [e for e in self.entries.get(rank, {}).values() if not e["done"] and (cell is None or e.get("cell") == cell)]
        return max(open_, key=lambda e: e["id"]) if open_ else None

    def stuck(self, rank: int) -> dict[str, Any] | None:
        """The rank's oldest collective not completed, from whichever cell issued it. A group runs
        its collectives in order, so its oldest open one is the one its peers must join first;
        NCCL (and gloo's ``async_op=True``) return to the host long before — the host then waits
        at a sync (``.item()``, ``.cpu()``, ``work.wait()``), not in the collective."""
        open_ = [e for e in self.entries.get(rank, {}).values() if not e["done"]]
        return min(open_, key=lambda e: e["id"]) if open_ else None

    def open_calls(self, rank: int) -> list[dict[str, Any]]:
        """Watched calls the rank is in now (a blocking send/recv, new_group) or has not seen
        complete (an isend/irecv), oldest first."""
        return sorted((c for c in self.calls.get(rank, {}).values() if c["end"] is None), key=lambda c: c["n"])

    def blocked_on(self, rank: int, cell: int, dead: set[int]) -> str:
        """What ``rank`` waits in, in words, when one of the ``dead`` ranks is needed there (its
        collective's group holds one, or its send/recv names one); "" when none is."""
        pending = self.pending(rank, cell)
        if pending is not None:
            members = set(self.groups.get(pending["group"], dead))  # a group distnb can't name: assume it holds them
            if members & dead:
                return f"{describe(pending)} (#{pending['seq']} on group {pending['group']})"
        for call in self.open_calls(rank):
            if call["op"] in P2P_OPS and ((peer := peer_of(call)) is None or peer in dead):
                return f"{call['op']} {'to' if P2P_OPS[call['op']] == 'send' else 'from'} rank {peer}"
            if call["op"] == "new_group":
                return "new_group"
        return ""

    def creations(self, rank: int) -> dict[int, dict[str, Any]]:
        """The rank's ``new_group`` calls by torch's group counter before each (1 = the first
        after init_process_group): every rank must make the same ones in the same order."""
        return {c["count"]: c for c in self.calls.get(rank, {}).values() if c["op"] == "new_group" and c.get("count") is not None}

    def p2p(self, rank: int) -> list[dict[str, Any]]:
        return sorted((c for c in self.calls.get(rank, {}).values() if c["op"] in P2P_OPS), key=lambda c: c["n"])

    def sequence(self, rank: int, group: str) -> list[dict[str, Any]]:
        return sorted((e for e in self.entries.get(rank, {}).values() if e["group"] == group and not e["p2p"]), key=lambda e: e["seq"])

    def last_seq(self, rank: int, group: str) -> int | None:
        """The highest sequence number the rank reached on ``group`` as far as the log knows —
        unlike a count of entries, right however much history the log has let go."""
        seqs = [e["seq"] for e in self.entries.get(rank, {}).values() if e["group"] == group and not e["p2p"]]
        return max(seqs) if seqs else None

    def report(self, ranks: list[int], last: int | None = None) -> CollectiveReport:
        return CollectiveReport(self, sorted(ranks), last)


#: What must match at one position of a group's sequence, in the order a difference is named.
_KINDS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "op": lambda e: e["op"],
    "shape": lambda e: e.get("sizes"),
    "dtype": lambda e: e.get("dtypes"),
    "args": lambda e: e.get("args"),
}


@dataclass
class Divergence:
    group: str
    seq: int
    kind: str  # missing · op · shape · dtype · args
    by_rank: dict[int, dict[str, Any] | None]

    def odd(self) -> list[int]:
        """The ranks that stand out by majority (every rank involved on a tie)."""
        if self.kind == "missing":
            return odd_ones({r: e is None for r, e in self.by_rank.items()})
        return odd_ones({r: _KINDS[self.kind](e) for r, e in self.by_rank.items() if e is not None})

    def text(self, members: list[int]) -> str:
        present = {r: e for r, e in self.by_rank.items() if e is not None}
        absent = [r for r, e in self.by_rank.items() if e is None]
        where = f"collective #{self.seq} on group {self.group} ({format_ranks(members)})"
        if self.kind == "missing":
            sample = next(iter(present.values()))
            return f"{where}: {format_ranks(present)} entered {sample['op']}, {format_ranks(absent)} never did"
        groups = group_by((r, describe(e)) for r, e in sorted(present.items()))
        what = {"op": "different ops", "shape": "different shapes", "dtype": "different dtypes", "args": "different arguments"}[self.kind]
        odd = self.odd()
        blame = f" (the odd one{'s' if len(odd) > 1 else ''} out: {format_ranks(odd)})" if odd and len(odd) < len(present) else ""
        died = f"; {format_ranks(absent)} died inside it before {'its' if len(absent) == 1 else 'their'} entry reached distnb" if absent else ""
        return f"{where}: {what}: " + "; ".join(f"{format_ranks(rs)} {d}" for rs, d in groups) + blame + died


@dataclass
class CollectiveReport:
    log: CollectiveLog
    ranks: list[int]
    last: int | None = None

    def members(self, group: str) -> list[int]:
        return [r for r in self.log.groups.get(group, self.ranks) if r in self.ranks] or self.ranks

    def group_names(self) -> list[str]:
        seen = {e["group"] for r in self.ranks for e in self.log.entries.get(r, {}).values() if not e["p2p"]}
        return sorted(seen, key=lambda g: (g != "0", g))

    def divergences(self) -> list[Divergence]:
        """First disagreement per group (at most one each), earliest first."""
        out = []
        for group in self.group_names():
            members = self.members(group)
            seqs = {r: {e["seq"]: e for e in self.log.sequence(r, group)} for r in members}
            top = max((max(s) for s in seqs.values() if s), default=0)
            low = min((min(s) for s in seqs.values() if s), default=1)
            for seq in range(low, top + 1):
                at = {r: seqs[r].get(seq) for r in members}
                if all(e is None for e in at.values()):
                    continue
                present = [e for e in at.values() if e is not None]
                # A rank that died inside this op before its entry reached distnb did enter it.
                inside = {r for r, e in at.items() if e is None and self.log.died_in.get(r) in {x["op"] for x in present}
                          and (not seqs[r] or max(seqs[r]) < seq)}
                if any(e is None and r not in inside for r, e in at.items()):
                    # A rank whose log starts later (ring buffer) is not "missing" it.
                    if all(e is not None or r in inside or (seqs[r] and min(seqs[r]) > seq) for r, e in at.items()):
                        continue
                    out.append(Divergence(group, seq, "missing", at))
                    break
                kind = next((k for k, key in _KINDS.items() if len({repr(key(e)) for e in present if k != "args" or "args" in e}) > 1), None)
                if kind:
                    out.append(Divergence(group, seq, kind, at))
                    break
        out.sort(key=self._when)
        return out

    def _when(self, d: Divergence) -> float:
        """When a divergence began, on the controller's clock (ranks' clocks may differ)."""
        return min((self.log.local_time(r, e) for r, e in d.by_rank.items() if e), default=0.0)

    def counts(self, group: str) -> dict[int, int]:
        return {r: len(self.log.sequence(r, group)) for r in self.members(group)}

    def text(self) -> str:
        if self.log.unavailable:
            return f"collective log unavailable: {self.log.unavailable}"
        groups = self.group_names()
        p2p = self._p2p_lines()
        gaps = [f"(not in this log: {RECORDER_NAMES.get(rec, rec)} collectives — {why})" for rec, why in sorted(self.log.missing.items())]
        if not groups and not p2p:
            return "\n".join([f"no collective recorded on {format_ranks(self.ranks)} yet.", *gaps])
        divs = {d.group: d for d in self.divergences()}
        lines = []
        first = min(divs.values(), key=self._when) if divs else None
        if first is not None:
            lines.append(f"first divergence: {first.text(self.members(first.group))}")
        else:
            lines.append(f"the collective sequences of {format_ranks(self.ranks)} agree.")
        for group in groups:
            members = self.members(group)
            seqs = {r: {e["seq"]: e for e in self.log.sequence(r, group)} for r in members}
            all_seqs = sorted({s for m in seqs.values() for s in m})
            shown = all_seqs[-self.last :] if self.last else all_seqs
            desc = next((e["desc"] for m in seqs.values() for e in m.values()), "")
            lines.append(f"── group {group}{f' ({desc})' if desc and desc != 'undefined' else ''}, {format_ranks(members)}: "
                         + ", ".join(f"rank {r} {len(seqs[r])}" for r in members) + " collectives"
                         + (f" (last {len(shown)} shown)" if len(shown) < len(all_seqs) else ""))
            cols = [f"rank {r}" for r in members]
            div = divs.get(group)
            odd = div.odd() if div is not None and div.kind != "missing" else []
            rows = []
            for seq in shown:
                cells = []
                for r in members:
                    e = seqs[r].get(seq)
                    if e is None:
                        cells.append("—")
                    else:
                        flag = div is not None and div.seq == seq and r in odd
                        cell = ("✗ " if flag else "") + describe(e) + state_mark(e)
                        if e.get("cell") is not None:
                            cell += f" c{e['cell']}"
                        cells.append(cell)
                rows.append((seq, cells, "  ◀ first divergence" if div is not None and div.seq == seq else ""))
            # Wide enough for the entries shown (arguments make them longer), within reason.
            width = min(40, max([24, *(len(c) + 2 for _, cells, _ in rows for c in cells)]))
            lines.append("    #  " + "".join(c.ljust(width) for c in cols))
            for seq, cells, mark in rows:
                lines.append(f"  {seq:>3}  " + "".join(c[: width - 1].ljust(width) for c in cells) + mark)
        lines.extend(p2p)
        lines.extend(gaps)
        lines.append("(⏳ entered, not completed · ⏸ queued on the GPU, not started · cN: issued in cell N · — never entered · ✗ the odd one out)")
        return "\n".join(lines)

    def _p2p_lines(self) -> list[str]:
        """The ranks' recent send/recv calls (gloo's recorder does not see them; distnb does)."""
        keep = self.last or 8
        rows = []
        for r in self.ranks:
            calls = self.log.p2p(r)[-keep:]
            if calls:
                rows.append(f"  rank {r}: " + ", ".join(
                    f"{c['op']} {'→' if P2P_OPS[c['op']] == 'send' else '←'} "
                    f"{peer_words(c)}{' ⏳' if c['end'] is None else ''}" + (f" c{c['cell']}" if c.get("cell") is not None else "")
                    for c in calls))
        return ["── point-to-point (last calls per rank)", *rows] if rows else []

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())
