"""Per-rank memory per cell, the report, imbalance flags and plots (CPU; CUDA paths marked gpu)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import threading
import time
import timeit
import types

import pytest

import distnb
from distnb.analysis.reports.memory import MemoryReport, imbalance, imbalances, memory_line
from distnb.worker.recorders import memory_sampler
from distnb.worker.recorders.memory_sampler import MemorySampler

pytestmark = pytest.mark.timeout(120)
MB = 1 << 20


def test_sampler_measures_a_cells_peak_in_process() -> None:
    sampler = MemorySampler()
    sampler.start()
    buf = bytearray(200 * MB)  # touched: bytearray zero-fills
    del buf
    sample = sampler.stop()
    assert sample["rss_peak"] - sample["rss_start"] >= 190 * MB
    sampler.start()
    assert sampler.stop()["rss_peak"] - sample["rss_start"] < 100 * MB  # the peak was reset


_CHILD = """
import json, sys
from distnb.worker.recorders import memory_sampler
from distnb.worker.recorders.memory_sampler import MemorySampler
sampler = MemorySampler()
sampler.start()
print(json.dumps(sampler.stop()))
"""

_PARENT = """
import subprocess, sys
blob = bytearray(300 << 20)
blob[::4096] = b"\\1" * len(blob[::4096])  # touch every page: 300 MB resident
del blob
# Spawned the way subprocess does by default (vfork + exec): the child's ru_maxrss starts at this
# process's 300 MB peak and keeps it for life; clear_refs does not reset that.
sys.exit(subprocess.run([sys.executable, "-c", sys.argv[1]]).returncode)
"""


@pytest.mark.timeout(60)
def test_peak_is_this_cells_not_inherited_at_exec() -> None:
    out = subprocess.run([sys.executable, "-c", _PARENT, _CHILD], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    sample = json.loads(out.stdout)
    assert sample["rss_peak_is_cell"]
    assert sample["rss_peak"] < sample["rss"] + 20 * MB, f"the child reports its parent's peak: {sample}"


def test_sampling_is_cheap() -> None:
    sampler = MemorySampler()
    # The best of several rounds: the machine may be busy, but the cost itself must stay small.
    per_cell = min(timeit.repeat(lambda: (sampler.start(), sampler.stop()), number=200, repeat=5)) / 200
    assert per_cell < 200e-6, f"sampling memory costs {per_cell * 1e6:.0f} µs per cell"


class _FakeCuda:
    """torch.cuda's per-thread current device, and per-device counters."""

    def __init__(self) -> None:
        self._tls = threading.local()
        self.asked: list[int] = []

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 2

    def current_device(self) -> int:
        return getattr(self._tls, "device", 0)

    def set_device(self, device: int) -> None:
        self._tls.device = device

    def reset_peak_memory_stats(self, device: int) -> None:
        self.asked.append(device)

    def memory_allocated(self, device: int) -> int:
        self.asked.append(device)
        return (device + 1) * MB

    memory_reserved = max_memory_allocated = memory_allocated

    def memory_stats(self, device: int) -> dict[str, int]:
        self.asked.append(device)
        self.peak = max(getattr(self, "peak", 0), self.memory_allocated(device))
        return {"allocated_bytes.all.current": (device + 1) * MB, "reserved_bytes.all.current": (device + 1) * MB,
                "allocated_bytes.all.peak": self.peak, "reserved_bytes.all.peak": self.peak}


def _on_another_thread(fn):
    out: list = []
    worker = threading.Thread(target=lambda: out.append(fn()))
    worker.start()
    worker.join(10)
    return out[0]


def test_cuda_queries_name_the_ranks_device_from_any_thread(monkeypatch) -> None:
    """%dist_memory is answered on the control thread, whose CUDA current device is 0."""
    cuda = _FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setitem(sys.modules, "torch.cuda", cuda)
    monkeypatch.setattr("distnb.worker.recorders.memory_sampler.MemorySampler._nvml_handle", lambda self, cuda: None)
    monkeypatch.setattr("distnb.worker.recorders.memory_sampler._peaks", memory_sampler._UserPeaks())
    # A cell thread bound to device 1 (as the rank does by LOCAL_RANK); the control thread asks.
    sampler = MemorySampler(local_rank=1)
    cuda.set_device(1)
    sampler.start()
    cuda.asked.clear()
    live = _on_another_thread(sampler.stop)
    assert live["cuda_allocated"] == 2 * MB and set(cuda.asked) == {1} and live["cuda_device"] == 1
    # Asked before any cell sampled CUDA: the rank's LOCAL_RANK, not the asking thread's device 0.
    assert _on_another_thread(MemorySampler(local_rank=1).stop)["cuda_device"] == 1
    # Set explicitly (the rank does, after binding its device).
    assert _on_another_thread(MemorySampler(local_rank=0, device=1).stop)["cuda_device"] == 1
    # The cell thread follows a cell that switches devices.
    cuda.set_device(0)
    assert sampler.stop()["cuda_device"] == 0 and _on_another_thread(sampler.stop)["cuda_device"] == 0


