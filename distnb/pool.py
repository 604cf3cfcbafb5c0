"""The Pool: a persistent torchrun pool and everything a notebook does with it."""

from __future__ import annotations

import atexit
import codecs
import itertools
import os
import socket
import pickle
import secrets
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from distnb import _processes
from distnb.channel import Channel
from distnb.collective_log import CollectiveLog, describe
from distnb.errors import LaunchError, NoPoolError, PoolBrokenError, PoolBusyError, RemoteError
from distnb.inspection import Inspection
from distnb.config import LaunchConfig, Rendezvous, is_loopback, split_host_port
from distnb.launcher import Launcher
from distnb.cluster import Nodes, NodeStarters, connect_host, join_command
from distnb.protocol import MAX_FRAME_BYTES, Msg, control_identity, exec_identity, node_identity, supervisor_identity
from distnb.security import Credentials, default_key_file
from distnb.ranks import format_ranks, parse_ranks
from distnb.results import CellRecord, CellResult, PoolState, PoolStatus, PushRecord, RankResult, RankState, RankStatus

__all__ = ["Pool", "PoolState", "CellEvents", "launch", "current_pool"]

#: Output kept per rank, per stream, per cell; the rest is counted, not stored.
OUTPUT_KEEP_BYTES = 1 << 20
#: Cells whose full results (output, values, memory) the pool keeps; older ones keep only
#: what replay and export need.
KEEP_RESULTS = 100
#: Pickled pushes kept for replay and export; beyond this the oldest are let go (and say so).
KEEP_PUSH_BYTES = 256 << 20


@dataclass
class CellEvents:
    """Callbacks for a running cell; all are called on distnb's I/O thread and must be quick."""

    on_output: Callable[[int, str, str], None] | None = None  # (rank, "stdout"/"stderr", text)
    on_display: Callable[[int, dict[str, str]], None] | None = None
    on_rank_done: Callable[[RankResult], None] | None = None


@dataclass
class _Rank:
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
    died_at: float | None = None
    main_ident: int | None = None
    node: int = 0  # 0: this machine; else the id of the node agent that started it
    group_rank: int | None = None  # torchrun's node rank
    node_beats: int = 0  # its agent's beat count when the rank said hello
    cause: str = ""  # why it died, when no exit code tells (a machine lost)
    run: "_CellRun | None" = None
    log: list[str] = field(default_factory=list)  # output outside any cell (start-up, threads)
    decoders: dict[str, Any] = field(default_factory=dict)

    def decode(self, stream: str, data: bytes) -> str:
        dec = self.decoders.get(stream)
        if dec is None:
            dec = self.decoders[stream] = codecs.getincrementaldecoder("utf-8")("replace")
        return dec.decode(data)


class _CellRun:
    def __init__(self, result: CellResult, events: CellEvents) -> None:
        self.result = result
        self.events = events
        self.started = time.monotonic()
        self.waiting_done = set(result.ranks)
        self.kept = {(r, s): 0 for r in result.ranks for s in ("stdout", "stderr")}
        self.finished = threading.Event()

    def rank_finished(self, rank: int) -> bool:
        return rank not in self.waiting_done


class _Request:
    def __init__(self, ranks: Iterable[int]) -> None:
        self.waiting = set(ranks)
        self.replies: dict[int, dict[str, Any]] = {}
        self.event = threading.Event()


_live_pools: "weakref.WeakSet[Pool]" = weakref.WeakSet()
_current: Pool | None = None


