"""A chatty session: the notebook process's memory over many cells that each print a lot on every
rank (a training loop's log, say). Each result keeps up to a MiB per rank and stream; the session
log keeps the last 100 full results, and (since the release that added this benchmark) at most
64 MiB of output in all.

    python benchmarks/bench_chatty.py [--ranks 8] [--cells 150] [--per-rank 1000000] [--out benchmarks/results/chatty.json]

Run it with PYTHONPATH pointing at another checkout to measure that version the same way.
Reported, not asserted: figures go to stdout and the JSON file; README.md quotes them.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path

import distnb


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--cells", type=int, default=150)
    parser.add_argument("--per-rank", type=int, default=1_000_000, help="characters each rank prints per cell")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "chatty.json"))
    args = parser.parse_args()

    # One print of many lines: a log of 100-character lines, as a training loop writes it.
    line = "y" * 99
    code = f"print(({line!r} + '\\n') * {args.per_rank // 100}, end='')"
    samples = []
    with distnb.launch(nproc=args.ranks, backend="gloo") as pool:
        gc.collect()
        base = rss_mib()
        start = time.monotonic()
        for i in range(1, args.cells + 1):
            result = pool.run(code)
            assert result.ok, result.text()
            if i % 10 == 0:
                gc.collect()
                held = sum(len(r.stdout) + len(r.stderr) for c in pool.history if isinstance(c, distnb.CellResult) for r in c.results.values())
                samples.append({"cells": i, "rss_mib": round(rss_mib() - base, 1), "held_mib": round(held / 2**20, 1)})
                print(f"after {i:4d} cells: notebook process +{samples[-1]['rss_mib']:7.1f} MiB, results hold "
                      f"{samples[-1]['held_mib']:7.1f} MiB of output", flush=True)
        elapsed = time.monotonic() - start
    report = {
        "distnb": distnb.__file__,
        "python": platform.python_version(),
        "ranks": args.ranks,
        "cells": args.cells,
        "per_rank_chars": args.per_rank,
        "seconds": round(elapsed, 1),
        "samples": samples,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}))


if __name__ == "__main__":
    main()
