"""Cost of issue 16's diagnosis depth: the call log's wrappers, arrival analysis, --profile.

    python benchmarks/bench_desync.py [--out benchmarks/results/desync.json]

* wrapper: µs per watched call (``dist.broadcast`` and ``dist.all_reduce`` with ``op=``) on a
  1-rank gloo pool, in two pools alive together, one with the call log off
  (``DISTNB_CALL_LOG=0``), runs alternated; the median paired difference. DDP's own collectives
  come from C++ and pass no wrapper: they cost nothing here.
* arrivals: the controller's straggler analysis over 200 collectives × 8 ranks (ms), in-process.
* profile: a 4-rank DDP loop (20 steps, 4 Linear(256)) with and without ``profile=True``,
  alternated, cell wall time as the notebook sees it, and the merge of the 4 traces.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import distnb
from distnb.analysis.verdicts.stragglers import StragglerReport, arrivals
from distnb.controller.collective_log import CollectiveLog

CALLS = """
import time
def per_call(op, n=400):
    x = torch.ones(4)
    call = {"broadcast": lambda: dist.broadcast(x, 0), "all_reduce": lambda: dist.all_reduce(x, op=dist.ReduceOp.SUM)}[op]
    for _ in range(50):
        call()
    t = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t) / n * 1e6
"""

DDP = """
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
bd_model = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]))
bd_opt = torch.optim.SGD(bd_model.parameters(), lr=0.01)
bd_x = torch.randn(32, 256)
"""
STEP = "for _ in range(20):\n    bd_opt.zero_grad(); bd_model(bd_x).sum().backward(); bd_opt.step()\n"


def wrapper_cost(rounds: int) -> dict[str, object]:
    out: dict[str, object] = {}
    os.environ["DISTNB_CALL_LOG"] = "0"
    off = distnb.Pool(nproc=1, backend="gloo")
    off.start()
    os.environ.pop("DISTNB_CALL_LOG")
    on = distnb.Pool(nproc=1, backend="gloo")
    on.start()
    try:
        for pool in (on, off):
            pool.run(CALLS, timeout=60)
        for op in ("broadcast", "all_reduce"):
            diffs, ons, offs = [], [], []
            for i in range(rounds):
                pair = (on, off) if i % 2 == 0 else (off, on)
                got = {id(p): float(p.run(f"per_call({op!r})", timeout=60).values[0]) for p in pair}
                ons.append(got[id(on)])
                offs.append(got[id(off)])
                diffs.append(got[id(on)] - got[id(off)])
            out[op] = {"on_us": statistics.median(ons), "off_us": statistics.median(offs), "added_us_median": statistics.median(diffs),
                       "added_us_quartiles": statistics.quantiles(diffs, n=4)}
    finally:
        on.shutdown()
        off.shutdown()
    return out


def arrival_cost() -> dict[str, float]:
    log = CollectiveLog()
    for r in range(8):
        entries = [{"id": i, "group": "0", "desc": "", "seq": i + 1, "p2p": False, "op": "all_reduce", "sizes": [[4]],
                    "dtypes": ["Float"], "t": 100.0 + i * 0.01 + r * 1e-4, "done": True, "cell": 1} for i in range(200)]
        log.merge(r, {"entries": entries, "groups": {"0": list(range(8))}})
    ts = []
    for _ in range(20):
        t = time.perf_counter()
        StragglerReport("0", list(range(8)), arrivals(log, "0", list(range(8)), 200)).text()
        ts.append(time.perf_counter() - t)
    return {"ms_200x8": statistics.median(ts) * 1000}


def profile_cost(rounds: int) -> dict[str, object]:
    with distnb.Pool(nproc=4, backend="gloo") as pool:
        assert pool.run(DDP, timeout=120).ok
        pool.run(STEP, timeout=120)
        plain, profiled, merge = [], [], []
        for i in range(rounds):
            for prof in ((False, True) if i % 2 == 0 else (True, False)):
                t = time.perf_counter()
                res = pool.run(STEP, timeout=120, profile=prof)
                took = time.perf_counter() - t
                assert res.ok, res.text()
                (profiled if prof else plain).append(took)
                if prof:
                    t = time.perf_counter()
                    pool.profile(res, "/tmp/distnb-bench-trace.json")
                    merge.append(time.perf_counter() - t)
    ratios = [p / q for p, q in zip(profiled, plain)]
    return {"plain_s": statistics.median(plain), "profiled_s": statistics.median(profiled),
            "ratio_median": statistics.median(ratios), "report_and_merge_s": statistics.median(merge)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {"machine": platform.node(), "python": sys.version.split()[0], "when": time.strftime("%Y-%m-%d %H:%M"),
              "wrapper": wrapper_cost(args.rounds), "arrivals": arrival_cost(), "profile": profile_cost(max(3, args.rounds // 2))}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
