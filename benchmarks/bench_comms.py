"""Cost of ``%%on_ranks --comms`` on a small FSDP2 + tensor-parallel step: the same cell run plain
and under the accounting (PyTorch's CommDebugMode, distnb's group and bytes per collective, the
redistribute wrapper), interleaved pair by pair so the machine's drift hits both alike.

    python benchmarks/bench_comms.py [--pairs 20] [--out benchmarks/results/comms.json]

Reported, not asserted. Two figures per pair: the cell's time on the slowest rank (what the
accounting adds where it runs) and the wall time of ``pool.run`` as the notebook waits for it
(that plus the larger reply). The quoted ratio is the median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import distnb

SETUP = """
from torch.distributed.device_mesh import init_device_mesh
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(4)])
for block in model:
    parallelize_module(block, mesh['tp'], {'0': ColwiseParallel(), '2': RowwiseParallel()})
    fully_shard(block, mesh=mesh['dp'])
fully_shard(model, mesh=mesh['dp'])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batch = torch.randn(32, 64)
"""
STEP = "loss = model(batch).pow(2).mean()\nloss.backward()\nopt.step()\nopt.zero_grad()\n"


def _one(pool: distnb.Pool, comms: bool) -> tuple[float, float]:
    t0 = time.perf_counter()
    res = pool.wait(pool.submit(STEP, comms=comms), timeout=120)
    wall = time.perf_counter() - t0
    assert res.ok, res.text()
    return max(r.duration or 0.0 for r in res.results.values()), wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with distnb.Pool(nproc=4) as pool:
        assert pool.run(SETUP, timeout=180).ok
        for _ in range(3):  # warm-up: first-step allocations, lazy imports of the debug mode
            _one(pool, False)
            _one(pool, True)
        plain, counted = [], []
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {c: _one(pool, c) for c in order}
            plain.append(got[False])
            counted.append(got[True])
        report = pool.wait(pool.submit(STEP, comms=True), timeout=120).comms()
    rank_ratio = statistics.median(c[0] / p[0] for p, c in zip(plain, counted))
    wall_ratio = statistics.median(c[1] / p[1] for p, c in zip(plain, counted))
    out = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}; 4 gloo ranks on one machine",
        "torch": torch.__version__,
        "step": "4 blocks of Linear(64,256)-ReLU-Linear(256,64), tensor parallel over tp=2, FSDP2 over dp=2, batch 32",
        "pairs": args.pairs,
        "rank_s_median": {"plain": statistics.median(p[0] for p in plain), "comms": statistics.median(c[0] for c in counted)},
        "wall_s_median": {"plain": statistics.median(p[1] for p in plain), "comms": statistics.median(c[1] for c in counted)},
        "ratio_rank_time": round(rank_ratio, 3),
        "ratio_wall_time": round(wall_ratio, 3),
        "collectives_per_step": sum(r.usual[0] for r in report.rows),
        "redistributes_per_step": sum(max(v.values(), default=0) for _, v in report.redistributes),
    }
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
