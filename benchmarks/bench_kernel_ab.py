"""Two versions of distnb side by side on the notebook path: a real ipykernel for each, each with
its own pool of N ranks, their cells interleaved (A, B, A, B …, who goes first rotating) so that
this VM's drift hits both alike. Each version's ranks import its own tree (the launcher puts it
first on their path).

    git worktree add /tmp/distnb-before <commit>
    python benchmarks/bench_kernel_ab.py --before /tmp/distnb-before [--ranks 8] [--cells 150]

Reports each version's ``%%on_ranks`` median and p99 and its ratio to the kernel's own floor
(``x = 1`` in the same kernel), and after/before: reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernel import Kernel, pct  # noqa: E402

HERE = Path(__file__).resolve().parent.parent


def start(tree: Path, ranks: int) -> Kernel:
    os.environ["PYTHONPATH"] = str(tree)  # the kernel imports this tree's distnb (its ranks follow it)
    k = Kernel()
    where = k.execute("import distnb; print(distnb.__file__)")[2].strip()
    assert where.startswith(str(tree)), (where, tree)
    k.execute(f"%load_ext distnb\n%dist_launch -n {ranks} --backend gloo --no-spares")
    k.refresh()
    return k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="A checkout of the version to compare with.")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--cells", type=int, default=150)
    parser.add_argument("--out", type=Path, default=HERE / "benchmarks" / "results" / "kernel_ab.json")
    args = parser.parse_args()
    kernels = {"before": start(args.before.resolve(), args.ranks), "after": start(HERE, args.ranks)}
    kinds = {"floor": "x = 1", "on_ranks": "%%on_ranks\nx = 1"}
    times: dict[str, dict[str, list[float]]] = {v: {k: [] for k in kinds} for v in kernels}
    try:
        for _ in range(20):  # warm-up
            for k in kernels.values():
                for code in kinds.values():
                    k.execute(code)
        order = [(v, name) for v in kernels for name in kinds]
        for i in range(args.cells):
            for v, name in order[i % len(order):] + order[: i % len(order)]:
                times[v][name].append(kernels[v].execute(kinds[name])[0])
    finally:
        for k in kernels.values():
            try:
                k.execute("%dist_shutdown")
            finally:
                k.close()
    result: dict[str, object] = {"ranks": args.ranks, "cells": args.cells, "python": platform.python_version(),
                                 "before_tree": str(args.before), "when": time.strftime("%Y-%m-%d %H:%M")}
    for v, by_kind in times.items():
        med = {name: statistics.median(t) * 1e3 for name, t in by_kind.items()}
        result[v] = {"on_ranks_median_ms": med["on_ranks"], "on_ranks_p99_ms": pct(by_kind["on_ranks"], 0.99) * 1e3,
                     "floor_median_ms": med["floor"], "on_ranks_over_floor": med["on_ranks"] / med["floor"]}
    b, a = result["before"], result["after"]
    assert isinstance(a, dict) and isinstance(b, dict)
    result["after_over_before"] = a["on_ranks_median_ms"] / b["on_ranks_median_ms"]
    print(json.dumps(result, indent=2))
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
