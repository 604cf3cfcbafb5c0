"""The ranks' collective logs as the controller keeps them: every rank's Flight Recorder entries
and watched calls, merged from the ranks' replies and pushes, kept after a death.

Times in the log are the ranks' own wall clocks. Ranks on another machine may be seconds off the
controller's, so the log never compares an entry's time with the controller's clock: each reply
carries the rank's ``now``, and :meth:`CollectiveLog.age` measures against that.
"""

from __future__ import annotations

import collections
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from distnb.analysis.agreement.calls import entry_key
from distnb.analysis.agreement.collectives import CollectiveReport
from distnb.analysis.agreement.entry_words import describe
from distnb.analysis.agreement.evidence import peer_of
from distnb.analysis.agreement.groups import GroupInfo, info_from, site_of
from distnb.wire.record_types import P2P_OPS, CallRecord, CollectiveEntry, CollectivesRead

__all__ = ["CollectiveLog"]

_HERE = socket.gethostname()


@dataclass
class CollectiveLog:
    """Every rank's Flight Recorder entries as the controller last saw them (kept after death)."""

    entries: dict[int, dict[int, CollectiveEntry]] = field(default_factory=dict)  # rank -> id -> entry
    groups: dict[str, list[int]] = field(default_factory=dict)
    # torch's description of each group (``mesh_dp`` for a mesh's dp groups), from its entries.
    descs: dict[str, str] = field(default_factory=dict)
    unavailable: str | None = None
    # Recorders some rank could not read (e.g. NCCL's on a torch without it), and why: the log
    # then lacks those collectives, and says so.
    missing: dict[str, str] = field(default_factory=dict)
    # Per rank, the watched calls (worker/torch_hooks/call_log.py) by number: point-to-point, group creation,
    # and the arguments of rooted and reducing collectives.
    calls: dict[int, dict[int, CallRecord]] = field(default_factory=dict)
    # Ranks that died inside a collective (by the stack they printed) before its entry reached
    # the controller: op name. Their missing entry is not "never entered".
    died_in: dict[int, str] = field(default_factory=dict)
    # And where in the notebook (cell, line) its stack at death put that call.
    died_at: dict[int, tuple[int | None, int | None]] = field(default_factory=dict)
    # Every rank that died, and the cell it died in: the entries it had not pushed yet are lost
    # with it, so its absence from that cell's later collectives is not known, not "never entered".
    died_during: dict[int, int] = field(default_factory=dict)
    # Per rank, the record id below which entries belong to process groups that no longer exist
    # (a regroup names its new default group "0" again and restarts its sequence at 1).
    floors: dict[int, int] = field(default_factory=dict)
    # Per machine, recent (its clock − controller's clock) samples; each is low by the reply's
    # transit and queueing time (a thousand replies queue for tens of ms here, a GC pause adds
    # more), so the largest recent one of any of the machine's ranks is the best estimate. Ranks
    # on the controller's own machine share its clock: no estimate at all.
    _skew: dict[str, collections.deque[float]] = field(default_factory=dict)
    _hosts: dict[int, str] = field(default_factory=dict, repr=False)
    _sites: dict[str, tuple[int, int]] | None = field(default=None, repr=False)
    # Per rank, per group, the collectives (not point-to-point) by sequence number: what every
    # comparison across ranks reads, kept as entries arrive so a look costs the entries it reads,
    # not the rank's whole history.
    _seqs: dict[int, dict[str, dict[int, CollectiveEntry]]] = field(default_factory=dict, repr=False)
    _keys: dict[int, dict[str, dict[int, tuple[Any, ...]]]] = field(default_factory=dict, repr=False)  # entry_key of each, as _seqs
    _infos: dict[str, GroupInfo] = field(default_factory=dict, repr=False)
    # Per rank, the entries not completed (by id) and the newest id held: what every look at a
    # running cell asks, without walking the rank's history.
    _open: dict[int, dict[int, CollectiveEntry]] = field(default_factory=dict, repr=False)
    _newest: dict[int, int] = field(default_factory=dict, repr=False)
    #: Bumped whenever an entry arrives or changes: a watcher sees at a glance whether anything moved.
    changes: int = 0
    # Bumped when the log forgets (new processes, a new default group): a reply asked for before
    # is about records the log no longer holds.
    generation: int = 0
    # Per rank, the key of the group table whose members it sent (a rank sends them only when its
    # table changes), and the key its latest reply carried: when they differ, a reply with the
    # members was missed, and the next request asks for them (``wants_groups``).
    _gkeys: dict[int, Any] = field(default_factory=dict, repr=False)
    _gseen: dict[int, Any] = field(default_factory=dict, repr=False)

    def last_id(self, rank: int) -> int:
        return max(self._newest.get(rank, -1), self.floors.get(rank, -1))

    def cursor(self, rank: int) -> int:
        """Where the next read of the rank's recorder starts: after the newest record held, or
        before the oldest one still held as open among the recent ones (the last 200 ids) — the
        rank re-sends open entries only while they are open, so one that completed after its last
        read would stay "entered, not completed" here for good."""
        last = self.last_id(rank)
        open_ = [i for i in self._open.get(rank, {}) if i > last - 200]
        return min(last, min(open_) - 1) if open_ else last

    def last_call(self, rank: int) -> int:
        """Where the next read of the rank's calls starts: after the newest held, or before the
        oldest held as open — an open call's end is sent only while it is newer than the cursor,
        so one that ended after its last read would stay open here for good."""
        calls = self.calls.get(rank)
        if not calls:
            return -1
        open_ = [n for n, c in calls.items() if c["end"] is None]
        return min(max(calls), min(open_) - 1) if open_ else max(calls)

    def merge(self, rank: int, reply: CollectivesRead) -> None:
        if reply.get("calls"):
            self._sites = None
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
        host = self._hosts.get(rank, f"rank {rank}")
        if "now" in reply and host != _HERE:
            self._skew.setdefault(host, collections.deque(maxlen=64)).append(float(reply["now"]) - time.time())
        floor = self.floors.get(rank, -1)
        for e in reply.get("entries", []):
            if e["id"] > floor:
                self.keep(rank, e)
        if "groups" in reply:
            self._gkeys[rank] = reply.get("gkey")
            self.groups.update(reply["groups"])
            self._infos.clear()
        if "gkey" in reply:
            self._gseen[rank] = reply["gkey"]
        for name, desc in reply.get("descs", {}).items():
            if name not in self.descs:  # an entry's own description (above) stands
                self.descs[name] = desc
                self._infos.pop(name, None)
        mine, seqs, open_ = self.entries.setdefault(rank, {}), self._seqs.setdefault(rank, {}), self._open.setdefault(rank, {})
        if len(mine) > 5000:  # the recorder itself keeps 2000; keep a bounded history
            for rid in sorted(mine)[: len(mine) - 5000]:
                gone = mine.pop(rid)
                open_.pop(rid, None)
                by_seq = seqs.get(gone["group"], {})
                if by_seq.get(gone["seq"]) is gone:
                    del by_seq[gone["seq"]]
                    self._keys.get(rank, {}).get(gone["group"], {}).pop(gone["seq"], None)

    def keep_calls(self, rank: int, calls: list[CallRecord]) -> None:
        """Calls the rank did not push itself (a dead rank's black box): each added, or taken in
        place of one held still open that it says ended; a call the rank pushed is kept otherwise
        (it has its real end time, and what ``new_group`` made)."""
        held = self.calls.setdefault(rank, {})
        for c in calls:
            mine = held.get(c["n"])
            if mine is None or (mine["end"] is None and c.get("end") is not None):
                held[c["n"]] = c
        self._sites = None

    def keep(self, rank: int, e: CollectiveEntry) -> None:
        """Hold (or update) one of the rank's entries."""
        mine = self.entries.setdefault(rank, {})
        held = mine.get(e["id"])
        if held is None or held["done"] != e["done"]:
            self.changes += 1
        mine[e["id"]] = e
        self._newest[rank] = max(self._newest.get(rank, -1), e["id"])
        open_ = self._open.setdefault(rank, {})
        if e["done"]:
            open_.pop(e["id"], None)
        else:
            open_[e["id"]] = e
        if not e.get("p2p"):
            self._seqs.setdefault(rank, {}).setdefault(e["group"], {})[e["seq"]] = e
            self._keys.setdefault(rank, {}).setdefault(e["group"], {})[e["seq"]] = entry_key(e)
        if e.get("desc") and self.descs.get(e["group"]) != e["desc"]:
            self.descs[e["group"]] = e["desc"]
            self._infos.pop(e["group"], None)

    def clear(self) -> None:
        """Forget everything (a fresh launch: new processes, record ids from 0 again)."""
        self.generation += 1
        self.entries.clear()
        self._seqs.clear()
        self._keys.clear()
        self._open.clear()
        self._newest.clear()
        self._infos.clear()
        self._gkeys.clear()
        self.groups.clear()
        self.descs.clear()
        self.calls.clear()
        self._sites = None
        self.died_in.clear()
        self.died_at.clear()
        self.died_during.clear()
        self.floors.clear()
        self._skew.clear()
        self.unavailable = None
        self.missing.clear()

    def new_generation(self, floors: dict[int, int]) -> None:
        """The ranks replaced their process groups (regroup): forget the old groups' entries and
        ignore records up to ``floors[rank]`` should a rank send them again (an old collective
        that never completed stays in its recorder)."""
        self.generation += 1
        self.entries.clear()
        self._seqs.clear()
        self._keys.clear()
        self._open.clear()
        self._newest.clear()
        self._infos.clear()
        self._gkeys.clear()
        self.groups.clear()
        self.descs.clear()
        self._sites = None
        self.calls.clear()  # the ranks cleared theirs: group names and counts start over
        self.floors.update(floors)

    def age(self, rank: int, entry: CollectiveEntry) -> float:
        """Seconds since the rank recorded ``entry``, by the rank's own clock."""
        return max(0.0, time.time() + self.offset(rank) - float(entry["t"]))

    def wants_groups(self, ranks: Iterable[int]) -> bool:
        """Should a request to these ranks ask for their groups' members again? (Never sent since
        the log was cleared, or a reply carrying them went missing.)"""
        return any(r not in self._gkeys or self._gseen.get(r, self._gkeys[r]) != self._gkeys[r] for r in ranks)

    def place(self, rank: int, host: str) -> None:
        """The machine the rank runs on (its HELLO): ranks of one machine share one clock."""
        self._hosts[rank] = host

    def offset(self, rank: int) -> float:
        """The rank's clock minus the controller's, seconds (0 on this machine, and until a reply
        says otherwise)."""
        samples = self._skew.get(self._hosts.get(rank, f"rank {rank}"))
        return max(samples) if samples else 0.0

    def local_time(self, rank: int, entry: CollectiveEntry) -> float:
        """When the rank recorded ``entry``, on the controller's clock (to order ranks' entries)."""
        return float(entry["t"]) - self.offset(rank)

    def pending(self, rank: int, cell: int | None = None) -> CollectiveEntry | None:
        """The collective the rank entered most recently and has not completed (in ``cell``, when
        given: the rank attributed it to that cell by its own clock)."""
        open_ = [e for e in self._open.get(rank, {}).values() if cell is None or e.get("cell") == cell]
        return max(open_, key=lambda e: e["id"]) if open_ else None

    def stuck(self, rank: int) -> CollectiveEntry | None:
        """The rank's oldest collective not completed, from whichever cell issued it. A group runs
        its collectives in order, so its oldest open one is the one its peers must join first;
        NCCL (and gloo's ``async_op=True``) return to the host long before — the host then waits
        at a sync (``.item()``, ``.cpu()``, ``work.wait()``), not in the collective."""
        open_ = self._open.get(rank)
        return open_[min(open_)] if open_ else None

    def open_calls(self, rank: int) -> list[CallRecord]:
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
                return f"{describe(pending)} ({self.at(pending)})"
        for call in self.open_calls(rank):
            if call["op"] in P2P_OPS and ((peer := peer_of(call)) is None or peer in dead):
                return f"{call['op']} {'to' if P2P_OPS[call['op']] == 'send' else 'from'} rank {peer}"
            if call["op"] == "new_group":
                return "new_group"
        return ""

    def at(self, entry: CollectiveEntry) -> str:
        """``#2 on dp (ranks 1,3)``: where an entry sits, its group named as the user built it."""
        return f"#{entry['seq']} on {self.group(entry['group']).label()}"

    def group(self, name: str) -> GroupInfo:
        """The group as the user built it (mesh dimension, members, new_group site)."""
        if self._sites is None:  # texts name many groups: build the map once per change of the calls
            self._sites = {c["made"]: site for calls in self.calls.values() for c in calls.values()
                           if c["op"] == "new_group" and "made" in c and (site := site_of(c)) is not None}
            self._infos.clear()
        info = self._infos.get(name)
        if info is None:  # kept until what it was made from changes (groups, descriptions, sites)
            info = self._infos[name] = info_from(name, self.groups, self.descs, self._sites)
        return info

    def creations(self, rank: int) -> dict[int, CallRecord]:
        """The rank's ``new_group`` calls by torch's group counter before each (1 = the first
        after init_process_group): every rank must make the same ones in the same order."""
        return {n: c for c in self.calls.get(rank, {}).values() if c["op"] == "new_group" and (n := c.get("count")) is not None}

    def calls_of(self, rank: int) -> list[CallRecord]:
        """The rank's watched calls as held, oldest first (read-only)."""
        return sorted(self.calls.get(rank, {}).values(), key=lambda c: c["n"])

    def p2p(self, rank: int) -> list[CallRecord]:
        return sorted((c for c in self.calls.get(rank, {}).values() if c["op"] in P2P_OPS), key=lambda c: c["n"])

    def sequence(self, rank: int, group: str) -> list[CollectiveEntry]:
        by_seq = self.seqs(rank, group)
        return [by_seq[s] for s in sorted(by_seq)]

    def groups_of(self, rank: int) -> dict[str, dict[int, CollectiveEntry]]:
        """The rank's collectives (not point-to-point) by group, then sequence number (read-only)."""
        return self._seqs.get(rank, {})

    def keys(self, rank: int, group: str) -> dict[int, tuple[Any, ...]]:
        """:func:`~distnb.analysis.agreement.calls.entry_key` of each of :meth:`seqs`' entries, made as they arrived."""
        return self._keys.get(rank, {}).get(group, {})

    def seqs(self, rank: int, group: str) -> dict[int, CollectiveEntry]:
        """The rank's collectives on ``group`` by sequence number (read-only: the log's own index)."""
        return self._seqs.get(rank, {}).get(group, {})

    def last_seq(self, rank: int, group: str) -> int | None:
        """The highest sequence number the rank reached on ``group`` as far as the log knows —
        unlike a count of entries, right however much history the log has let go."""
        by_seq = self.seqs(rank, group)
        return max(by_seq) if by_seq else None

    def report(self, ranks: list[int], last: int | None = None) -> CollectiveReport:
        return CollectiveReport(self, sorted(ranks), last)
