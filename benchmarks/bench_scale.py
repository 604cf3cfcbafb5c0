"""The controller at scale: every notebook-side path timed with synthetic ranks (8 … 4,096).

    python benchmarks/bench_scale.py [--sizes 8,64,256,1024,4096] [--out benchmarks/results/scale.json]

No process is started: the ranks are tests/synthetic.py's, which answer the controller's requests
through the same seam the tests use (messages in, the magics' own calls on top), so what is timed
is the notebook's own work — CPU seconds of this process (``time.process_time``), which the VM's
drift touches far less than wall time. Each path:

* ``watch``: one tick of the hang watch (``Pool.watch(...).look()``, what ``%%on_ranks`` runs once
  a second) on a healthy running cell that issued 50 collectives: the tick that sees new ones
  (``s``, with the straggler check) and one that sees none (``idle_s``).
* ``diagnose``: ``Pool.diagnose`` on that cell: stacks and logs asked of every rank, judged.
* ``timeline``: ``%dist_timeline`` text (and its plot, drawn, not rendered to PNG).
* ``hang``: the diagnosis of a hang where one rank never entered the 51st collective.
* ``collectives``: ``%dist_collectives`` text and HTML (sizes in characters).
* ``stacks``: ``%dist_stacks`` text during that hang.
* ``memory``: ``%dist_memory`` text.
* ``output``: a cell where each rank prints a distinct line: its messages into the tracker, the
  finished cell's text and its saved HTML (sizes in characters).
* ``trivial``: a cell with no output: its messages and its finished view.
* ``round``: one round of collective-log replies (bytes on the wire, the first round carries each
  rank's groups, later ones don't).

A path is skipped at the next size once it took more than ``--budget`` seconds (its growth then
says enough). The growth exponent is the log-log slope between the two largest sizes measured.
Reported, not asserted: correctness of the summarised views lives in tests/analysis/test_scale.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from distnb.display.html import collectives_html  # noqa: E402
from distnb.display.static import StaticCell  # noqa: E402
from distnb.services.watch import CellWatch  # noqa: E402
from distnb.wire.peers import control_identity  # noqa: E402
from distnb.wire.protocol import Msg  # noqa: E402

from synthetic import SyntheticPool, healthy_cell, hung_cell  # noqa: E402


def cpu(fn: Callable[[], Any], repeat: int = 1) -> tuple[float, Any]:
    """Median CPU seconds of ``fn`` over ``repeat`` runs, and its last result."""
    times, out = [], None
    for _ in range(repeat):
        gc.collect()  # as timeit does: a collection of the setup's garbage is not the path's cost
        gc.disable()
        try:
            t = time.process_time()
            out = fn()
            times.append(time.process_time() - t)
        finally:
            gc.enable()
    times.sort()
    return times[len(times) // 2], out


def measure(world: int, skip: set[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    repeat = 3 if world <= 256 else 1

    if "trivial" not in skip:
        pool = SyntheticPool(world)

        def trivial() -> int:
            result = pool.cell("x = 1")
            for r in range(world):
                pool.done(r, result)
            view = StaticCell(result)
            return len(view.text()) + len(view.html())

        t, size = cpu(trivial, repeat)
        out["trivial"] = {"s": t, "chars": size}

    if "output" not in skip:
        pool = SyntheticPool(world)

        def output() -> tuple[int, int, int]:
            result = pool.cell("print(f'step 1 loss {loss:.4f} on {socket.gethostname()}')")
            for r in range(world):
                pool.output(r, f"step 1 loss {2.31 + (r % 97) / 2000:.4f} on node{r // 8}\n")
                pool.done(r, result)
            view = StaticCell(result)
            text, html = view.text(), view.html()
            return len(text), len(html), text.count("\n") + 1

        t, (chars, html_chars, lines) = cpu(output, repeat)
        out["output"] = {"s": t, "chars": chars, "html_chars": html_chars, "lines": lines}

    pool = SyntheticPool(world)
    result = healthy_cell(pool, steps=50)
    if "round" not in skip:
        before = pool.reply_bytes
        t, _ = cpu(lambda: pool.inspector.collectives(refresh=True))
        first = pool.reply_bytes - before
        before = pool.reply_bytes
        t2, _ = cpu(lambda: pool.inspector.collectives(refresh=True))
        later = pool.reply_bytes - before
        # The same round as before issue 27: every reply carrying every group's member list.
        before = pool.reply_bytes
        t3, _ = cpu(lambda: pool.tracker.requests.ask(control_identity, list(range(world)), {"t": Msg.COLLECTIVES, "since": 10**9,
                                                                                          "calls_since": 10**9, "groups": True}, 5.0, partial=True))
        out["round"] = {"s": t2, "first_s": t, "bytes_first": first, "bytes": later, "with_members_s": t3,
                        "bytes_with_members": pool.reply_bytes - before}
    if "watch" not in skip:
        # The tick that sees new collectives (it runs the straggler check), then a tick with none
        # new; on a cell just built, so its open collectives are fresh as a healthy cell's are.
        fresh = SyntheticPool(world, hang_after=60.0)  # building 4,096 ranks takes longer than 1 s
        watch = CellWatch(fresh.tracker, fresh.inspector, healthy_cell(fresh, steps=50), fresh.config.hang_after)
        t, diag = cpu(watch.look)
        t_idle, _ = cpu(watch.look, 3)
        out["watch"] = {"s": t, "idle_s": t_idle, "said": diag.kind if diag else None, "full_looks": watch.full_looks}
    if "diagnose" not in skip:
        t, diag = cpu(lambda: pool.inspector.diagnose(result), repeat)
        out["diagnose"] = {"s": t, "kind": diag.kind}
    if "timeline" not in skip:
        def timeline() -> int:
            report = pool.inspector.stragglers()
            text = report.text()
            report.plot()
            return len(text)

        t, chars = cpu(timeline, repeat)
        out["timeline"] = {"s": t, "chars": chars}
    if "collectives" not in skip:
        def collectives() -> tuple[int, int]:
            report = pool.inspector.collectives(refresh=False)
            return len(report.text()), len(collectives_html(report))

        t, (chars, html_chars) = cpu(collectives, repeat)
        out["collectives"] = {"s": t, "chars": chars, "html_chars": html_chars}
    if "memory" not in skip:
        t, chars = cpu(lambda: len(pool.inspector.memory().text()), repeat)
        out["memory"] = {"s": t, "chars": chars}

    pool = SyntheticPool(world)
    result = hung_cell(pool, steps=50, odd=min(17, world - 1))
    if "hang" not in skip:
        t, diag = cpu(lambda: pool.inspector.diagnose(result), repeat)
        out["hang"] = {"s": t, "state": str(diag.state), "kind": diag.kind, "culprits": diag.culprits, "lines": diag.text().count("\n") + 1}
    if "stacks" not in skip:
        t, chars = cpu(lambda: len(pool.inspector.stacks().text()), repeat)
        out["stacks"] = {"s": t, "chars": chars}
    return out


def growth(rows: dict[int, dict[str, dict[str, Any]]], path: str) -> float | None:
    sizes = [n for n in sorted(rows) if path in rows[n]]
    if len(sizes) < 2:
        return None
    a, b = sizes[-2], sizes[-1]
    ta, tb = max(rows[a][path]["s"], 1e-4), max(rows[b][path]["s"], 1e-4)
    return round(math.log(tb / ta) / math.log(b / a), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="8,64,256,1024,4096")
    parser.add_argument("--budget", type=float, default=20.0, help="Skip a path at larger sizes once it took this long (s).")
    parser.add_argument("--out", default="benchmarks/results/scale.json")
    args = parser.parse_args()
    rows: dict[int, dict[str, dict[str, Any]]] = {}
    skip: set[str] = set()
    # Once per kernel, not per size: the first plot imports matplotlib and loads its fonts (about
    # 0.8 s here), which a run of one large size alone would otherwise count as that size's cost.
    measure(8, set())
    for world in [int(s) for s in args.sizes.split(",")]:
        rows[world] = measure(world, skip)
        for path, figures in rows[world].items():
            if figures["s"] > args.budget:
                skip.add(path)
        print(f"{world:>5} ranks: " + "  ".join(f"{p} {f['s'] * 1000:.1f} ms" for p, f in rows[world].items()), flush=True)
        if "watch" in rows[world] and "round" in rows[world]:
            w, r = rows[world]["watch"], rows[world]["round"]
            print(f"       a watch tick with nothing new {w['idle_s'] * 1000:.1f} ms; a round of replies {r['bytes'] / 1024:.0f} KiB, "
                  f"{r['bytes_with_members'] / 1024:.0f} KiB ({r['with_members_s'] * 1000:.0f} ms) when each carried every member list",
                  flush=True)
    paths = sorted({p for r in rows.values() for p in r})
    fits = {p: growth(rows, p) for p in paths}
    print("growth (log-log slope between the two largest sizes): " + ", ".join(f"{p} N^{g}" for p, g in fits.items() if g is not None))
    with open(args.out, "w") as f:
        json.dump({"machine": platform.node(), "python": platform.python_version(), "sizes": rows, "growth": fits}, f, indent=1)


if __name__ == "__main__":
    main()
