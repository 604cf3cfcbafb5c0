"""Cost of issue 28's evidence: path recording (which notebook lines each rank ran) on a small DDP
training loop, and the compile record (with and without reading the graphs' collectives).

    python benchmarks/bench_paths.py [--ranks 4] [--rounds 7] [--out benchmarks/results/paths.json]

* ``paths``: a 4-rank gloo pool runs the same DDP loop cell (20 steps of a 4-layer MLP, AdamW)
  with ``paths=True`` and without, alternated round by round; each rank's own cell duration (its
  ``duration``, not the round trip), median over ranks and rounds; the ratio of medians. On this
  machine's Python 3.11 the recorder is ``sys.settrace`` declining every frame but the notebook's;
  3.12+ uses ``sys.monitoring`` (not run here).
* ``compile``: the same pool compiles a small function afresh (``torch._dynamo.reset()`` first) in a
  cell without paths (the compile record only: reading dynamo's own metrics) and with paths (the
  structured-trace handler that reads each graph's collectives), alternated; and the compile record
  alone, read after a cell that compiled nothing (µs).

Reported, not asserted: figures to stdout and the JSON file; README.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

import distnb

SETUP = """
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
bp_model = DDP(nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)]))
bp_opt = torch.optim.AdamW(bp_model.parameters())
def bp_step(x):
    loss = bp_model(x).square().mean()
    if not torch.isfinite(loss):
        return None
    bp_opt.zero_grad()
    loss.backward()
    bp_opt.step()
    return loss
"""
LOOP = "for bp_i in range(20):\n    bp_loss = bp_step(torch.randn(16, 128))\n"
COMPILE = "torch._dynamo.reset()\nbp_f = torch.compile(lambda x: (x * 2).sin().sum(), backend='aot_eager')\nbp_f(torch.ones(64))\n"


def durations(pool: distnb.Pool, code: str, paths: bool) -> list[float]:
    res = pool.wait(pool.submit(code, paths=paths), timeout=300)
    assert res.ok, res.text()
    return [res[r].duration or 0.0 for r in res.ranks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/paths.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with distnb.launch(nproc=args.ranks, backend="gloo") as pool:
        assert pool.run(SETUP, timeout=300).ok
        durations(pool, LOOP, False), durations(pool, LOOP, True)  # warm both
        plain: list[float] = []
        traced: list[float] = []
        for i in range(args.rounds):
            first, second = (False, True) if i % 2 == 0 else (True, False)
            for paths in (first, second):
                (traced if paths else plain).extend(durations(pool, LOOP, paths))
        durations(pool, COMPILE, False)  # dynamo imported and warm
        bare: list[float] = []
        graphs: list[float] = []
        for i in range(args.rounds):
            for paths in ((False, True) if i % 2 == 0 else (True, False)):
                (graphs if paths else bare).extend(durations(pool, COMPILE, paths))
        nothing = durations(pool, "bp_x = 1", False)
        torch_version = pool.run("torch.__version__", 0).values[0]
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch_version},
        "ranks": args.ranks, "rounds": args.rounds,
        "loop": {"plain_ms": statistics.median(plain) * 1e3, "paths_ms": statistics.median(traced) * 1e3,
                 "ratio": statistics.median(traced) / statistics.median(plain)},
        "compile": {"record_only_ms": statistics.median(bare) * 1e3, "with_graphs_ms": statistics.median(graphs) * 1e3,
                    "ratio": statistics.median(graphs) / statistics.median(bare)},
        "trivial_cell_with_record_ms": statistics.median(nothing) * 1e3,
    }
    print(json.dumps(out, indent=1))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
