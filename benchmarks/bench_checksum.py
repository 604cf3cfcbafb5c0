"""Checksum speed: fingerprint throughput over 1 GiB of float32 tensors, per-call overhead, and the
per-cell memory-sampling cost.

    python benchmarks/bench_checksum.py [--gib 1] [--repeats 5] [--out benchmarks/results/checksum.json]

Reported, not asserted. Targets: fingerprints ≥ 2 GB/s on one CPU thread (ranks run with
OMP_NUM_THREADS=1), bandwidth-bound on a GPU without host copies; memory sampling under 0.2 ms
per cell. Throughput is the median of ``--repeats`` passes over 16 tensors of 1/16 GiB each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import torch

from distnb.worker.recorders.checksum import checksum
from distnb.worker.recorders.fingerprint import fingerprint
from distnb.worker.recorders.memory_sampler import MemorySampler


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _gbps(fn: Callable[[Any], Any], tensors: list[torch.Tensor], device: str, repeats: int) -> float:
    total = sum(t.numel() * t.element_size() for t in tensors)
    fn(tensors[0])  # warm-up: weights cached per device, allocator primed
    runs = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for t in tensors:
            fn(t)
        _sync(device)
        runs.append(time.perf_counter() - t0)
    return total / statistics.median(runs) / 1e9


def _per_call_us(fn: Callable[[Any], Any], t: torch.Tensor, n: int = 2000) -> float:
    fn(t)
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n // 5):
            fn(t)
        runs.append((time.perf_counter() - t0) / (n // 5))
    return statistics.median(runs) * 1e6


def bench(device: str, gib: float, repeats: int, threads: int | None) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    n = int(gib * (1 << 30)) // 4 // 16
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = [torch.randn(n, device=device, generator=gen) for _ in range(16)]
    small = torch.randn(16, device=device)
    row = {
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads() if device == "cpu" else None,
        "bytes": sum(t.numel() * 4 for t in tensors),
        "tensors": len(tensors),
        "fingerprint_gb_per_s": _gbps(fingerprint, tensors, device, repeats),
        "checksum_gb_per_s": _gbps(checksum, tensors, device, max(1, repeats // 2)),  # + sum/norm/min/max/NaN
        "small_fingerprint_us": _per_call_us(fingerprint, small),
        "small_checksum_us": _per_call_us(checksum, small),
    }
    module = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(50)]).to(device)  # 100 parameters
    t0 = time.perf_counter()
    checksum(module)
    _sync(device)
    row["module_100_params_ms"] = (time.perf_counter() - t0) * 1e3
    del tensors
    return row


def memory_sampling(n: int = 5000) -> float:
    sampler = MemorySampler()
    t0 = time.perf_counter()
    for _ in range(n):
        sampler.start()
        sampler.stop()
    return (time.perf_counter() - t0) / n * 1e6


def _line(row: dict[str, Any]) -> str:
    where = f"{row['device']}" + (f", {row['threads']} thread{'s' * (row['threads'] != 1)}" if row["threads"] else "")
    return (f"checksum [{where}]: fingerprint {row['fingerprint_gb_per_s']:.2f} GB/s, full checksum "
            f"{row['checksum_gb_per_s']:.2f} GB/s over {row['bytes'] / 2**30:.2g} GiB; small tensor "
            f"{row['small_fingerprint_us']:.0f} µs fingerprint / {row['small_checksum_us']:.0f} µs checksum; "
            f"100-parameter module {row['module_100_params_ms']:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "checksum.json"))
    args = parser.parse_args()
    out: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "load_average": os.getloadavg(),  # other work on the machine skews CPU figures
        "runs": [],
    }
    all_threads = torch.get_num_threads()
    for threads in sorted({1, all_threads}):  # 1: what a rank gets (OMP_NUM_THREADS=1)
        row = bench("cpu", args.gib, args.repeats, threads)
        out["runs"].append(row)
        print(_line(row), flush=True)
    torch.set_num_threads(all_threads)
    if torch.cuda.is_available():
        row = bench("cuda", args.gib, args.repeats, None)
        out["runs"].append(row)
        print(_line(row), flush=True)
    out["memory_sampling_us_per_cell"] = memory_sampling()
    print(f"memory sampling: {out['memory_sampling_us_per_cell']:.1f} µs per cell", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
