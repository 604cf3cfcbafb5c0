"""Small text helpers shared by the controller and the workers (standard library only).

Sizes are binary everywhere and say so: a MiB is 2**20 bytes, so a limit reads the same wherever
it is quoted (a push, a pull, a frame, a memory table).

Output lines are shown once for the ranks that share them (:func:`merge_lines`). Above
:data:`~distnb.ranks.SUMMARY_ABOVE` ranks, lines that differ only in their numbers (a loss, a
rank, a node) are one line too: each number that varies is shown as its range over the ranks,
and the ranks whose number lies far outside it, or is nan/inf, are named after it::

    [ranks 0-1023] step 1 loss ⟨2.3100 … 2.3585⟩ on node⟨0 … 127⟩, except rank 17: loss nan
"""

from __future__ import annotations

import math
import re

from distnb.ranks import SUMMARY_ABOVE, format_ranks, group_by

__all__ = ["MERGED_NOTE", "MiB", "Repeats", "Rows", "end_sentence", "fit", "merge_lines", "merge_rows", "mib", "prefix_lines", "size"]

MiB = 1 << 20
_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))

#: A number as a line prints it: an int, a decimal, scientific, nan or inf. A sign belongs to it
#: only where it can't be a hyphen ("node-3" is node 3, "x=-0.5" is -0.5); digits after letters
#: are a number ("node12"), so hostnames and device names merge as well as values do.
_SIGN = r"(?:(?<![\w.)\]])[-+])?"
_NUMBER = re.compile(rf"({_SIGN}(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|{_SIGN}\b(?:nan|inf(?:inity)?)\b)", re.I | re.A)
#: Lines sharing a template (numbers masked) are shown as they are when there are at most this
#: many distinct ones: "[ranks 0-511] leader 1" and "[ranks 512-1023] leader 0" say more than a range.
EXACT_UP_TO = 4
#: Rows per line position (or distinct outputs) before the rest are named in one row; bounds a
#: view of 1,024 ranks that each print a line of their own making (a UUID, a hostname).
MAX_ROWS = 16
#: Groups of ranks named after "except" before the rest are counted (and still listed).
MAX_NAMED = 8
#: A value is far from the rest when it lies this many median absolute deviations from the
#: median: wide enough that a spread of losses or rank numbers never trips it, narrow enough
#: that a diverging rank does.
FAR = 10.0

#: Said once under output whose lines were merged: how to read them, and where every line is.
MERGED_NOTE = (f"[distnb] above {SUMMARY_ABOVE} ranks, lines that differ only in numbers are merged: ⟨lo … hi⟩ is their range, ⟨rank⟩ "
               "each rank's own number, 'except' names the ranks outside it (or at nan/inf); every rank's own output: "
               "_dist[rank].stdout / .stderr.")


def mib(n_bytes: float) -> str:
    """A size in MiB with one decimal, as limits are stated: ``"256.0 MiB"``."""
    return f"{n_bytes / MiB:,.1f} MiB"


def size(n_bytes: float | None) -> str:
    """A size in the largest binary unit it fills: ``"1.50 GiB"``, ``"300 MiB"``, ``"12 KiB"``, ``"-"`` for None."""
    if n_bytes is None:
        return "-"
    for unit, scale in _UNITS:
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.2f} {unit}" if unit == "GiB" else f"{n_bytes / scale:.0f} {unit}"
    return f"{n_bytes:.0f} B"


def end_sentence(text: str) -> str:
    """``text`` ended by a full stop, unless it already ends in its own: a message quoted whole
    ("… must match."), or cut (``…``). A sentence that ends in someone else's words reads ".." otherwise."""
    return text if text.rstrip().endswith((".", "…", "!", "?")) else text + "."


