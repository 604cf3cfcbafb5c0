"""Point-to-point hangs on rings and pipelines, generated: the rank that made the unmatched calls
is named, whoever the chain of waits ends at.

Each case runs a small SPMD program of sends and receives on a model of rendezvous transfers (a
call completes once its partner's matching call is issued: the k-th send on a channel pairs with
the k-th receive there), with one rank's program changed: an extra send, a call made twice, a
skipped call, one more turn of the loop. The ranks' call logs and positions where the model stops are judged as the pool
judges them. The verdict names the changed rank or no rank, never another; the channel counts
name it whenever the other ends agree."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from distnb.analysis.verdicts.diagnose import diagnose
from distnb.analysis.verdicts.position import Position
from distnb.analysis.verdicts.verdict import Kind, Verdict
from distnb.controller.collective_log import CollectiveLog

CELL = 9
Op = tuple[str, int, int]  # ("send" | "recv", peer, line)


def _ring(rank: int, world: int, hops: int) -> list[list[Op]]:
    """Every hop: send to the next rank and receive from the previous, waited on together."""
    return [[("send", (rank + 1) % world, 5), ("recv", (rank - 1) % world, 6)] for _ in range(hops)]


def _pipeline(rank: int, world: int, hops: int) -> list[list[Op]]:
    """Every microbatch: receive from the stage before (not the first), then send on (not the last)."""
    out: list[list[Op]] = []
    for _ in range(hops):
        if rank > 0:
            out.append([("recv", rank - 1, 5)])
        if rank < world - 1:
            out.append([("send", rank + 1, 6)])
    return out


@dataclass
class Case:
    name: str
    culprit: int
    programs: dict[int, list[list[Op]]]


def _mutate(shape: str, fault: str, world: int, hops: int, f: int, at: int) -> Case:
    build = _ring if shape == "ring" else _pipeline
    programs = {r: build(r, world, hops) for r in range(world)}
    mine = programs[f]
    at = min(at, len(mine) - 1)
    if fault == "extra":  # one more send, at a line of its own
        peer = next((p for kind, p, _ in mine[at] if kind == "send"), (f + 1) % world if f < world - 1 or shape == "ring" else f - 1)
        mine[at] = [*mine[at], ("send", peer, 8)]
    elif fault == "again":  # one call made twice, the second at a line of its own (an extra recv or send)
        kind, peer, _ = mine[at][0]
        mine[at] = [*mine[at], (kind, peer, 8)]
    elif fault == "skip":  # one call left out, once
        mine[at] = mine[at][1:]
    else:  # one more turn of the loop
        programs[f] = build(f, world, hops + 1)
    return Case(f"{shape}:{fault}@{at}:r{f}/{world}", f, programs)


def _run(case: Case) -> tuple[list[Position], CollectiveLog] | None:
    """Where the model stops: each rank's issued calls (done or open) and position; None when no
    rank is left waiting (the change did not hang the cell)."""
    world = len(case.programs)
    hop = dict.fromkeys(case.programs, 0)
    issued: dict[int, list[dict]] = {r: [] for r in case.programs}
    sends: dict[tuple[int, int], list[dict]] = {}
    recvs: dict[tuple[int, int], list[dict]] = {}
    counter = itertools.count(1)

    def issue(r: int) -> None:
        for kind, peer, line in case.programs[r][hop[r]]:
            call = {"n": next(counter), "op": "isend" if kind == "send" else "irecv", "cell": CELL, "line": line, "end": None,
                    "args": {"dst" if kind == "send" else "src": peer, "tag": 0}}
            issued[r].append(call)
            (sends if kind == "send" else recvs).setdefault((r, peer) if kind == "send" else (peer, r), []).append(call)

    def matched(call: dict, r: int) -> bool:
        send = call["op"] == "isend"
        peer = call["args"]["dst" if send else "src"]
        mine, theirs = (sends, recvs) if send else (recvs, sends)
        key = (r, peer) if send else (peer, r)
        return len(theirs.get(key, [])) > mine[key].index(call)

    for r in case.programs:
        if case.programs[r]:
            issue(r)
    moved = True
    while moved:
        moved = False
        for r in case.programs:
            if hop[r] >= len(case.programs[r]):
                continue
            current = issued[r][-len(case.programs[r][hop[r]]):]
            if all(matched(c, r) for c in current):
                for c in current:
                    c["end"] = 1.0
                hop[r] += 1
                moved = True
                if hop[r] < len(case.programs[r]):
                    issue(r)
    positions = []
    for r in range(world):
        if hop[r] >= len(case.programs[r]):
            positions.append(Position(r, "finished"))
            continue
        open_ = [c for c in issued[r][-len(case.programs[r][hop[r]]):] if not matched(c, r)]
        positions.append(Position(r, "collective", op=open_[0]["op"], since=5.0, peers=open_, running=CELL, line_cell=CELL, line=7))
    if all(p.state == "finished" for p in positions):
        return None
    log = CollectiveLog()
    for r, calls in issued.items():
        log.merge(r, {"entries": [], "groups": {"0": list(range(world))}, "descs": {}, "calls": calls, "now": 0.0})
    return positions, log


def _cases() -> list[Case]:
    rng = random.Random(39)
    out = []
    for shape, fault in itertools.product(("ring", "pipeline"), ("extra", "again", "skip", "loop")):
        for _ in range(12):
            world, hops = rng.randint(3, 6), rng.randint(2, 4)
            out.append(_mutate(shape, fault, world, hops, rng.randrange(world), rng.randrange(2 * hops)))
    return out


CASES = _cases()


def _judge(case: Case) -> Verdict | None:
    ran = _run(case)
    if ran is None:
        return None
    positions, log = ran
    return diagnose(positions, 3.0, 5.0, log.report(list(range(len(positions)))), None, {}, CELL)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_point_to_point_hang_never_blames_a_rank_whose_calls_were_as_written(case: Case) -> None:
    verdict = _judge(case)
    if verdict is None:
        return  # the change did not hang this program: nothing to judge
    assert verdict.culprits in ([], [case.culprit]), f"{case.name}: {verdict.summary}"


def test_the_changed_rank_is_named_in_nearly_every_hang_and_one_more_turn_is_a_loop() -> None:
    judged = [(case, v) for case in CASES if (v := _judge(case)) is not None]
    named = [case for case, v in judged if v.culprits == [case.culprit]]
    assert len(judged) >= 40 and len(named) >= 0.9 * len(judged), [(c.name, v.summary) for c, v in judged if v.culprits != [c.culprit]]
    # One more turn shows on every end of a ring rank or a pipeline's first stage; a later stage
    # blocks in its extra turn's first receive, so only that end moved: an unmatched call then.
    loops = [v.kind for case, v in judged if ":loop@" in case.name and v.culprits == [case.culprit]
             and (case.name.startswith("ring") or ":r0/" in case.name)]
    assert len(loops) >= 8 and loops.count(Kind.LOOP_COUNT) == len(loops), loops
