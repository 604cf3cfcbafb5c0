"""What the pool can tell about its ranks while they run or hang: stacks, diagnoses, collective
logs, memory, environments, checksums — plus recovery by regrouping and export of the session.

A mixin of :class:`distnb.pool.Pool`: it relies on the pool's state, rank table and request
machinery (``_request``, ``_check_usable``, ``_raise_if_busy``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterable

from distnb import _processes
from distnb.check_report import CheckReport, compare
from distnb.collective_log import CollectiveReport, describe
from distnb.diagnose import Diagnosis, Position, diagnose, position_from_stack
from distnb.errors import NoPoolError, RemoteError
from distnb.memory_report import MemoryReport
from distnb.protocol import Msg, control_identity, exec_identity, supervisor_identity
from distnb.ranks import format_ranks, parse_ranks
from distnb.results import CellResult, EnvReport, PoolState, RankState
from distnb.stacks import RankStack, StackReport, ThreadStack, frames_from_wire, parse_faulthandler, py_spy_dumps

if TYPE_CHECKING:
    from distnb.pool import Pool

__all__ = ["Inspection"]


class Inspection:
    def stacks(
        self: Pool,
        ranks: str | int | Iterable[int] | None = None,
        all_threads: bool = False,
        native: bool = False,
        timeout: float = 0.25,
    ) -> StackReport:
        """Where every (or each given) rank is right now; works while cells run or hang.

        The rank's control thread answers even while the main thread waits in a collective. A
        rank whose main thread holds the GIL (a C loop) can't answer; its supervisor then asks
        faulthandler for a dump with SIGUSR1. ``native`` adds py-spy's native frames.
        """
        if self.state in (PoolState.NEW, PoolState.STOPPED):
            raise NoPoolError("no pool is running; start one with %dist_launch -n 4 (or distnb.launch(nproc=4)).")
        targets = parse_ranks(ranks, self.world_size)
        with self._lock:
            alive = [r for r in targets if self._ranks[r].state != RankState.DEAD]
        # The collective log comes in the same answer: a rank that can't answer (a C loop holding
        # the GIL) then costs one timeout here, not one more per question.
        since = {r: self.collective_log.last_id(r) for r in alive}
        msg = {"t": Msg.STACKS, "all_threads": all_threads, "collectives_since": min(since.values(), default=-1)}
        replies = self._request(control_identity, alive, msg, timeout, partial=True)
        self._merge_collectives({r: m["collectives"] for r, m in replies.items() if "collectives" in m}, since)
        # A control thread that answered with an error instead of stacks gave no stack either.
        silent = [r for r in alive if "stacks" not in replies.get(r, {})]
        dumps = self._request(supervisor_identity, silent, {"t": Msg.FAULT_REQUEST, "wait": 0.15}, 3.0, partial=True)
        cell_sources = {f"<cell-{c.cell}>": c.code for c in self.history[-200:]}
        status = {rs.rank: rs for rs in self.status().ranks}
        out = []
        for r in targets:
            st = status[r]
            info = self._ranks[r]
            if r in replies and "stacks" in replies[r]:
                threads = [
                    ThreadStack(t["thread"], t["main"], frames_from_wire(t["frames"])) for t in replies[r]["stacks"]
                ]
                rs = RankStack(r, st.describe(), "control thread", threads)
            elif r in dumps and dumps[r].get("text"):
                threads = parse_faulthandler(dumps[r]["text"], cell_sources, info.main_ident)
                if not all_threads:
                    threads = [t for t in threads if t.main] or threads[:1]
                rs = RankStack(r, st.describe(), "faulthandler: the rank holds the GIL", threads)
            elif st.state == RankState.DEAD:
                rs = RankStack(r, st.describe(), "dead")
            else:
                rs = RankStack(r, st.describe(), f"no answer: {self._why_silent(r)}")
            pending = self.collective_log.pending(r, st.cell) if st.state == RankState.RUNNING else None
            if pending is not None:
                # How long by the rank's own clock: another machine's may be off from this one's.
                rs.annotation = f"in {describe(pending)} (#{pending['seq']} on group {pending['group']}) for {self.collective_log.age(r, pending):.1f} s"
            if native and info.pid and st.state != RankState.DEAD and info.node:
                # py-spy runs here: a rank on another machine needs it run there.
                rs.native = f"rank {r} runs on {info.host}: run `py-spy dump --native --pid {info.pid}` there."
            out.append(rs)
        if native:
            by_rank = {rs.rank: rs for rs in out}
            local = {r: pid for r in by_rank if (pid := self._ranks[r].pid) and not self._ranks[r].node
                     and status[r].state != RankState.DEAD}
            for r, text in py_spy_dumps(local).items():
                by_rank[r].native = text
        return StackReport(out)

    def diagnose(self: Pool, result: CellResult | None = None, hang_after: float | None = None) -> Diagnosis:
        """Is the (last) cell hung, and why? Names the ranks, collectives and cell lines involved.
        ``hang_after`` (seconds) overrides the pool's threshold for this call."""
        if result is None:
            if not self.history:
                raise NoPoolError("no cell has run on this pool yet; run one with %%on_ranks (pool.run) first.")
            result = self.history[-1]  # type: ignore[assignment]
        elapsed = time.monotonic() - result._run.started  # type: ignore[attr-defined]
        busy = [r for r in result.ranks if result.results[r].status == "running"]
        with self._lock:
            alive = [r for r in range(self.world_size) if self._ranks[r].state != RankState.DEAD]
        # One round trip: stacks of every live rank (idle ones answer at once) with their collective
        # logs, so a rank holding the GIL costs one timeout per diagnosis.
        stacks = self.stacks(alive) if busy else None
        log = self.collectives(refresh=not busy)
        lines = result.code.splitlines()
        positions = []
        for r in range(self.world_size):
            res = result.results.get(r)
            if res is None:
                positions.append(Position(r, "idle"))
            elif res.status == "ok":
                positions.append(Position(r, "finished"))
            elif res.status in ("error", "interrupted") and res.error:
                line = res.error.get("line")
                positions.append(Position(r, "failed", line=line, code=lines[line - 1] if line and line <= len(lines) else "",
                                          detail=f"{res.error['ename']}: {res.error['evalue'][:200]}"))
            elif res.status == "dead":
                positions.append(Position(r, "dead", detail=_processes.signal_meaning(res.returncode)))
            else:
                assert stacks is not None
                if not stacks[r].threads:
                    positions.append(Position(r, "unresponsive", since=elapsed, detail=self._why_silent(r)))
                    continue
                pos = position_from_stack(stacks[r])
                # The rank tells which cell an entry belongs to by its own clock: no cross-machine
                # clock comparison.
                pending = self.collective_log.pending(r, result.cell)
                if pending is not None:
                    pos.state, pos.op, pos.seq, pos.group = "collective", pending["op"], pending["seq"], pending["group"]
                    pos.shapes = describe(pending, with_op=False)
                    pos.sizes, pos.dtypes = pending.get("sizes"), pending.get("dtypes")
                    pos.since = self.collective_log.age(r, pending)
                pos.since = pos.since if pos.since is not None else elapsed
                positions.append(pos)
        return diagnose(positions, self.config.hang_after if hang_after is None else hang_after, elapsed, log, self.first_death)

    def _why_silent(self: Pool, rank: int) -> str:
        """Words for a rank that gave no stack at all, neither from its control thread nor from
        faulthandler: its process state when it runs on this machine."""
        info = self._ranks[rank]
        state = _processes.process_state(info.pid) if info.pid and not info.node else None
        if state:
            return f"its process (pid {info.pid}) is {state}"
        return "neither its control thread nor faulthandler gave a stack (a process stopped, or stuck in the kernel)"

    def collectives(self: Pool, ranks: str | int | Iterable[int] | None = None, last: int | None = None, refresh: bool = True) -> CollectiveReport:
        """Every rank's collective sequence (from the Flight Recorder), side by side, with the
        first divergence marked. Works while ranks are blocked; dead ranks keep their last log."""
        targets = parse_ranks(ranks, self.world_size)
        if refresh and self.state not in (PoolState.NEW, PoolState.STOPPED):
            alive = [r for r in targets if self._ranks[r].state != RankState.DEAD]
            since = {r: self.collective_log.last_id(r) for r in alive}
            floor = min(since.values(), default=-1)
            replies = self._request(control_identity, alive, {"t": Msg.COLLECTIVES, "since": floor}, 1.0, partial=True)
            self._merge_collectives(replies, since)
        return self.collective_log.report(targets, last)

    def _merge_collectives(self: Pool, replies: dict[int, dict[str, Any]], since: dict[int, int]) -> None:
        """Merge the ranks' log replies; each was asked from the lowest ``since`` of the batch, so
        drop what a rank had already sent (entries still open may have changed: keep those)."""
        with self._lock:
            for r, reply in replies.items():
                reply["entries"] = [e for e in reply.get("entries", []) if e["id"] > since.get(r, -1) or not e["done"]]
                self.collective_log.merge(r, reply)

    def export(self: Pool, path: str, cells: str | None = None, include_failed: bool = False) -> str:
        """Write the session's cells (since launch; by default those that succeeded) as a
        standalone ``torchrun`` script, or as a notebook when ``path`` ends in ``.ipynb``."""
        from distnb.export import export_notebook, export_script, select_cells, with_pushes

        chosen = select_cells(self.history[self._launch_index :] if cells is None else self.history, cells, include_failed)
        if not chosen:
            raise ValueError("there is no cell to export yet; run some with %%on_ranks first (or pass --all to include failed ones).")
        # The cells read what %dist_push sent them: the pushes go in too, where they happened.
        steps = with_pushes(self.history, chosen, self.pushes, self._launch_index)
        writer = export_notebook if str(path).endswith(".ipynb") else export_script
        return str(writer(steps, self.config, path))

    def memory(self: Pool, ranks: str | int | Iterable[int] | None = None) -> MemoryReport:
        """Each rank's memory now (asked live, works while cells run) and its peak per cell."""
        if self.state in (PoolState.NEW, PoolState.STOPPED):
            raise NoPoolError("no pool is running; start one with %dist_launch -n 4 (or distnb.launch(nproc=4)).")
        targets = [r for r in parse_ranks(ranks, self.world_size) if self._ranks[r].state != RankState.DEAD]
        replies = self._request(control_identity, targets, {"t": Msg.MEMORY}, 2.0, partial=True)
        timeline = []
        for cell in self.history[self._launch_index :]:
            if not isinstance(cell, CellResult):
                continue
            samples = {r: res.memory for r, res in cell.results.items() if res.memory and r in targets}
            if samples:
                timeline.append((cell.cell, samples))
        return MemoryReport({r: m["memory"] for r, m in sorted(replies.items()) if "memory" in m}, timeline)

    def env(self: Pool, ranks: str | int | Iterable[int] | None = None) -> EnvReport:
        """RANK, LOCAL_RANK, MASTER_*, CUDA_VISIBLE_DEVICES, NCCL_*/TORCH_* … per rank."""
        if self.state in (PoolState.NEW, PoolState.STOPPED):
            raise NoPoolError("no pool is running; start one with %dist_launch -n 4 (or distnb.launch(nproc=4)).")
        targets = [r for r in parse_ranks(ranks, self.world_size) if self._ranks[r].state != RankState.DEAD]
        replies = self._request(control_identity, targets, {"t": Msg.ENV}, 5.0)
        return EnvReport({r: m["env"] for r, m in sorted(replies.items())}, {r: self._ranks[r].host for r in targets})

    def regroup(self: Pool) -> None:
        """Recover from a collective timeout without restarting processes: every rank replaces its
        poisoned default process group with a fresh one (namespaces are kept; objects holding
        the old group, such as a DDP model, must be rebuilt). Ranks must be idle and alive."""
        with self._lock:
            self._check_usable()
            targets = list(range(self.world_size))
            self._raise_if_busy(targets)
            self._regroups += 1
        # The new default group is named "0" again and counts from #1, while the ranks' recorders
        # keep the old group's entries: start a new generation of the log, ignoring every record
        # the ranks made so far (ranks are idle, so nothing new is recorded before the regroup).
        self.collectives(refresh=True)
        with self._lock:
            self.collective_log.new_generation({r: self.collective_log.last_id(r) for r in targets})
        replies = self._request(exec_identity, targets, {"t": Msg.REGROUP, "generation": self._regroups}, self.config.pg_timeout + 30)
        errors = {r: m["error"] for r, m in sorted(replies.items()) if m.get("status") != "ok"}
        if errors:
            raise RemoteError(f"regroup failed on {format_ranks(errors)}: {next(iter(errors.values()))} Use %dist_restart --replay instead.")

    def check(self: Pool, names: str | Iterable[str], ranks: str | int | Iterable[int] | None = None) -> list[CheckReport]:
        """Checksum names (tensors, modules, state dicts, optimizers) on every rank and compare:
        identical, or which entries differ and which ranks are the odd ones out."""
        names = [names] if isinstance(names, str) else list(names)
        if not names:
            raise ValueError("name at least one variable to check, e.g. pool.check('model').")
        with self._lock:
            self._check_usable()
            targets = parse_ranks(ranks, self.world_size)
            self._raise_if_busy(targets)
        replies = self._request(exec_identity, targets, {"t": Msg.CHECK, "names": names}, 120.0)
        errors = {r: m["error"] for r, m in sorted(replies.items()) if m.get("status") != "ok"}
        if errors:
            raise RemoteError(f"check failed on {format_ranks(errors)}: {next(iter(errors.values()))}")
        return [compare(n, {r: replies[r]["checks"][n] for r in targets}) for n in names]
