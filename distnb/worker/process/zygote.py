"""Fresh rank processes forked from one that has imported torch and a session's modules already.

A spare (``worker/process/rank.py``'s ``wait_as_spare``) saves a fresh rank the import of torch,
but each spare imports it again, and what a session's cells import later — DDP's first use pulls
in ``torch._dynamo``, about 800 modules, 8–9 s of four ranks on two cores — is imported again by
every fresh rank. On a 2-core machine that import is CPU work no spare can hide, and it was most
of each of ``%dist_minimize``'s tries. A zygote imports once; each fresh rank is a fork of it
(copy-on-write), with the session's modules loaded, ready in milliseconds.

The zygote is the supervisor's child, started like a spare (``python -m distnb.worker.process.rank``
with :data:`ZYGOTE_ENV` naming its end of a socket pair); the ranks are its children. The supervisor
sends the pipes a rank needs with each fork request (``SCM_RIGHTS``), and a status pipe on which
the zygote, which reaps its children, writes the rank's wait status when it exits: a grandchild's
status is not the supervisor's to ``waitpid``. :class:`ForkedRank` reads it there, and answers the
supervisor as a ``subprocess.Popen`` would.

What a fork keeps that a fresh process would not: the hash seed and the zygote's imported state.
Python's ``random`` reseeds itself in the child; NumPy's global generator is reseeded here. Only
torch's modules and those of the libraries torch imports lazily are imported (:data:`WARMABLE`): a
session's own modules may read, as they are imported, settings its cells make first. A module that
fails to import is skipped (the cell that needs it raises then).
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import Any, Callable, Iterable, Sequence

__all__ = ["WARMABLE", "ZYGOTE_ENV", "ForkedRank", "Zygote", "fork_refusal", "heavy_modules", "run_zygote"]

#: The environment variable that makes a rank process a zygote: its end of the socket pair.
ZYGOTE_ENV = "DISTNB_ZYGOTE_FD"
#: Top-level packages whose modules a zygote imports for a session: torch and what torch itself
#: imports lazily. A session's own modules and other libraries are left to its cells (their
#: imports may read settings a cell makes first).
WARMABLE = frozenset({"torch", "functorch", "sympy", "mpmath", "networkx", "numpy", "jinja2", "markupsafe", "triton",
                      "filelock", "fsspec", "typing_extensions"})
#: The most module names a request carries (``torch._dynamo`` with its dependencies: ~900).
MAX_MODULES = 5000
_STATUS = struct.Struct("!i")
_RECV = 1 << 20


def heavy_modules(names: Iterable[str]) -> list[str]:
    """The names a zygote may import, in order."""
    return [n for n in names if n.partition(".")[0] in WARMABLE][:MAX_MODULES]


# -- the zygote's side ------------------------------------------------------------------------------
def _import(names: Sequence[str]) -> None:
    """What the supervisor named (``Zygote.warm`` has kept only ``WARMABLE``'s)."""
    for name in names:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001  (a module that can't be imported here is the cell's to meet)
                pass


def run_zygote(fd: int) -> bool:
    """Run as the zygote on socket ``fd``: import torch, then what the supervisor names, and fork
    a rank for each request. Returns True in a forked child, which then goes on as the rank; False
    in the zygote once the supervisor has closed the socket."""
    import torch.distributed  # noqa: F401  (as a spare does)

    sock = socket.socket(fileno=fd)
    statuses: dict[int, int] = {}  # pid -> the status pipe's write end
    # Reaped in the handler, whatever the loop is doing (a long import): the status is what tells
    # the supervisor its rank has ended.
    signal.signal(signal.SIGCHLD, lambda *_: _reap(statuses))
    while True:
        msg, fds, _flags, _addr = socket.recv_fds(sock, _RECV, 16)
        if not msg:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
            for out in statuses.values():
                os.close(out)
            return False
        request = pickle.loads(msg)
        if request["op"] == "import":
            _import(request["modules"])
        elif _fork(request, fds, sock, statuses) == 0:
            return True


def _fork(request: dict[str, Any], fds: list[int], sock: socket.socket, statuses: dict[int, int]) -> int:
    """Fork a rank with the request's pipes; 0 in the child (set up as the rank), its pid in the zygote."""
    out, err, status, *passed = fds
    refused = fork_refusal()
    if refused:  # the supervisor starts a process instead
        socket.send_fds(sock, [pickle.dumps({"error": refused})], [])
        for f in fds:
            os.close(f)
        return -1
    sys.stdout.flush()
    sys.stderr.flush()
    me = os.getpid()
    # Until its status pipe is recorded, a child that ends at once must not be reaped without it.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    pid = os.fork()
    if pid == 0:
        sock.close()
        _become_rank(me, request, out, err, passed, [*statuses.values(), status], mask)
        return 0
    statuses[pid] = status
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for f in (out, err, *passed):
        os.close(f)
    socket.send_fds(sock, [pickle.dumps({"pid": pid})], [])
    return pid


def fork_refusal(maps_path: str = "/proc/self/maps") -> str:
    """Why this process must not fork a rank now; "" when it may. A Python thread could hold a lock
    the child needs (native pools such as OpenBLAS's handle a fork themselves: torch's DataLoader
    forks beside them). CUDA does not survive a fork once its driver is initialised (a rank would
    fail at its first CUDA call), and an import may have asked it for the device count."""
    threads = threading.active_count()
    if threads > 1:
        return f"the zygote has {threads} Python threads"
    try:
        with open(maps_path) as f:
            if any("libcuda.so" in line for line in f):
                return "the zygote has loaded the CUDA driver"
    except OSError:
        pass
    return ""


def _become_rank(zygote: int, request: dict[str, Any], out: int, err: int, passed: list[int], zygote_fds: list[int],
                 mask: Iterable[int]) -> None:
    """In the forked child: the rank's stdio and environment, nothing of the zygote's."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for f in zygote_fds:
        os.close(f)
    devnull = os.open(os.devnull, os.O_RDONLY)
    for src, dst in ((devnull, 0), (out, 1), (err, 2)):
        os.dup2(src, dst)
        os.close(src)
    # The interpreter's text streams were made on the zygote's /dev/null (seekable): made again on
    # the pipes, as a fresh process's would be.
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        new = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding, errors=old.errors,
                               line_buffering=old.line_buffering, write_through=old.write_through)
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)
    env = dict(request["env"])
    for name, f in zip(request["passed"], passed):
        os.set_inheritable(f, True)
        env[name] = str(f)
    os.environ.clear()
    os.environ.update(env)
    from distnb import _processes

    # The rank never outlives its zygote, which never outlives the supervisor (as a spare would not).
    _processes.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != zygote:
        os._exit(1)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()  # a fresh process draws a fresh seed; the zygote's would be every child's


def _reap(statuses: dict[int, int]) -> None:
    """Each forked rank that has ended: its exit status to its pipe. Only ours: a child an import
    started is its own module's to wait for (subprocess would read a stolen one as exit code 0)."""
    for pid in list(statuses):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, -1
        out = statuses.pop(pid, None) if done else None  # None: running, or a nested call took it
        if out is None:
            continue
        try:
            if status >= 0:
                os.write(out, _STATUS.pack(os.waitstatus_to_exitcode(status)))
        except OSError:
            pass
        os.close(out)


# -- the supervisor's side --------------------------------------------------------------------------
class ForkedRank:
    """A rank the zygote forked, as the supervisor's ``Child`` uses a ``subprocess.Popen``: its exit
    code (negative: the signal) arrives on the status pipe the zygote writes; EOF without one means
    the zygote is gone, and with it the rank (its parent-death signal): SIGKILL."""

    def __init__(self, pid: int, status_r: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.exit_fd = self._status_r = status_r  # readable once the status (or the pipe's end) is there
        self._buf = b""
        try:
            self._pidfd = os.pidfd_open(pid)  # signals reach this process even once its pid is reused
        except OSError:
            self._pidfd = -1

    def poll(self) -> int | None:
        if self.returncode is None and self._read(0.0):
            self._done()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._read(timeout):
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        self._done()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        try:
            if self._pidfd >= 0:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, timeout: float | None) -> bool:
        """True once the status (or the pipe's end) has been read."""
        if self._status_r < 0:
            return True
        ready, _, _ = select.select([self._status_r], [], [], timeout)
        while ready:
            data = os.read(self._status_r, _STATUS.size - len(self._buf))
            if not data:
                return True
            self._buf += data
            if len(self._buf) == _STATUS.size:
                return True
            ready, _, _ = select.select([self._status_r], [], [], timeout)
        return False

    def _done(self) -> None:
        if self.returncode is None:
            self.returncode = _STATUS.unpack(self._buf)[0] if len(self._buf) == _STATUS.size else -signal.SIGKILL

    def close(self) -> None:
        """Let go of its pipe and pidfd (the supervisor has discarded it)."""
        for fd in (self._status_r, self._pidfd):
            if fd >= 0:
                os.close(fd)
        self._status_r = self._pidfd = self.exit_fd = -1


class Zygote:
    """The supervisor's handle on its zygote process: ``fork`` gives a fresh rank (None where the
    zygote can't: gone, or not safe to fork), ``warm`` names more modules for it to import."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc, self._sock = proc, sock
        self.modules: set[str] = set()

    @classmethod
    def start(cls, env: dict[str, str], preexec: Callable[[], object]) -> Zygote:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # torch.cuda.is_available() by NVML, which leaves the CUDA driver alone (fork_refusal).
        env = {**env, ZYGOTE_ENV: str(theirs.fileno()), "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "distnb.worker.process.rank"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=[theirs.fileno()],
                                env=env, preexec_fn=preexec)
        theirs.close()
        return cls(proc, mine)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def warm(self, modules: Sequence[str]) -> None:
        new = [m for m in heavy_modules(modules) if m not in self.modules]
        if new and self.alive():
            self.modules.update(new)
            try:
                self._send({"op": "import", "modules": new}, [])
            except OSError:  # it has just died: the next fork finds it gone and starts a process
                pass

    def fork(self, env: dict[str, str], stdout: int, stderr: int, passed: dict[str, int], timeout: float) -> ForkedRank | None:
        """A rank forked with these pipes (the caller keeps and closes its copies); None if the
        zygote did not answer within ``timeout`` (still importing) or refused."""
        if not self.alive():
            return None
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        try:
            self._send({"op": "fork", "env": env, "passed": list(passed)}, [stdout, stderr, status_w, *passed.values()])
        except OSError:
            os.close(status_r)
            return None
        finally:
            os.close(status_w)
        ready, _, _ = select.select([self._sock], [], [], timeout)
        data = self._sock.recv(_RECV) if ready else b""
        answer = pickle.loads(data) if data else {}  # nothing: it did not answer in time, or it died
        if "pid" not in answer:
            os.close(status_r)
            if not data:
                self.close()  # a late answer would come to the next request
            return None
        return ForkedRank(int(answer["pid"]), status_r)

    def _send(self, request: dict[str, Any], fds: list[int]) -> None:
        socket.send_fds(self._sock, [pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)], fds)

    def close(self) -> None:
        """End the zygote (its ranks die with it: their parent-death signal)."""
        self._sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
