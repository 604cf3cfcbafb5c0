"""What the controller knows of one rank: its processes, where it runs, its state, the cell it
runs, and its output outside any cell."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any

from distnb.controller.cell_run import CellRun
from distnb.states import RankState
from distnb.wire.protocol import Hello, RankExit, Ready, StartFailed, SupHello
from distnb.wire.record_types import CallRecord

__all__ = ["RankRecord"]


@dataclass
class RankRecord:
    """What the controller knows of one rank. ``agent`` is the node agent that started it (0: this
    machine); ``group_rank`` is torchrun's node index."""

    rank: int
    state: RankState = RankState.LAUNCHED
    supervisor_pid: int | None = None
    pid: int | None = None
    host: str | None = None
    local_rank: int | None = None
    device: str | None = None
    backend: str | None = None
    returncode: int | None = None
    start_error: str | None = None
    stderr_tail: str = ""
    # A dead rank's last watched calls, from its black box (wire/black_box.py), oldest first.
    last_calls: list[CallRecord] = field(default_factory=list)
    died_at: float | None = None  # monotonic
    main_ident: int | None = None
    agent: int = 0
    group_rank: int | None = None
    agent_beats: int = 0  # its agent's beat count when the rank said hello
    cause: str = ""  # why it died, when no exit code tells (a machine lost)
    run: CellRun | None = None
    log: list[str] = field(default_factory=list)  # output outside any cell (start-up, threads)
    decoders: dict[str, Any] = field(default_factory=dict)

    # -- what the rank and its supervisor say about themselves (the tracker moves the state) -----
    def learn_supervisor(self, msg: SupHello) -> None:
        """The supervisor's hellos: the first with its own process and place, a second with the
        rank process's pid once it exists (again after each respawn)."""
        if "pid" in msg:
            self.supervisor_pid = msg["pid"]
            self.host = msg.get("host")
            self.local_rank = msg.get("local_rank")
            self.group_rank = msg.get("group_rank")
            self.agent = int(msg.get("agent", 0))
        if "child_pid" in msg:
            self.pid = msg["child_pid"]

    def learn_hello(self, msg: Hello) -> None:
        self.pid, self.host, self.local_rank = msg["pid"], msg["host"], msg["local_rank"]
        self.main_ident = msg.get("main_ident")

    def learn_ready(self, msg: Ready) -> None:
        self.device, self.backend = msg["device"], msg["backend"]

    def learn_start_failure(self, msg: StartFailed) -> None:
        # Root cause first: the exception's line, then the traceback it came from (a note that
        # keeps a failure's first line must not keep "Traceback (most recent call last):").
        self.start_error = "\n".join(filter(None, (msg.get("summary"), msg.get("error")))) or "no reason given"

    def learn_exit(self, msg: RankExit) -> None:
        self.returncode = msg["returncode"]
        self.stderr_tail, self.last_calls = msg.get("stderr_tail", ""), msg.get("last_calls", [])

    def decode(self, stream: str, data: bytes) -> str:
        dec = self.decoders.get(stream)
        if dec is None:
            dec = self.decoders[stream] = codecs.getincrementaldecoder("utf-8")("replace")
        return str(dec.decode(data))
