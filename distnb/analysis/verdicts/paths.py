"""Why ranks diverged: the first decision in the notebook's code that ranks took differently.

Each rank sends the transitions its notebook code made (``worker/recorders/paths.py``): line ``a`` then
line ``b``, how often, how many times ``a`` had run when it first happened, and the rank's line
event number then. Ranks run the same lines in the same order until their first differing
decision, so up to it their event numbers line up: the transition ranks disagree on (one side
took it, the other never did, or took it at another iteration) with the smallest event number is
that decision. Its ``a`` is the line that decided (an ``if``, a loop header, a call that raised);
the words quote it from the cell's source.

A decision under a condition on the rank (``if rank == 0:``, ``if is_main_process:``) is what the
user asked for: :func:`first_difference` can leave those out (the end-of-cell note does; a hang's
diagnosis does not — a rank-conditional collective is exactly such a decision).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

from distnb.cell_names import cell_name
from distnb.ranks import format_ranks, group_by
from distnb.worker.recorders.paths import LEFT  # the "line" a frame goes to when it returns

__all__ = ["PathDifference", "first_difference", "rank_condition"]

_CELL = re.compile(r"<cell-(\d+)>")
#: Names whose value differs by rank on purpose: a condition on them is rank targeting.
RANK_CONDITION_NAMES = frozenset({"rank", "local_rank", "global_rank", "node_rank", "group_rank", "world_rank", "is_main_process",
                        "master_process", "is_master", "is_main", "main_process", "ddp_rank", "ddp_local_rank", "RANK", "LOCAL_RANK",
                        "get_rank", "get_local_rank", "is_rank_zero", "rank_zero"})

Transition = tuple[str, int, int]
#: Sides of a decision named before "… and N more ranks in M other ways".
MAX_SIDES = 5


def _cell_of(filename: str) -> int | None:
    m = _CELL.fullmatch(filename)
    return int(m.group(1)) if m else None


def _source_line(sources: dict[int, str], filename: str, line: int) -> str:
    cell = _cell_of(filename)
    lines = sources.get(cell, "").splitlines() if cell is not None else []
    return lines[line - 1].strip() if 0 < line <= len(lines) else ""


def rank_condition(code: str) -> bool:
    """Is this line a condition (``if``/``elif``/``while``/ternary) on the rank?"""
    text = code.strip().rstrip(":")
    for prefix in ("elif ", "if ", "while "):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    else:
        return False
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if name in RANK_CONDITION_NAMES:
            return True
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in ("RANK", "LOCAL_RANK"):
            return True  # os.environ["RANK"]
    return False


def _kind(code: str) -> str:
    """What the deciding line is, for the words."""
    head = code.split(None, 1)[0].rstrip(":") if code else ""
    return {"if": "if", "elif": "if", "while": "loop", "for": "loop", "try": "try", "with": "with"}.get(head, "line")


@dataclass
class PathDifference:
    """The first decision ranks took differently."""

    filename: str
    decided: int  # the line that decided (a's line)
    took: dict[int, tuple[int, int] | None]  # rank -> (to line, iteration of `decided` when first taken) or None
    sides: list[tuple[list[int], Any]]  # ranks grouped by what they did there, majority first
    decided_runs: dict[int, int]  # rank -> how often the deciding line ran in the cell
    source: str  # the deciding line's code
    target_source: dict[int, str]  # to line -> its code
    expected: bool  # a condition on the rank: targeting, not a bug
    event: int  # the line event number where it happened

    @property
    def cell(self) -> int | None:
        return _cell_of(self.filename)

    @property
    def odd(self) -> list[int]:
        """The ranks not on the majority's side (every rank on a tie)."""
        if len(self.sides) > 1 and len(self.sides[0][0]) > len(self.sides[1][0]):
            return sorted(r for rs, _ in self.sides[1:] for r in rs)
        return sorted(self.took)

    def where(self) -> str:
        cell = self.cell
        return f"{cell_name(cell)} line {self.decided}" if cell is not None else f"line {self.decided}"

    def text(self) -> str:
        """``rank 2 took line 6 (`break`, under `if not torch.isfinite(loss):`) at iteration 7 of
        12; ranks 0,1,3 never did`` · ``rank 1 left the loop `for b in batches:` after 7
        iterations; ranks 0,2,3 after 12``."""
        odd = set(self.odd)
        majority = [r for r in self.took if r not in odd] or list(self.took)
        runs = Counter(self.decided_runs.get(r, 0) for r in majority).most_common(1)[0][0]
        sides = sorted(self.sides, key=lambda side: not set(side[0]) <= odd)  # the odd ranks first: the culprits
        more = ""
        if len(sides) > MAX_SIDES:  # a thousand ranks, each leaving a loop at its own count
            rest = sides[MAX_SIDES - 1:]
            sides = sides[: MAX_SIDES - 1] + [sides[-1]]  # the majority's side stays
            more = f"; and {sum(len(rs) for rs, _ in rest[:-1])} more ranks in {len(rest) - 1} other ways (.took has each)"
        kind = _kind(self.source)
        targets = {what[0] for _, what in sides if what is not None}
        if kind == "loop" and len(targets) == 1:
            # The sides left the loop by the same way out after other trip counts, or some are in it still.
            parts, left = [], False
            for rs, what in sides:
                if what is None:
                    n = Counter(self.decided_runs.get(r, 0) for r in rs).most_common(1)[0][0]
                    parts.append(f"{format_ranks(rs)} {'was' if len(rs) == 1 else 'were'} still in it, at iteration {n}")
                elif not left:
                    left = True
                    parts.append(f"{format_ranks(rs)} left the loop `{self.source}` after {what[1] - 1} iteration{'s' if what[1] != 2 else ''}")
                else:
                    parts.append(f"{format_ranks(rs)} after {what[1] - 1}")
            return "; ".join(parts) + more
        how = f"under `{self.source}`" if kind in ("if", "loop") else f"after `{self.source}`" if self.source else f"after line {self.decided}"
        parts = []
        for ranks, what in sides:
            if what is None:
                parts.append(f"{format_ranks(ranks)} never did")
                continue
            to, at = what
            if to == LEFT:
                parts.append(f"{format_ranks(ranks)} returned ({how}){f' at iteration {at} of {runs}' if runs > 1 else ''}")
                continue
            target = self.target_source.get(to, "")
            iteration = f" at iteration {at} of {runs}" if runs > 1 else ""
            parts.append(f"{format_ranks(ranks)} took line {to} (" + (f"`{target}`, " if target else "") + f"{how}){iteration}")
        return "; ".join(parts) + more

    def summary(self) -> str:
        """The sentence a diagnosis adds: ``Why: …`` with the cell and line."""
        note = " (a condition on the rank: targeting, as written)" if self.expected else ""
        return f"the first decision that differed, at {self.where()}: {self.text()}{note}."


