"""Cost of ``%%on_ranks --numerics`` on a small DDP step and a small tensor-parallel step: each cell
run plain, with every op recorded (``numerics=True``) and with the collectives only
(``numerics="collectives"``), interleaved (the order rotates each round, so the machine's drift hits
all three alike); and the record's size on a long cell, which the op limit keeps bounded.

    python benchmarks/bench_numerics.py [--rounds 10] [--out benchmarks/results/numerics.json]

Reported, not asserted. Per round: the cell's time on the slowest rank and the wall time of the
run as the notebook waits for it (that plus the larger reply); ratios are medians of per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import statistics
import time

import torch

import distnb

DDP_SETUP = """
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
ddp = DDP(nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(4)]))
ddp_opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
ddp_batch = torch.randn(32, 64)
"""
DDP_STEP = "ddp(ddp_batch).pow(2).mean().backward()\nddp_opt.step()\nddp_opt.zero_grad()\n"
TP_SETUP = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
tp_mesh = init_device_mesh('cpu', (4,), mesh_dim_names=('tp',))
torch.manual_seed(0)
tp = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(4)])
for block in tp:
    parallelize_module(block, tp_mesh, {'0': ColwiseParallel(), '2': RowwiseParallel()})
tp_opt = torch.optim.SGD(tp.parameters(), lr=0.01)
tp_batch = torch.randn(32, 64)
"""
TP_STEP = "tp(tp_batch).pow(2).mean().backward()\ntp_opt.step()\ntp_opt.zero_grad()\n"
LONG = "for _ in range({steps}):\n    ddp(ddp_batch).pow(2).mean().backward()\n    ddp_opt.step()\n    ddp_opt.zero_grad()\n"
MODES: tuple[bool | str, ...] = (False, True, "collectives")


def _one(pool: distnb.Pool, code: str, numerics: bool | str) -> tuple[float, float, distnb.CellResult]:
    t0 = time.perf_counter()
    res = pool.run(code, timeout=300, numerics=numerics)
    wall = time.perf_counter() - t0
    assert res.ok, res.text()
    return max(r.duration or 0.0 for r in res.results.values()), wall, res


def _compare(pool: distnb.Pool, code: str, rounds: int) -> dict[str, object]:
    for mode in MODES:  # warm-up: first-step allocations, the record's lazy imports
        _one(pool, code, mode)
    times: dict[str, list[tuple[float, float]]] = {str(m): [] for m in MODES}
    for i in range(rounds):
        order = MODES[i % 3:] + MODES[:i % 3]
        for mode in order:
            rank_s, wall, _ = _one(pool, code, mode)
            times[str(mode)].append((rank_s, wall))
    res = _one(pool, code, True)[2]
    report = res.numerics()
    rec = res.results[0].numerics or {}
    plain = times["False"]
    return {
        "ops_per_rank": len(rec.get("ops") or []),
        "record_bytes_rank0": len(pickle.dumps(rec)),
        "divergence": report.first is not None,
        "rank_s_median": {k: round(statistics.median(t[0] for t in v), 5) for k, v in times.items()},
        "wall_s_median": {k: round(statistics.median(t[1] for t in v), 5) for k, v in times.items()},
        "ratio_rank_time": {k: round(statistics.median(c[0] / p[0] for p, c in zip(plain, v)), 3) for k, v in times.items() if k != "False"},
        "ratio_wall_time": {k: round(statistics.median(c[1] / p[1] for p, c in zip(plain, v)), 3) for k, v in times.items() if k != "False"},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--long-steps", type=int, default=400)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with distnb.Pool(nproc=4) as pool:
        assert pool.run(DDP_SETUP, timeout=180).ok and pool.run(TP_SETUP, timeout=180).ok
        ddp = _compare(pool, DDP_STEP, args.rounds)
        tp = _compare(pool, TP_STEP, args.rounds)
        _, wall, long = _one(pool, LONG.format(steps=args.long_steps), True)
        rec = long.results[0].numerics or {}
        bounded = {"steps": args.long_steps, "ops_run_rank0": rec.get("total"), "ops_kept_rank0": len(rec.get("ops") or []),
                   "limit": rec.get("limit"), "record_bytes_rank0": len(pickle.dumps(rec)), "wall_s": round(wall, 3),
                   "rss_peak_mib_rank0": round(((long.results[0].memory or {}).get("rss_peak") or 0) / 2**20, 1),
                   "note": long.numerics().notes[:1]}
    out = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}; 4 gloo ranks on one machine ({__import__('os').cpu_count()} cores)",
        "torch": torch.__version__,
        "rounds": args.rounds,
        "ddp_step": {"step": "DDP of 4 blocks Linear(64,256)-ReLU-Linear(256,64), Adam, batch 32", **ddp},
        "tp_step": {"step": "the same blocks tensor parallel over 4 ranks (Colwise, Rowwise), SGD, batch 32", **tp},
        "long_cell": bounded,
    }
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
