"""The rank process (``python -m distnb.worker.process.rank``), started by its supervisor.

Order matters: connect and say hello *before* importing torch and initialising the process group,
so a rank stuck in rendezvous or NCCL init is visible to the controller.
"""

from __future__ import annotations

import ctypes
import faulthandler
import io
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Mapping

import zmq

from distnb import _processes
from distnb._text import mib
from distnb.wire import codec
from distnb.wire.cell_code import RANK_NAMES, unpack
from distnb.wire.codec import BadFrame, Codec, FrameTooLarge, ReplayGuard, socket_max_msgsize
from distnb.wire.peers import PeerKind, exec_identity
from distnb.wire.protocol import CellDone, Hello, Msg, Ready, StartFailed, StdinReply, ToExec, accept_request
from distnb.wire.security import Credentials
from distnb.wire.zmq_io import recv_frames, send_frames
from distnb.worker.process import zygote
from distnb.worker.process.child import write_event
from distnb.worker.process.control import ControlThread
from distnb.worker.process.debug import Prompter
from distnb.worker.process.debug import install as install_debugger
from distnb.worker.process.execute import Executor, mimebundle
from distnb.worker.process.quiet import QuietCheck
from distnb.worker.recorders.checksum import checksum
from distnb.worker.recorders.memory_sampler import MemorySampler
from distnb.worker.recorders.paths import record_paths
from distnb.worker.recorders.profiling import run_profiled
from distnb.worker.torch_hooks import gloo_idle, pasted
from distnb.worker.torch_hooks.call_log import install
from distnb.worker.torch_hooks.comms import run_with_comms
from distnb.worker.torch_hooks.flight_recorder import open_nccl
from distnb.worker.torch_hooks.imported import imported_module
from distnb.worker.torch_hooks.numerics import run_with_numerics
from distnb.worker.torch_hooks.regroup import regroup

_libc = ctypes.CDLL(None)
_IONBF = 2


def _c_stdio_unbuffered() -> bool:
    """Make sure C's stdout and stderr are unbuffered (CPython does it too under the
    PYTHONUNBUFFERED the supervisor sets, but a user's environment may say otherwise): a C
    extension's printf reaches the notebook when it is written, and the end of a cell needs no
    ``fflush`` through ctypes (~25 µs of a rank's CPU per cell on a busy machine). False where the
    C library does not name its streams so; then every cell flushes them."""
    try:
        for name in ("stdout", "stderr"):
            if _libc.setvbuf(ctypes.c_void_p.in_dll(_libc, name), None, _IONBF, 0) != 0:
                return False
    except (ValueError, AttributeError):
        return False
    return True

#: The running rank (set by ``main``), for inspection from a cell when debugging distnb itself:
#: ``sys.modules["__main__"].current`` (this module runs as ``__main__``).
current: Rank | None = None


#: Seconds a check or pull waits for the rank's GPU to finish queued work before saying it is busy.
DEVICE_WAIT = 3.0


def _device_busy(bound: float) -> str:
    """``""`` when the rank's current CUDA stream has no unfinished work (or CUDA is not in use);
    else the open NCCL collectives in words (``"busy"`` when there are none to name). An event
    recorded on the stream completes once everything queued before it has."""
    cuda: Any = imported_module("torch.cuda")
    if cuda is None or not cuda.is_initialized():
        return ""
    event = cuda.Event()
    event.record()
    deadline = time.monotonic() + bound
    while not event.query():
        if time.monotonic() > deadline:
            return open_nccl() or "busy"
        time.sleep(0.005)
    return ""


#: Room left in a pull reply for the message around the pickled value (tags, id, counter).
_REPLY_SLACK = 4096


def _reopen(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True)


