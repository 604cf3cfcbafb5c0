"""Time per rank for a cell run under ``torch.profiler`` (``%%on_ranks --profile``).

Each rank measures its own cell (worker/recorders/profiling.py): wall time, time inside collectives (the
backend's ``gloo:``/``nccl:`` spans, which last until the collective completes) and its top ops.
Waiting for peers comes from the ranks' arrivals at the cell's collectives (the Flight Recorder,
clocks aligned: :mod:`distnb.analysis.verdicts.stragglers`): time between a rank's arrival and the last one's.
Compute is the rest. Each rank starts the cell once every rank's profiler runs (a profiler's start
costs each rank a different time; unaligned, that would read as waiting). The ranks' Chrome traces
are merged into one file, one process row per rank.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from typing import Any

from distnb.cell_names import cell_name
from distnb.ranks import format_ranks

__all__ = ["ProfileReport", "RankTime", "merge_traces", "OP_SPREAD"]

#: An op whose self time differs this much between ranks (max/min) is flagged …
OP_SPREAD = 1.5
#: … when the difference is at least this many seconds.
OP_MIN_DIFF = 0.001


@dataclass
class RankTime:
    rank: int
    wall: float  # the cell's duration on the rank
    collectives: float  # inside collectives, waiting included
    waiting: float  # of which: waiting for the last peer to arrive

    @property
    def compute(self) -> float:
        return max(0.0, self.wall - self.collectives)


@dataclass
class ProfileReport:
    cell: int
    times: list[RankTime]
    ops: dict[int, list[dict[str, Any]]]  # rank → top ops (name, count, self_s, total_s)
    trace_path: str | None = None
    missing: dict[int, str] = field(default_factory=dict)  # rank → why it has no profile
    unaligned: list[int] = field(default_factory=list)  # ranks that started the cell before every profiler ran

    def flagged_ops(self) -> list[tuple[str, dict[int, float]]]:
        """Top ops whose self time differs between ranks: (name, rank → seconds)."""
        names = {o["name"] for ops in self.ops.values() for o in ops}
        out = []
        for name in sorted(names):
            per = {r: next((o["self_s"] for o in ops if o["name"] == name), 0.0) for r, ops in self.ops.items()}
            lo, hi = min(per.values()), max(per.values())
            if hi - lo >= OP_MIN_DIFF and (lo == 0 or hi / lo >= OP_SPREAD):
                out.append((name, per))
        out.sort(key=lambda item: -(max(item[1].values()) - min(item[1].values())))
        return out

    def text(self) -> str:
        lines = [f"profile of {cell_name(self.cell)} on {format_ranks([t.rank for t in self.times])}"]
        lines.append("  rank   wall (ms)  compute (ms)  collectives (ms)  of which waiting for peers (ms)")
        for t in self.times:
            lines.append(f"  {t.rank:>4}  {t.wall * 1000:>10.1f}  {t.compute * 1000:>12.1f}  {t.collectives * 1000:>16.1f}  "
                         f"{t.waiting * 1000:>31.1f}")
        if self.times:
            slowest = max(self.times, key=lambda t: t.compute)
            waits = [t for t in self.times if t is not slowest]
            if waits and slowest.compute > 0 and min(t.waiting for t in waits) > 0.2 * slowest.compute:
                lines.append(f"  rank {slowest.rank} computes longest ({slowest.compute * 1000:.0f} ms); the others wait for it.")
        merged: dict[str, list[float]] = {}
        for ops in self.ops.values():
            for o in ops:
                merged.setdefault(o["name"], []).append(o["self_s"])
        if merged:
            lines.append("  top ops by self time (median over ranks):")
            flagged = dict(self.flagged_ops())
            for name, vals in sorted(merged.items(), key=lambda kv: -sorted(kv[1])[len(kv[1]) // 2])[:8]:
                mark = ""
                if name in flagged:
                    per = flagged[name]
                    hi = max(per, key=lambda r: per[r])
                    mark = f"  ◀ differs: rank {hi} {per[hi] * 1000:.1f} ms, ranks' minimum {min(per.values()) * 1000:.1f} ms"
                lines.append(f"    {sorted(vals)[len(vals) // 2] * 1000:>9.2f} ms  {name}{mark}")
        if self.unaligned:
            lines.append(f"  {format_ranks(self.unaligned)} started the cell before every rank's profiler was running "
                         "(no store to meet on, or one still not running when the others gave up waiting): their waits at its "
                         "first collective include that start")
        for r, why in sorted(self.missing.items()):
            lines.append(f"  rank {r}: no profile ({why})")
        if self.trace_path:
            lines.append(f"  merged trace (one row per rank): {self.trace_path} — open it in https://ui.perfetto.dev or chrome://tracing")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    def plot(self) -> Any:
        """Stacked bars per rank: compute, collectives (transfer), waiting for peers."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7.5, 0.5 * len(self.times) + 1.2))
        ax = fig.add_subplot()
        ys = list(range(len(self.times)))
        compute = [t.compute * 1000 for t in self.times]
        transfer = [max(0.0, t.collectives - t.waiting) * 1000 for t in self.times]
        waiting = [t.waiting * 1000 for t in self.times]
        ax.barh(ys, compute, label="compute")
        ax.barh(ys, transfer, left=compute, label="collectives")
        ax.barh(ys, waiting, left=[c + x for c, x in zip(compute, transfer)], label="waiting for peers")
        ax.set_yticks(ys, [f"rank {t.rank}" for t in self.times])
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        ax.set_title(f"time per rank, {cell_name(self.cell)}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
        fig.tight_layout()
        return fig


def merge_traces(traces: dict[int, bytes], offsets: dict[int, float], path: str) -> str:
    """One Chrome trace from the ranks' (zlib'd) traces: each rank's events under process id =
    rank, named "rank N", moved onto the controller's clock (``offsets``: rank clock − ours, s)."""
    events: list[dict[str, Any]] = []
    base: float | None = None
    loaded = {}
    for r, packed in sorted(traces.items()):
        data = json.loads(zlib.decompress(packed))
        loaded[r] = data
        b = data.get("baseTimeNanoseconds", 0) / 1e9
        base = b if base is None else min(base, b)
    for r, data in loaded.items():
        # Kineto's ts: µs after baseTimeNanoseconds on the rank's wall clock.
        shift = ((data.get("baseTimeNanoseconds", 0) / 1e9 - (base or 0.0)) - offsets.get(r, 0.0)) * 1e6
        for e in data.get("traceEvents", []):
            e = dict(e, pid=r)
            if "ts" in e:
                e["ts"] = e["ts"] + shift
            if e.get("ph") == "M" and e.get("name") == "process_name":
                e["args"] = {"name": f"rank {r}"}
            elif e.get("ph") == "M" and e.get("name") == "process_sort_index":
                e["args"] = {"sort_index": r}
            events.append(e)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "baseTimeNanoseconds": int((base or 0.0) * 1e9)}, f)
    return path
