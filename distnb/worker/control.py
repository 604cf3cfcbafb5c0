"""The rank's control thread: answers stack, status and interrupt requests while a cell runs.

It owns its own socket, so it keeps answering while the main thread executes user code. gloo's and
NCCL's waits release the GIL, so a rank blocked in a collective still answers within a millisecond.
Nothing here may ever issue a collective on the user's process groups.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import zmq

from distnb.protocol import BadFrame, Codec, Msg, ReplayGuard, control_identity
from distnb.security import Credentials
from distnb.worker.collectives import read_collectives
from distnb.worker.execute import Executor

__all__ = ["ControlThread", "thread_stacks"]

#: What %dist_env shows: torchrun's contract and the variables that steer NCCL/torch/CUDA.
ENV_NAMES = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "GROUP_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID",
}
ENV_PREFIXES = ("NCCL_", "TORCH_", "GLOO_", "CUDA_", "PYTORCH_")


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


class ControlThread(threading.Thread):
    def __init__(self, ctx: zmq.Context, addr: str, creds: Credentials, rank: int, executor: Executor) -> None:
        super().__init__(name="distnb-control", daemon=True)
        self.rank = rank
        self.executor = executor
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, control_identity(rank))
        self.sock.setsockopt(zmq.LINGER, 0)
        creds.secure_client(self.sock)
        self.sock.connect(addr)
        self.codec = Codec(creds.key, f"c{rank}")
        self.guard = ReplayGuard()
        self.state = "starting"

    def run(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart()
            except zmq.ContextTerminated:
                return
            try:
                msg = self.codec.decode(frames, self.guard)
            except BadFrame:
                continue
            try:
                reply = self.handle(msg)
            except Exception as exc:  # a failing probe must never take the control plane down
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            if reply is not None:
                reply.update(t=Msg.REPLY, id=msg.get("id"), rank=self.rank)
                self.sock.send_multipart(self.codec.encode(reply))

    def status(self) -> dict[str, Any]:
        ex = self.executor
        cell = ex.cell
        return {
            "state": "running" if cell is not None else self.state,
            "cell": cell,
            "elapsed": time.monotonic() - ex.started if cell is not None else None,
            "pid": os.getpid(),
        }

    def _nudge(self, cell: int, sigints: int) -> None:
        ex = self.executor
        with ex.lock:
            if ex.cell == cell and ex.sigints == sigints:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]

    def handle(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        t = msg["t"]
        if t == Msg.STACKS:
            return {"stacks": thread_stacks(bool(msg.get("all_threads")), {threading.get_ident()}), **self.status()}
        if t == Msg.STATUS:
            return self.status()
        if t == Msg.MEMORY:
            # Safe from this thread: /proc reads and CUDA allocator counters take no user locks.
            return {"memory": self.executor.memory.stop()}
        if t == Msg.COLLECTIVES:
            return read_collectives(int(msg.get("since", -1)), self.executor.clock)
        if t == Msg.ENV:
            return {"env": {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}}
        if t == Msg.INTERRUPT:
            delivered = False
            ex, cell = self.executor, msg.get("cell")
            with ex.lock:
                if ex.cell is not None and cell in (None, ex.cell):
                    # A real signal (not interrupt_main) so a main thread blocked in a syscall wakes up.
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
                    delivered = True
                    # A signal landing just before a blocking call (e.g. sleep) is only acted on when
                    # the call returns; if the handler has not run shortly after, signal once more.
                    nudge = threading.Timer(0.25, self._nudge, (ex.cell, ex.sigints))
                    nudge.daemon = True
                    nudge.start()
                elif ex.cell is None and cell is not None:
                    ex.interrupt_cell = cell  # the cell's EXEC has not arrived yet: interrupt it on arrival
                    delivered = True
            return {"delivered": delivered, **self.status()}
        return {"error": f"unknown request {t!r}"}
