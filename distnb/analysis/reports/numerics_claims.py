"""Which ranks must hold the same values at one op of a numerics record, and how that is known.

Three sources, strongest first: what the ranks' records say (the members of a collective whose
result every member holds, a DTensor's replicas, a DDP module's replicas, and whatever is made only
from such tensors: worker/torch_hooks/numerics_context.py); groups of ranks the caller names (they
ran the same data); and what the records show — ranks that read bit-for-bit equal inputs into the
same op must get equal outputs, where the op's outputs are fixed by what it read (``determined``:
every tensor input read, a kernel that gives equal bits for equal inputs), with equal arguments,
and, for an op that draws random numbers, from one generator state — or from another state than
the majority of such ranks drew from: that rank is where the group parts."""

from __future__ import annotations

import struct
from typing import Any

from distnb.ranks import group_by
from distnb.wire.record_types import TENSORS_READ, OpRecord

__all__ = ["INFERRED", "claims", "value_key"]

#: ``why`` of a group found from equal inputs.
INFERRED = "same inputs"


def value_key(h: int, total: float) -> tuple[int, int] | None:
    """A fingerprint to compare: non-finite values (their NaN payloads vary with the order of a
    reduction) compare as one — where they were born is the non-finite analysis's answer."""
    return (h, int(struct.unpack("<q", struct.pack("<d", total))[0])) if total - total == 0 else None


def claims(ops: dict[int, OpRecord], named: list[list[int]], inputs: bool, k: int = 0) -> list[tuple[tuple[int, ...], str]]:
    """The groups of ranks that must agree at one position (on its ``k``-th tensor input, or on its
    outputs), with how that is known."""
    found: dict[tuple[int, ...], str] = {}
    for op in ops.values():
        if inputs:
            read = next((i for i in op.inputs if i.arg == k), None)
            agree, why = (read.agree, read.why) if read is not None else (None, "")
        else:
            agree, why = op.agree, op.why
        if agree:
            members = tuple(r for r in agree if r in ops)
            if len(members) > 1:
                found.setdefault(members, why)
    for g in named:
        members = tuple(r for r in g if r in ops)
        if len(members) > 1:
            found.setdefault(members, "named")
    if not inputs:
        for members in _inferred(ops):
            found.setdefault(members, INFERRED)
    return list(found.items())


def _inferred(ops: dict[int, OpRecord]) -> list[tuple[int, ...]]:
    """Ranks that read equal values, with equal arguments, into an op whose outputs those fix (an
    op with no tensor input: its arguments alone). Arguments are part of the key, not a cause:
    code passes a rank's own scalars on purpose (``x * (rank == 0)``). A random op's generator
    state is a cause where a majority of those ranks drew from one state (a rank that drew more
    numbers before, or was seeded apart, stays in the group: it is where the group parts); where
    none did (each rank seeded its own way), only ranks sharing a state are held together."""
    by_input: dict[Any, list[int]] = {}
    for r, op in sorted(ops.items()):
        if op.collective or not op.determined or not op.outputs or len(op.inputs) >= TENSORS_READ:
            continue
        # The place-weighted sum too: equal xor and sum hold for a permutation of the same values.
        keys = tuple((i.arg, value_key(i.hash, i.total), value_key(0, i.order)) for i in op.inputs)
        if all(key is not None and order is not None for _, key, order in keys):
            by_input.setdefault((keys, op.args), []).append(r)
    found: list[tuple[int, ...]] = []
    for ranks in by_input.values():
        if len(ranks) < 2:
            continue
        states = [g for g, _ in group_by((r, ops[r].rng if ops[r].random else 0) for r in ranks)]
        biggest = max(states, key=len)
        if len(biggest) >= 2 and 2 * len(biggest) > len(ranks):
            found.append(tuple(ranks))
        else:
            found += [tuple(g) for g in states if len(g) >= 2]
    return found
