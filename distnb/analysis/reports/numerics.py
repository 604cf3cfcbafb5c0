"""Where the ranks' numbers part (``%%on_ranks --numerics``): the per-op records of the ranks
(worker/torch_hooks/numerics.py) compared where ranks must hold the same values.

Which ranks must agree is what the records say, op by op: the members of a collective whose result
every member holds (all_reduce, all_gather, broadcast), a DTensor's replicas (``Replicate()``
placements), a DDP module's replicas (its parameters, their gradients and optimizer state at the
step; its buffers, said as replicas should), and every op made only from tensors that must agree;
any ranks the caller names (``agree``: the ranks ran the same data); and ranks that read equal
inputs into an op those inputs determine (numerics_claims.py). The answer is the first
op, in execution order, where they do not: its output (or a tensor it read from before the cell)
differs among ranks that must agree. Separately: where a NaN or Inf is born — the first op on a
rank whose output is non-finite while every input it read was finite — and which collective carried
it to other ranks. Data here; the words are numerics_text.py's.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field, replace
from difflib import SequenceMatcher
from typing import Any, NamedTuple

from distnb.analysis.agreement.evidence import odd_ones
from distnb.analysis.reports.numerics_claims import claims, value_key
from distnb.analysis.reports.numerics_gap import Gap, gap, within
from distnb.ranks import group_by
from distnb.wire.record_types import TENSORS_READ, NumericsRecord, OpRecord

__all__ = ["EvalMode", "NumericDivergence", "NonFinite", "NumericsReport", "ProgramSplit", "Side", "Spread", "compare_numerics", "nonfinite",
           "rank_groups"]


@dataclass(frozen=True)
class Side:
    """Ranks holding one value: its fingerprint, float64 sum and sampled elements (of the first
    output, or the input), and its number of elements."""

    ranks: list[int]
    hash: int
    total: float
    sample: tuple[float, ...] = ()
    numel: int = 0


@dataclass
class NumericDivergence:
    """The first op at which ranks that must agree hold different values."""

    position: int  # in the reference rank's op order
    seq: dict[int, int]  # each rank's own op number for it
    op: str
    module: str
    phase: str
    cell: int
    line: int
    group: list[int]  # the ranks that must agree here
    why: str  # how that is known: "allreduce", "Replicate", "inputs", "DDP", "named" …
    what: str  # "output", or "input": a tensor the op read (``label``) already differed
    label: str | None
    sides: list[Side]  # majority first
    odd: list[int]  # the ranks apart from the majority (every rank on a tie)
    inputs_agreed: bool | None  # for an output: every tensor it read had the same fingerprint (None: none read)
    args_agreed: bool  # its non-tensor arguments were the same
    random: bool  # the op draws random numbers
    exact: bool  # compared bit for bit (else by sums within the tolerance)
    writers: dict[int, int] = field(default_factory=dict)  # an input: rank → the op (seq) that wrote it, where one did
    # A random op: the ranks whose generator state before it differed from the majority's (None: not
    # random, or a state not read).
    rng_apart: list[int] | None = None

    @property
    def diff(self) -> float:
        """The largest difference of an odd side's sum from the majority's."""
        ref = self.sides[0].total
        return max((abs(s.total - ref) for s in self.sides[1:]), default=0.0)

    @property
    def size(self) -> Gap:
        """The largest element difference of an odd side from the majority (see :class:`Gap`)."""
        gaps = [gap(self.sides[0], s) for s in self.sides[1:]]
        return max(gaps, key=lambda g: g.value, default=Gap(0.0, True, 0, 0))


class EvalMode(NamedTuple):
    """A module in eval() mode on one rank and in train() on another, as its ops show."""

    rank: int  # the rank whose module ran in eval mode
    module: str
    layer: str  # "batch norm" (its statistics not updated) or "dropout" (not run)


@dataclass
class ProgramSplit:
    """Where a rank's sequence of ops departs from the reference rank's."""

    rank: int
    reference: int
    position: int  # in the reference's ops
    how: str  # "extra" (the rank ran ops the reference did not), "missing", "different"
    theirs: OpRecord | None
    ours: OpRecord | None  # the reference's op there
    mode: EvalMode | None = None  # the departure's likely cause, where the module's ops show one
    # The op there writes, in place, a named tensor both ranks must hold the same (a parameter, buffer
    # or optimizer state): values part with it. Other ops on one rank only (a metric rank 0 alone
    # computes, even from the parameters) change nothing the ranks share.
    writes_shared: bool = False


@dataclass
class Spread:
    """A collective whose output was non-finite on ranks whose input was finite."""

    position: int
    op: str
    cell: int
    line: int
    sources: list[int]  # ranks whose input held non-finite values
    reached: list[int]  # ranks it made non-finite


@dataclass
class NonFinite:
    """Where non-finite values came from on one rank."""

    rank: int
    how: str  # "born" (its inputs were finite), "before" (a tensor from before the cell held them), "received" (a collective),
    # "sent" (only collectives recorded: the rank's input to one held them)
    op: OpRecord
    label: str | None = None  # the input that held them ("before")

    @property
    def certain(self) -> bool:
        """"born" is certain only where every tensor input was read (an op reads its first TENSORS_READ)."""
        return self.how != "born" or len(self.op.inputs) < TENSORS_READ


@dataclass
class NumericsReport:
    cell: int
    ranks: list[int]
    mode: str
    first: NumericDivergence | None
    divergences: list[NumericDivergence]  # the first per group of ranks, in order
    programs: list[ProgramSplit]
    nonfinite: list[NonFinite]
    spreads: list[Spread]
    records: dict[int, list[OpRecord]]
    aligned: list[dict[int, int]]  # per reference position: rank → index into its ops
    reference: int
    tolerance: tuple[float, float]  # (rtol, atol); (0, 0): bit for bit
    named: list[list[int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: int = 0  # ops at which some ranks had to agree (the rest say nothing either way)

    @property
    def departure(self) -> ProgramSplit | None:
        """The first place ranks ran other ops where that is a divergence, not just other code (a
        metric only rank 0 computes): a module's mode, or a write to what the ranks share."""
        return next((s for s in self.programs if s.mode is not None or s.writes_shared), None) if self.mode != "collectives" else None

    def text(self) -> str:
        from distnb.analysis.reports.numerics_text import report_text

        return report_text(self)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    def table(self, around: int = 4) -> list[dict[str, Any]]:
        from distnb.analysis.reports.numerics_text import table_rows

        return table_rows(self, around)

    def plot(self) -> Any:
        from distnb.analysis.reports.numerics_text import plot

        return plot(self)