class Pool(Inspection):
    """A persistent pool of ranks under torchrun.

    >>> pool = distnb.launch(nproc=4)          # doctest: +SKIP
    >>> pool.run("x = torch.ones(1); dist.all_reduce(x); x")
    """

    def __init__(self, config: LaunchConfig | None = None, **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise TypeError("pass either a LaunchConfig or keyword arguments, not both.")
        self.config = config if config is not None else LaunchConfig(**kwargs)
        self.state = PoolState.NEW
        self._lock = threading.RLock()
        self._ranks: dict[int, _Rank] = {}
        self._channel: Channel | None = None
        self._launcher: Launcher | None = None
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count(1)
        self._cells = itertools.count(1)
        # Every cell run, in order; only the last KEEP_RESULTS keep their outputs (memory stays flat).
        self.history: list[CellResult | CellRecord] = []
        self.pushes: list[PushRecord] = []  # what %dist_push sent, in order, for replay and export
        self._launch_index = 0
        self.collective_log = CollectiveLog()
        self._fr_dirty: set[int] = set()
        self._fr_ticks = 0
        self._regroups = 0
        self.first_death: int | None = None
        self.nodes = Nodes(0)
        self._starters: NodeStarters | None = None
        self.key_file: str | None = None
        self.join_command: str | None = None
        self.address: str | None = None  # what other machines connect to (multi-node)
        self._node_rdzv: Rendezvous | None = None
        self._notes: list[str] = []  # delivered to start()'s on_note on the caller's thread
        self._changed = threading.Condition(self._lock)
        _live_pools.add(self)

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.config.world_size

    def start(
        self,
        on_progress: Callable[[dict[int, RankState]], None] | None = None,
        on_note: Callable[[str], None] | None = None,
    ) -> "Pool":
        """Launch torchrun and return once every rank's process group is ready.

        ``on_note`` hears what a multi-node start has to say: the command to run on the other
        machines, and each machine joining."""
        global _current
        if self.state not in (PoolState.NEW, PoolState.STOPPED):
            raise LaunchError(f"this pool is {self.state.value}; call shutdown() or restart() instead of start().")
        self.state = PoolState.STARTING
        self.first_death = None
        self._notes = []
        self._ranks = {r: _Rank(r) for r in range(self.world_size)}
        self.collective_log.clear()
        self.nodes = Nodes(self.config.nnodes - 1)
        self._channel = self._launcher = None
        try:
            try:
                creds = Credentials.new(curve=self.config.curve)
                self._channel = Channel(creds, self._on_message, bind=self.config.bind_host, port=self.config.bind_port)
                rdzv = self._prepare_nodes(creds) if self.config.nnodes > 1 else None
            except (OSError, RuntimeError) as exc:
                raise LaunchError(str(exc)) from None
            self._launcher = Launcher(self.config, self._channel.address, creds, rdzv=rdzv)
            self._launcher.start()
            self._start_nodes(creds)
            self._wait_ready(on_progress, on_note)
        except BaseException:
            self._teardown()
            raise
        self.state = PoolState.READY
        self._launch_index = len(self.history)
        _current = self
        return self

    def _prepare_nodes(self, creds: Credentials) -> Rendezvous:
        """Key file, join command and rendezvous for a pool that spans machines."""
        assert self._channel is not None
        run_id = f"distnb-{secrets.token_hex(6)}"
        bind_host = self.config.bind_host
        host = connect_host(bind_host)
        self.address = f"tcp://{host}:{self._channel.address.rsplit(':', 1)[1]}"
        self.key_file = str(creds.write(self.config.key_file or default_key_file(run_id)))
        self.join_command = join_command(self.address, self.key_file, self.config.node_python)
        if self.config.rdzv_endpoint:
            endpoint = self.config.rdzv_endpoint
        else:
            endpoint = f"{host}:{_free_port(bind_host)}"
        rdzv_host = split_host_port(endpoint, "rendezvous endpoint")[0]
        # This machine hosts the rendezvous store when the endpoint names it, so an agent that
        # joins first can't take the store with it when it leaves.
        here = rdzv_host in (host, bind_host, "localhost") or is_loopback(rdzv_host)
        local_addr = "127.0.0.1" if is_loopback(bind_host) else None
        self._node_rdzv = Rendezvous(endpoint, run_id, False if here else None, local_addr, self.config.start_timeout)
        if not self.config.local_nodes:
            self._note(f"waiting for {self.config.nnodes - 1} other node(s); on each, run:\n  {self.join_command}\n"
                       f"(the key file must be readable there: shared home, or copy it with `scp {self.key_file} NODE:{self.key_file}`)")
        return Rendezvous(endpoint, run_id, True if here else None, local_addr, self.config.start_timeout)

    def _start_nodes(self, creds: Credentials) -> None:
        if not (self.config.hosts or self.config.slurm or self.config.local_nodes):
            return
        self._starters = NodeStarters()
        if self.config.hosts or self.config.local_nodes:
            local = self.config.local_nodes
            commands = (NodeStarters.local_commands if local else NodeStarters.ssh_commands)(self.config, self.address)
            labels = [f"local node {i + 1}" for i in range(len(commands))] if local else [f"ssh {h}" for h in self.config.hosts]
            for command, label in zip(commands, labels):
                self._starters.start(command, stdin_text=creds.for_nodes().dumps(), label=label)
            where = f"{len(commands)} simulated on this machine" if local else f"over ssh on {', '.join(self.config.hosts)}"
            self._note(f"started node agents {where}")
        else:
            assert self.key_file is not None
            self._starters.start(NodeStarters.srun_command(self.config, self.address, self.key_file), label="srun")
            self._note(f"started {self.config.nnodes - 1} node agent(s) with srun")
        if self._launcher is not None:
            self._launcher.known_pids |= self._starters.pids()

    def _note(self, text: str) -> None:
        with self._lock:
            self._notes.append(text)
            del self._notes[:-50]

    def _stages(self) -> dict[int, RankState]:
        return {r: info.state for r, info in self._ranks.items()}

    def _wait_ready(
        self,
        on_progress: Callable[[dict[int, RankState]], None] | None,
        on_note: Callable[[str], None] | None = None,
    ) -> None:
        assert self._launcher is not None
        deadline = time.monotonic() + self.config.start_timeout
        last: dict[int, RankState] | None = None
        with self._changed:
            while True:
                notes, self._notes = self._notes, []
                for note in notes if on_note is not None else ():
                    on_note(note)
                stages = self._stages()
                if stages != last and on_progress is not None:
                    on_progress(dict(stages))
                last = stages
                failure = self._start_failure()
                if failure:
                    raise LaunchError(failure)
                if all(s == RankState.IDLE for s in stages.values()):
                    return
                if time.monotonic() > deadline:
                    missing = {r: s.value for r, s in stages.items() if s != RankState.IDLE}
                    detail = ", ".join(f"rank {r}: {s}" for r, s in missing.items())
                    nodes = ""
                    if self.config.nnodes > 1:
                        nodes = f"Nodes:\n  this machine: torchrun pid {self._launcher.pid}\n  " + self.nodes.text(self._ranks_by_agent()).replace("\n", "\n  ") + "\n"
                        if self._starters is not None:
                            nodes += "Node agents started by this notebook:\n  " + self._starters.text().replace("\n", "\n  ") + "\n"
                        elif self.nodes.missing():
                            nodes += f"On each missing node run:\n  {self.join_command}\n"
                    raise LaunchError(
                        f"the pool did not start within {self.config.start_timeout:g} s ({detail}).\n{nodes}"
                        f"torchrun's last output:\n{self._launcher.tail_text(15)}\n"
                        "Raise --start-timeout if the machine is just slow, or check the output above."
                    )
                self._changed.wait(0.1)

    def _start_failure(self) -> str | None:
        assert self._launcher is not None
        failed = [info for info in self._ranks.values() if info.start_error or info.state == RankState.DEAD]
        if failed:
            first = min(failed, key=lambda i: (i.died_at or float("inf"), i.rank))
            if first.start_error:
                why = first.start_error.rstrip()
            else:
                why = f"its process {_processes.signal_meaning(first.returncode)}"
                tail = (first.stderr_tail or "\n".join(first.log)).strip()
                if tail:
                    why += "; its last output:\n" + "\n".join(tail.splitlines()[-15:])
            return f"rank {first.rank} failed to start: {why}\nThe other ranks were stopped."
        starter = self._starters.failed() if self._starters is not None else None
        if starter is not None:
            return (f"a node agent's starter ended before every rank was ready — {starter.describe()}\n"
                    "Check that the machine is reachable and distnb is installed there (python -m distnb doctor). "
                    "The other ranks were stopped.")
        for node in self.nodes.agents.values():
            if node.state.value != "running":
                tail = "\n".join(list(node.tail)[-15:])
                return f"{node.cause()} before every rank was ready. Its last output:\n{tail}\nThe other ranks were stopped."
        rc = self._launcher.returncode()
        if rc is not None:
            return (
                f"torchrun exited ({_processes.signal_meaning(rc)}) before every rank was ready. "
                f"Its last output:\n{self._launcher.tail_text(20)}\n"
                "Check that torch.distributed works here (python -m distnb doctor), then launch again."
            )
        return None

    def shutdown(self) -> None:
        """Stop every rank: ask nicely, then SIGTERM, then SIGKILL, and verify nothing is left."""
        global _current
        if self.state in (PoolState.NEW, PoolState.STOPPED):
            return
        self.state = PoolState.STOPPING
        leftovers = self._teardown()
        if _current is self:
            _current = None
        if leftovers:
            raise RemoteError(
                f"processes {leftovers} of the pool survived SIGKILL (stuck in the kernel, e.g. on a "
                "hung GPU); they may need a reboot or `nvidia-smi` to clear."
            )

    def _teardown(self) -> list[int]:
        leftovers: list[int] = []
        if self._channel is not None:
            for r in self._ranks:
                self._channel.send(supervisor_identity(r), {"t": Msg.SHUTDOWN})
            for agent in self.nodes.agents:
                self._channel.send(node_identity(agent), {"t": Msg.SHUTDOWN})
            # Other machines stop first: their torchrun leans on this one's rendezvous store.
            deadline = time.monotonic() + 5.0
            with self._changed:
                while time.monotonic() < deadline and any(n.state.value == "running" for n in self.nodes.agents.values()):
                    self._changed.wait(0.1)
        if self._launcher is not None:
            leftovers = self._launcher.stop(grace=2.0)
        if self._starters is not None:
            self._starters.stop()
            self._starters = None
        if self.key_file is not None:
            try:  # the key dies with the launch; a later one writes a fresh file
                os.unlink(self.key_file)
            except OSError:
                pass
            self.key_file = None
        if self._channel is not None:
            self._channel.close()
        with self._lock:
            for info in self._ranks.values():
                if info.state != RankState.DEAD:
                    info.state = RankState.DEAD
                if info.run is not None:
                    self._finish_rank_dead(info)
        self.state = PoolState.STOPPED
        return leftovers

    def restart(
        self,
        on_progress: Callable[[dict[int, RankState]], None] | None = None,
        replay: bool = False,
        on_replay: Callable[[CellResult], None] | None = None,
        on_note: Callable[[str], None] | None = None,
    ) -> "Pool":
        """Fresh ranks with the same configuration (cell numbers keep counting).

        With ``replay``, the cells that succeeded since the last launch are re-run in order on
        the same ranks, bringing the fresh pool back to the state before a failure. Replay stops
        at the first cell that fails this time.
        """
        steps = self._since_launch() if replay else []
        self.shutdown()
        self.start(on_progress, on_note)
        for old in steps:
            if isinstance(old, PushRecord):
                if old.blob is None:
                    raise RemoteError(
                        f"replay stopped: the values pushed before cell {self._history_cell(old.position)} "
                        f"({', '.join(old.names)}) were too large to keep; push them again and re-run from there."
                    )
                self._push_blob(old.blob, list(old.ranks), old.names)
                with self._lock:  # recorded again: a later replay starts from this launch
                    self.pushes.append(PushRecord(len(self.history), old.ranks, old.names, old.blob))
                continue
            if not old.ok:
                continue
            result = self.run(old.code, old.ranks)
            if on_replay is not None:
                on_replay(result)
            if not result.ok:
                break
        return self

    def _since_launch(self) -> list[CellResult | CellRecord | PushRecord]:
        """Cells and pushes since the last launch, in the order they happened."""
        steps: list[CellResult | CellRecord | PushRecord] = []
        pushes = [p for p in self.pushes if p.position >= self._launch_index]
        for i in range(self._launch_index, len(self.history) + 1):
            steps.extend(p for p in pushes if p.position == i)
            if i < len(self.history):
                steps.append(self.history[i])
        return steps

    def _history_cell(self, position: int) -> str:
        return str(self.history[position].cell) if position < len(self.history) else "the next cell"

    def __enter__(self) -> "Pool":
        if self.state == PoolState.NEW:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- I/O thread -----------------------------------------------------------------------------
    def _on_message(self, kind: str, rank: int, msg: dict[str, Any]) -> None:
        t = msg["t"]
        with self._lock:
            if t == "tick":
                self._check_processes()
                return
            if kind == "n":
                self._on_node(rank, t, msg)
                self._changed.notify_all()
                return
            info = self._ranks.get(rank)
            if info is None:
                return
            if kind == "s":
                self._on_supervisor(info, t, msg)
            elif kind == "x":
                self._on_exec(info, t, msg)
            elif t == Msg.REPLY:
                self._on_reply(rank, msg)
            self._changed.notify_all()

    def _on_node(self, agent: int, t: str, msg: dict[str, Any]) -> None:
        assert self._channel is not None
        if t == Msg.NODE_HELLO:
            known = agent in self.nodes.agents
            reason = self.nodes.hello(agent, str(msg.get("host")), int(msg.get("pid", 0)), str(msg.get("version")),
                                      accepting=self.state == PoolState.STARTING)
            if reason:
                self._channel.send(node_identity(agent), {"t": Msg.NODE_REFUSED, "reason": reason})
                self._note(f"refused a node agent on {msg.get('host')} (pid {msg.get('pid')}): {reason}")
                return
            self._channel.heartbeat_peers.add(node_identity(agent))
            self._channel.send(node_identity(agent), {"t": Msg.NODE_START, "config": self.config, "rdzv": self._node_rdzv})
            if not known:
                n = len(self.nodes.agents)
                self._note(f"node {n} of {self.nodes.expected} joined: {self.nodes.agents[agent].name()}")
        elif t == Msg.NODE_BEAT:
            self.nodes.beat(agent, list(msg.get("pids", [])))
        elif t == Msg.NODE_OUTPUT:
            self.nodes.output(agent, list(msg.get("lines", [])))
        elif t == Msg.NODE_EXIT:
            self.nodes.exited(agent, msg.get("returncode"), str(msg.get("why", "")), str(msg.get("tail", "")))

    def _ranks_by_agent(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for r, info in sorted(self._ranks.items()):
            if info.node and info.supervisor_pid is not None:
                out.setdefault(info.node, []).append(r)
        return out

    def _on_supervisor(self, info: _Rank, t: str, msg: dict[str, Any]) -> None:
        if t == Msg.OUTPUT:
            text = info.decode(msg["stream"], msg["data"])
            if text:
                self._route_output(info, msg["stream"], text)
        elif t == Msg.EVENT:
            # Unsigned inside, but it reached us in a frame signed by the rank's supervisor,
            # which read it from a pipe only its own child can write.
            event = pickle.loads(msg["body"])
            self._on_exec(info, event["t"], event)
        elif t == Msg.SUP_HELLO:
            if "pid" in msg:
                info.supervisor_pid = msg["pid"]
                info.host = msg.get("host")
                info.local_rank = msg.get("local_rank")
                info.group_rank = msg.get("group_rank")
                info.node = int(msg.get("node", 0))
                if info.node:
                    node = self.nodes.agents.get(info.node)
                    info.node_beats = node.beats if node else 0
                elif self._launcher is not None:
                    self._launcher.known_pids.add(msg["pid"])
                if self._channel is not None:
                    self._channel.heartbeat_peers.add(supervisor_identity(info.rank))
                if info.state == RankState.LAUNCHED:
                    info.state = RankState.STARTED
            if "child_pid" in msg:
                info.pid = msg["child_pid"]
                if self._launcher is not None and not info.node:
                    self._launcher.known_pids.add(msg["child_pid"])
        elif t == Msg.RANK_EXIT:
            info.returncode = msg["returncode"]
            info.stderr_tail = msg.get("stderr_tail", "")
            self._mark_dead(info, msg.get("time"))
        elif t == Msg.SUP_REPLY:
            self._on_reply(info.rank, msg)

    def _on_exec(self, info: _Rank, t: str, msg: dict[str, Any]) -> None:
        if t == Msg.DONE:
            run = info.run
            if "cell" in msg and run is not None and run.result.cell == msg["cell"]:
                res = run.result.results[info.rank]
                res.status = msg["status"]
                res.value = msg.get("value")
                res.error = msg.get("error")
                res.duration = msg.get("duration")
                res.memory = msg.get("memory")
                res.finished_at = time.monotonic()
                run.waiting_done.discard(info.rank)
                if res.error and "OutOfMemoryError" in str(res.error.get("ename")) and run.waiting_done and self._channel:
                    # The others usually wait for this rank in a collective and will report no
                    # end-of-cell memory: ask for theirs now, for the side-by-side comparison.
                    for r in run.waiting_done:
                        self._channel.send(control_identity(r), {"t": Msg.MEMORY, "id": f"oom-{run.result.cell}"})
                self._maybe_finish(info)
            else:
                self._on_reply(info.rank, msg)
        elif t == Msg.DISPLAY:
            run = info.run
            if run is not None and run.result.cell == msg["cell"]:
                run.result.results[info.rank].displays.append(msg["data"])
                if run.events.on_display:
                    run.events.on_display(info.rank, msg["data"])
            else:
                info.log.append(msg["data"].get("text/plain", ""))
        elif t == Msg.HELLO:
            info.pid = msg["pid"]
            info.host = msg["host"]
            info.local_rank = msg["local_rank"]
            info.main_ident = msg.get("main_ident")
            if info.state in (RankState.LAUNCHED, RankState.STARTED):
                info.state = RankState.CONNECTED
        elif t == Msg.READY:
            info.device = msg["device"]
            info.backend = msg["backend"]
            info.state = RankState.IDLE
        elif t == Msg.START_FAILED:
            info.start_error = msg.get("error") or msg.get("summary")

    def _on_reply(self, rank: int, msg: dict[str, Any]) -> None:
        req_id = str(msg.get("id", ""))
        if req_id.startswith("fr-poll"):
            self.collective_log.merge(rank, msg)
            return
        if req_id.startswith("oom-") and "memory" in msg:
            cell = int(req_id[4:])
            for old in reversed(self.history[-KEEP_RESULTS:]):
                if isinstance(old, CellResult) and old.cell == cell:
                    old.live_memory[rank] = msg["memory"]
                    break
            return
        req = self._requests.get(msg.get("id", ""))
        if req is not None and rank in req.waiting:
            req.replies[rank] = msg
            req.waiting.discard(rank)
            if not req.waiting:
                req.event.set()

    def _route_output(self, info: _Rank, stream: str, text: str) -> None:
        run = info.run
        if run is None or info.rank not in run.waiting_done:
            info.log.append(text)
            del info.log[:-200]
            return
        res = run.result.results[info.rank]
        key = (info.rank, stream)
        room = OUTPUT_KEEP_BYTES - run.kept[key]
        if room > 0:
            kept = text[:room]
            setattr(res, stream, getattr(res, stream) + kept)
            run.kept[key] += len(kept)
            if len(kept) < len(text):
                res.output_truncated += len(text) - len(kept)
        else:
            res.output_truncated += len(text)
        if run.events.on_output:
            run.events.on_output(info.rank, stream, text)

    def _maybe_finish(self, info: _Rank) -> None:
        run = info.run
        if run is None or not run.rank_finished(info.rank):
            return
        info.run = None
        if info.state == RankState.RUNNING:
            info.state = RankState.IDLE
        res = run.result.results[info.rank]
        if run.events.on_rank_done:
            run.events.on_rank_done(res)
        if all(run.rank_finished(r) for r in run.result.ranks):
            run.result.elapsed = time.monotonic() - run.started
            run.events = CellEvents()  # let go of the caller's callbacks (views, printers)
            run.finished.set()

    def _mark_dead(self, info: _Rank, when: float | None = None) -> None:
        if info.died_at is None:
            # ``when`` is the supervisor's wall clock at its exit report. Reports can arrive out of
            # order (a supervisor waits up to 2 s for pipes a rank's child holds open), so deaths
            # are ordered by it — trusted only a few seconds back, so a machine whose clock is
            # off can't reorder deaths by more than a report can be late.
            late = min(max(0.0, time.time() - when), 5.0) if when is not None else 0.0
            info.died_at = time.monotonic() - late
        info.state = RankState.DEAD
        if self.state in (PoolState.READY, PoolState.STARTING, PoolState.BROKEN):
            first = self._ranks.get(self.first_death) if self.first_death is not None else None
            if first is None or first.died_at is None or info.died_at < first.died_at:
                if first is not None:
                    # Its post-mortem already said "died first": the report of an earlier death came later.
                    for cell in self.history[-3:]:
                        res = cell.results.get(first.rank) if isinstance(cell, CellResult) else None
                        if res is not None and res.first_death:
                            res.first_death = False
                self.first_death = info.rank
        if self.state == PoolState.READY:
            self.state = PoolState.BROKEN
        self._finish_rank_dead(info)

    def _finish_rank_dead(self, info: _Rank) -> None:
        run = info.run
        if run is None:
            return
        res = run.result.results[info.rank]
        if res.status == "running":
            res.status = "dead"
            res.returncode = info.returncode
            res.stderr_tail = info.stderr_tail
            res.first_death = self.first_death == info.rank
            res.cause = info.cause
            res.finished_at = time.monotonic()
            # As the rank last pushed it (within ~50 ms of entering) or the pool last polled it;
            # the rank itself tells which cell an entry belongs to (no cross-machine clocks).
            pending = self.collective_log.pending(info.rank, run.result.cell)
            if pending is not None:
                res.collective = f"{describe(pending)} (#{pending['seq']} on group {pending['group']})"
            else:
                # Died before the log could hear of it (gloo aborts within ms of a mismatch): the
                # stack faulthandler printed on the fatal signal still says where.
                from distnb.diagnose import collective_at_death

                res.collective = collective_at_death(info.stderr_tail, info.main_ident) or ""
        run.waiting_done.discard(info.rank)
        self._maybe_finish(info)

    def _check_processes(self) -> None:
        if self.state not in (PoolState.READY, PoolState.STARTING, PoolState.BROKEN):
            return
        launcher = self._launcher
        agent_rc = launcher.returncode() if launcher else None
        for node in self.nodes.check():
            self._note(f"{node.name()} stopped answering: its ranks are taken for dead")
            for info in self._ranks.values():
                # Ranks that already reported a SIGTERM died because their machine's agent went.
                if info.node == node.agent_id and info.state == RankState.DEAD and not info.cause:
                    info.cause = node.cause()
                    res = self._last_result_of(info.rank)
                    if res is not None and res.status == "dead":
                        res.cause = info.cause
        for info in self._ranks.values():
            if info.state == RankState.DEAD:
                continue
            if info.node:  # on another machine: its agent knows
                cause = self.nodes.rank_gone(info.node, info.supervisor_pid, info.node_beats)
                if cause:
                    info.cause = cause
                    self._mark_dead(info)
                continue
            # By PID and start time: a reused number must not make a dead supervisor look alive.
            sup_gone = info.supervisor_pid is not None and not (launcher is not None and launcher.known_pids.is_alive(info.supervisor_pid))
            if sup_gone or agent_rc is not None and info.supervisor_pid is None:
                # No exit report is coming: the supervisor itself is gone (killed with the agent).
                self._mark_dead(info)
        self._poll_collectives()
        self._changed.notify_all()

    def _last_result_of(self, rank: int) -> RankResult | None:
        last = self.history[-1] if self.history else None
        return last.results.get(rank) if isinstance(last, CellResult) else None

    def _poll_collectives(self) -> None:
        """Fetch new collective-log entries of ranks that ran cells (asynchronously, on the tick),
        so the log survives a rank that later dies abruptly."""
        if self._channel is None:
            return
        # Running ranks push their own new entries within ~50 ms (worker/control.py); this poll is
        # the backstop, every 5 s for them, since a full read of a rank's recorder costs ms.
        self._fr_ticks += 1
        running = {r for r, i in self._ranks.items() if i.run is not None} if self._fr_ticks % 5 == 0 else set()
        targets = self._fr_dirty | running
        self._fr_dirty = set()
        for r in targets:
            if self._ranks[r].state != RankState.DEAD:
                self._channel.send(control_identity(r), {"t": Msg.COLLECTIVES, "id": "fr-poll", "since": self.collective_log.last_id(r)})

    # -- running cells --------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self.state == PoolState.BROKEN:
            dead = [i for i in self._ranks.values() if i.state == RankState.DEAD]
            first = self._ranks.get(self.first_death) if self.first_death is not None else (dead[0] if dead else None)
            why = f"rank {first.rank} died ({_processes.signal_meaning(first.returncode)})" if first else "a rank died"
            raise PoolBrokenError(
                f"the pool is broken: {why}, so collectives can't complete any more. "
                "Run %dist_restart (pool.restart()) for fresh ranks, or %dist_restart --replay to re-run the cells that succeeded."
            )
        if self.state != PoolState.READY:
            raise NoPoolError(f"the pool is {self.state.value}; start one with %dist_launch (distnb.launch()).")

    def _busy(self, ranks: Iterable[int]) -> dict[int, int]:
        return {r: self._ranks[r].run.result.cell for r in ranks if self._ranks[r].run is not None}  # type: ignore[union-attr]

    def _raise_if_busy(self, ranks: list[int]) -> None:
        busy = self._busy(ranks)
        if busy:
            cells = sorted(set(busy.values()))
            raise PoolBusyError(
                f"{format_ranks(busy)} {'is' if len(busy) == 1 else 'are'} still running cell "
                f"{', '.join(map(str, cells))}. Wait for it, see where it is with %dist_stacks, "
                "interrupt it with pool.interrupt(), or %dist_restart."
            )

    def submit(self, code: str, ranks: str | int | Iterable[int] | None = None, events: CellEvents | None = None) -> CellResult:
        """Start a cell on the ranks and return its live :class:`CellResult` at once."""
        compile(code, "<cell>", "exec")  # a SyntaxError is raised here, once, before anything is sent
        with self._lock:
            self._check_usable()
            targets = parse_ranks(ranks, self.world_size)
            self._raise_if_busy(targets)
            cell = next(self._cells)
            result = CellResult(cell=cell, code=code, ranks=targets, results={r: RankResult(r) for r in targets})
            run = _CellRun(result, events or CellEvents())
            result._run = run  # type: ignore[attr-defined]
            for r in targets:
                self._ranks[r].run = run
                self._ranks[r].state = RankState.RUNNING
            self._fr_dirty.update(targets)
            self.history.append(result)
            old = len(self.history) - 1 - KEEP_RESULTS
            if old >= 0 and isinstance(self.history[old], CellResult) and not self.history[old].running:
                self.history[old] = CellRecord.of(self.history[old])
        assert self._channel is not None
        self._channel.send_many(map(exec_identity, targets), {"t": Msg.EXEC, "id": f"cell-{cell}", "cell": cell, "code": code})
        return result

    def wait(
        self,
        result: CellResult,
        timeout: float | None = None,
        on_tick: Callable[[CellResult], None] | None = None,
        tick: float = 0.1,
    ) -> CellResult:
        """Wait for a submitted cell. The first Ctrl-C interrupts the ranks; a second stops waiting."""
        run: _CellRun = result._run  # type: ignore[attr-defined]
        # From this call, not the cell's start: %dist_wait --timeout on an old background cell waits.
        deadline = None if timeout is None else time.monotonic() + timeout
        interrupted = False
        while not run.finished.is_set():
            try:
                wait_for = tick if deadline is None else max(0.0, min(tick, deadline - time.monotonic()))
                if run.finished.wait(wait_for):
                    break
                if on_tick is not None:
                    on_tick(result)
                if deadline is not None and time.monotonic() >= deadline:
                    result.timed_out = True
                    break
            except KeyboardInterrupt:
                if interrupted:
                    result.detached = True
                    result.notes.append(
                        f"Stopped waiting after a second interrupt; {format_ranks(result.running)} did not respond "
                        "(likely blocked in C++ or a collective). They keep running: see them with %dist_stacks."
                    )
                    break
                interrupted = True
                self.interrupt(result.running)
        result.elapsed = time.monotonic() - run.started
        if on_tick is not None:
            on_tick(result)
        return result

    def run(
        self,
        code: str,
        ranks: str | int | Iterable[int] | None = None,
        timeout: float | None = None,
        events: CellEvents | None = None,
    ) -> CellResult:
        """Run ``code`` on the ranks (all by default) and return per-rank output, value and error."""
        return self.wait(self.submit(code, ranks, events), timeout)

    def interrupt(self, ranks: Iterable[int] | None = None) -> list[int]:
        """Send a KeyboardInterrupt to the cell running on the given (default: all busy) ranks."""
        with self._lock:
            targets = list(ranks) if ranks is not None else list(self._busy(self._ranks))
            cells = self._busy(targets)
        assert self._channel is not None
        for r in targets:
            # The cell id lets a rank whose EXEC has not arrived yet interrupt that cell on arrival.
            self._channel.send(control_identity(r), {"t": Msg.INTERRUPT, "id": f"int-{next(self._ids)}", "cell": cells.get(r)})
        return targets

    # -- requests -------------------------------------------------------------------------------
    def _request(
        self,
        identity: Callable[[int], bytes],
        ranks: list[int],
        msg: dict[str, Any],
        timeout: float,
        partial: bool = False,
    ) -> dict[int, dict[str, Any]]:
        """Send ``msg`` to each rank and collect replies; ``partial`` returns what came in time."""
        if self._channel is None or not ranks:
            return {}
        req_id = f"req-{next(self._ids)}"
        req = _Request(ranks)
        with self._lock:
            self._requests[req_id] = req
        try:
            self._channel.send_many(map(identity, ranks), {**msg, "id": req_id})
            req.event.wait(timeout)
        finally:
            with self._lock:
                self._requests.pop(req_id, None)
        if req.waiting and not partial:
            raise RemoteError(f"{format_ranks(req.waiting)} did not answer within {timeout:g} s; check them with %dist_status.")
        return dict(req.replies)

    def push(self, ranks: str | int | Iterable[int] | None = None, **values: Any) -> None:
        """Copy notebook values into every (or the given) rank's namespace."""
        if not values:
            raise ValueError("name at least one value to push, e.g. pool.push(lr=0.1).")
        for name, value in values.items():
            try:
                pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise ValueError(
                    f"{name!r} can't be sent to the ranks: {type(exc).__name__}: {exc}. "
                    "Push picklable data (tensors, numbers, dicts) or build the object in a cell."
                ) from None
        with self._lock:
            self._check_usable()
            targets = parse_ranks(ranks, self.world_size)
            self._raise_if_busy(targets)
        blob = pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL)
        room = MAX_FRAME_BYTES - 4096  # the message's own fields and signature
        if len(blob) > room:
            sizes = ", ".join(f"{n!r} {_mb(len(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)))}" for n, v in values.items())
            raise ValueError(
                f"the push is {_mb(len(blob))} pickled ({sizes}), over distnb's limit of {_mb(room)} per message. "
                "Push fewer names at a time, send a smaller value, or save it to a file the ranks can read "
                "(torch.save(value, path), then torch.load(path) in a cell); DISTNB_MAX_FRAME_BYTES raises the limit."
            )
        self._push_blob(blob, targets, tuple(values))
        with self._lock:
            self.pushes.append(PushRecord(len(self.history), tuple(targets), tuple(values), blob))
            kept = 0
            for i in range(len(self.pushes) - 1, -1, -1):  # newest first: let the oldest go
                old = self.pushes[i]
                kept += len(old.blob or b"")
                if old.blob is not None and kept > KEEP_PUSH_BYTES:
                    self.pushes[i] = PushRecord(old.position, old.ranks, old.names, None)

    def _push_blob(self, blob: bytes, targets: list[int], names: tuple[str, ...]) -> None:
        replies = self._request(exec_identity, targets, {"t": Msg.PUSH, "values": blob}, 60.0)
        errors = {r: m["error"] for r, m in replies.items() if m.get("status") != "ok"}
        if errors:
            r, err = next(iter(sorted(errors.items())))
            raise RemoteError(f"push of {', '.join(names)} failed on {format_ranks(errors)}: {err}")

    def pull(self, name: str, ranks: str | int | Iterable[int] | None = None) -> dict[int, Any]:
        """``{rank: value}`` of a name in each (or the given) rank's namespace."""
        with self._lock:
            self._check_usable()
            targets = parse_ranks(ranks, self.world_size)
            self._raise_if_busy(targets)
        replies = self._request(exec_identity, targets, {"t": Msg.PULL, "names": [name]}, 60.0)
        errors = {r: m["error"] for r, m in sorted(replies.items()) if m.get("status") != "ok"}
        if errors:
            first = next(iter(errors.values()))
            hint = " Check the spelling, or define it in an %%on_ranks cell first." if "is not defined" in first else ""
            raise RemoteError(f"pull of {name!r} failed on {format_ranks(errors)}: {first}.{hint}")
        return {r: pickle.loads(replies[r]["values"][name]) for r in targets}

    # -- status ---------------------------------------------------------------------------------
    def status(self) -> PoolStatus:
        """Per-rank pid, host, device and state, from what the controller knows (no round trip)."""
        now = time.monotonic()
        with self._lock:
            ranks = []
            for r, info in sorted(self._ranks.items()):
                run = info.run
                ranks.append(
                    RankStatus(
                        rank=r,
                        state=info.state,
                        pid=info.pid,
                        host=info.host,
                        device=info.device,
                        cell=run.result.cell if run else None,
                        elapsed=now - run.started if run else None,
                        returncode=info.returncode,
                        local_rank=info.local_rank,
                        node=info.group_rank,
                        cause=info.cause,
                    )
                )
            backend = next((i.backend for i in self._ranks.values() if i.backend), None)
            return PoolStatus(
                state=self.state.value,
                backend=backend,
                world_size=self.world_size,
                ranks=ranks,
                agent_pid=self._launcher.pid if self._launcher else None,
                address=self.address or (self._channel.address if self._channel else None),
                cells_run=len(self.history),
                nnodes=self.config.nnodes,
                nodes=self.nodes.text(self._ranks_by_agent()) if self.config.nnodes > 1 else "",
                rejected=self._channel.rejected if self._channel else 0,
                internal_errors=self._channel.errors if self._channel else 0,
                last_internal_error=self._channel.last_error if self._channel else None,
            )

    def pids(self) -> list[int]:
        """Every process of the pool known to be alive (agent, supervisors, ranks)."""
        if self._launcher is None:
            return []
        return sorted(self._launcher.live_pids())

    def __repr__(self) -> str:
        return f"<distnb.Pool {self.state.value}, {self.world_size} ranks>"


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host if host not in ("", "::") else "0.0.0.0", 0))
        return int(sock.getsockname()[1])


def launch(config: LaunchConfig | None = None, on_progress: Callable[[dict[int, RankState]], None] | None = None, **kwargs: Any) -> Pool:
    """Start a pool and make it the current one: ``pool = distnb.launch(nproc=4)``."""
    return Pool(config, **kwargs).start(on_progress)


def current_pool() -> Pool:
    """The pool the magics act on; raises :class:`NoPoolError` when none is running."""
    if _current is None or _current.state in (PoolState.STOPPED, PoolState.NEW):
        raise NoPoolError("no pool is running; start one with %dist_launch -n 4 (or distnb.launch(nproc=4)).")
    return _current


@atexit.register
def _shutdown_all() -> None:
    for pool in list(_live_pools):
        try:
            pool.shutdown()
        except Exception:
            pass
