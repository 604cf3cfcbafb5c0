"""Checksum speed: fingerprint throughput over 1 GiB of tensors, and per-cell memory sampling cost.

    python benchmarks/bench_checksum.py [--gib 1] [--out benchmarks/results/checksum.json]

Targets: fingerprints ≥ 2 GB/s on this CPU (≥ 100 GB/s on a GPU, without host copies); memory
sampling under 0.2 ms per cell.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from distnb.worker.checksum import checksum, fingerprint
from distnb.worker.memory import MemorySampler


def throughput(device: str, gib: float, repeats: int = 5) -> dict[str, float]:
    n = int(gib * (1 << 30)) // 4 // 16
    tensors = [torch.randn(n, device=device) for _ in range(16)]
    total = sum(t.numel() * t.element_size() for t in tensors)
    for t in tensors[:2]:
        fingerprint(t)  # warm-up (weights cached per device)
    runs = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for t in tensors:
            fingerprint(t)
        runs.append(time.perf_counter() - t0)
    small = torch.randn(16, device=device)
    t0 = time.perf_counter()
    for _ in range(1000):
        checksum(small)
    return {
        "device": device,
        "bytes": total,
        "fingerprint_gb_per_s": total / statistics.median(runs) / 1e9,
        "small_checksum_us": (time.perf_counter() - t0) / 1000 * 1e6,
        "threads": torch.get_num_threads(),
    }


def memory_sampling(n: int = 5000) -> float:
    sampler = MemorySampler()
    t0 = time.perf_counter()
    for _ in range(n):
        sampler.start()
        sampler.stop()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "checksum.json"))
    args = parser.parse_args()
    out: dict[str, object] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": sys.version.split()[0]}
    out["cpu"] = throughput("cpu", args.gib)
    print(json.dumps(out["cpu"]), flush=True)
    if torch.cuda.is_available():
        out["gpu"] = throughput("cuda", args.gib)
        print(json.dumps(out["gpu"]), flush=True)
    out["memory_sampling_us_per_cell"] = memory_sampling()
    print(json.dumps({"memory_sampling_us_per_cell": out["memory_sampling_us_per_cell"]}), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