# -- comparison ------------------------------------------------------------------------------------
def _align(records: dict[int, list[OpRecord]]) -> tuple[int, list[dict[int, int]], list[ProgramSplit]]:
    """The reference rank (the program most ranks ran), each reference position's op on every
    rank, and where a rank's program departs from it."""
    names = {r: tuple(op.op for op in ops) for r, ops in records.items()}
    groups = sorted(group_by(sorted(names.items())), key=lambda g: (-len(g[0]), g[0][0]))
    ref = groups[0][0][0]
    ref_ops = records[ref]
    aligned: list[dict[int, int]] = [{} for _ in ref_ops]
    splits = []
    for r, ops in records.items():
        if names[r] == names[ref]:
            for i in range(len(ops)):
                aligned[i][r] = i
            continue
        first = True
        for tag, i1, i2, j1, _j2 in SequenceMatcher(None, names[ref], names[r], autojunk=False).get_opcodes():
            if tag == "equal":
                for k in range(i2 - i1):
                    aligned[i1 + k][r] = j1 + k
            elif first:
                first = False
                how = {"insert": "extra", "delete": "missing"}.get(tag, "different")
                splits.append(ProgramSplit(r, ref, i1, how, ops[j1] if j1 < len(ops) else None, ref_ops[i1] if i1 < len(ref_ops) else None))
    for s in splits:
        s.mode = eval_mode(records, s)
        s.writes_shared = any(_writes_shared(op, {s.rank, s.reference}) for op in (s.ours, s.theirs))
    return ref, aligned, sorted(splits, key=lambda s: (s.position, s.rank))


_DROPOUT = {"native_dropout", "bernoulli_", "bernoulli"}


def _batch_norm(ops: set[str]) -> bool:
    return any("batch_norm" in n for n in ops)


def _batch_norm_eval(ops: set[str]) -> bool:
    """Batch norm without training: traced, its own op; eager, no batch counted (``add_``)."""
    return any("batch_norm" in n and "no_training" in n for n in ops) or (_batch_norm(ops) and "add_" not in ops)


def eval_mode(records: dict[int, list[OpRecord]], s: ProgramSplit) -> EvalMode | None:
    """Whether the module where two ranks' ops part ran in eval() mode on one and train() on the
    other. Its ops show it: batch norm in training counts its batches (``add_`` on
    ``num_batches_tracked``) and, traced, runs another op than without (``…_no_training``); eager
    passes the mode only as an argument. Dropout runs no op at all in eval."""
    op = s.theirs or s.ours
    if op is None or not op.module or op.phase not in ("fwd", "bwd"):
        return None
    names = {r: {o.op.split(".")[1] for o in records[r] if o.module == op.module and o.op.count(".") >= 2} for r in (s.rank, s.reference)}
    for rank, other in ((s.rank, s.reference), (s.reference, s.rank)):
        mine, theirs = names[rank], names[other]
        if _batch_norm(mine) and _batch_norm(theirs) and _batch_norm_eval(mine) and not _batch_norm_eval(theirs):
            return EvalMode(rank, op.module, "batch norm")
        if theirs & _DROPOUT and not mine & _DROPOUT:
            return EvalMode(rank, op.module, "dropout")
    return None