def first_difference(paths: Mapping[int, dict[str, Any] | None], sources: dict[int, str], quiet_expected: bool = False) -> PathDifference | None:
    """The earliest transition the ranks disagree on, from each rank's record; None when every
    rank took the same decisions (or no rank recorded). ``quiet_expected``: skip decisions under
    a condition on the rank (the end-of-cell note); the first other one is returned."""
    tables: dict[int, dict[Transition, list[int]]] = {}
    for r, rec in paths.items():
        if rec and rec.get("transitions"):
            tables[r] = {(f, a, b): [count, at, event] for f, a, b, count, at, event in rec["transitions"]}
    if len(tables) < 2:
        return None
    ranks = sorted(tables)
    # By deciding line: each rank's successors of it, with the iteration each was first taken.
    decisions: dict[tuple[str, int], dict[int, dict[int, tuple[int, int]]]] = {}
    for r, table in tables.items():
        for (f, a, b), (_, at, event) in table.items():
            decisions.setdefault((f, a), {}).setdefault(r, {})[b] = (at, event)
    found: list[tuple[int, tuple[str, int], dict[int, Any]]] = []
    for (f, a), by_rank in decisions.items():
        if a == 0:
            continue  # entering a frame decides nothing
        # Each rank's choices at this line: which successors, first taken at which iteration.
        seen = {r: frozenset((b, at) for b, (at, _) in by_rank.get(r, {}).items()) for r in ranks if r in by_rank}
        if len(seen) < 2 or len(set(seen.values())) == 1:
            continue  # a line only one rank ran is a consequence, decided earlier
        # The differing choices: successors (with iteration) not on every rank that ran the line.
        common = frozenset.intersection(*seen.values())
        event = min(ev for r in seen for b, (at, ev) in by_rank[r].items() if (b, at) not in common)
        first = {r: min(((at, b) for b, (at, _) in by_rank[r].items() if (b, at) not in common), default=None) for r in seen}
        found.append((event, (f, a), first))
    found.sort(key=lambda x: x[0])
    for event, (f, a), first in found:
        source = _source_line(sources, f, a)
        expected = rank_condition(source)
        if expected and quiet_expected:
            continue
        took = {r: (None if v is None else (v[1], v[0])) for r, v in first.items()}
        sides = sorted(group_by((r, took[r]) for r in sorted(took)), key=lambda g: (-len(g[0]), g[1] is None))
        runs = {r: sum(c for (ff, aa, _), (c, _, _) in tables[r].items() if ff == f and aa == a) for r in took}
        targets = {v[0]: _source_line(sources, f, v[0]) for v in took.values() if v is not None}
        return PathDifference(f, a, took, sides, runs, source, targets, expected, event)
    return None
