"""Two ranks' programs side by side: what the odd rank did differently from the majority.

A disagreement says *where* a group's members parted; it does not say *how*. A rank whose call
at ``#4`` differs from the others' may have made another call there (a mismatch), skipped the
one the others made (its next call paired with theirs), made one they did not, repeated a loop
more or fewer times, or sent the same call to another group. Each rank's collectives of the cell,
in issue order, keyed by call site (:func:`~distnb.analysis.agreement.calls.program_key`), are its
program; :func:`compare_programs` aligns the odd rank's with a majority rank's (difflib's longest
matching blocks) and names the first difference.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from distnb.analysis.agreement.calls import Call, program_key
from distnb.analysis.agreement.evidence import op_stem

__all__ = ["Change", "Difference", "compare_programs"]

#: The longest loop body (in calls) looked for when deciding a difference is a loop's count.
MAX_PERIOD = 16


class Change(str, Enum):
    MISSING = "missing"  # the odd rank did not make calls the majority made
    EXTRA = "extra"  # it made calls the majority did not
    REPEATS = "repeats"  # it repeated the same calls (a loop body) another number of times
    DIFFERENT = "different"  # the same call site, another op, shape, dtype or argument
    OTHER_GROUP = "other_group"  # the same call, over a group of another role


@dataclass
class Difference:
    change: Change
    odd_calls: list[Call]  # the odd rank's calls involved (extra, mismatched, misrouted)
    majority_calls: list[Call]  # the majority rank's (missing, or the ones it made instead)
    index: int  # position in the majority's program where they part (0-based)
    loop: tuple[int, int] | None = None  # (times the body ran on the odd rank, on the majority), for REPEATS
    body: list[Call] = field(default_factory=list)  # the repeated calls, for REPEATS
    fields: tuple[str, ...] = ()


def _period(keys: list[Any], end: int, run: list[Any]) -> int | None:
    """The smallest loop body length ``p`` such that ``keys[end - p:end]`` repeats into ``run``
    (``run`` a prefix of that body repeated)."""
    for p in range(1, min(MAX_PERIOD, end) + 1):
        body = keys[end - p : end]
        if all(run[i] == body[i % p] for i in range(len(run))):
            return p
    return None


def _times(keys: list[Any], body: list[Any]) -> int:
    """How many times ``body`` runs back to back in ``keys`` (its longest run), a last partial
    run counted (a loop whose iteration has begun)."""
    p, best = len(body), 0
    i = 0
    while i < len(keys):
        n = 0
        while keys[i + n * p : i + (n + 1) * p] == body:
            n += 1
        tail = keys[i + n * p : i + (n + 1) * p]
        if n and tail and tail == body[: len(tail)] and i + n * p + len(tail) == len(keys):
            n += 1  # an iteration begun at the end
        best, i = max(best, n), i + max(1, n * p)
    return best


def _fields(a: Call, b: Call) -> tuple[str, ...]:
    out = []
    if op_stem(a.op) != op_stem(b.op):
        out.append("op")
    if a.sizes is not None and b.sizes is not None and a.sizes != b.sizes:
        out.append("shape")
    if a.dtypes is not None and b.dtypes is not None and a.dtypes != b.dtypes:
        out.append("dtype")
    da, db = dict(a.args), dict(b.args)
    out.extend(k for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k))
    return tuple(out)


#: (cell, line) → the first and last line of the loop around it in that cell (None: in no loop).
LoopOf = Callable[[int, int], "tuple[int, int] | None"]
#: (cell, line, line) → the two lines are the two branches of one ``if``.
Apart = Callable[[int, int, int], bool]


def _same_site(a: Call, b: Call) -> bool:
    if a.site() is not None and b.site() is not None:
        return a.site() == b.site()
    if (a.site() is None) != (b.site() is None):
        return False  # a call from Python against one from C++: not the same call
    return op_stem(a.op) == op_stem(b.op)


def compare_programs(odd: list[Call], majority: list[Call], odd_left: bool, majority_left: bool = True,
                     loop_of: LoopOf | None = None, apart: Apart | None = None) -> Difference | None:
    """The first difference between the odd rank's program and a majority rank's; None when they
    agree call for call (roles included). ``odd_left``: the odd rank has left the cell (its
    program is complete), so calls the majority made after its last are missing, not yet to come;
    ``majority_left``: so is the majority rank's (else its last loop iteration may be partial).
    ``loop_of`` reads the cells' loops, to tell a rank that went round a loop again from one that
    skipped a call, when the two calls are at different sites; ``apart`` reads whether two lines
    are the two branches of one ``if`` (then the calls are alternatives: one differs from the other)."""
    a = [program_key(c) for c in odd]
    b = [program_key(c) for c in majority]
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            for k in range(i2 - i1):
                x, y = odd[i1 + k], majority[j1 + k]
                if x.role != y.role:
                    return Difference(Change.OTHER_GROUP, [x], [y], j1 + k)
            continue
        if tag == "insert":
            if i1 == len(a) and not odd_left:
                return None  # the odd rank has not got there yet
            return _missing(a, b, odd, majority, i1, j1, j2, majority_left)
        if tag == "delete":
            if i2 == len(a) and j1 == len(b) and not majority_left:
                return None  # the majority rank has not got there yet (its next call may not be recorded)
            return _extra(a, b, odd, majority, i1, i2, j1)
        # replace
        x, y = odd[i1], majority[j1]
        if _same_site(x, y) and x.role == y.role:
            return Difference(Change.DIFFERENT, [x], [y], j1, fields=_fields(x, y))
        if _same_site(x, y):
            return Difference(Change.OTHER_GROUP, [x], [y], j1)
        if a[i1] in b[j1 + 1 :]:
            return _missing(a, b, odd, majority, i1, j1, j1 + b[j1 + 1 :].index(a[i1]) + 1, True)
        if b[j1] in a[i1 + 1 :]:
            return _extra(a, b, odd, majority, i1, i1 + a[i1 + 1 :].index(b[j1]) + 1, j1)
        # Two lines of one cell: the code says which way the odd rank went; calls from C++ have no
        # line, and only their repetition says whether one side went round a loop again.
        if x.line is not None and y.line is not None and x.site_cell == y.site_cell and x.site_cell is not None and apart is not None \
                and apart(x.site_cell, x.line, y.line):
            return Difference(Change.DIFFERENT, [x], [y], j1, fields=_fields(x, y) or ("call site",))
        found = _code_order(odd, majority, i1, j1, loop_of) or _repeats(a, b, odd, majority, i1, i2, j1, j2)
        if found is not None:
            return found
        return Difference(Change.DIFFERENT, [x], [y], j1, fields=_fields(x, y) or ("call site",))
    return None


def _repeats(a: list[Any], b: list[Any], odd: list[Call], majority: list[Call], i1: int, i2: int, j1: int, j2: int) -> Difference | None:
    """One side went round the loop it was in again where the other went on: its calls there
    repeat the body just before them, and the other side ran that body too."""
    for mine, theirs, i, end, more in ((a, b, i1, i2, True), (b, a, j1, j2, False)):
        run = mine[i:end]
        p = _period(mine, i, run)
        if p is None:
            continue
        body = mine[i - p : i]
        ran = _times(theirs, body)
        if ran:
            runs = (_times(a, body), _times(b, body))
            calls = odd[i1:i2] if more else []
            return Difference(Change.REPEATS, calls, [] if more else majority[j1:j2], j1, runs,
                              (odd if more else majority)[i - p : i])
    return None


def _code_order(odd: list[Call], majority: list[Call], i1: int, j1: int, loop_of: LoopOf | None) -> Difference | None:
    """Two calls at different lines of one cell, after the same calls: which way through the
    cell's code did the odd rank go? Further down than the majority's call, it skipped that call;
    above it, it made one the majority did not. A side that went back up (round its loop) while
    the other went on past the loop's end ran the loop another number of times."""
    x, y = odd[i1], majority[j1]
    if x.line is None or y.line is None or x.site_cell != y.site_cell:
        return None
    prev = odd[i1 - 1] if i1 > 0 else None
    last = prev.line if prev is not None and prev.site_cell == x.site_cell and prev.line is not None else 0
    x_on, y_on = x.line > last, y.line > last
    if x_on == y_on:
        if x.line > y.line:
            return Difference(Change.MISSING, [], [y], j1)
        return Difference(Change.EXTRA, [x], [], j1)
    loop = loop_of(x.site_cell, last) if loop_of is not None and x.site_cell is not None and last else None
    if y_on:  # the odd rank went back up, the majority on
        if loop is not None and y.line > loop[1]:
            return Difference(Change.REPEATS, [x], [], j1, None, [x])  # it went round again; the majority left the loop
        return Difference(Change.MISSING, [], [y], j1)
    if loop is not None and x.line > loop[1]:
        return Difference(Change.REPEATS, [], [y], j1, None, [y])  # it left the loop; the majority went round again
    return Difference(Change.EXTRA, [x], [], j1)