def _writes_shared(op: OpRecord | None, ranks: set[int]) -> bool:
    """An in-place op (aten's trailing ``_``) on a named tensor from before the cell that ``ranks``
    must hold the same."""
    if op is None or op.collective or op.op.count(".") < 2 or not op.op.split(".")[1].endswith("_"):
        return False
    target = next((i for i in op.inputs if i.arg == 0), None)
    return target is not None and target.label is not None and target.agree is not None and ranks <= set(target.agree)


_NAN = "nan"  # a NaN sum or element, as the exact comparison keys it


def _split(values: dict[int, tuple[Any, ...]], exact: bool, rtol: float, atol: float) -> list[list[int]] | None:
    """The ranks grouped by value, majority first, or None when they all agree. A value is
    (shape/dtype key, hashes, sums and sampled elements); without ``exact``, values whose sums and
    sampled elements are within the tolerance agree."""
    if exact:
        # Each rank's NaN is a float of its own, and no NaN equals another: four outputs with NaN
        # in the same places would read as four values. A NaN compares as NaN.
        groups = [rs for rs, _ in group_by((r, (v[0], v[1], tuple(_NAN if x != x else x for x in v[2])))
                                           for r, v in sorted(values.items()))]
    else:
        groups = []
        reps: list[tuple[Any, ...]] = []
        for r, v in sorted(values.items()):
            for g, rep in zip(groups, reps):
                # Fingerprints equal only say "the same" when finite (a non-finite one is None).
                same = rep[1] == v[1] and None not in v[1]
                if rep[0] == v[0] and (same or all(within(a, b, rtol, atol) for a, b in zip(rep[2], v[2]))):
                    g.append(r)
                    break
            else:
                groups.append([r])
                reps.append(v)
    if len(groups) < 2:
        return None
    return sorted(groups, key=lambda g: (-len(g), g[0]))


def _divergence(pos: int, ops: dict[int, OpRecord], group: tuple[int, ...], why: str, what: str, k: int, exact: bool,
                rtol: float, atol: float) -> NumericDivergence | None:
    values: dict[int, tuple[Any, ...]] = {}
    firsts: dict[int, Side] = {}
    label = None
    writers: dict[int, int] = {}
    for r in group:
        op = ops[r]
        if what == "input":
            read = next((i for i in op.inputs if i.arg == k), None)
            if read is None:
                continue
            label = label or read.label
            values[r] = ((read.numel,), (value_key(read.hash, read.total),), (read.total, *read.sample))
            firsts[r] = Side([r], read.hash, read.total, read.sample, read.numel)
            if read.producer >= 0:
                writers[r] = read.producer
        else:
            if not op.outputs:
                continue  # a collective whose output was never read
            values[r] = (tuple((o.shape, o.dtype) for o in op.outputs), tuple(value_key(o.hash, o.total) for o in op.outputs),
                         tuple(x for o in op.outputs for x in (o.total, *o.sample)))
            out = op.outputs[0]
            firsts[r] = Side([r], out.hash, out.total, out.sample, out.numel)
    split = _split(values, exact or what == "input", rtol, atol)
    if split is None:
        return None
    ref = ops[split[0][0]]
    sides = [replace(firsts[g[0]], ranks=g) for g in split]
    odd = odd_ones({r: split_index for split_index, g in enumerate(split) for r in g})
    ins = {r: tuple(sorted((i.arg, value_key(i.hash, i.total) or (0, 0)) for i in ops[r].inputs)) for r in values}
    rng_apart = None
    if ref.random and what == "output" and all(ops[r].rng for r in values):
        (usual, n), *rest = collections.Counter(ops[r].rng for r in values).most_common()
        # No state most ranks drew from: each rank is apart.
        rng_apart = [r for r in sorted(values) if ops[r].rng != usual or n < 2 or (rest and rest[0][1] == n)]
    return NumericDivergence(pos, {r: ops[r].seq for r in group}, ref.op, ref.module, ref.phase, ref.cell, ref.line, list(group),
                      why if what == "output" else (why or "inputs"), what, label, sides, odd,
                      (len(set(ins.values())) == 1) if any(ins.values()) else None,
                      len({ops[r].args for r in values}) == 1, ref.random, exact or what == "input", writers, rng_apart)


