"""Cost of issue 13's NCCL path: reading each recorder, the end-of-cell desync check, and the time
from a hang's start to its diagnosis.

    python benchmarks/bench_nccl.py [--out benchmarks/results/nccl.json]

* read: µs per entry of one read of each recorder the rank's groups write (``read_collectives``:
  the dump, unpickling, distnb's ids and the entry views), measured inside a 1-rank pool after
  ``ENTRIES`` collectives; NCCL's recorder where a GPU is present, gloo's everywhere.
* sync check: the rank's end-of-cell counts (``sync_state``, µs per cell, in the rank) and the
  controller's comparison at 8 ranks (``count_mismatches``, µs per cell, in-process).
* hang to diagnosis: a rank-conditional collective on 2 ranks (NCCL on one shared GPU where
  present, else gloo); the time from submitting the cell to ``pool.diagnose`` first saying
  "hang", polled every 50 ms, with ``hang_after=1`` s (the documented bound is hang_after plus
  one poll of the ranks).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import distnb
from distnb.analysis.agreement.desync import count_mismatches

ENTRIES = 400

READ = """
import time
from distnb.worker.torch_hooks.flight_recorder import read_collectives, CellClock, dump_recorders
from distnb.worker.torch_hooks.group_state import sync_state
def bench_read(n=20):
    t = time.perf_counter()
    for _ in range(n):
        reply = read_collectives(-1, CellClock())
    per_read = (time.perf_counter() - t) / n
    by_rec = {}
    for e in reply["entries"]:
        by_rec[e["rec"]] = by_rec.get(e["rec"], 0) + 1
    return per_read, by_rec
def bench_sync(n=2000):
    calls = __import__("sys").modules["__main__"].current.executor.calls
    t = time.perf_counter()
    for _ in range(n):
        sync_state(calls)
    return (time.perf_counter() - t) / n * 1e6
"""


def recorder_reads(backend: str) -> dict[str, object]:
    with distnb.Pool(nproc=1, backend=backend) as pool:
        dev = "device" if backend == "nccl" else "'cpu'"
        assert pool.run(READ + f"x = torch.ones(4, device={dev})\nfor _ in range({ENTRIES}):\n    dist.all_reduce(x)\n"
                        "torch.cuda.synchronize() if x.is_cuda else None").ok
        res = pool.run("bench_read()")
        per_read, by_rec = eval(res.values[0])
        sync = float(pool.run("bench_sync()").values[0])
    entries = sum(by_rec.values())
    return {"backend": backend, "entries": by_rec, "ms_per_read": round(per_read * 1e3, 2),
            "us_per_entry": round(per_read / entries * 1e6, 1), "sync_state_us_per_cell": round(sync, 2)}


def compare_cost(ranks: int = 8, groups: int = 4, n: int = 20000) -> float:
    syncs: dict[int, dict[str, object] | None] = {r: {"seqs": {str(g): 100 for g in range(groups)}, "created": groups} for r in range(ranks)}
    t = time.perf_counter()
    for _ in range(n):
        count_mismatches(syncs)
    return (time.perf_counter() - t) / n * 1e6


def hang_to_diagnosis(share: bool, rounds: int) -> dict[str, object]:
    # NCCL: the interrupt ends the wait (an abort); gloo: only its timeout does.
    options: dict[str, object] = {"nproc": 2, "hang_after": 1.0, "pg_timeout": 600 if share else 3}
    options.update({"share_gpus": True} if share else {"backend": "gloo"})
    times = []
    with distnb.Pool(**options) as pool:  # type: ignore[arg-type]
        dev = "device" if share else "'cpu'"
        assert pool.run(f"warm = torch.ones(1, device={dev})\ndist.all_reduce(warm)").ok  # NCCL connects at the first collective
        for i in range(rounds):
            res = pool.submit(f"h{i} = torch.ones(2, device={dev})\nif rank == 0:\n    dist.all_reduce(h{i})\n    h{i}.sum().item()\n")
            t0 = time.monotonic()
            while time.monotonic() - t0 < 30:
                if pool.diagnose(res).kind == "hang":
                    times.append(time.monotonic() - t0)
                    break
                time.sleep(0.05)
            if share:
                pool.interrupt()  # escalates to an abort after 2 s
            pool.wait(res, timeout=60)
            if res.running:
                raise RuntimeError(f"the hung cell did not end:\n{res.text()}\n{pool.stacks(all_threads=True).text()}")
            pool.regroup()
            assert pool.run("dist.all_reduce(warm)").ok
    return {"backend": "nccl (2 ranks, one shared GPU)" if share else "gloo (2 ranks)", "hang_after_s": 1.0,
            "seconds": [round(t, 2) for t in times], "median_s": round(statistics.median(times), 2) if times else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch

    gpu = torch.cuda.is_available()
    out: dict[str, object] = {"machine": platform.node(), "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name(0) if gpu else None}
    out["read"] = [recorder_reads("gloo")] + ([recorder_reads("nccl")] if gpu else [])
    out["compare_us_per_cell_8_ranks_4_groups"] = round(compare_cost(), 2)
    out["hang_to_diagnosis"] = hang_to_diagnosis(gpu, args.rounds)
    print(json.dumps(out, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
