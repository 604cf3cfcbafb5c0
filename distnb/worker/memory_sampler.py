"""Per-cell memory on a rank: process RSS and its peak, CUDA allocator stats, NVML device usage.

Sampled at the start and end of every cell, so it must stay cheap (target: well under 0.2 ms on
CPU): one write and one read of /proc per sample through descriptors kept open; CUDA calls only
once CUDA is initialised.

The peak is VmHWM from /proc/self/status, reset at every cell start by writing 5 to
/proc/self/clear_refs. Not getrusage's ru_maxrss: the kernel folds high-water marks into that
per-process maximum (at exec, a forked child's copy of its parent's peak; at exit), and
clear_refs never resets it, so it can report a peak the cell never had.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

__all__ = ["MemorySampler", "read_rss"]

_KB = 1024


class _ProcSelf:
    """/proc/self/status and /proc/self/clear_refs, opened once per process.

    ``pread`` at offset 0 makes the kernel regenerate the file and uses no shared file position,
    so the main thread and the control thread can read at the same time; a forked child (a cell
    that forks) reopens its own files rather than reading its parent's.
    """

    def __init__(self) -> None:
        self._pid = -1
        self._status = -1
        self._clear = -1
        self._lock = threading.Lock()

    def _open(self) -> None:
        pid = os.getpid()
        if self._pid == pid:
            return
        with self._lock:
            if self._pid == pid:
                return
            # After a fork the inherited descriptors still name the parent's /proc entries; they
            # are the parent's to close, so just stop using them.
            self._status = self._clear = -1
            try:
                self._status = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                pass
            try:
                self._clear = os.open("/proc/self/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
            except OSError:  # not writable (some containers, old kernels): peaks are lifetime peaks
                pass
            self._pid = pid

    def status(self) -> bytes:
        self._open()
        if self._status < 0:
            return b""
        try:
            data = os.pread(self._status, 4096, 0)
            while len(data) % 4096 == 0 and data and b"VmHWM:" not in data:
                data += os.pread(self._status, 4096, len(data))  # a long Groups: line pushed it further
            return data
        except OSError:
            return b""

    def reset_peak(self) -> bool:
        """"5" resets VmHWM to the current RSS (Linux >= 4.0), giving a per-cell peak."""
        self._open()
        if self._clear < 0:
            return False
        try:
            os.write(self._clear, b"5")
            return True
        except OSError:
            return False


_proc = _ProcSelf()


def _field_kb(data: bytes, name: bytes) -> int:
    """``VmRSS:\\t  1234 kB`` -> 1234 * 1024; 0 when the field is missing."""
    start = data.find(name)
    if start < 0:
        return 0
    start += len(name)
    end = data.find(b"kB", start)
    try:
        return int(data[start:end]) * _KB
    except ValueError:
        return 0


def read_rss() -> tuple[int, int]:
    """(current RSS, peak RSS since the last reset) in bytes, from one read of /proc/self/status."""
    data = _proc.status()
    rss = _field_kb(data, b"VmRSS:")
    return rss, max(rss, _field_kb(data, b"VmHWM:"))


def _reset_rss_peak() -> bool:
    return _proc.reset_peak()


class MemorySampler:
    """Samples one rank's memory around each cell.

    ``device`` is the CUDA device index to report on. CUDA's current device is per thread: it is
    the rank's own only on the thread that ran ``torch.cuda.set_device`` (the main thread), while
    the control thread, which answers a live ``%dist_memory``, would see device 0. So the index is
    fixed explicitly: by the rank after binding its device, else read on the thread that runs
    cells at each sample (once the user's code has initialised CUDA), and used by every query.
    """

    def __init__(self, local_rank: int = 0, device: int | None = None) -> None:
        self.local_rank = local_rank
        self.device = device
        self._start: dict[str, Any] = {}
        self._can_reset = True
        self._nvml: Any = None
        self._nvml_tried = False
        self._cell_thread: int | None = None

    def _cuda(self) -> Any:
        torch = sys.modules.get("torch")
        # Never initialise CUDA ourselves: only report once the user's code has.
        # is_initialized() first: it is a flag, while is_available() asks the driver every time.
        if torch is None or not torch.cuda.is_initialized() or not torch.cuda.is_available():
            return None
        return torch.cuda

    def _device_index(self, cuda: Any) -> int:
        if threading.get_ident() == self._cell_thread:
            # The thread that runs cells: its current device is the rank's (a cell may change it).
            self.device = int(cuda.current_device())
        elif self.device is None:
            # Asked from another thread before any cell sampled CUDA: LOCAL_RANK is how ranks bind.
            count = int(cuda.device_count())
            self.device = self.local_rank if self.local_rank < count else int(cuda.current_device())
        return self.device

    def _nvml_handle(self) -> Any:
        if self._nvml_tried:
            return self._nvml
        self._nvml_tried = True
        try:
            import pynvml

            pynvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            ids = [v.strip() for v in visible.split(",") if v.strip()]
            index = self.device if self.device is not None else self.local_rank
            target = ids[index] if index < len(ids) else str(index)
            if target.isdigit():
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(target))
            else:
                handle = pynvml.nvmlDeviceGetHandleByUUID(target)
            self._nvml = (pynvml, handle)
        except Exception:
            self._nvml = None
        return self._nvml

    def start(self) -> None:
        """At a cell's start, on the thread that runs cells."""
        self._cell_thread = threading.get_ident()
        if self._can_reset:
            self._can_reset = _reset_rss_peak()
        rss, _ = read_rss()
        self._start = {"rss": rss}
        cuda = self._cuda()
        if cuda is not None:
            dev = self._device_index(cuda)
            cuda.reset_peak_memory_stats(dev)
            self._start["cuda_allocated"] = cuda.memory_allocated(dev)
            self._start["cuda_reserved"] = cuda.memory_reserved(dev)

    def stop(self) -> dict[str, Any]:
        """At a cell's end (the cell's thread), or any time from another thread for a live reading."""
        rss, hwm = read_rss()
        out: dict[str, Any] = {
            "rss": rss,
            "rss_start": self._start.get("rss", rss),
            "rss_peak": max(hwm, rss),
            "rss_peak_is_cell": self._can_reset,
        }
        cuda = self._cuda()
        if cuda is not None:
            dev = self._device_index(cuda)
            out.update(
                cuda_device=dev,
                cuda_allocated=cuda.memory_allocated(dev),
                cuda_reserved=cuda.memory_reserved(dev),
                cuda_peak=cuda.max_memory_allocated(dev),
                cuda_allocated_start=self._start.get("cuda_allocated", 0),
                cuda_reserved_start=self._start.get("cuda_reserved", 0),
            )
            nvml = self._nvml_handle()
            if nvml is not None:
                pynvml, handle = nvml
                try:
                    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                    out.update(device_used=int(info.used), device_total=int(info.total))
                except Exception:
                    pass
        return out
