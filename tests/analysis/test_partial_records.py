"""A diagnosis read while the records are still arriving never blames a rank that did nothing wrong.

A live pool judges from what has reached the controller: a rank blocked in a collective may not
have pushed that call's entry yet (its stack says where it is, the log does not), or its stack
may have been read just before it entered the call. CI once saw "Root cause: rank 2" for a cell
where rank 1 raised, because rank 0's entry had not arrived. Here faults of the field's common
shapes (an error, a death, a call skipped, a call made by one rank only) are generated over worlds
of 3-6 ranks and cells of 2-5 calls, and each waiting rank's record is cut in every way a race can
cut it: the verdict read from the complete records names the faulty rank, and no partial view
names another."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from distnb.analysis.verdicts.diagnose import diagnose
from distnb.analysis.verdicts.position import Position
from distnb.analysis.verdicts.verdict import Kind, Verdict
from distnb.controller.collective_log import CollectiveLog

CELL = 7


@dataclass
class Case:
    """One generated failure: the cell's source, each rank's entries and position, the faulty rank."""

    name: str
    source: str
    world: int
    culprit: int
    entries: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    positions: dict[int, Position] = field(default_factory=dict)
    first_death: int | None = None
    died: dict[int, tuple[str, int]] = field(default_factory=dict)  # a dead rank's call and line from its stack at death

    def wait(self, r: int, entries: list[dict[str, Any]]) -> None:
        """Rank ``r`` made ``entries`` and waits in the last."""
        self.entries[r] = entries
        last = entries[-1]
        self.positions[r] = Position(r, "collective", op=last["op"], seq=last["seq"], group="0", since=4.0, line=last["line"],
                                     running=CELL, line_cell=CELL, func="<module>", code=self.source.splitlines()[last["line"] - 1].strip())

    def judge(self, cut: dict[int, str]) -> Verdict:
        """The verdict with each waiting rank's record cut as ``cut`` says: ``full``, ``unlogged``
        (its open entry has not arrived; its stack still says where it waits) or ``before`` (its
        stack was read just before it entered the call, and no entry yet)."""
        entries = {r: list(es) for r, es in self.entries.items()}
        positions = []
        for r in range(self.world):
            p = self.positions[r]
            how = cut.get(r, "full")
            if how != "full" and p.state == "collective":
                entries[r] = [e for e in entries[r] if e["done"]]
                if how == "unlogged":
                    p = Position(r, "collective", op=p.op, since=p.since, line=p.line, code=p.code, running=CELL, line_cell=CELL,
                                 func="<module>")
                else:
                    p = Position(r, "computing", line=p.line, code=p.code, running=CELL, line_cell=CELL, func="<module>")
            positions.append(p)
        log = CollectiveLog()
        for r, es in entries.items():
            log.merge(r, {"entries": es, "groups": {"0": list(range(self.world))}, "descs": {}, "calls": [], "now": 0.0})
        for r, (op, line) in self.died.items():
            log.died_in[r], log.died_at[r] = op, (CELL, line)
        for p in positions:
            if p.state == "dead":  # as the pool's Deaths records every death, with its cell
                log.died_during[p.rank] = CELL
        return diagnose(positions, 3.0, 5.0, log.report(list(range(self.world))), self.first_death, {CELL: self.source}, CELL)


def _entry(i: int, seq: int, line: int, size: int, done: bool, op: str = "all_reduce") -> dict[str, Any]:
    return {"id": i, "group": "0", "desc": "default_pg", "seq": seq, "p2p": False, "op": op, "sizes": [[size]],
            "dtypes": ["Float"], "t": float(i), "done": done, "cell": CELL, "line": line, "call_cell": CELL, "func": "<module>"}


#: The faults: the faulty rank raises, dies, skips the last call, makes one more, passes another
#: shape, calls another collective in the other branch of an ``if``, or runs a loop once less.
FAULTS = ["raised", "died", "skip_last", "extra", "shape", "other_op", "loop", "abort"]


def _generate(rng: random.Random) -> Case:
    world, calls, fault = rng.randint(3, 6), rng.randint(2, 5), rng.choice(FAULTS)
    f = rng.randrange(world)
    if fault == "loop":
        return _loop(world, calls, f)
    if fault == "abort":
        return _abort(rng, world, calls, f)
    k = rng.randrange(calls) if fault not in ("skip_last", "extra") else calls - 1
    lines = ["x = torch.ones(8)"]
    site: list[int] = []  # the line of each call (the majority's)
    odd_site = 0
    for i in range(calls):
        if i == k and fault == "raised":
            lines += [f"if rank == {f}:", "    raise ValueError('bad batch')"]
        if i == k and fault == "died":
            lines += [f"if rank == {f}:", "    os._exit(3)"]
        if i == k and fault == "skip_last":
            lines += [f"if rank != {f}:", "    dist.all_reduce(x)"]
        elif i == k and fault == "shape":
            lines += [f"dist.all_reduce(x if rank != {f} else x[:4])"]
        elif i == k and fault == "other_op":
            lines += [f"if rank == {f}:", "    dist.broadcast(x, 0)", "else:", "    dist.all_reduce(x)"]
            odd_site = len(lines) - 2
        else:
            lines.append("dist.all_reduce(x)")
        site.append(len(lines))
    if fault == "extra":
        lines += [f"if rank == {f}:", "    dist.all_reduce(torch.ones(1))"]
    case = Case(f"{fault} world={world} calls={calls} rank={f} at={k}", "\n".join(lines), world, f)
    done = [_entry(j, j + 1, site[j], 8, True) for j in range(k)]
    for r in range(world):
        if fault in ("raised", "died") and r != f or fault == "skip_last" and r != f:
            case.wait(r, done + [_entry(k, k + 1, site[k], 8, False)])
        elif fault == "shape":
            case.wait(r, done + [_entry(k, k + 1, site[k], 4 if r == f else 8, False)])
        elif fault == "other_op":
            case.wait(r, done + [_entry(k, k + 1, odd_site, 8, False, "broadcast") if r == f else _entry(k, k + 1, site[k], 8, False)])
        elif fault == "extra" and r == f:
            case.wait(r, done + [_entry(k, k + 1, site[k], 8, True), _entry(calls, calls + 1, len(lines), 1, False)])
        elif fault == "raised":
            case.entries[r] = done
            case.positions[r] = Position(r, "failed", line=site[k] - 1, code="    raise ValueError('bad batch')", detail="ValueError: bad batch")
        elif fault == "died":
            case.entries[r] = done
            case.positions[r] = Position(r, "dead", detail="exited with code 3")
            case.first_death = r
        else:
            made = [j for j in range(calls) if not (fault == "skip_last" and j == k)]
            case.entries[r] = [_entry(n, n + 1, site[j], 8, True) for n, j in enumerate(made)]
            case.positions[r] = Position(r, "finished")
    return case


def _abort(rng: random.Random, world: int, calls: int, f: int) -> Case:
    """Rank f's tensor at call k is larger than the others': gloo aborts a rank that receives more
    than its own holds (SIGABRT, within milliseconds: its entry may never have been pushed, its
    stack at death says where). The others then fail on the closed connection or stay blocked."""
    k = rng.randrange(calls)
    lines = ["x = torch.ones(8)"] + ["dist.all_reduce(x)"] * k + [f"dist.all_reduce(x if rank != {f} else torch.ones(16))"] + \
        ["dist.all_reduce(x)"] * (calls - k - 1)
    case = Case(f"abort world={world} calls={calls} rank={f} at={k}", "\n".join(lines), world, f)
    done = [_entry(j, j + 1, j + 2, 8, True) for j in range(k)]
    victim = rng.choice([r for r in range(world) if r != f])
    log_died: dict[int, tuple[str, int]] = {}
    for r in range(world):
        mine = _entry(k, k + 1, k + 2, 16 if r == f else 8, False)
        if r == victim:
            pushed = rng.random() < 0.5
            case.entries[r] = done + ([mine] if pushed else [])
            case.positions[r] = Position(r, "dead", detail="aborted (SIGABRT: a C++ assertion or abort(), e.g. gloo on mismatched tensors)")
            case.first_death = r
            if not pushed:
                log_died[r] = ("all_reduce", k + 2)
        elif rng.random() < 0.5:
            case.wait(r, done + [mine])
        else:
            case.entries[r] = done + [mine]
            case.positions[r] = Position(r, "failed", line=k + 2, code=lines[k + 1],
                                         detail="RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:6314")
    case.died = log_died
    return case


def _loop(world: int, calls: int, f: int) -> Case:
    """``for step in range(n if rank != f else n - 1): all_reduce`` then a barrier: rank f reaches
    the barrier while the others make their last all_reduce."""
    source = f"x = torch.ones(8)\nfor step in range({calls} if rank != {f} else {calls - 1}):\n    dist.all_reduce(x)\ndist.barrier()"
    case = Case(f"loop world={world} steps={calls} rank={f}", source, world, f)
    done = [_entry(j, j + 1, 3, 8, True) for j in range(calls - 1)]
    for r in range(world):
        last = _entry(calls - 1, calls, 4, 1, False, "barrier") if r == f else _entry(calls - 1, calls, 3, 8, False)
        case.wait(r, done + [last])
    return case


CASES = [_generate(random.Random(seed)) for seed in range(240)]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_partial_records_never_blame_an_innocent_rank(case: Case) -> None:
    full = case.judge({})
    assert full.is_problem and full.culprits == [case.culprit], f"{case.name}\n{case.source}\n{full.text()}"
    waiting = [r for r, p in case.positions.items() if p.state == "collective"]
    rng = random.Random(case.name)
    cuts = [dict(zip(waiting, how)) for how in itertools.product(("full", "unlogged", "before"), repeat=len(waiting))]
    for cut in cuts if len(cuts) <= 27 else rng.sample(cuts, 27):
        verdict = case.judge(cut)
        # Ranks read just before they entered the call are, by their records, still running code:
        # "still running" may name them (a service reads the stacks again before saying so).
        running = {r for r, how in cut.items() if how == "before"} if verdict.kind == Kind.STILL_RUNNING else set()
        blamed = set(verdict.culprits) - {case.culprit} - running
        assert not blamed, f"{case.name}, records cut {cut}\n{case.source}\n{verdict.text()}"
