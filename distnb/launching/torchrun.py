"""The torchrun agent process: its command line, environment, output and shutdown."""

from __future__ import annotations

import collections
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Callable

from distnb import _processes
from distnb.config import DEBUG_ENV, LaunchConfig, Rendezvous
from distnb.launching import network
from distnb.wire.security import Credentials

__all__ = ["Launcher", "drain_lines"]


def drain_lines(stream: IO[bytes], tail: collections.deque[str], on_line: Callable[[str], None] | None = None) -> None:
    """Read a child's output to its end: each line into ``tail`` and to ``on_line``."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        tail.append(line)
        if on_line is not None:
            try:
                on_line(line)
            except Exception:  # a display callback must not stop the draining
                pass
    stream.close()


def _sweep_orphaned_run_dirs() -> None:
    """Remove run folders of controllers that died without shutting their pool down."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "distnb-*-*")):
        owner = os.path.basename(path).split("-")[1]
        if owner.isdigit() and int(owner) != os.getpid() and not _processes.pid_alive(int(owner)):
            shutil.rmtree(path, ignore_errors=True)


def nccl_environment(run_dir: str) -> dict[str, str]:
    """NCCL's watchdog settings for interactive debugging (documented in ``%dist_launch?``).

    NCCL's defaults suit batch jobs: at a collective timeout the watchdog aborts the communicator
    *and ends the process* (the others follow minutes later), after sleeping 4 ×
    ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (60 s); the heartbeat monitor kills a rank whose
    watchdog looks stuck. In a notebook every namespace would be lost. So: abort only the
    communicator (the rank lives; the next collective on that group raises, and distnb's
    ``%dist_regroup`` builds a new one), no heartbeat kill, the timeout dump written into the
    pool's run folder (distnb reads it for the post-mortem), a short dump wait, and per-collective
    GPU start times (the collective log tells "queued behind other GPU work" from "running").
    """
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # CleanUpOnly: abort the communicator, keep the process
        "TORCH_NCCL_ENABLE_MONITORING": "0",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": os.path.join(run_dir, FR_DUMP_PREFIX),
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000",
        "TORCH_NCCL_ENABLE_TIMING": "1",
    }


#: Where the watchdog writes each rank's Flight Recorder at a timeout: ``<run dir>/<prefix><rank>``.
FR_DUMP_PREFIX = "nccl_trace_rank_"

#: Several ranks on one GPU (``share_gpus``): NCCL refuses two ranks on one device unless each
#: looks like its own host (``NCCL_HOSTID``, set per rank by the rank itself), and then must not
#: use the same-host transports (peer-to-peer, shared memory) or InfiniBand: only sockets on
#: loopback remain. Real collectives, real hangs; slow (~4.5 ms per small all_reduce at 2 ranks,
#: ~18 ms at 4, on an H100).
SHARED_GPU_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}


#: How often torchrun looks at its workers (the supervisors). Its default, 0.1 s, costs an idle
#: pool ~3 ms of CPU a second (a store query each time); distnb learns of deaths from the
#: supervisors, not from torchrun, and :meth:`Launcher.stop` signals torchrun once its workers
#: are gone instead of waiting for it to look, so nothing waits on this interval.
AGENT_MONITOR_INTERVAL = 2.0


