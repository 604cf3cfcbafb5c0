"""The calls ranks must agree on, as signatures.

Every collective a rank issues is a :class:`Call`: its group (by name, and by *role*: the mesh
dimension, torch's description, the ``new_group`` site, so two ranks on different groups of one
dimension compare), its position in the group's sequence, op, shapes, dtypes, the arguments that
must match (reduce op, root), split sizes (which must match between sender and receiver, not
across ranks), and its call site in the notebook when distnb's call log saw the Python call
(``dist.all_reduce`` at cell 5 line 7); collectives issued from C++ (DDP's buckets, FSDP's
all_gathers) have no site, and their signature stands for one.

A rank's calls of a cell, in issue order and without their groups, are its *program* as the
other ranks must run it too (SPMD): :func:`program_key` is what makes two ranks' programs
comparable — the call site (or the signature where there is none), op, shapes, dtypes, arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distnb.analysis.agreement.entry_words import describe
from distnb.analysis.agreement.evidence import ROOT_INPUT_ONLY, CollectiveEvidence, op_stem, same_op, unrecorded_calls
from distnb.cell_names import cell_name
from distnb.wire.record_types import UNRECORDED, CollectiveEntry, issued_in

__all__ = ["Call", "SPLIT_ARGS", "call_of", "cell_calls", "death_call", "entry_key", "program_key"]

#: Arguments that differ across ranks by design and are checked pairwise instead (all_to_all).
SPLIT_ARGS = ("input_split_sizes", "output_split_sizes")


def entry_key(e: CollectiveEntry) -> tuple[Any, ...]:
    """What of an entry its :class:`Call`'s signature and site are made of, and whether it carries
    split sizes (checked pairwise, never by equality): two entries with equal keys make equal
    calls. The collective log keeps one per entry as it arrives, so that a diagnosis compares
    thousands of ranks' calls at a position without building one."""
    args = e.get("args")
    return (e.get("op"), e.get("sizes"), e.get("dtypes"), args, e.get("call_cell"), e.get("line"),
            bool(args and any(args.get(k) is not None for k in SPLIT_ARGS)))


def _tup(x: Any) -> Any:
    return tuple(_tup(v) for v in x) if isinstance(x, (list, tuple)) else x


@dataclass(frozen=True)
class Call:
    """One collective of one rank, as the ranks of its group must all make it."""

    rank: int
    group: str
    role: str  # what ranks in step share while their groups differ (groups.GroupInfo.role)
    seq: int | None  # position in the group's sequence (None: in the call, not yet recorded)
    op: str
    sizes: Any  # tuple of shapes (None: not known)
    dtypes: Any
    args: tuple[tuple[str, str], ...]  # the arguments that must match, sorted
    splits: tuple[Any, Any] | None  # (input split sizes, output split sizes) of an all_to_all
    cell: int | None  # the cell that issued it
    line: int | None  # its line in ``site_cell``, when the call log saw the Python call
    func: str
    done: bool
    t: float  # when the rank issued it, on the controller's clock
    entry: CollectiveEntry
    site_cell: int | None = None  # the cell whose code holds ``line``: ``cell``, or an earlier cell's function
    in_line: int | None = None  # where ``site_cell`` is not ``cell``: the line of ``cell`` that called it

    def signature(self) -> tuple[Any, ...]:
        """What must be equal across the group's members at this position."""
        return (op_stem(self.op), self.sizes, self.dtypes, self.args)

    def site(self) -> tuple[int, int] | None:
        return (self.site_cell, self.line) if self.site_cell is not None and self.line is not None else None

    def sites(self) -> list[tuple[int, int]]:
        """Its own line, then the line of the issuing cell that called it (a function an earlier
        cell defined): where an ``if`` on the rank may decide whether it is made."""
        own = self.site()
        out = [own] if own is not None else []
        if self.in_line is not None and self.cell is not None and self.cell != self.site_cell:
            out.append((self.cell, self.in_line))
        return out

    def words(self) -> str:
        """``all_reduce [4] f32``."""
        return describe(self.entry)

    def at(self) -> str:
        """`` (cell 5 line 7)``, or ``""`` for a call issued from C++."""
        if self.line is None:
            return ""
        func = f" in {self.func}()" if self.func not in ("", "<module>") else ""
        return f" ({cell_name(self.site_cell)} line {self.line}{func})"


def call_of(log: CollectiveEvidence, rank: int, e: CollectiveEntry) -> Call:
    """The :class:`Call` of one log entry (a Flight Recorder entry with the call log's arguments)."""
    args = e.get("args") or {}
    kept = tuple(sorted((k, repr(v)) for k, v in args.items() if k not in SPLIT_ARGS and v is not None))
    splits = (_tup(args.get("input_split_sizes")), _tup(args.get("output_split_sizes"))) \
        if any(args.get(k) is not None for k in SPLIT_ARGS) else None
    root_only = e["op"] in ROOT_INPUT_ONLY
    cell, site_cell = issued_in(e), e.get("call_cell")
    return Call(
        rank=rank, group=str(e["group"]), role=log.group(str(e["group"])).role(), seq=e.get("seq"), op=e["op"],
        sizes=None if root_only else _tup(e.get("sizes")), dtypes=None if root_only else _tup(e.get("dtypes")), args=kept,
        splits=splits, cell=int(cell) if cell is not None else None, line=e.get("line") if site_cell is not None else None,
        func=e.get("func") or "", done=bool(e.get("done")), t=log.local_time(rank, e), entry=e,
        site_cell=int(site_cell) if site_cell is not None else None, in_line=e.get("in_line") if site_cell is not None else None,
    )


def cell_calls(log: CollectiveEvidence, rank: int, cell: int) -> list[Call]:
    """The rank's collectives issued in ``cell``, in issue order: its recorder's entries, then the
    collective it is in when the recorder has no entry for it yet (a call the log watched)."""
    entries = sorted((e for e in log.entries.get(rank, {}).values()
                      if not e.get("p2p") and issued_in(e) == cell), key=lambda e: e["id"])
    return [call_of(log, rank, e) for e in entries + unrecorded_calls(log, rank, cell, entries)]


def death_call(log: CollectiveEvidence, rank: int, group: str, seq: int | None) -> Call | None:
    """The collective a dead rank's stack at death put it in, when its entry never reached distnb:
    op and site known, shapes not."""
    op = log.died_in.get(rank)
    if op is None:
        return None
    cell, line = log.died_at.get(rank, (None, None))
    entry: CollectiveEntry = {"id": UNRECORDED, "group": group, "op": op, "done": False, "cell": cell, "call_cell": cell if line else None,
             "line": line, "p2p": False, "t": float("inf"), "sizes": [], "dtypes": []}
    if seq is not None:
        entry["seq"] = seq
    return Call(rank=rank, group=group, role=log.group(group).role(), seq=seq, op=op, sizes=None, dtypes=None, args=(),
                splits=None, cell=cell, line=line, func="", done=False, t=float("inf"), entry=entry, site_cell=cell if line else None)


def program_key(call: Call) -> tuple[Any, ...]:
    """What two ranks running the same program have in common at the same point of a cell: the
    call site (the signature for a call from C++), op, shapes, dtypes and arguments — not the
    group, which differs between ranks of one mesh dimension."""
    return (call.site() or ("C++",), *call.signature())


def same_call_op(a: Call, b: Call) -> bool:
    return same_op(a.op, b.op)
