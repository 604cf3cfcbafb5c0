"""Cost of the debugger panel (issue 29): debugpy in every rank, attached, with the panel's
breakpoints in another cell — what a user pays on the cells they are *not* debugging.

    python benchmarks/bench_panel.py [--ranks 2] [--rounds 7] [--out benchmarks/results/panel.json]

Three gloo pools of the same size run side by side: ``plain``, never attached; ``armed``, attached
through ``Pool.panel`` (as the panel's "attach" does) with a breakpoint in a cell that never runs
(debugpy traces the ranks); ``idle``, attached with no breakpoint (the panel turned off, or on
with nothing set: the ranks run untraced). The same cells go to all three, alternated round by
round (interleaved: this machine drifts ±20%):

* ``trivial``: ``pb_x = 1`` — the round trip of a cell, as the notebook waits for it;
* ``python``: a pure-Python loop (200k additions) — each rank's own cell duration;
* ``ddp``: 20 steps of a small DDP MLP with AdamW — each rank's own cell duration.

Also the time to attach the ranks (debugpy started in each, initialize/attach answered).
Reported, not asserted: medians and the ratios of medians (to plain) to stdout and the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time

import distnb

SETUP = """
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
pb_model = DDP(nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)]))
pb_opt = torch.optim.AdamW(pb_model.parameters())
"""
CELLS = {
    "trivial": "pb_x = 1\n",
    "python": "pb_s = 0\nfor pb_i in range(200_000):\n    pb_s += pb_i\n",
    "ddp": ("for pb_i in range(20):\n    pb_loss = pb_model(torch.randn(16, 128)).square().mean()\n"
            "    pb_opt.zero_grad()\n    pb_loss.backward()\n    pb_opt.step()\n"),
}


def measure(pool: distnb.Pool, name: str) -> float:
    start = time.perf_counter()
    res = pool.wait(pool.submit(CELLS[name], source={"path": f"/tmp/ipykernel_bench/{name}.py", "line": 2}), timeout=300)
    wall = time.perf_counter() - start
    assert res.ok, res.text()
    return wall if name == "trivial" else statistics.median(res[r].duration or 0.0 for r in res.ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/panel.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    kinds = ("plain", "armed", "idle")
    with contextlib.ExitStack() as stack:
        pools = {k: stack.enter_context(distnb.launch(nproc=args.ranks, backend="gloo")) for k in kinds}
        for pool in pools.values():
            assert pool.wait(pool.submit(SETUP), timeout=300).ok
        start = time.perf_counter()
        problems = pools["armed"].panel.attach({"/tmp/ipykernel_bench/elsewhere.py": [{"line": 3}]})
        attach_s = time.perf_counter() - start
        assert not problems and not pools["idle"].panel.attach({}), problems
        times: dict[str, dict[str, list[float]]] = {n: {k: [] for k in kinds} for n in CELLS}
        for _ in range(args.rounds):
            for name in CELLS:
                for kind, pool in pools.items():
                    times[name][kind].append(measure(pool, name))
    out: dict[str, object] = {"ranks": args.ranks, "rounds": args.rounds, "attach_s": attach_s,
                              "python": platform.python_version(), "cells": {}}
    print(f"attach {args.ranks} ranks: {attach_s:.2f} s")
    for name, got in times.items():
        med = {k: statistics.median(v) for k, v in got.items()}
        out["cells"][name] = {"runs_s": got, "median_s": med, "ratio": {k: med[k] / med["plain"] for k in kinds}}  # type: ignore[index]
        print(f"{name:8} " + "   ".join(f"{k} {med[k] * 1000:8.2f} ms ×{med[k] / med['plain']:.2f}" for k in kinds))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