class Launcher:
    """Runs ``python -m torch.distributed.run ... -m distnb.worker`` in its own process session:
    on the controller's machine for the pool, and inside each node agent for another machine."""

    TAIL_LINES = 400

    def __init__(
        self,
        config: LaunchConfig,
        address: str,
        creds: Credentials,
        on_line: Callable[[str], None] | None = None,
        rdzv: Rendezvous | None = None,
        agent: int = 0,
    ) -> None:
        self.config = config
        self._address = address
        self._creds = creds
        self._on_line = on_line
        self.rdzv = rdzv
        self.agent = agent  # the node agent running this launcher; 0: the controller's machine
        self.proc: subprocess.Popen[bytes] | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=self.TAIL_LINES)
        self._drain: threading.Thread | None = None
        # Every PID the pool was seen with, each with its start time: stop() signals only those
        # still running as the same process, never whoever got a dead rank's number since.
        self.known_pids = _processes.KnownProcesses()
        _sweep_orphaned_run_dirs()
        # The controller's pid in the name lets a later launch remove it if this process is killed.
        self.run_dir = tempfile.mkdtemp(prefix=f"distnb-{os.getpid()}-")

    def command(self) -> list[str]:
        nodes = ["--standalone", "--nnodes", "1"] if self.rdzv is None else ["--nnodes", str(self.config.nnodes), *self.rdzv.args()]
        return [
            sys.executable, "-m", "torch.distributed.run",
            *nodes,
            "--nproc-per-node", str(self.config.nproc),
            "--max-restarts", "0",
            "--monitor-interval", repr(AGENT_MONITOR_INTERVAL),
            # torchrun otherwise leaves a /tmp/torchelastic_* folder behind for every launch.
            "--log-dir", self.run_dir,
            "-m", "distnb.worker",
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        for switch in self.config.debug:
            env.update(DEBUG_ENV[switch])
        env.update(self.config.env)  # explicit --env wins over a debug switch
        # Workers must import this very distnb, installed or not.
        src = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(self._creds.env())
        env.update(
            DISTNB_ADDR=self._address,
            DISTNB_AGENT=str(self.agent),
            DISTNB_BACKEND=self.config.backend,
            DISTNB_PG_TIMEOUT=repr(self.config.pg_timeout),
            DISTNB_HEARTBEAT_TIMEOUT=repr(self.config.heartbeat_timeout),
        )
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its warning
        # The Flight Recorder is distnb's collective log (~2 µs per collective); on by default
        # in recent torch, asked for explicitly for older ones. A user's 0 turns it off. Kept
        # short: every read converts the whole ring (~35 ms for 2000 entries, ~9 ms for 500),
        # ranks push new entries within ~50 ms, and the controller keeps 5000 per rank itself.
        env.setdefault("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "500"))
        if self.config.backend != "gloo":
            for key, value in nccl_environment(self.run_dir).items():
                env.setdefault(key, value)  # the user's own --env / environment wins
        if self.config.share_gpus:
            env.update(SHARED_GPU_ENV, DISTNB_SHARE_GPUS="1")
        if self.rdzv is not None and self.rdzv.local_addr:
            # Pin gloo's and NCCL's sockets to the interface this node reaches the others on; the
            # hostname's address (their default) may be loopback or unknown to the other machines.
            env.update(network.socket_env(self.rdzv.local_addr, env))
        return env

    def start(self) -> None:
        self.proc = _processes.popen_with_parent_death(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            # Own session: Jupyter's interrupt signals the kernel's process group, not the pool.
            start_new_session=True,
        )
        self.known_pids.add(self.proc.pid)
        self._drain = threading.Thread(target=self._drain_output, name="distnb-agent-output", daemon=True)
        self._drain.start()

    def _drain_output(self) -> None:
        # Never leave the pipe undrained: a full pipe blocks the agent and then every rank.
        assert self.proc is not None and self.proc.stdout is not None
        drain_lines(self.proc.stdout, self.tail, self._on_line)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def tail_text(self, lines: int = 30) -> str:
        return "\n".join(list(self.tail)[-lines:])

    def _pool_pids(self) -> dict[int, int]:
        """The pool's live processes as ``{pid: start time}``, from one snapshot of /proc.

        Starts from the known PIDs that are still the same processes, then takes their descendants
        and the members of their sessions (torchrun gives each rank its own session, and a cell's
        subprocesses stay in it), until nothing new turns up. A known PID whose number now belongs
        to another process is left alone, and so are its descendants and session. A known PID that
        is gone still leads to its session's survivors: while any process has a session id, the
        kernel does not hand that number out again, so those members can only be ours.
        """
        table = _processes.process_table()
        found: dict[int, int] = {}
        sessions: set[int] = set()
        for pid, started in self.known_pids.items():
            entry = table.get(pid)
            if entry is None:
                sessions.add(pid)
            elif entry.start == started:
                found[pid] = entry.start
        children: dict[int, list[int]] = {}
        members: dict[int, list[int]] = {}
        for pid, entry in table.items():
            children.setdefault(entry.ppid, []).append(pid)
            members.setdefault(entry.sid, []).append(pid)
        todo = list(found) + [m for sid in sessions for m in members.get(sid, [])]
        while todo:
            pid = todo.pop()
            if pid not in found:
                found[pid] = table[pid].start
            for other in children.get(pid, []) + members.get(pid, []):
                if other not in found:
                    found[other] = table[other].start
                    todo.append(other)
        return found

    def live_pids(self) -> list[int]:
        """Known PIDs whose original process still runs (a reused number does not count)."""
        return self.known_pids.alive()

    def stop(self, grace: float = 3.0) -> list[int]:
        """Stop every process of the pool: wait ``grace``, SIGTERM, then SIGKILL.

        Returns the PIDs still alive afterwards (empty on success).
        """
        if self.proc is None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return []
        deadline = time.monotonic() + grace
        told = False
        while time.monotonic() < deadline and self.proc.poll() is None:
            if not told and not set(self._pool_pids()) - {self.proc.pid}:
                # Its workers are gone and it only has to notice (at its next look, up to
                # AGENT_MONITOR_INTERVAL away) and exit: SIGTERM is its own shutdown path.
                self.proc.send_signal(signal.SIGTERM)  # our own child, not reaped yet: its PID is its own
                told = True
            time.sleep(0.02)
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            pids = self._pool_pids()
            if not pids:
                break
            self.known_pids.update(pids)
            for pid, started in pids.items():
                # Checked again at the moment of signalling: the snapshot is already in the past.
                _processes.signal_process(pid, started, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the agent, our only direct child
                if not any(_processes.same_process(p, s) for p, s in pids.items()):
                    break
                time.sleep(0.02)
        try:
            self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            pass
        if self._drain is not None:
            self._drain.join(2.0)
        leftovers = self.known_pids.alive()
        if not leftovers:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return leftovers
