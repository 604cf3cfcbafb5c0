"""Per-rank memory per cell, the report, imbalance flags and plots (CPU; CUDA paths marked gpu)."""

from __future__ import annotations

import io

import pytest

import distnb
from distnb.memory import MemoryReport, imbalance, memory_line
from distnb.worker.memory import MemorySampler

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


def test_imbalance_needs_ratio_and_absolute_gap() -> None:
    base = {r: {"rss_peak": 200 * MB} for r in range(4)}
    assert imbalance(base) == []
    base[3] = {"rss_peak": 390 * MB}
    assert imbalance(base) == ["rank 3 peaks at 1.9× the median RSS peak of the others (390 MB vs 200 MB)"]
    small = {0: {"rss_peak": 1 * MB}, 1: {"rss_peak": 10 * MB}}
    assert imbalance(small) == []  # 10× but only 9 MB apart: noise


def test_cuda_peaks_are_compared_when_present() -> None:
    samples = {r: {"rss_peak": 300 * MB, "cuda_peak": (2000 if r == 1 else 1000) * MB} for r in range(3)}
    assert "CUDA peak" in memory_line(samples) and "rank 1 peaks at 2.0× the median CUDA peak of the others" in memory_line(samples)


@pytest.fixture(scope="module")
def pool3():
    with distnb.Pool(nproc=3, backend="gloo") as pool:
        yield pool
    assert pool.pids() == []


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
    assert "rank 2 peaks at" in text and "+300 MB" in text
    for fig in (report.plot_bars(), report.plot_timeline()):
        png = io.BytesIO()
        fig.savefig(png, format="png")
        assert png.getvalue()[:8] == b"\x89PNG\r\n\x1a\n" and len(png.getvalue()) > 5000
    pool3.run("del blob")


def test_oom_error_brings_everyones_memory(pool3: distnb.Pool) -> None:
    # On CPU a failed huge allocation raises RuntimeError; raise the CUDA OOM type by name instead.
    res = pool3.run("if rank == 1:\n    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 20.00 GiB')")
    assert res.failed == [1]
    text = res.text()
    assert "out of memory — every rank's memory for comparison" in text
    assert MemoryReport({}, [(res.cell, {r: x.memory for r, x in res.results.items()})]).text().count("\n") >= 4


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