def test_per_cell_peak_resets_leave_the_users_own_peak_reading_alone() -> None:
    """distnb resets the allocator's peak at each cell start; the user's max_memory_allocated()
    still answers the peak since *their* last reset (or the process start)."""
    stats = {"allocated_bytes.all.peak": 0, "reserved_bytes.all.peak": 0}
    resets: list[object] = []
    cuda = types.SimpleNamespace(
        memory_stats=lambda dev=None: dict(stats),
        reset_peak_memory_stats=lambda dev=None: (resets.append(dev), stats.update({k: 0 for k in stats})),
        _utils=types.SimpleNamespace(_get_device_index=lambda d, optional=True: 0 if d is None else int(d)),
    )
    peaks = memory_sampler._UserPeaks()

    def cell_start() -> None:  # what MemorySampler.start does
        peaks.carry(0, cuda.memory_stats(0))
        peaks.install(cuda)
        peaks.raw_reset(0)

    cell_start()
    stats["allocated_bytes.all.peak"] = 700 * MB  # cell 1 peaks at 700 MiB
    cell_start()
    stats["allocated_bytes.all.peak"] = 100 * MB  # cell 2 only at 100
    assert cuda.max_memory_allocated() == 700 * MB  # the user's reading spans both cells
    assert cuda.memory_stats(0)["allocated_bytes.all.peak"] == 100 * MB  # distnb's per-cell figure
    cuda.reset_peak_memory_stats()  # the user's own reset starts their window afresh
    assert cuda.max_memory_allocated() == 0 and resets[-1] is None
    cell_start()
    stats["allocated_bytes.all.peak"] = 50 * MB
    assert cuda.max_memory_allocated(0) == 50 * MB


def test_imbalance_needs_ratio_and_absolute_gap() -> None:
    base = {r: {"rss_peak": 200 * MB} for r in range(4)}
    assert imbalance(base) == []
    base[3] = {"rss_peak": 390 * MB}
    assert imbalance(base) == ["rank 3 peaks at 1.9× the median RSS peak of the others (390 MiB vs 200 MiB)"]
    small = {0: {"rss_peak": 1 * MB}, 1: {"rss_peak": 10 * MB}}
    assert imbalance(small) == []  # 10× but only 9 MB apart: noise


def test_rss_peaks_are_compared_above_what_every_rank_starts_with() -> None:
    # A CUDA build of torch holds ~490 MiB in every process before any user code: 200 MiB more on
    # one rank is 1.4x in all, and all of what the cell added.
    samples = {0: {"rss_start": 487 * MB, "rss_peak": 488 * MB}, 1: {"rss_start": 487 * MB, "rss_peak": 688 * MB}}
    assert imbalance(samples) == ["rank 1 peaks at 688 MiB, 200 MiB above the median RSS peak of the others (488 MiB)"]
    # Alike above the floor: nothing, however large the floor.
    alike = {r: {"rss_start": 2000 * MB, "rss_peak": (2100 + 10 * r) * MB} for r in range(4)}
    assert imbalance(alike) == []
    # A rank that started the cell higher (it kept 1 GiB from an earlier cell) still stands out.
    kept = {r: {"rss_start": 500 * MB, "rss_peak": 520 * MB} for r in range(3)}
    kept[2] = {"rss_start": 1500 * MB, "rss_peak": 1520 * MB}
    assert [f.rank for f in imbalances(kept)] == [2]


def test_what_the_c_allocator_keeps_is_not_an_imbalance() -> None:
    # Seen in CI: two identical ranks freeing 10 MB tensors 50 times; one peaked 86 MiB higher
    # (glibc kept freed blocks), 3.3x the other's growth above the floor. Noise, not a leak ...
    noise = {0: {"rss_start": 330 * MB, "rss_peak": 453 * MB}, 1: {"rss_start": 331 * MB, "rss_peak": 367 * MB}}
    assert imbalance(noise) == []
    # ... while the same gap in CUDA's exact counts of live tensors is evidence.
    cuda = {r: {"rss_peak": 400 * MB, "cuda_peak": (s["rss_peak"] - 300 * MB)} for r, s in noise.items()}
    assert [f.rank for f in imbalances(cuda)] == [0]


