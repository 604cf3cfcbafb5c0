"""Rank sets: parsing ``"0,2"``, ``"1-3"``, ``"all"`` and writing them back compactly."""

from __future__ import annotations

import re
from typing import Any, Iterable

__all__ = ["Ranks", "SUMMARY_ABOVE", "format_ranks", "group_by", "parse_ranks", "rank_span"]

#: Which ranks a call is for: ``None`` (all), a rank, ``"0,2"``, ``"1-3"``, ``"0:8:2"``, ``"all"`` or any iterable of ranks.
Ranks = str | int | Iterable[int] | None


def parse_ranks(spec: str | int | Iterable[int] | None, world_size: int) -> list[int]:
    """Sorted, de-duplicated ranks from a spec (``0``, ``"0,2"``, ``"1-3"``, ``"0:8:2"``, ``"all"``);
    raises ValueError with a hint on bad input."""
    if spec is None:
        return list(range(world_size))
    if isinstance(spec, bool):
        raise ValueError(f"rank spec {spec!r} is not a rank; use e.g. 0, '0,2', '1-3' or 'all'.")
    if isinstance(spec, int):
        items: list[int] = [spec]
    elif isinstance(spec, str):
        text = spec.strip()
        if text in ("", "all", "*"):
            return list(range(world_size))
        items = []
        # Commas or spaces: "0,2", "0, 2" and "0 2" (how %%on_ranks 0 2 arrives) mean the same.
        for part in re.split(r"\s*,\s*|\s+", text):
            lo, sep, hi = part.partition("-")
            try:
                if ":" in part:  # "0:8:2", a Python slice of the world (as Monarch writes rank sets)
                    if part.count(":") > 2:
                        raise ValueError(part)
                    items.extend(range(world_size)[slice(*(int(x) if x else None for x in part.split(":")))])
                    continue
                if sep and lo:  # "1-3"
                    a, b = int(lo), int(hi)
                    if a > b:
                        raise ValueError(f"rank range {part!r} runs backwards; write {b}-{a}.")
                    items.extend(range(a, b + 1))
                else:  # "2" or "-1" (the latter is caught as negative below)
                    items.append(int(part))
            except ValueError as exc:
                if "backwards" in str(exc):
                    raise
                raise ValueError(
                    f"can't read {part!r} in rank spec {spec!r}; use ranks like 0, 0,2, 1-3, 0:8:2 or all."
                ) from None
    else:
        items = []
        for r in spec:
            if isinstance(r, bool) or not isinstance(r, int):
                raise ValueError(f"ranks must be integers, got {r!r}.")
            items.append(r)
    if not items:
        raise ValueError(f"rank spec {spec!r} names no rank.")
    bad = sorted({r for r in items if not 0 <= r < world_size})
    if bad:
        raise ValueError(
            f"rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} "
            f"{'are' if len(bad) > 1 else 'is'} out of range: this pool has ranks 0-{world_size - 1}."
        )
    return sorted(set(items))


#: Views list every rank up to this many; above it they lead with the majority and name the outliers.
SUMMARY_ABOVE = 16


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0,1,2,5]`` -> ``"ranks 0-2,5"``; a single rank reads ``"rank 3"``."""
    rs = sorted(set(ranks))
    if not rs:
        return "no ranks"
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rank_span(rs)}"


def rank_span(ranks: Iterable[int]) -> str:
    """``[0,1,2,5]`` -> ``"0-2,5"``: the ranks alone, for a sentence that names them itself."""
    rs = sorted(set(ranks))
    if not rs:
        return ""
    parts = []
    start = prev = rs[0]
    for r in [*rs[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else (f"{start},{prev}" if prev == start + 1 else f"{start}-{prev}"))
        if r is not None:
            start = prev = r
    return ",".join(parts)


def group_by(items: Iterable[tuple[int, Any]]) -> list[tuple[list[int], Any]]:
    """Group ranks whose values are equal, in order of first appearance.

    Hashable values are grouped through a dict (linear in ranks, whatever the number of distinct
    values); an unhashable one is compared with the unhashable groups so far."""
    groups: list[tuple[list[int], Any]] = []
    index: dict[Any, list[int]] = {}
    loose: list[tuple[list[int], Any]] = []
    for rank, value in items:
        try:
            ranks = index.get(value)
        except TypeError:
            ranks = next((rs for rs, v in loose if v == value), None)
            if ranks is None:
                loose.append(([rank], value))
                groups.append(loose[-1])
                continue
        else:
            if ranks is None:
                index[value] = [rank]
                groups.append((index[value], value))
                continue
        ranks.append(rank)
    return groups
