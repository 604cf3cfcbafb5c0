"""An attachable rank of a job distnb did not launch (issue 40): the pool ranks' control thread,
listening instead of connecting, so ``%dist_attach`` can read the rank's stacks, collective log
and memory while the job runs or hangs.

``maybe_start()`` runs at interpreter start-up (``python -m distnb run`` puts a ``sitecustomize``
calling it on the ranks' path; ``distnb/_attach_site.py`` holds that file) when
``DISTNB_ATTACH=1`` and torchrun's ``RANK``/``WORLD_SIZE`` are set. On the main thread it only
sets the Flight Recorder's buffer size (torch reads it when the job makes its process group) and
starts one daemon thread; that thread imports what it needs, binds ``tcp://127.0.0.1:*`` (or
``DISTNB_ATTACH_HOST``), writes the rank's discovery file (``wire/discovery.py``) and serves
requests as a pool rank's control thread does. It never issues a collective, never signals the
main thread (interrupts are refused), and any failure of its own is one line on stderr, the job
going on. Only on the notebook's explicit request (``%dist_debug``, a PEEK or DAP carrying
``consent``) does it run code in the rank (an expression evaluated in a frame) or start debugpy to
pause and step the main thread; a job started with DISTNB_ATTACH_DEBUG=0 refuses even that. The call log (``worker/torch_hooks/call_log.py``: the
arguments the Flight Recorder does not keep, gloo's point-to-point calls) is wrapped onto
``torch.distributed`` as soon as the job imports it, by a ``sys.meta_path`` finder that answers
for that one module (``DISTNB_CALL_LOG=0`` leaves it out): an attach then finds the calls made
before it, and changes nothing in the job.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any, Mapping

from distnb.worker.process.job_records import RECORD_AFTER, RECORD_AFTER_ENV, RECORDS_SWITCH, JobRecorder

__all__ = ["ATTACH_ENV", "DEBUG_SWITCH", "LEASE", "LEASE_ENV", "STARTED_ENV", "maybe_start", "serve"]

#: The switch: set to 1 in a job's environment, its ranks become attachable.
ATTACH_ENV = "DISTNB_ATTACH"
#: Set by an attachable rank to its pid: the processes it starts (spawned DataLoader workers, its
#: own subprocesses) inherit it along with RANK and must not publish themselves as that rank.
STARTED_ENV = "DISTNB_ATTACH_STARTED"
#: The Flight Recorder's size when the job sets none (the pool's default).
FR_ENTRIES = "500"
#: Bind addresses only this machine reaches: no CURVE needed (the discovery file is private).
LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: Set to 0 in a job's environment, its ranks refuse to be debugged (%dist_debug): looked at only.
DEBUG_SWITCH = "DISTNB_ATTACH_DEBUG"
#: Seconds a rank paused by a notebook's debugger stays paused with no word from that notebook
#: (DISTNB_DEBUG_LEASE): then it goes on, so a notebook that closed never leaves the job held.
LEASE = 600.0
LEASE_ENV = "DISTNB_DEBUG_LEASE"
#: Milliseconds between the control thread's looks at a debugged rank (the lease, the untrace).
TICK_MS = 200
#: The debugpy requests that leave the main thread held, or about to be (and breakpoints set).
_HOLDING = frozenset({"pause", "next", "stepIn", "stepOut"})
#: debugpy request numbers the rank uses for itself (far above the notebook's).
LET_GO_SEQ = 1_000_000_000

_started = False


def maybe_start() -> bool:
    """Start the attachable control thread in this process when it is a torchrun rank of a job
    that asked for it (and not a rank of distnb's own pool, which has its control thread).
    Returns whether it started. Never raises."""
    global _started
    env = os.environ
    if _started or env.get(ATTACH_ENV) != "1" or "RANK" not in env or "WORLD_SIZE" not in env or "DISTNB_ADDR" in env:
        return False
    if env.get(STARTED_ENV, str(os.getpid())) != str(os.getpid()):
        return False  # a child of an attachable rank, not the rank
    try:
        if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
            env.setdefault("TORCH_FR_BUFFER_SIZE", FR_ENTRIES)
        if env.get("DISTNB_CALL_LOG", "1") != "0" and "torch.distributed" not in sys.modules:
            sys.meta_path.insert(0, _WrapAfterImport())
        threading.Thread(target=serve, name="distnb-attach", daemon=True).start()
        env[STARTED_ENV] = str(os.getpid())
        _started = True
    except Exception as exc:  # the job comes first
        print(f"distnb: this rank is not attachable: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return False
    try:
        if env.get(RECORDS_SWITCH, "1") != "0":
            # What the rank leaves when it dies or hangs, for %dist_load (worker/process/job_records.py).
            from distnb.wire.job_dumps import records_dir

            JobRecorder(int(env["RANK"]), int(env["WORLD_SIZE"]), records_dir(env), _call_log,
                        float(env.get(RECORD_AFTER_ENV) or RECORD_AFTER)).install()
    except Exception as exc:  # the job comes first
        print(f"distnb: this rank leaves no records: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    return True


_calls: Any = None
_calls_lock = threading.Lock()


def _call_log() -> Any:
    """The rank's call log (``worker/torch_hooks/call_log.py``), one per process: made by whichever
    comes first, the import hook on the main thread or the control thread."""
    global _calls
    with _calls_lock:
        if _calls is None:
            from distnb.wire.cell_code import CELL_PREFIX
            from distnb.worker.torch_hooks.call_log import CallLog

            _calls = CallLog(CELL_PREFIX)
        return _calls


class _WrapAfterImport:
    """A ``sys.meta_path`` finder that answers for ``torch.distributed`` alone, once: it finds the
    module with the other finders and, once the module has run, wraps the call log onto it — before
    the job's first collective, as a pool rank does after ``init_process_group``. Every other
    import passes by after one string comparison."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch.distributed":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        import importlib.util

        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module: Any) -> None:
            run(module)
            try:
                from distnb.worker.torch_hooks.call_log import install

                install(_call_log())
            except Exception as exc:  # the job comes first
                print(f"distnb: rank {os.environ.get('RANK')}: no call log ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)

        loader.exec_module = exec_module  # type: ignore[union-attr]
        return spec


def serve() -> None:
    """The daemon thread's body: bind, publish, serve until the process ends."""
    try:
        control, path = _listen()
    except Exception as exc:
        print(f"distnb: rank {os.environ.get('RANK')} is not attachable: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return
    import atexit

    atexit.register(_remove, path)
    control.run()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _listen() -> tuple[Any, str]:
    import time

    import zmq

    from distnb.wire.codec import socket_max_msgsize
    from distnb.wire.discovery import RankEndpoint, job_id_from_env, write_endpoint
    from distnb.wire.security import Credentials
    from distnb.worker.process.execute import Executor
    from distnb.worker.recorders.memory_sampler import MemorySampler

    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    host = env.get("DISTNB_ATTACH_HOST", "127.0.0.1")
    # Reachable from other machines, the rank also encrypts and admits only the notebook's key
    # (CURVE, as a multi-machine pool); the keys go into the private discovery file, read over ssh.
    remote = host not in LOOPBACK
    creds = Credentials.new(curve=remote)
    ctx: zmq.Context[Any] = zmq.Context(1)
    ctx.setsockopt(zmq.MAXMSGSIZE, socket_max_msgsize())
    executor = Executor({}, lambda cell, bundle: None, MemorySampler(int(env.get("LOCAL_RANK", "0"))))
    executor.calls = _call_log()  # the one the import hook wraps onto torch.distributed
    control = _attachable_control(ctx, f"tcp://{host}:*", creds, rank, executor)
    port = int(control.addr.rsplit(":", 1)[1])
    endpoint = RankEndpoint(job_id_from_env(), rank, world, os.getpid(), host, port, creds.key, time.time(), argv=tuple(sys.argv),
                            cwd=os.getcwd(), creds=creds.for_nodes().dumps() if remote else "", node=socket.gethostname())
    return control, write_endpoint(endpoint)


def _attachable_control(ctx: Any, addr: str, creds: Any, rank: int, executor: Any) -> Any:
    from distnb.wire.protocol import Msg, ToControl
    from distnb.worker.process.control import ControlThread
    from distnb.worker.process.peek import peek

    class AttachableControl(ControlThread):
        """A pool rank's control thread that never interrupts the job. Its frames can be looked
        into and its main thread paused and stepped by debugpy only on the notebook's explicit
        request (``consent``, asked by ``%dist_debug`` with a warning), unless the job was started
        with DISTNB_ATTACH_DEBUG=0; a pause nobody speaks to for the lease is let go."""

        debugged = False
        # When the notebook debugging (push_route) last spoke: a pause it holds lasts the lease from then.
        heard = 0.0
        leaving = False  # the notebook let the main thread go: untrace it once it has left the debugger
        holding = False  # the notebook paused (or stepped) the main thread, and has not let it go
        lapsed = False  # the lease ran out since the notebook last spoke, and was acted on
        attached_dap = False  # a notebook's DAP client attached to debugpy here (a later one need not)

        def handle(self, msg: ToControl) -> Mapping[str, Any] | None:
            if msg["t"] in (Msg.INTERRUPT, Msg.HOLD):
                return {"error": "this job is attached read-only: distnb does not interrupt or pause it"}
            if msg["t"] == Msg.PEEK or msg["t"] == Msg.DAP:
                why = _refused(msg)
                if why:
                    return {"error": why}
                self._note_debugging()
                if msg["t"] == Msg.PEEK:
                    if self.asked_by == self.push_route:
                        self.heard, self.lapsed = time.monotonic(), False  # the notebook holding the pause is still there
                    return dict(peek(msg))
                self.heard, self.lapsed = time.monotonic(), False
                self.push_route = self.asked_by  # debugpy's answers and stops go to the notebook debugging
                self.tick_every = TICK_MS
                self.leaving = bool(msg.get("leave"))
                commands = {m.get("command") for m in msg["msgs"]}
                arming = any(m.get("command") == "setBreakpoints" and (m.get("arguments") or {}).get("breakpoints") for m in msg["msgs"])
                self.holding = not self.leaving and (self.holding or bool(commands & _HOLDING) or arming)
                reply = super().handle({"t": Msg.DAP, "id": msg["id"], "msgs": msg["msgs"]})  # not the pool's "before each collective"
                if reply is None or "error" in reply:
                    return reply
                # Fresh until a client attached: one whose first try timed out must still attach.
                fresh, self.attached_dap = not self.attached_dap, self.attached_dap or "attach" in commands
                return {**reply, "fresh": fresh}
            return super().handle(msg)

        def _note_debugging(self) -> None:
            if not self.debugged:
                self.debugged = True
                print(f"distnb: rank {rank}: a notebook attached to this job is debugging this rank (%dist_debug): what it types "
                      "runs here, and it may pause this rank; DISTNB_ATTACH_DEBUG=0 at launch refuses that", file=sys.stderr, flush=True)

        def tick(self) -> None:
            link = self.executor.panel
            if self.leaving and link.untrace():
                self.leaving = False
            if self.lapsed or time.monotonic() - self.heard < _lease():
                if self.lapsed and not self.leaving:
                    self.tick_every = None  # nothing left to do until the notebook speaks again
                return
            self.lapsed = True
            if self.holding and link.sock is not None:
                # The notebook that paused the rank (or asked it to, or set breakpoints) went quiet:
                # closed, crashed, forgot. The job comes first: its breakpoints go, and "*" resumes it
                # and takes back a pause or step not landed yet.
                clear = [{"seq": LET_GO_SEQ + 1 + i, "type": "request", "command": "setBreakpoints",
                          "arguments": {"source": {"path": path}, "breakpoints": []}} for i, path in enumerate(link.armed_files())]
                link.send([*clear, {"seq": LET_GO_SEQ, "type": "request", "command": "continue", "arguments": {"threadId": "*"}}])
                print(f"distnb: rank {rank}: the notebook that paused this rank said nothing for {_lease():g} s: "
                      "the rank goes on", file=sys.stderr, flush=True)
            self.holding = False
            self.leaving = link.sock is not None  # debugpy traced the rank on starting, whatever the notebook did since

    control = AttachableControl(ctx, addr, creds, rank, executor, bind=True)
    control.state = "in the job"
    control.seqs = None  # nothing to push to: the notebook asks
    return control


def _refused(msg: Mapping[str, Any]) -> str:
    """Why a look into this rank's frames, or its debugger, is refused ("" when it is not)."""
    if os.environ.get(DEBUG_SWITCH) == "0":
        return f"this job was started with {DEBUG_SWITCH}=0: its ranks can be looked at (%dist_stacks …), not debugged"
    if not msg.get("consent"):
        return ("debugging a rank of a live job runs code in it and may pause it, so it is done only when asked: "
                "%dist_debug RANK (AttachedJob.debug) asks, with a warning")
    return ""


def _lease() -> float:
    try:
        return float(os.environ.get(LEASE_ENV) or LEASE)
    except ValueError:
        return LEASE
