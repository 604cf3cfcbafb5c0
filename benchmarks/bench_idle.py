"""CPU an idle pool uses, per second, by process kind and thread (issue 15's target: <= 5 ms/s
at 8 ranks).

    python benchmarks/bench_idle.py [--nproc 8] [--seconds 20] [--label NAME] [--out FILE]

Starts a pool, runs one cell, waits until the spares have imported torch, then reads utime+stime of every thread of every pool
process (/proc/PID/task/TID/stat, 10 ms ticks) over ``--seconds``. ``--out`` merges this run under
``--label`` into the JSON file, so runs of two versions (say, ``git stash`` and back: an editable
install maps ``distnb`` to the working tree whatever PYTHONPATH says) land side by side;
alternate them, as this machine's speed drifts by ±20% over an hour.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import distnb

TICK = os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> dict[tuple[str, str], float]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode()
        fields = stat.rsplit(b")", 1)[1].split()
        out[(tid, name)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def _kind(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return "gone"
    return "torchrun" if b"torch.distributed.run" in cmd else "rank" if b"worker.rank" in cmd else "supervisor" if b"distnb.worker" in cmd else "other"


def _tree(pids: list[int]) -> set[int]:
    out: set[int] = set()
    todo = list(pids)
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out.add(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _total(pids: set[int]) -> float:
    return sum(sum(_threads(p).values()) for p in pids if os.path.exists(f"/proc/{p}"))


def _settle(pool: distnb.Pool, quiet: float = 0.05, limit: float = 120.0) -> set[int]:
    """Wait until the pool's tree uses under ``quiet`` s of CPU in a second: the spares (one per
    rank, started once the pool is ready) import torch first, which is start-up, not idle."""
    deadline = time.monotonic() + limit
    while True:
        pids = _tree(pool.pids())
        before = _total(pids)
        time.sleep(1.0)
        if _total(pids) - before < quiet or time.monotonic() > deadline:
            return _tree(pool.pids())


def measure(nproc: int, seconds: float) -> dict[str, float]:
    with distnb.Pool(nproc=nproc, backend="gloo") as pool:
        assert pool.run("x = 1").ok
        pids = _settle(pool)
        before = {p: _threads(p) for p in pids}
        mine = time.process_time()
        time.sleep(seconds)
        mine = time.process_time() - mine
        after = {p: _threads(p) for p in pids}
        kinds = {p: _kind(p) for p in pids}
    agg: collections.Counter[str] = collections.Counter()
    for p in pids:
        kind = kinds[p]
        for key, t1 in after[p].items():
            agg[f"{kind}/{key[1]}"] += t1 - before[p].get(key, t1)
    out = {k: round(v / seconds * 1000, 1) for k, v in sorted(agg.items()) if v > 0}
    out["pool total"] = round(sum(agg.values()) / seconds * 1000, 1)
    out["notebook (controller)"] = round(mine / seconds * 1000, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--label", default="this")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = measure(args.nproc, args.seconds)
    print(json.dumps({args.label: result}, indent=2))
    if args.out:
        data: dict[str, object] = {}
        if os.path.exists(args.out):
            with open(args.out) as f:
                data = json.load(f)
        data.update({"nproc": args.nproc, "seconds": args.seconds, "unit": "ms of CPU per second"})
        data.setdefault("runs", [])
        data["runs"].append({"label": args.label, **result})  # type: ignore[union-attr]
        with open(args.out, "w") as f:
            json.dump(data, f, indent=2)


if __name__ == "__main__":
    main()