class Rank:
    def __init__(self) -> None:
        env = os.environ
        self.rank = int(env["RANK"])
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.world_size = int(env["WORLD_SIZE"])
        self.addr = env["DISTNB_ADDR"]
        # Keep the key out of the user's os.environ (and of subprocesses the user starts).
        self.creds = Credentials.from_env(env, pop=True)
        # Cell events (display, done) go through a pipe to the supervisor, which drains the
        # rank's stdout/stderr before forwarding them: output and results stay in order.
        self.events_fd = int(env.pop("DISTNB_EVENTS_FD"))
        self.backend = env.get("DISTNB_BACKEND", "auto")
        self.pg_timeout = float(env.get("DISTNB_PG_TIMEOUT", "1800"))
        self.ctx = zmq.Context(1)
        # A default for every socket of this context, the control thread's included: a frame
        # bigger than any legitimate one is refused by libzmq instead of being buffered whole.
        self.ctx.setsockopt(zmq.MAXMSGSIZE, socket_max_msgsize())
        self.sock = self.ctx.socket(zmq.DEALER)
        self.generation = int(os.environ.get("DISTNB_GENERATION", "0"))
        self.sock.setsockopt(zmq.IDENTITY, exec_identity(self.rank, self.generation))
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.creds.secure_client(self.sock)
        self.sock.connect(self.addr)
        self.codec = Codec(self.creds.key, exec_identity(self.rank, self.generation).decode())
        self.guard = ReplayGuard()
        self.send_lock = threading.Lock()
        self.stdio = (sys.stdout, sys.stderr)
        self.c_unbuffered = False  # C's stdout and stderr (see setup_process)
        self.control: ControlThread | None = None
        self.ns: dict[str, Any] = {}
        self.executor = Executor(self.ns, self._send_display, MemorySampler(self.local_rank))
        fence = env.pop("DISTNB_READ_FENCE_FD", None)
        self.quiet = QuietCheck(int(fence) if fence else None, (1, 2, self.events_fd))
        self.executor.debug = install_debugger(Prompter(self._ask, self._answer, lambda: self.executor.cell))

    def send(self, msg: Mapping[str, Any]) -> None:
        frames = self.codec.encode(msg)
        with self.send_lock:
            send_frames(self.sock, frames)

    def _send_display(self, cell: int, bundle: dict[str, str]) -> None:
        if threading.current_thread() is not threading.main_thread():
            # Events belong to the main thread's cell; from elsewhere fall back to text.
            print(bundle.get("text/plain", ""), flush=True)
            return
        self.flush_output()
        write_event(self.events_fd, {"t": Msg.DISPLAY, "cell": cell, "data": bundle})

    def _ask(self, request: dict[str, Any]) -> None:
        """A cell wants a line from the notebook: after everything it printed so far."""
        self.flush_output()
        write_event(self.events_fd, request)

    def _answer(self, request_id: int) -> StdinReply:
        """The notebook's line for request ``request_id``, read on the main thread (which owns this
        socket, and in a cell has nothing else to read from it)."""
        while True:
            try:
                msg = accept_request(PeerKind.EXEC, self.codec.decode(recv_frames(self.sock), self.guard))
            except BadFrame:
                continue
            if msg["t"] == Msg.STDIN_REPLY and msg.get("id") == request_id:
                return msg
            if "id" in msg and msg["t"] != Msg.STDIN_REPLY:
                self.reply(msg, {"status": "error", "error": f"rank {self.rank} is running cell {self.executor.cell} and waits for a "
                                 "line from the notebook (debugger or input()); answer it first."})

    def setup_process(self) -> None:
        _processes.set_parent_death_signal(signal.SIGKILL)
        self.c_unbuffered = _c_stdio_unbuffered()
        for stream in self.stdio:
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(errors="backslashreplace")
        faulthandler.enable(file=sys.stderr, all_threads=True)
        fault_fd = os.environ.pop("DISTNB_FAULT_FD", None)
        if fault_fd is not None:
            # Read by the supervisor: gives a stack even when a C loop holds the GIL. The main
            # thread's own, never all threads': the handler reads frames without the GIL, so
            # another thread's, changing as that thread runs, can be freed under it (a SIGSEGV seen
            # on 3.11, a control thread's frame read while it ran; tests/e2e/test_stress_threads.py).
            # The supervisor sends the signal to the main thread itself (_processes.signal_main_thread).
            self._fault_file = os.fdopen(int(fault_fd), "w")
            faulthandler.register(signal.SIGUSR1, file=self._fault_file, all_threads=False, chain=False)
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.executor.cell is not None:
            self.executor.sigints += 1
            self.executor.panel.let_go()
            raise KeyboardInterrupt

    def init_distributed(self) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        backend = self.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise RuntimeError("--backend nccl needs CUDA, but torch.cuda.is_available() is False on this rank; use --backend gloo.")
            count = torch.cuda.device_count()
            shared = os.environ.get("DISTNB_SHARE_GPUS") == "1"
            if self.local_rank >= count and not shared:
                raise RuntimeError(
                    f"LOCAL_RANK {self.local_rank} has no GPU: only {count} visible "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); launch fewer ranks, "
                    "or --share-gpus to rehearse several NCCL ranks per GPU."
                )
            if shared:
                # NCCL's duplicate-GPU check and its transport choice key on this host hash.
                os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-distnb-rank{self.local_rank}"
            device = torch.device("cuda", self.local_rank % count)
            torch.cuda.set_device(device)  # by LOCAL_RANK, before the process group exists
            # The control thread answers %dist_memory, and its own current device is 0.
            self.executor.memory.device = device.index
        else:
            device = torch.device("cpu")
        kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=self.pg_timeout)}
        if backend == "nccl":
            kwargs["device_id"] = device
        if self.generation:
            # A respawned rank (%dist_restart, torchrun kept): torchrun's store still holds the first
            # group's keys, so this one lives under a prefix of its own.
            from torch.distributed.rendezvous import rendezvous

            store, _, _ = next(rendezvous("env://", timeout=timedelta(seconds=self.pg_timeout)))
            kwargs.update(store=dist.PrefixStore(f"distnb/restart/{self.generation}", store), rank=self.rank, world_size=self.world_size)
        gloo_idle.install()  # before the first group: an idle gloo group costs ~nothing then
        dist.init_process_group(**kwargs)
        _timeout_for_later_groups(kwargs["timeout"])
        if os.environ.get("DISTNB_CALL_LOG", "1") != "0":  # benchmarks compare without it
            install(self.executor.calls)
        pasted.install()  # a pasted script's init_process_group and clean-up keep the pool's group
        self.ns.update(zip(RANK_NAMES, (torch, dist, self.rank, self.local_rank, self.world_size, device)))
        return {"device": str(device), "backend": backend}

    def flush_output(self) -> None:
        """Push every buffered byte of output into the pipes (Python and C stdio)."""
        out, err = self.stdio
        if out.closed or err.closed:
            # The cell closed the stream object itself; fds 1 and 2 are still open.
            self.stdio = out, err = tuple(s if not s.closed else _reopen(fd) for s, fd in ((out, 1), (err, 2)))  # type: ignore[assignment]
        if sys.stdout is not out:
            sys.stdout = out  # the cell replaced it
        if sys.stderr is not err:
            sys.stderr = err
        for stream in (out, err):
            try:
                stream.flush()
            except Exception:
                pass
        if not self.c_unbuffered:
            _libc.fflush(None)  # C stdio buffers (printf from extensions)

    def handle(self, msg: ToExec) -> None:
        if msg["t"] == Msg.EXEC:
            cell = msg["cell"]
            mark = self.quiet.mark()
            try:
                if msg.get("debug_last"):
                    reply = self.executor.debug_last(cell)
                else:
                    compiled = unpack(msg.get("compiled"))
                    run = partial(self.executor.run, cell, msg["code"], bool(msg.get("pdb")), compiled=compiled,
                                  paths=record_paths(msg.get("paths")), source=msg.get("source"))
                    if msg.get("comms"):
                        run = partial(run_with_comms, run)
                    if msg.get("numerics"):
                        run = partial(run_with_numerics, run, str(msg.get("numerics")), self.ns)
                    peers = int(msg.get("profile") or 0)
                    reply = run_profiled(run, peers, f"distnb/profile/{cell}") if peers else run()
            except KeyboardInterrupt:  # a SIGINT that landed just outside the cell's try block
                reply = {"status": "interrupted", "value": None, "duration": 0.0,
                         "error": {"ename": "KeyboardInterrupt", "evalue": "", "traceback": "KeyboardInterrupt\n", "line": None}}
            self.flush_output()
            done: CellDone = {**reply, "t": Msg.CELL_DONE, "cell": cell}
            if self.quiet.quiet_since(mark):
                try:
                    self.send(done)  # the controller marks the result ``direct``
                    return
                except FrameTooLarge:
                    pass  # the supervisor's path replaces an oversized CELL_DONE with a small one
            write_event(self.events_fd, done)
        elif msg["t"] == Msg.PUSH:
            try:
                values = pickle.loads(msg["values"])
                self.ns.update(values)
                self.reply(msg, {"status": "ok"})
            except Exception as exc:
                self.reply(msg, {"status": "error", "error": f"{type(exc).__name__}: {exc}"})
        elif msg["t"] == Msg.PULL:
            pulled = self.on_device("distnb's pull", lambda: self.pull(msg["names"]))
            try:
                self.reply(msg, pulled)
            except FrameTooLarge as exc:
                # Each value fitted on its own, together they do not: say which and how big.
                sizes = ", ".join(f"{n!r} {mib(len(b))}" for n, b in pulled.get("values", {}).items())
                self.reply(msg, {"status": "error",
                           "error": f"{sizes} on rank {self.rank} are {mib(exc.size)} together, over distnb's limit of "
                           f"{mib(exc.limit)} per message; pull them one at a time."})
        elif msg["t"] == Msg.REGROUP:
            self.reply(msg, self.regroup(int(msg["generation"])))
        elif msg["t"] == Msg.CHECK:
            self.reply(msg, self.on_device("distnb's check", lambda: self.check(msg["names"])))

    def on_device(self, what: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run a request that may read GPU tensors, on the main thread between cells. Work still
        queued on the GPU (an NCCL collective whose peers never came) would block any read: wait
        for it DEVICE_WAIT seconds at most, then answer that the device is busy, and why."""
        self.executor.busy = what
        try:
            busy = _device_busy(DEVICE_WAIT)
            if busy:
                return {"status": "error", "error": f"rank {self.rank}'s GPU is still busy with queued work after {DEVICE_WAIT:.0f} s"
                        f"{' (not completed: ' + busy + ')' if busy != 'busy' else ''}: reading its tensors now would block the "
                        "rank until that work ends. See %dist_collectives; a collective whose peers never came needs them, or "
                        "an interrupt (which aborts it) and %dist_regroup."}
            return work()
        finally:
            self.executor.busy = ""

    def reply(self, request: ToExec, fields: dict[str, Any]) -> None:
        """Answer a request (PUSH, PULL, CHECK, REGROUP): the controller matches it by ``id``."""
        self.send({**fields, "t": Msg.REPLY, "id": request.get("id"), "rank": self.rank})

    def regroup(self, generation: int) -> dict[str, Any]:
        held = self.executor.stale.remember(self.ns)  # before the groups they hold are closed
        reply = regroup(self.rank, self.world_size, self.pg_timeout, self.ns.get("device"), self.executor.calls, generation)
        return {**reply, "holders": held} if held else reply

    def check(self, names: list[str]) -> dict[str, Any]:
        missing = [n for n in names if n not in self.ns]
        if missing:
            return {"status": "error", "error": f"{', '.join(map(repr, missing))} not defined on rank {self.rank}; "
                    "define it in an %%on_ranks cell (or pool.run) first, or %dist_push it from the notebook."}
        try:
            return {"status": "ok", "checks": {n: checksum(self.ns[n]) for n in names}}
        except Exception as exc:
            return {"status": "error", "error": f"checksum failed on rank {self.rank}: {type(exc).__name__}: {exc}"}

    def pull(self, names: list[str]) -> dict[str, Any]:
        out: dict[str, bytes] = {}
        for name in names:
            if name not in self.ns:
                return {"status": "error", "error": f"name {name!r} is not defined on rank {self.rank}"}
            value = self.ns[name]
            try:
                import torch

                if isinstance(value, torch.Tensor):
                    value = value.detach().cpu()  # the notebook may have no GPU
                blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
                if len(blob) > codec.MAX_FRAME_BYTES - _REPLY_SLACK:
                    raise FrameTooLarge(len(blob), codec.MAX_FRAME_BYTES)
                out[name] = blob
            except FrameTooLarge as exc:
                # Caught here, before the reply is built, so the notebook hears why at once
                # instead of waiting out its timeout for a frame that could never be sent.
                return {
                    "status": "error",
                    "error": f"{name!r} on rank {self.rank} is {mib(exc.size)} pickled, over distnb's limit of "
                    f"{mib(exc.limit)} per message. Reduce it in a cell first (a slice, a summary such as "
                    f"{name}.shape or {name}.sum(), or .half()), or save it to disk on the rank "
                    f"(torch.save({name}, path)) and load the file in the notebook. (The limit can be raised "
                    "with DISTNB_MAX_FRAME_BYTES set before launching.)",
                    "summary": mimebundle(value)["text/plain"][:500],
                }
            except Exception as exc:
                return {
                    "status": "error",
                    "error": f"{name!r} on rank {self.rank} can't be sent to the notebook: {type(exc).__name__}: {exc} "
                    f"(convert it to a picklable value in a cell first, e.g. a tensor, number or dict).",
                    "summary": mimebundle(value)["text/plain"][:500],
                }
        return {"status": "ok", "values": out}

    def serve(self) -> None:
        while True:
            msg: ToExec | None = None
            try:
                frames = recv_frames(self.sock)
                try:
                    msg = accept_request(PeerKind.EXEC, self.codec.decode(frames, self.guard))
                except BadFrame as exc:
                    print(f"distnb: rank {self.rank} dropped a message: {exc}", file=sys.stderr, flush=True)
                    continue
                self.handle(msg)
            except KeyboardInterrupt:
                continue  # an interrupt that arrived just after a cell ended
            except Exception as exc:
                if msg is not None and msg.get("t") == Msg.EXEC:
                    # The cell itself can't fail here (the executor catches everything); this is
                    # the events pipe or stdio failing, so no CELL_DONE could reach the notebook. Dying
                    # is then the honest answer: the supervisor reports the exit and the cell ends.
                    raise
                # Any other request this rank can't handle (a bug, a malformed message) must not
                # end the rank and every namespace the user built: report it and carry on.
                print(f"distnb: rank {self.rank} failed to handle a {msg.get('t') if msg else 'frame'!s} request: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                if msg is not None and "id" in msg:
                    try:
                        self.reply(msg, {"status": "error",
                                         "error": f"rank {self.rank} failed to handle the request: {type(exc).__name__}: {exc}"})
                    except Exception:
                        pass


def wait_as_spare(fd: int) -> bool:
    """A spare rank: import torch now, then wait until the supervisor makes this process the rank
    (``%dist_restart`` then skips the import). The word is the environment to add, pickled by our
    own supervisor on a private pipe. False: the pipe closed without it (the spare is not needed)."""
    import torch.distributed  # noqa: F401  (the import is what a spare is for)

    with os.fdopen(fd, "rb") as pipe:
        word = pipe.read()
    if not word:
        return False
    os.environ.update(pickle.loads(word))
    return True


def _timeout_for_later_groups(timeout: timedelta) -> None:
    """Groups made later without a timeout (``new_group``, ``init_device_mesh``'s dimensions) get
    torch's module default — 30 min on gloo — so a hang on a mesh dimension outlived the pool's
    ``--pg-timeout`` by far. The default is a module global read at each creation: set it."""
    from torch.distributed import distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        c10d.default_pg_nccl_timeout = timeout


def main() -> int:
    global current
    spare = os.environ.pop("DISTNB_SPARE_FD", None)
    if spare is not None and not wait_as_spare(int(spare)):
        return 0
    zygote_fd = os.environ.pop(zygote.ZYGOTE_ENV, None)
    if zygote_fd is not None and not zygote.run_zygote(int(zygote_fd)):
        return 0  # the zygote, ended; a forked child goes on as the rank
    r = current = Rank()
    r.setup_process()
    control = r.control = ControlThread(r.ctx, r.addr, r.creds, r.rank, r.executor, r.generation)
    control.start()
    r.send(Hello(t=Msg.HELLO, rank=r.rank, local_rank=r.local_rank, world_size=r.world_size, pid=os.getpid(),
                 host=socket.gethostname(), main_ident=threading.main_thread().ident))
    try:
        info = r.init_distributed()
    except BaseException as exc:
        r.send(StartFailed(t=Msg.START_FAILED, rank=r.rank, error="".join(traceback.format_exception(exc)),
                           summary=f"{type(exc).__name__}: {exc}"))
        time.sleep(0.2)  # let the frame leave before exiting
        return 1
    control.state = "idle"
    r.send(Ready(t=Msg.READY, rank=r.rank, device=info["device"], backend=info["backend"]))
    r.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