def fit(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: whole when it fits, else cut at a space outside any
    brackets, parentheses or backticks and ended with ``…``. A label (``In[15]``, ``[256, 64]``,
    ``(#18 on group 0)``, `` `if rank == 0:` ``) is shown whole or not at all: a cut one reads as
    another label (``In[1``). Only a first word longer than the width is cut inside."""
    if len(text) <= width:
        return text
    depth, tick, cut = 0, False, -1
    for i, ch in enumerate(text[: width - 1]):  # a cut at i keeps text[:i] and " …": i + 2 characters
        if ch == "`":
            tick = not tick
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch == " " and not depth and not tick:
            cut = i
    kept = text[:cut].rstrip(" ,;:") if cut > 0 else ""
    return f"{kept} …" if kept else text[: width - 1] + "…"


class Rows(list[tuple[list[int], str]]):
    """``(ranks, line)`` rows. ``merged``: a row stands for lines that differ in their numbers (the
    caller then adds :data:`MERGED_NOTE`); ``odd``: the ranks a summary singles out — named after
    "except", or printing a line of their own that few ranks print — for views that give those
    ranks a section of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.merged = False
        self.odd: list[int] = []


# -- a block a rank prints after it was printed above ----------------------------------------------
# Ranks print the same block at different moments (a library's log, a config dump, a warning with
# its stack), and a library logs the same block again (each recompile, each retry); the views group
# lines that arrive together or stand at the same place. A run of at least REPEAT_MIN_RUN lines that
# the same ranks have all printed before becomes one line, ``(20 lines: the same as ranks 0,2 printed
# above)`` — or, printed before by the rank itself alone, ``(20 lines: repeated from above)`` (a
# block of at least REPEAT_MIN_RUN different lines); the cell's result keeps every rank's text.

#: The shortest run folded: one or two equal lines (a loss printed by every rank) read better as they are.
REPEAT_MIN_RUN = 3
#: How many distinct lines a cell remembers (the printed view holds at most 20,000 lines).
REPEATS_KEEP = 20_000


def _fold_text(n: int, by: set[int], rank: int) -> str:
    """The one line a folded run of ``n`` lines becomes."""
    if by == {rank}:
        return f"({n} lines: repeated from above)"
    return f"({n} lines: the same as {format_ranks(sorted(by))} printed above)"


class Repeats:
    """The lines each rank has printed in this cell, per stream (one thread uses it: the live
    view's flushing thread, or the one rendering a finished cell)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], set[int]] = {}

    def fold(self, stream: str, rank: int, lines: list[str]) -> list[str]:
        """``lines``, with each run that was printed before (by other ranks, or by this one, earlier
        or higher in ``lines``) as one line."""
        out: list[str] = []
        earlier: set[str] = set()  # the lines of ``lines`` before the run: this rank printed them above it
        i = 0
        while i < len(lines):
            end, by = self._run(stream, rank, lines, i, earlier)
            said = [line for line in lines[i:end] if line.strip()]
            # A rank's own repeat is folded when it is a block (a log, a traceback), not one line
            # printed again and again ("waiting…"), which reads better as it is.
            if len(said) < REPEAT_MIN_RUN:
                end = i + 1
                out.append(lines[i])
            elif by != {rank} or len(set(said)) >= REPEAT_MIN_RUN:
                out.append(_fold_text(end - i, by, rank))
            else:  # the same line or two again: all of them as printed (one at a time would rescan the run each)
                out.extend(lines[i:end])
            earlier.update(lines[i:end])
            i = end
        return out

    def _run(self, stream: str, rank: int, lines: list[str], start: int, earlier: set[str]) -> tuple[int, set[int]]:
        """The longest run from ``start`` whose every line the same ranks printed before."""
        by: set[int] | None = None
        end = start
        while end < len(lines):
            printers = self._seen.get((stream, lines[end]), set())
            if lines[end] in earlier:
                printers = printers | {rank}
            common = printers if by is None else by & printers
            if not common:
                break
            by, end = common, end + 1
        return end, by or set()

    def printed(self, stream: str, rank: int, lines: list[str]) -> None:
        """``rank`` printed ``lines`` (as it wrote them, before any fold)."""
        for line in lines:
            ranks = self._seen.get((stream, line))
            if ranks is not None:
                ranks.add(rank)
            elif len(self._seen) < REPEATS_KEEP:
                self._seen[(stream, line)] = {rank}


def merge_lines(outputs: list[tuple[int, str]]) -> Rows:
    """Per-rank texts → ``(ranks, line)`` rows, each line shown once for the ranks that share it.

    Ranks with the same number of lines are aligned line by line (the common case of a cell
    whose prints differ only in a rank number); otherwise whole outputs are grouped, and a run of
    lines an earlier group showed is one line in a later one (:class:`Repeats`). Above
    :data:`~distnb.ranks.SUMMARY_ABOVE` ranks, lines that differ only in their numbers are merged
    (:func:`merge_rows`) and whole outputs are grouped by their lines' templates, the largest
    group first."""
    split = [(r, _lines(t)) for r, t in outputs]
    rows = Rows()
    if len(split) > SUMMARY_ABOVE:
        _summarise(split, rows)
    elif len({len(ls) for _, ls in split}) == 1:
        for i in range(len(split[0][1]) if split else 0):
            rows.extend(group_by((r, ls[i]) for r, ls in split))
    else:
        # Whole outputs, one after another: a block a later group repeats is one line there.
        repeats = Repeats()
        for ranks, output in group_by((r, tuple(ls)) for r, ls in split):
            lines = list(output)
            rows.extend((ranks, line) for line in repeats.fold("", ranks[0], lines))
            for r in ranks:
                repeats.printed("", r, lines)
    return rows


def _summarise(split: list[tuple[int, list[str]]], rows: Rows) -> None:
    if len({len(ls) for _, ls in split}) == 1:
        for i in range(len(split[0][1])):
            _add(rows, merge_rows([(r, ls[i]) for r, ls in split]))
        return
    # Outputs of different lengths ("if rank == 0: print(config)"): grouped by their lines'
    # templates, so that ranks printing the same lines with other numbers are one group.
    parts_of: dict[str, list[str]] = {}  # a line → its pieces, each distinct line split once (here and in merge_rows)

    def template(line: str) -> tuple[str, ...]:
        parts = parts_of.get(line)
        if parts is None:
            parts = parts_of[line] = _NUMBER.split(line)
        return tuple(parts[0::2])

    groups = group_by((r, tuple(map(template, ls))) for r, ls in split)
    groups.sort(key=lambda g: -len(g[0]))  # the majority first; ties stay in order of their first rank
    lines_of = dict(split)
    for n, (ranks, keys) in enumerate(groups):
        if n == MAX_ROWS:
            rest = sorted(r for rs, _ in groups[n:] for r in rs)
            rows.append((rest, f"⋯ {len(groups) - n:,} other outputs, each of fewer ranks, not shown here: _dist[rank].stdout / .stderr"))
            rows.merged = True
            return
        if n and len(ranks) <= MAX_NAMED and 2 * len(groups[0][0]) > len(split):
            rows.odd.extend(ranks)  # an output of their own, beside a majority's
        for i in range(len(keys)):
            _add(rows, merge_rows([(r, lines_of[r][i]) for r in ranks], parts_of))


def _add(rows: Rows, more: Rows) -> None:
    rows.extend(more)
    rows.merged = rows.merged or more.merged
    rows.odd.extend(more.odd)


def merge_rows(items: list[tuple[int, str]], parts_of: dict[str, list[str]] | None = None) -> Rows:
    """One line position of many ranks (``(rank, line)``) → rows, the most ranks first.

    Equal lines are one row; lines equal once their numbers are masked (a template) are one row
    when they are more than :data:`EXACT_UP_TO` distinct lines (:func:`_merged`); past
    :data:`MAX_ROWS` rows, one row names the remaining ranks. Each distinct line is split once,
    so the cost is linear in the ranks plus the distinct lines' length (``parts_of``: lines split
    already, by the caller)."""
    out = Rows()
    by_template: dict[tuple[str, ...], list[tuple[list[int], str, list[str]]]] = {}
    for ranks, line in group_by(items):
        parts = parts_of[line] if parts_of is not None and line in parts_of else _NUMBER.split(line)
        by_template.setdefault(tuple(parts[0::2]), []).append((ranks, line, parts))
    groups = sorted(by_template.values(), key=lambda g: -sum(len(rs) for rs, _, _ in g))
    for n, lines in enumerate(groups):
        if len(out) >= MAX_ROWS:
            rest = sorted(r for g in groups[n:] for rs, _, _ in g for r in rs)
            count = sum(len(g) for g in groups[n:])
            out.append((rest, f"⋯ {count:,} other lines, each of fewer ranks, not shown here: _dist[rank].stdout / .stderr"))
            out.merged = True
            break
        if len(lines) <= EXACT_UP_TO:
            out.extend((rs, line) for rs, line, _ in sorted(lines, key=lambda g: -len(g[0])))
        else:
            ranks, line, named = _merged(lines)
            out.append((ranks, line))
            out.odd.extend(named)
            out.merged = True
    # A line only a few ranks print, beside a majority's, singles them out ("[rank 17] diverged");
    # where no line has a majority (a UUID per rank), nobody is odd.
    if out and 2 * len(out[0][0]) > len(items):
        out.odd.extend(r for rs, _ in out[1:] if len(rs) <= MAX_NAMED for r in rs)
    return out


def _merged(lines: list[tuple[list[int], str, list[str]]]) -> tuple[list[int], str, list[int]]:
    """Lines of one template → one: each number that varies as ``⟨lo … hi⟩`` (as the ranks
    printed lo and hi), or ``⟨rank⟩`` where it is each rank's own; ``, except …`` names the ranks
    whose number is nan/inf or far outside the rest (:data:`FAR`). Returns the ranks, the line and
    the ranks it names."""
    literals = lines[0][2][0::2]
    named: dict[int, list[tuple[str, bool]]] = {}  # rank → its numbers left out of the ranges, in words
    pieces = [literals[0]]
    for j in range(len(literals) - 1):
        pieces.append(_slot([(parts[2 * j + 1], ranks) for ranks, _, parts in lines], literals[j], literals[j + 1], named))
        pieces.append(literals[j + 1])
    line = "".join(pieces)
    if named:
        line += ", except " + _except(named)
    return sorted(r for rs, _, _ in lines for r in rs), line, sorted(named)


def _slot(values: list[tuple[str, list[int]]], before: str, after: str, named: dict[int, list[tuple[str, bool]]]) -> str:
    """One number's place in a merged line, adding the ranks it leaves out to ``named``."""
    first = values[0][0]
    if all(t == first for t, _ in values):
        return first
    if all(len(rs) == 1 and t == str(rs[0]) for t, rs in values):
        return "⟨rank⟩"
    finite: list[tuple[float, str, list[int]]] = []
    odd: list[tuple[str, list[int]]] = []
    for t, rs in values:
        v = float(t)  # the pattern matches only what float() reads
        if math.isfinite(v):
            finite.append((v, t, rs))
        else:
            odd.append((t, rs))
    if not finite:  # nan or inf everywhere: nothing to range over, so nobody is odd
        texts = sorted({t for t, _ in values})
        return "⟨" + " | ".join(texts[:3]) + (" | …" if len(texts) > 3 else "") + "⟩"
    far = _far(finite)
    kept = [f for i, f in enumerate(finite) if i not in far]
    lo, hi = min(kept), max(kept)
    head, tail = _label(before, after)
    for t, rs in odd:
        for r in rs:
            named.setdefault(r, []).append((head + t + tail, True))
    for i in sorted(far):
        _, t, rs = finite[i]
        for r in rs:
            named.setdefault(r, []).append((head + t + tail, False))
    return lo[1] if lo[1] == hi[1] else f"⟨{lo[1]} … {hi[1]}⟩"


def _far(finite: list[tuple[float, str, list[int]]]) -> set[int]:
    """Indexes of the values far from the rest: :data:`FAR` median absolute deviations from the
    median, each value weighed by how many ranks printed it. Where more than half the ranks print
    one value (the deviation's median is 0), the mean deviation stands in, so one rank that differs
    among a thousand that agree is named, and a spread among many is not."""
    per_rank = sorted(v for v, _, rs in finite for _ in rs)
    if len(per_rank) < 5:
        return set()
    median = per_rank[len(per_rank) // 2]
    deviations = sorted(abs(v - median) for v in per_rank)
    scale = deviations[len(deviations) // 2] or sum(deviations) / len(deviations)
    if not scale or not math.isfinite(scale):
        return set()
    return {i for i, (v, _, _) in enumerate(finite) if abs(v - median) > FAR * scale}


def _label(before: str, after: str) -> tuple[str, str]:
    """The words that say which number an outlier's is: the word before it ("loss nan",
    "node12"), or the one after it where none comes before ("nan it/s")."""
    words = before.split()
    if words:
        word = words[-1] if any(c.isalpha() for c in words[-1]) or len(words) == 1 else " ".join(words[-2:])
        return word[-32:] + (" " if before[-1:].isspace() else ""), ""
    words = after.split()
    return "", ((" " if after[:1].isspace() else "") + words[0][:32]) if words else ""


def _except(named: dict[int, list[tuple[str, bool]]]) -> str:
    """``rank 17: loss nan; ranks 3,9: loss 9.8``: the ranks a merged line leaves out, those with
    nan/inf first, each group with its own numbers; past :data:`MAX_NAMED` groups, the rest listed."""
    groups = group_by((r, tuple(vs)) for r, vs in sorted(named.items()))
    groups.sort(key=lambda g: not any(bad for _, bad in g[1]))  # stable: nan/inf first, then by rank
    shown = [f"{format_ranks(rs)}: {', '.join(t for t, _ in vs)}" for rs, vs in groups[:MAX_NAMED]]
    rest = [r for rs, _ in groups[MAX_NAMED:] for r in rs]
    if rest:
        shown.append(f"{len(rest):,} more outside the ranges ({format_ranks(rest)})")
    return "; ".join(shown)


def _lines(text: str) -> list[str]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def prefix_lines(label: str, text: str) -> str:
    """``[ranks 0-3] line`` for every line of text (a trailing newline adds no empty line)."""
    return "\n".join(f"[{label}] {line}" for line in _lines(text))
