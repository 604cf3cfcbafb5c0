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
import threading
from typing import Any

from distnb.worker.torch_hooks.imported import imported_module

__all__ = ["MemorySampler", "read_rss"]

_KB = 1024
_PAGE = os.sysconf("SC_PAGE_SIZE")


class _ProcSelf:
    """/proc/self/status, /proc/self/statm and /proc/self/clear_refs, opened once per process.

    ``pread`` at offset 0 makes the kernel regenerate the file and uses no shared file position,
    so the main thread and the control thread can read at the same time; a forked child (a cell
    that forks) reopens its own files rather than reading its parent's.
    """

    def __init__(self) -> None:
        self._opened = False
        self._status = -1
        self._statm = -1
        self._clear = -1
        self._lock = threading.Lock()
        # After a fork the inherited descriptors still name the parent's /proc entries; they are
        # the parent's to close, so the child just stops using them. (Not os.getpid() per read:
        # a syscall each, three times a cell.)
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._opened = False
        self._status = self._statm = self._clear = -1

    def _open(self) -> None:
        if self._opened:
            return
        with self._lock:
            if self._opened:
                return
            try:
                self._status = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
                self._statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                pass
            try:
                self._clear = os.open("/proc/self/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
            except OSError:  # not writable (some containers, old kernels): peaks are lifetime peaks
                pass
            self._opened = True

    def rss(self) -> int | None:
        """Current RSS in bytes from statm, a fifth of what status costs (it has no peak)."""
        self._open()
        if self._statm < 0:
            return None
        try:
            return int(os.pread(self._statm, 128, 0).split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            return None

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
        cuda: Any = imported_module("torch.cuda")
        # Never initialise CUDA ourselves: only report once the user's code has.
        # is_initialized() first: it is a flag, while is_available() asks the driver every time.
        if cuda is None or not cuda.is_initialized() or not cuda.is_available():
            return None
        return cuda

    def _device_index(self, cuda: Any) -> int:
        if threading.get_ident() == self._cell_thread:
            # The thread that runs cells: its current device is the rank's (a cell may change it).
            self.device = int(cuda.current_device())
        elif self.device is None:
            # Asked from another thread before any cell sampled CUDA: LOCAL_RANK is how ranks bind.
            count = int(cuda.device_count())
            self.device = self.local_rank if self.local_rank < count else int(cuda.current_device())
        return self.device

    def _nvml_handle(self, cuda: Any) -> Any:
        if self._nvml_tried:
            return self._nvml
        self._nvml_tried = True
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = (pynvml, _nvml_device(pynvml, cuda, self.device if self.device is not None else self.local_rank))
        except Exception:
            self._nvml = None
        return self._nvml

    def start(self) -> None:
        """At a cell's start, on the thread that runs cells."""
        self._cell_thread = threading.get_ident()
        if self._can_reset:
            self._can_reset = _reset_rss_peak()
        rss = _proc.rss()
        self._start = {"rss": rss if rss is not None else read_rss()[0]}
        cuda = self._cuda()
        if cuda is not None:
            dev = self._device_index(cuda)
            stats = cuda.memory_stats(dev)
            _peaks.carry(dev, stats)  # the user's own max_memory_allocated() keeps its meaning
            _peaks.install(cuda)
            _peaks.raw_reset(dev)
            self._start["cuda_allocated"] = stats.get("allocated_bytes.all.current", 0)
            self._start["cuda_reserved"] = stats.get("reserved_bytes.all.current", 0)

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
            stats = cuda.memory_stats(dev)  # one call: each accessor below would make its own
            out.update(
                cuda_device=dev,
                cuda_allocated=stats.get("allocated_bytes.all.current", 0),
                cuda_reserved=stats.get("reserved_bytes.all.current", 0),
                cuda_peak=stats.get("allocated_bytes.all.peak", 0),
                cuda_allocated_start=self._start.get("cuda_allocated", 0),
                cuda_reserved_start=self._start.get("cuda_reserved", 0),
            )
            nvml = self._nvml_handle(cuda)
            if nvml is not None:
                pynvml, handle = nvml
                try:
                    # What the device holds in all: PyTorch's allocator plus the CUDA context, NCCL's
                    # buffers and anything else on the GPU (other processes too).
                    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                    out.update(device_used=int(info.used), device_total=int(info.total))
                except Exception:
                    pass
        return out


def _nvml_device(pynvml: Any, cuda: Any, index: int) -> Any:
    """The NVML handle of CUDA device ``index`` of this process, found by the UUID CUDA reports:
    NVML numbers every GPU of the machine, CUDA only the visible ones, in its own order
    (CUDA_VISIBLE_DEVICES by index or UUID, Slurm's cgroups, MIG instances)."""
    uuid = str(getattr(cuda.get_device_properties(index), "uuid", "") or "")
    for name in (uuid, f"GPU-{uuid}", f"MIG-{uuid}") if uuid else ():
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(name)
        except Exception:
            continue
    ids = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    target = ids[index] if index < len(ids) else str(index)
    return pynvml.nvmlDeviceGetHandleByIndex(int(target)) if target.isdigit() else pynvml.nvmlDeviceGetHandleByUUID(target)


class _UserPeaks:
    """Keeps ``torch.cuda.max_memory_allocated()`` / ``max_memory_reserved()`` meaning what the
    user expects although distnb resets the allocator's peak at every cell start (that is how it
    reports a per-cell peak): the peak seen at each of distnb's resets is carried, and the two
    functions, wrapped, answer the larger of it and the allocator's own. The user's own
    ``reset_peak_memory_stats()`` clears the carried peak. (``memory_stats()["…peak"]`` is the
    allocator's raw, per-cell figure.)"""

    def __init__(self) -> None:
        self.carried: dict[int, dict[str, int]] = {}
        self.installed = False
        self.raw_reset: Any = None  # the allocator's own reset, unwrapped

    def carry(self, dev: int, stats: dict[str, Any]) -> None:
        mine = self.carried.setdefault(dev, {})
        for key in ("allocated_bytes.all.peak", "reserved_bytes.all.peak"):
            mine[key] = max(mine.get(key, 0), int(stats.get(key, 0)))

    def install(self, cuda: Any) -> None:
        if self.installed:
            return
        self.installed = True

        def index(device: Any) -> int:
            return int(cuda._utils._get_device_index(device, optional=True))

        def peak(key: str) -> Any:
            def read(device: Any = None) -> int:
                dev = index(device)
                return max(int(cuda.memory_stats(dev).get(key, 0)), self.carried.get(dev, {}).get(key, 0))
            return read

        self.raw_reset = original = cuda.reset_peak_memory_stats

        def reset(device: Any = None) -> None:
            self.carried.pop(index(device), None)
            original(device)

        cuda.max_memory_allocated = peak("allocated_bytes.all.peak")
        cuda.max_memory_reserved = peak("reserved_bytes.all.peak")
        cuda.reset_peak_memory_stats = reset


_peaks = _UserPeaks()
