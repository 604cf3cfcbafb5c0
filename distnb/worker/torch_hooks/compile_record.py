"""What ``torch.compile`` did on this rank during a cell, from PyTorch's own records.

* ``torch._dynamo.utils._compilation_metrics``: one ``CompilationMetrics`` per frame compile
  (dynamo appends it when a frame's compile ends): the code compiled (name, file, line), its
  compile id (``frame/recompile``), why it recompiled (the guard that failed), graph breaks,
  whether it failed, the cache entries the frame now has, time spent.
* ``torch._dynamo.utils.counters["graph_break"]``: each graph break's reason, counted.
* the structured trace (``torch.__trace``, what ``TORCH_TRACE`` writes): its ``dynamo_output_graph``
  event carries each graph's code, in which the collectives dynamo captured are counted (a graph
  with an all_reduce one rank's compile dropped is exactly a desync). A handler on that logger turns
  every structured payload on (torch builds them at compile time only, but compiles get slower:
  benchmarks/bench_paths.py), so graphs are read only in cells recorded in detail (``--paths``).

Nothing here imports torch._dynamo: a rank that never compiles pays nothing (the first
``torch.compile`` imports it during a cell, and the record starts from empty then).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from distnb.worker.torch_hooks.imported import imported_module

__all__ = ["CompileRecorder"]

#: Collectives as dynamo's graphs spell them (functional collectives and the c10d ops they lower to).
#: (As calls: ``torch.ops._c10d_functional.all_reduce(l_x_, 'sum', '0')``.)
_COLLECTIVE = re.compile(r"torch\.ops\.(?:_c10d_functional|c10d_functional|c10d|_dtensor)\.(all_reduce|all_gather_into_tensor|"
                         r"reduce_scatter_tensor|all_to_all_single|broadcast|all_reduce_coalesced|all_gather_into_tensor_coalesced|"
                         r"reduce_scatter_tensor_coalesced|allreduce_|allgather_|reduce_scatter_|alltoall_base_|broadcast_)\b")
#: Compile events kept per cell (a loop recompiling on every step must not grow the reply without bound).
MAX_COMPILES = 64


class _Graphs(logging.Handler):
    """Counts the collectives in each graph dynamo outputs, by compile id."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.by_id: dict[str, list[str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        meta = getattr(record, "metadata", None)
        if not isinstance(meta, dict) or "dynamo_output_graph" not in meta:
            return
        payload = getattr(record, "payload", None) or ""
        # The graph's comments quote the source of each node (torch's own code too): calls only.
        code = "\n".join(line for line in payload.splitlines() if not line.lstrip().startswith("#"))
        ops = [op.rstrip("_") for op in _COLLECTIVE.findall(code)]
        if len(self.by_id) < 1000:
            self.by_id[f"{meta.get('frame_id')}/{meta.get('frame_compile_id')}"] = ops


class CompileRecorder:
    """Takes the compile records dynamo adds during a cell."""

    def __init__(self) -> None:
        self._last: Any = None  # the newest CompilationMetrics before the cell
        self._breaks: dict[str, int] = {}
        self._graphs: _Graphs | None = None
        self.on = False

    def start(self, graphs: bool = False) -> None:
        """Begin a cell; ``graphs``: read the collectives in the graphs it compiles (costlier)."""
        utils = imported_module("torch._dynamo.utils")
        self.on = True
        if graphs and self._graphs is None:
            self._graphs = _Graphs()
            logging.getLogger("torch.__trace").addHandler(self._graphs)  # no torch import: a logger by name
        if utils is None:
            self._last, self._breaks = None, {}
            return
        metrics = getattr(utils, "_compilation_metrics", None)
        self._last = metrics[-1] if metrics else None
        self._breaks = dict(utils.counters.get("graph_break", {}))

    def stop(self) -> dict[str, Any] | None:
        """The cell's compile record (None when nothing was compiled)."""
        if not self.on:
            return None
        record = self.snapshot()
        self.on = False
        if self._graphs is not None:  # payloads cost every compile: on for this cell only
            logging.getLogger("torch.__trace").removeHandler(self._graphs)
            self._graphs = None
        return record

    def snapshot(self) -> dict[str, Any] | None:
        utils = imported_module("torch._dynamo.utils")
        if utils is None:
            return None
        metrics = list(getattr(utils, "_compilation_metrics", ()))
        new = metrics
        if self._last is not None:
            at = next((i for i in range(len(metrics) - 1, -1, -1) if metrics[i] is self._last), None)
            new = metrics[at + 1:] if at is not None else metrics  # the deque let it go: all it holds are new
        graphs = self._graphs.by_id if self._graphs else {}
        compiles = []
        for m in new[-MAX_COMPILES:]:
            cid = str(getattr(m, "compile_id", "") or "")
            compiles.append({
                "id": cid,
                "name": getattr(m, "co_name", None),
                "file": getattr(m, "co_filename", None),
                "line": getattr(m, "co_firstlineno", None),
                "recompile": getattr(m, "recompile_reason", None),
                "fail": " ".join(str(x) for x in (getattr(m, "fail_type", None), getattr(m, "fail_reason", None)) if x) or None,
                "breaks": getattr(m, "num_graph_breaks", None),
                "ops": getattr(m, "graph_op_count", None),
                "entries": getattr(m, "cache_size", None),
                "seconds": getattr(m, "entire_frame_compile_time_s", None),
                "collectives": graphs.get(cid.split("-")[0].strip("[]")) if cid else None,
            })
        counts = dict(utils.counters.get("graph_break", {}))
        breaks = {reason: n - self._breaks.get(reason, 0) for reason, n in counts.items() if n > self._breaks.get(reason, 0)}
        if not compiles and not breaks:
            return None
        return {"compiles": compiles, "breaks": breaks, "more": max(0, len(new) - MAX_COMPILES)}