def test_cuda_peaks_are_compared_when_present() -> None:
    samples = {r: {"rss_peak": 300 * MB, "cuda_peak": (2000 if r == 1 else 1000) * MB} for r in range(3)}
    assert "CUDA peak" in memory_line(samples) and "rank 1 peaks at 2.0× the median CUDA peak of the others" in memory_line(samples)


def test_rank_allocating_300mb_is_flagged(pool3: distnb.Pool) -> None:
    res = pool3.run("blob = bytearray(300 << 20) if rank == 2 else None")
    assert res.ok, res.text()
    grow = {r: rr.memory["rss_peak"] - rr.memory["rss_start"] for r, rr in res.results.items()}
    assert grow[2] >= 300 * MB
    assert grow[0] < 50 * MB and grow[1] < 50 * MB
    assert "rank 2 peaks at" in res.text()
    report = pool3.memory()
    assert set(report.current) == {0, 1, 2}
    assert any(flag.startswith("rank 2 peaks at") for flag in report.imbalance())
    text = report.text()
    # The bytearray's 300 MiB, and whatever else the cell's allocator took beside it (+301 seen).
    assert "rank 2 peaks at" in text and re.search(r"\+3\d\d MiB", text), text
    for fig in (report.plot_bars(), report.plot_timeline()):
        png = io.BytesIO()
        fig.savefig(png, format="png")
        assert png.getvalue()[:8] == b"\x89PNG\r\n\x1a\n" and len(png.getvalue()) > 5000
    pool3.run("del blob")


def test_oom_error_brings_everyones_memory(pool3: distnb.Pool) -> None:
    # On CPU a failed huge allocation raises RuntimeError; raise the CUDA OOM type by name instead.
    # The others then wait for rank 1 in an all_reduce, as they would in a training step: they
    # have no end-of-cell sample, so their memory is asked for the moment the error arrives.
    res = pool3.run("oom_x = torch.ones(1)\nif rank == 1:\n    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 20.00 GiB')\n"
                    "dist.all_reduce(oom_x)", timeout=3)
    assert res.failed == [1] and res.running == [0, 2], res.text()
    deadline = time.monotonic() + 5
    while set(res.live_memory) != {0, 2} and time.monotonic() < deadline:
        time.sleep(0.05)
    text = res.text()
    section = text.split("out of memory — every rank's memory for comparison:\n", 1)[1]
    for r in (0, 1, 2):
        assert re.search(rf"^\s*{r}\s+\d+ MiB\s+\d+ MiB", section, re.M), f"rank {r} missing from the comparison:\n{text}"
    # Rank 1 joins the all_reduce the others wait in: the cell ends for them, the pool is fine.
    assert pool3.run("dist.all_reduce(oom_x)", ranks="1", timeout=30).ok
    assert pool3.wait(res, timeout=30).running == []


@pytest.mark.gpu
def test_cuda_memory_is_sampled_per_cell() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with distnb.Pool(nproc=1, backend="nccl") as pool:
        res = pool.run("t = torch.empty(256 << 20, dtype=torch.uint8, device=device)")
        mem = res[0].memory
        assert mem["cuda_peak"] >= 256 * MB and mem["cuda_allocated"] >= 256 * MB
        assert mem.get("device_total", 0) > 0  # NVML sees the device
        assert "CUDA peak" in res.memory_text()


def test_imbalance_is_data_first_and_its_words_come_from_it() -> None:
    from distnb.analysis.reports.memory import Imbalance, imbalances

    samples = {0: {"cuda_peak": 1000 * MB}, 1: {"cuda_peak": 3000 * MB}, 2: {"cuda_peak": 1100 * MB}}
    (flag,) = imbalances(samples)
    assert flag == Imbalance(rank=1, what="CUDA peak", peak=3000 * MB, median=1050 * MB)
    assert flag.text() == "rank 1 peaks at 2.9× the median CUDA peak of the others (2.93 GiB vs 1.03 GiB)"
    report = MemoryReport({r: {"rss": 100 * MB} for r in range(3)}, [(4, samples)])
    assert [f.rank for f in report.imbalances()] == [1] and report.imbalance() == [flag.text()]
