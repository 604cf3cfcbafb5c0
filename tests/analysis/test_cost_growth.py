"""The notebook's work per rank does not grow with the number of ranks (issue 47: "a test that fails
when a verdict's cost grows faster than linearly in the ranks").

Time would make this test as flaky as the machine is loaded, so it counts instead: every Python
function call and C call the path makes (``sys.setprofile`` events, the same on any machine; two
runs of a diagnosis differ by a few dozen of millions). A path that loops over every rank for each
rank (a quadratic) makes 4× the calls per rank at 4× the ranks; a linear one, the same. Speed
itself is ``benchmarks/bench_scale.py``'s."""

from __future__ import annotations

import sys
from typing import Any, Callable

import pytest

from distnb.results import CellResult
from distnb.services.watch import CellWatch

from synthetic import SyntheticPool, healthy_cell, hung_cell

SMALL, LARGE = 64, 256
#: The calls per rank may grow this much from SMALL to LARGE ranks (a quadratic path: 4×).
SLACK = 1.25


def _calls(fn: Callable[[], Any]) -> int:
    count = [0]

    def seen(frame: Any, event: str, arg: Any) -> None:
        count[0] += 1

    fn()  # once before counting: the first reading fills caches (group infos, sources) once per session
    sys.setprofile(seen)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


def _hang(world: int) -> Callable[[], Any]:
    pool = SyntheticPool(world)
    result = hung_cell(pool, steps=20, odd=min(17, world - 1))
    return lambda: pool.inspector.diagnose(result).text()


def _healthy(world: int) -> tuple[SyntheticPool, CellResult]:
    pool = SyntheticPool(world, hang_after=60.0)
    return pool, healthy_cell(pool, steps=20)


def _healthy_diagnosis(world: int) -> Callable[[], Any]:
    pool, result = _healthy(world)
    return lambda: pool.inspector.diagnose(result).text()


def _stacks(world: int) -> Callable[[], Any]:
    pool, _ = _healthy(world)
    return lambda: pool.inspector.stacks().text()


def _collectives(world: int) -> Callable[[], Any]:
    pool, _ = _healthy(world)
    return lambda: pool.inspector.collectives(refresh=False).text()


def _timeline(world: int) -> Callable[[], Any]:
    pool, _ = _healthy(world)
    return lambda: pool.inspector.stragglers().text()


def _watch(world: int) -> Callable[[], Any]:
    pool, result = _healthy(world)
    return CellWatch(pool.tracker, pool.inspector, result, pool.config.hang_after).look


PATHS: dict[str, Callable[[int], Callable[[], Any]]] = {
    "a hang's diagnosis": _hang, "a healthy cell's diagnosis": _healthy_diagnosis, "%dist_stacks": _stacks,
    "%dist_collectives": _collectives, "%dist_timeline": _timeline, "the watch's tick": _watch,
}


@pytest.mark.parametrize("path", list(PATHS))
def test_the_work_per_rank_does_not_grow_with_the_ranks(path: str) -> None:
    small, large = _calls(PATHS[path](SMALL)), _calls(PATHS[path](LARGE))
    per_small, per_large = small / SMALL, large / LARGE
    assert per_large <= per_small * SLACK, f"{path}: {per_small:.0f} calls per rank at {SMALL} ranks, {per_large:.0f} at {LARGE}"