def compare_numerics(cell: int, per_rank: dict[int, NumericsRecord | None], agree: Any = (),
                     rtol: float = 0.0, atol: float = 0.0) -> NumericsReport:
    """The ranks' records compared: ``agree`` names groups of ranks that must agree at every op
    (they ran the same data: see :func:`rank_groups`, a mesh dimension's name included);
    ``rtol``/``atol`` let sums within them agree (else bit for bit)."""
    records = {r: list(rec.get("ops") or []) for r, rec in sorted(per_rank.items()) if rec and "ops" in rec}
    notes = [f"rank {r}: {rec['error']}" for r, rec in sorted(per_rank.items()) if rec and rec.get("error")]
    for r, rec in sorted(per_rank.items()):
        if rec and int(rec.get("total") or 0) > len(rec.get("ops") or []):
            notes.append(f"rank {r} ran {rec.get('total')} ops; the first {len(rec.get('ops') or [])} were recorded "
                         "(DISTNB_NUMERICS_OPS): nothing after them was compared")
    mode = next((str(rec.get("mode")) for rec in per_rank.values() if rec and rec.get("mode")), "ops")
    dims: dict[str, list[list[int]]] = {}
    for rec in per_rank.values():
        for name, members in ((rec or {}).get("mesh_groups") or {}).items():
            if sorted(members) not in dims.setdefault(name, []):
                dims[name].append(sorted(members))
    named = [sorted(set(g)) for g in rank_groups(agree, max(per_rank, default=0) + 1, dims)]
    exact = rtol == 0 and atol == 0
    if not records:
        return NumericsReport(cell, sorted(per_rank), mode, None, [], [], [], [], {}, [], -1, (rtol, atol), named, notes)
    ref, aligned, programs = _align(records)
    found: dict[tuple[int, ...], NumericDivergence] = {}
    checked = 0
    for pos, where in enumerate(aligned):
        ops = {r: records[r][i] for r, i in where.items()}
        exchange = any(op.collective for op in ops.values())  # what ranks send a collective differs by design
        any_claim = False
        for k in sorted({i.arg for op in ops.values() for i in op.inputs} if not exchange else ()):
            for group, why in claims(ops, named, True, k):
                any_claim = True
                if group not in found and (d := _divergence(pos, ops, group, why, "input", k, exact, rtol, atol)):
                    found[group] = d
        for group, why in claims(ops, named, False):
            any_claim = True
            if group not in found and (d := _divergence(pos, ops, group, why, "output", 0, exact, rtol, atol)):
                found[group] = d
        checked += any_claim
    divergences = sorted(found.values(), key=lambda d: (d.position, d.what != "input"))
    births, spreads = nonfinite(records, aligned, mode)
    return NumericsReport(cell, sorted(per_rank), mode, divergences[0] if divergences else None, divergences, programs, births, spreads,
                          records, aligned, ref, (rtol, atol), named, notes, checked)


def _finite(op: OpRecord) -> bool:
    return all(math.isfinite(o.total) for o in op.outputs)


def nonfinite(records: dict[int, list[OpRecord]], aligned: list[dict[int, int]], mode: str = "ops") -> tuple[list[NonFinite], list[Spread]]:
    """Per rank, where non-finite values first appear; and the collectives that carried them.
    With only the collectives recorded, a non-finite input is one the rank ``sent``."""
    origins: list[NonFinite] = []
    for r, ops in records.items():
        for op in ops:
            bad_in = next((i for i in op.inputs if not i.finite), None)
            if bad_in is not None and bad_in.producer < 0:
                origins.append(NonFinite(r, "sent" if mode == "collectives" else "before", op, bad_in.label))
                break
            if op.outputs and not _finite(op) and bad_in is None:
                origins.append(NonFinite(r, "received" if op.collective else "born", op))
                break
    spreads = []
    for pos, where in enumerate(aligned):
        colls = {r: records[r][i] for r, i in where.items() if records[r][i].collective}
        sources = sorted(r for r, c in colls.items() if any(not i.finite for i in c.inputs))
        reached = sorted(r for r, c in colls.items() if r not in sources and c.outputs and not _finite(c))
        if sources and reached:
            op = colls[sources[0]]
            spreads.append(Spread(pos, op.op, op.cell, op.line, sources, reached))
    return origins, spreads


def rank_groups(agree: Any, world_size: int, mesh_groups: dict[str, list[list[int]]] | None = None) -> list[list[int]]:
    """Groups of ranks from ``"0-3"``, ``"0,1;2,3"``, ``[0, 1]``, ``[[0, 1], [2, 3]]``, or a mesh
    dimension's name (``"tp"``: each of its groups, from ``mesh_groups``)."""
    from distnb.ranks import parse_ranks

    if agree is None or agree == () or agree == "":
        return []
    if isinstance(agree, str) and mesh_groups and agree.strip() in mesh_groups:
        return mesh_groups[agree.strip()]
    if isinstance(agree, str):
        return [parse_ranks(part, world_size) for part in agree.split(";") if part.strip()]
    items = list(agree)
    if items and all(isinstance(x, int) for x in items):
        return [parse_ranks(items, world_size)]
    return [parse_ranks(g, world_size) for g in items]
