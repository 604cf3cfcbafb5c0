"""The rank's control thread: answers stack, status and interrupt requests while a cell runs.

It owns its own socket, so it keeps answering while the main thread executes user code. gloo's and
NCCL's waits release the GIL, so a rank blocked in a collective still answers within a millisecond.
Nothing here may ever issue a collective on the user's process groups.

It also pushes the rank's new Flight Recorder entries to the controller on its own, within ~50 ms
of a collective being issued (~100 ms in a cell's first 50 ms, as it only starts watching once the
controller says the cell runs on; see :meth:`ControlThread._watch`): the controller's once-a-second
poll alone loses the last collective of a rank that dies abruptly (SIGKILL, gloo's SIGABRT) within
that second, which is exactly the one a post-mortem needs.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Mapping

import zmq

from distnb.wire.codec import BadFrame, Codec, ReplayGuard
from distnb.wire.peers import PeerKind, control_identity
from distnb.wire.protocol import CollectivesPush, Msg, ToControl, accept_request
from distnb.wire.security import Credentials
from distnb.wire.zmq_io import recv_frames, send_frames
from distnb.worker.process.debug import hold_request
from distnb.worker.process.execute import Executor
from distnb.worker.process.exit_guard import torch_work
from distnb.worker.recorders.main_cpu import MainCpu
from distnb.worker.torch_hooks.call_log import c10d_calls
from distnb.worker.torch_hooks.flight_recorder import SeqWatch, backends_in_use, open_nccl, read_collectives
from distnb.worker.torch_hooks.group_abort import ESCALATE_AFTER
from distnb.worker.torch_hooks.meshes import describe_meshes

__all__ = ["ControlThread", "thread_stacks"]

#: What %dist_env shows: torchrun's contract and the variables that steer NCCL/torch/CUDA.
ENV_NAMES = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "GROUP_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID",
}
ENV_PREFIXES = ("NCCL_", "TORCH_", "GLOO_", "CUDA_", "PYTORCH_")
#: How often the control thread looks at the groups' sequence numbers (a few µs per look).
WATCH_INTERVAL = 0.05
#: Share of one core the pushes may take while the main thread computes: a dump of a full
#: 2000-entry Flight Recorder takes ~50 ms, so pushes then come at most every ~2.5 s (the
#: controller's 1 s poll still runs); with the few entries of a typical notebook, every 50 ms.
WATCH_CPU_SHARE = 0.02


def thread_stacks(all_threads: bool, skip: set[int]) -> list[dict[str, Any]]:
    """Python stacks of the main thread (and others if asked), outermost frame first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    out = []
    for tid, frame in sys._current_frames().items():
        if tid in skip or (not all_threads and tid != main_id):
            continue
        frames = [(fs.filename, fs.lineno, fs.name, fs.line or "") for fs in traceback.extract_stack(frame)]
        out.append({"thread": names.get(tid, f"thread-{tid}"), "ident": tid, "main": tid == main_id, "frames": frames})
    out.sort(key=lambda s: not s["main"])
    return out


#: torch.distributed calls whose wait is on the rendezvous store, not on a gloo pair.
_GROUP_SETUP = {"init_process_group", "new_group", "new_subgroups", "new_subgroups_by_enumeration", "destroy_process_group",
                "split_group", "_new_group_with_tag", "_new_process_group_helper"}