def _missing(a: list[Any], b: list[Any], odd: list[Call], majority: list[Call], i1: int, j1: int, j2: int,
             majority_left: bool) -> Difference:
    run = b[j1:j2]
    p = _period(b, j1, run)
    # A loop's count when the missing calls are whole repetitions of the body just before them
    # (or the start of one the majority is in now), the odd rank ran that body too, and it went
    # on with something else (it left the loop).
    whole = p is not None and (len(run) % p == 0 or (not majority_left and j2 == len(b)))
    if p is not None and whole and (i1 == len(a) or a[i1] != b[j1 - p]):
        body = b[j1 - p : j1]
        ran = _times(a, body)
        if ran:
            return Difference(Change.REPEATS, [], majority[j1:j2], j1, (ran, _times(b, body)), majority[j1 - p : j1])
    return Difference(Change.MISSING, [], majority[j1:j2], j1)


def _extra(a: list[Any], b: list[Any], odd: list[Call], majority: list[Call], i1: int, i2: int, j1: int) -> Difference:
    run = a[i1:i2]
    p = _period(a, i1, run)
    if p is not None and (i2 == len(a) or a[i2] != a[i1 - p]) and (len(run) % p == 0 or i2 == len(a)):
        body = a[i1 - p : i1]
        ran = _times(b, body)
        if ran:
            return Difference(Change.REPEATS, odd[i1:i2], [], j1, (_times(a, body), ran), odd[i1 - p : i1])
    return Difference(Change.EXTRA, odd[i1:i2], [], j1)