class ControlThread(threading.Thread):
    #: The last interrupted cell whose group this thread aborted (or whose gloo connections it
    #: shut down) because the interrupt could not land: the controller reads it from the status
    #: (STACKS) once the cell has ended, and rebuilds the process group.
    unblocked: dict[str, Any] | None = None

    def __init__(self, ctx: zmq.Context[Any], addr: str, creds: Credentials, rank: int, executor: Executor, generation: int = 0,
                 bind: bool = False) -> None:
        """``generation``: the rank's respawn generation, in its connection's name (peers.in_generation).
        ``bind``: listen on ``addr`` (``tcp://127.0.0.1:*``) for a notebook that attaches to a job
        distnb did not launch (``worker/process/attachable.py``), instead of connecting to a pool's
        controller; ``addr`` then becomes the address bound."""
        super().__init__(name="distnb-control", daemon=True)
        self.rank = rank
        self.executor = executor
        # Bound, it is a ROUTER: each notebook attached gets its own replies (a DEALER would deal them round).
        self.routed = bind
        self.sock = ctx.socket(zmq.ROUTER if bind else zmq.DEALER)
        name = control_identity(rank, generation)
        self.sock.setsockopt(zmq.IDENTITY, name)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Bound on an address other machines reach, it is the CURVE server (an attachable rank's
        # credentials hold the server's secret); kept, so the gate admitting the notebook's key lives.
        self.gate = creds.secure_server(ctx, self.sock) if bind else None
        if not bind:
            creds.secure_client(self.sock)
        if bind:
            self.sock.bind(addr)
            addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sock.connect(addr)
        self.addr = addr
        self.codec = Codec(creds.key, name.decode())
        self.guard = ReplayGuard()
        self.state = "starting"
        # DISTNB_FR_WATCH=0 turns the pushes off (benchmarks compare; the 1 s poll remains).
        self.seqs: SeqWatch | None = SeqWatch() if os.environ.get("DISTNB_FR_WATCH", "1") != "0" else None
        self._main_cpu = MainCpu()
        self._pushed_seqs: tuple[tuple[str, int], ...] | None = None
        self._seen_seqs: tuple[tuple[str, int], ...] | None = None
        self._pushed_id = -1  # the newest record already pushed
        self._pushed_call = -1  # the newest watched call already pushed (worker/torch_hooks/call_log.py)
        self._open_ids: set[int] = set()  # records pushed as not yet completed
        self._stuck_ids: set[int] = set()  # open ones not worth re-reading for
        self._was_running = False
        self._next_push = 0.0
        self._next_watch = 0.0
        self._poller: zmq.Poller | None = None
        self._panel_fd: int | None = None  # debugpy's socket, once the notebook's debugger panel asked
        self.asked_by: list[bytes] = []  # bound: the route to the notebook whose request is being handled
        self.push_route: list[bytes] = []  # bound: the route debugpy's messages are pushed to (the notebook debugging)
        #: Milliseconds between calls of :meth:`tick` (None: never), for a subclass's own timers.
        self.tick_every: int | None = None
        self.watch_dumps = 0  # Flight Recorder reads the watch made, and their total time (benchmarks)
        self.watch_seconds = 0.0

    def run(self) -> None:
        # An idle rank's control thread sleeps until a request comes: no wake-ups between cells,
        # nor in a quick cell. A cell still running after WATCH_AFTER gets a WATCH from the
        # controller, and the thread looks every WATCH_INTERVAL from then until the cell ends.
        poller = self._poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while True:
            try:
                idle = self.executor.cell is None and not self._was_running
                # Rounded up: a 0 ms poll would spin until the next look is due.
                wait_ms = None if self.seqs is None or idle else max(0, math.ceil((self._next_watch - time.monotonic()) * 1000))
                if self.tick_every is not None:
                    wait_ms = min(wait_ms, self.tick_every) if wait_ms is not None else self.tick_every
                events = dict(poller.poll(wait_ms))
                # What it does may enter torch's C++ code: never while the rank exits (exit_guard.py).
                with torch_work() as serving:
                    if not serving:
                        return
                    if self.sock in events:
                        self._serve_one(recv_frames(self.sock))
                    if self._panel_fd is not None and self._panel_fd in events:
                        self._relay_panel()
                    if self.tick_every is not None:
                        self.tick()
                    if self.seqs is not None and time.monotonic() >= self._next_watch:
                        self._next_watch = time.monotonic() + WATCH_INTERVAL
                        self._watch()
            except zmq.ContextTerminated:
                return

    def _serve_one(self, frames: list[bytes]) -> None:
        route: list[bytes] = []
        if self.routed:  # the asking notebook's identity first: the reply goes back to it
            route, frames = frames[:1], frames[1:]
        self.asked_by = route
        try:
            msg = accept_request(PeerKind.CONTROL, self.codec.decode(frames, self.guard))
        except BadFrame:
            return
        try:
            answer = self.handle(msg)
        except Exception as exc:  # a failing probe must never take the control plane down
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        if answer is not None:
            reply = {**answer, "t": Msg.REPLY, "id": msg.get("id"), "rank": self.rank}
            try:
                frames = self.codec.encode(reply)
            except Exception as exc:  # e.g. FrameTooLarge: answer with the reason, keep serving
                frames = self.codec.encode({"t": Msg.REPLY, "id": msg.get("id"), "rank": self.rank,
                                            "error": f"the reply could not be sent: {type(exc).__name__}: {exc}"})
            send_frames(self.sock, route + frames)

    def _watch(self) -> None:
        """Push new Flight Recorder entries when a group's sequence number moved, and the end of
        the collectives pushed as still open once the main thread has left them.

        The look costs a few µs; the read it may trigger costs ms (tens with a full recorder), so
        while the main thread computes, reads are spaced to stay under WATCH_CPU_SHARE of a core.
        A main thread that has sat in a collective for a whole look is the case that matters (it
        may never come back) and costs the user nothing, so that one is pushed at once.
        """
        assert self.seqs is not None
        # Collectives are issued by cells: an idle rank skips the look (one more after a cell ends).
        running = self.executor.cell is not None
        if not running and not self._was_running:
            return
        self._was_running = running
        try:
            seqs = self.seqs.snapshot()
            # Unchanged since the last look: the rank has been sitting in (or after) a collective.
            settled, self._seen_seqs = seqs == self._seen_seqs, seqs
            if seqs is None:
                return
            moved = seqs != self._pushed_seqs
            in_collective = bool(c10d_calls())
            # Pushed as open, and the main thread is no longer in torch.distributed: likely done.
            # (Without this, a rank killed while computing after a collective would be reported
            # as dying inside it.)
            closing = bool(self._open_ids - self._stuck_ids) and not in_collective
            if not moved and not closing:
                return
            now = time.monotonic()
            # A loop issuing collectives back to back is inside torch.distributed most of the time
            # but never settled: it stays within the CPU share.
            if now < self._next_push and not (moved and settled and in_collective):
                return
            # Re-read from the oldest entry that may have closed (open ones always come back).
            watched = self._open_ids - self._stuck_ids
            since = min(min(watched) - 1, self._pushed_id) if watched else self._pushed_id
            t0 = time.perf_counter()
            reply = read_collectives(since, self.executor.clock, self.executor.calls, self._pushed_call)
            took = time.perf_counter() - t0
            self.watch_dumps += 1
            self.watch_seconds += took
            self._next_push = now + max(WATCH_INTERVAL, took / WATCH_CPU_SHARE)
            entries = reply.get("entries")
            if entries is None:  # no Flight Recorder: nothing to push, ever
                self.seqs = None
                return
            newest = max((e["id"] for e in entries), default=-1)
            calls = reply.get("calls", [])
            newest_call = max((c["n"] for c in calls), default=-1)
            # Point-to-point calls and group creation move a group's counter without an entry.
            if moved and newest <= self._pushed_id and newest_call <= self._pushed_call:
                # The look raced ahead of the recorder (counter moved, entry not yet written):
                # look again next time.
                return
            open_ids = {e["id"] for e in entries if not e["done"]}  # every open one, whatever ``since``
            self._stuck_ids &= open_ids
            unchanged = not moved and open_ids == self._open_ids
            if unchanged:
                # Still open with the main thread elsewhere (an async handle not waited yet, or a
                # collective that timed out and will never retire): stop re-reading for them;
                # the controller's own poll follows them from here.
                self._stuck_ids |= open_ids
            self._pushed_seqs, self._pushed_id, self._open_ids = seqs, max(self._pushed_id, newest), open_ids
            self._pushed_call = max(self._pushed_call, newest_call)
            if (entries or calls) and not unchanged:
                push: CollectivesPush = {**reply, "t": Msg.COLLECTIVES_PUSH, "rank": self.rank, "pid": os.getpid()}
                send_frames(self.sock, self.codec.encode(push))
        except zmq.ContextTerminated:
            raise
        except Exception:  # best effort: the controller's own poll still runs
            self._next_push = time.monotonic() + 1.0

    def status(self) -> dict[str, Any]:
        ex = self.executor
        cell = ex.cell
        paused = (ex.debug.prompter.paused if ex.debug is not None else None) or ex.panel.paused()
        return {
            "state": "running" if cell is not None else "busy" if ex.busy else self.state,
            "busy": ex.busy,
            # {kind, where, since}: waiting for the notebook's line (pdb or input()), not hung
            "paused": dict(paused, since=time.monotonic() - paused["since"]) if paused else None,
            "cell": cell,
            "elapsed": time.monotonic() - ex.started if cell is not None else None,
            "pid": os.getpid(),
            "unblocked": self.unblocked,
            # The main thread's CPU share lately: computing (slow) or blocked outside torch.distributed.
            "cpu": self._main_cpu.look() if cell is not None else None,
        }

    def _nudge(self, cell: int, sigints: int) -> None:
        ex = self.executor
        with ex.lock:
            if ex.cell == cell and ex.sigints == sigints:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]

    def _escalate(self, cell: int, sigints: int) -> None:
        """The interrupt has not landed: a Python signal handler can't run while the main thread
        waits in C++ — in gloo's wait for a peer, or in a CUDA sync that waits for an NCCL
        collective whose peers never come. NCCL: aborting the rank's communicators ends the
        collective. gloo: its abort does not wake the wait, so the rank's gloo connections are
        shut down under it (``worker/torch_hooks/gloo_unblock.py``) and the collective raises. Either way the
        pending KeyboardInterrupt is raised in the cell and the namespace stays; the group is then
        unusable, and the controller rebuilds it once the cell has ended on every rank."""
        ex = self.executor
        with ex.lock:
            if ex.cell != cell or ex.sigints != sigints:
                return
        from distnb.worker.torch_hooks.gloo_unblock import open_gloo

        backends = backends_in_use()
        nccl = open_nccl() if "nccl" in backends else ""
        gloo = "" if nccl or "gloo" not in backends else open_gloo()
        calls = c10d_calls()
        entering = not nccl and not gloo and bool(calls)
        if entering and "nccl" in backends:
            # Inside the call itself, before its entry exists: NCCL connects to the group's
            # peers at its first collective, and the host waits there for peers that never come.
            nccl = "a collective it is still entering (connecting to its peers)"
        elif entering and "gloo" in backends and not _GROUP_SETUP.intersection(calls):
            gloo = f"{calls[0]} (gloo)"
        elif not nccl and not gloo and "gloo" in backends:
            # A main thread in work.wait() of an isend/irecv is in no torch.distributed frame and
            # no gloo recorder entry: the call log still holds the call as open.
            pending = ex.calls.open_p2p()
            if pending:
                last = pending[-1]
                peer = last["args"].get("dst" if last["op"] in ("send", "isend") else "src")
                gloo = f"{last['op']} {'to' if last['op'] in ('send', 'isend') else 'from'} rank {peer} (gloo)"
        if nccl:
            self._abort_nccl(cell, nccl)
        elif gloo:
            self._unblock_gloo(cell, gloo, also_nccl="nccl" in backends)
        # else: not a wait on a peer (a long kernel, C code): an abort would not help

    def _abort_nccl(self, cell: int, waiting: str) -> None:
        from distnb.worker.torch_hooks.group_abort import abort_backends

        self.unblocked = {"cell": cell, "backend": "nccl", "waiting": waiting}
        print(f"distnb: rank {self.rank} did not react to the interrupt for {ESCALATE_AFTER:.0f} s while its GPU waited for "
              f"{waiting}: aborting its NCCL communicators so the cell can stop (the namespace stays; the process group is "
              "rebuilt once the cell has ended on every rank).", file=sys.stderr, flush=True)
        if not abort_backends(timeout=10.0):
            print("distnb: the abort has not finished after 10 s; %dist_restart if the cell stays stuck.", file=sys.stderr, flush=True)

    def _unblock_gloo(self, cell: int, waiting: str, also_nccl: bool) -> None:
        from distnb.worker.torch_hooks.gloo_unblock import gloo_connections, shut_down, store_and_controller_ports
        from distnb.worker.torch_hooks.group_abort import abort_backends

        record = {"cell": cell, "backend": "gloo", "waiting": waiting}
        if also_nccl:  # NCCL's own sockets go with its communicators, not by a shutdown under them
            self.unblocked = record
            abort_backends(timeout=10.0)
        conns = gloo_connections(store_and_controller_ports(self.addr))
        if not conns:
            print(f"distnb: rank {self.rank} did not react to the interrupt for {ESCALATE_AFTER:.0f} s while blocked in {waiting}, "
                  "and distnb found none of its gloo connections to shut down: the cell stops when the collective times out "
                  "(--pg-timeout); %dist_restart to stop it now.", file=sys.stderr, flush=True)
            return
        if self.executor.cell != cell and not also_nccl:
            return  # ended meanwhile (a peer's shutdown reached it): the group is rebuilt on that peer's word
        self.unblocked = {**record, "connections": len(conns)}
        print(f"distnb: rank {self.rank} did not react to the interrupt for {ESCALATE_AFTER:.0f} s while blocked in {waiting}: "
              f"shutting down its {len(conns)} gloo connection{'s' * (len(conns) != 1)} so the cell can stop (the namespace stays; "
              "the process group is rebuilt once the cell has ended on every rank).", file=sys.stderr, flush=True)
        shut_down(conns)
        deadline = time.monotonic() + ESCALATE_AFTER * 2
        while time.monotonic() < deadline and self.executor.cell == cell:
            time.sleep(0.05)
        if self.executor.cell == cell:
            print(f"distnb: rank {self.rank} is still in the cell {ESCALATE_AFTER * 2:.0f} s later: it waits in something else "
                  "(%dist_stacks shows where); %dist_restart if it stays stuck.", file=sys.stderr, flush=True)

    def _start_panel(self, msgs: list[dict[str, Any]], stops: bool | None = None) -> dict[str, Any]:
        """Relay DAP requests to this rank's debugpy (started on the first): the answers come back
        unasked, as DAP_PUSH, in the order debugpy sends them."""
        link = self.executor.panel
        why = link.start()
        if why:
            return {"error": why}
        if link.sock is not None and self._panel_fd != link.sock.fileno() and self._poller is not None:
            self._panel_fd = link.sock.fileno()
            self._poller.register(self._panel_fd, zmq.POLLIN)
        if stops is not None:
            link.collective_stops(stops)
        if msgs:
            link.send(msgs)
        return {"ok": True}

    def _relay_panel(self) -> None:
        link = self.executor.panel
        msgs, open_ = link.read()
        if not open_ and self._poller is not None and self._panel_fd is not None:
            self._poller.unregister(self._panel_fd)
            self._panel_fd = None
            msgs.append({"type": "event", "event": "distnb_link_closed", "body": {}})
        if msgs:
            send_frames(self.sock, self.push_route + self.codec.encode({"t": Msg.DAP_PUSH, "rank": self.rank, "msgs": msgs}))

    def tick(self) -> None:
        """Called every :attr:`tick_every` ms on this thread, while that is set."""

    def handle(self, msg: ToControl) -> Mapping[str, Any] | None:
        if msg["t"] == Msg.DAP:
            return self._start_panel(msg["msgs"], msg.get("stops"))
        if msg["t"] == Msg.STACKS:
            reply = {"stacks": thread_stacks(bool(msg.get("all_threads")), {threading.get_ident()}), **self.status()}
            if msg.get("paths") and self.executor.paths.on:
                reply["paths"] = self.executor.paths.snapshot()  # where a hung cell's ranks went so far
            if msg.get("paths") and self.executor.compiles.on:
                reply["compiles"] = self.executor.compiles.snapshot()
            if threads := self.executor.threads.peek():
                reply["threads"] = threads  # a thread that raised while the cell runs on
            if "collectives_since" in msg:
                # In the same answer, so a rank that can't answer (a C loop holding the GIL) costs
                # the caller one timeout, not one per question.
                reply["collectives"] = read_collectives(int(msg["collectives_since"]), self.executor.clock,
                                                        self.executor.calls, int(msg.get("calls_since", -1)),
                                                        groups=bool(msg.get("groups")))
            return reply
        if msg["t"] == Msg.MEMORY:
            # Safe from this thread: /proc reads and CUDA allocator counters take no user locks.
            return {"memory": self.executor.memory.stop()}
        if msg["t"] == Msg.COLLECTIVES:
            return read_collectives(int(msg.get("since", -1)), self.executor.clock, self.executor.calls, int(msg.get("calls_since", -1)),
                                    groups=bool(msg.get("groups")))
        if msg["t"] == Msg.ENV:
            return {"env": {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}}
        if msg["t"] == Msg.MESHES:
            return {"meshes": describe_meshes(self.executor.ns)}
        if msg["t"] == Msg.HOLD:  # before the next collective: pause there, or raise rather than wait (worker/process/debug.py)
            return hold_request(self.executor.debug, msg)
        if msg["t"] == Msg.WATCH:
            return None  # waking this thread was the point: the loop now watches the running cell
        if msg["t"] == Msg.INTERRUPT:
            delivered = False
            ex, cell = self.executor, msg.get("cell")
            with ex.lock:
                if ex.cell is not None and cell in (None, ex.cell):
                    # A real signal (not interrupt_main) so a main thread blocked in a syscall wakes up.
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
                    delivered = True
                    # A signal landing just before a blocking call (e.g. sleep) is only acted on when
                    # the call returns; if the handler has not run shortly after, signal once more.
                    for after, then in ((0.25, self._nudge), (ESCALATE_AFTER, self._escalate)):
                        timer = threading.Timer(after, then, (ex.cell, ex.sigints))
                        timer.daemon = True
                        timer.start()
                elif ex.cell is None and cell is not None:
                    ex.interrupt_cell = cell  # the cell's EXEC has not arrived yet: interrupt it on arrival
                    delivered = True
            return {"delivered": delivered, **self.status()}
        return {"error": f"unknown request {msg['t']!r}"}
