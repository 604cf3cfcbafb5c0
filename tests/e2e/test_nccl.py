"""NCCL's path without a GPU: recorder selection and entry states from recorded dumps of both
recorders, blame by sequence numbers after every rank timed out, the watchdog's words, the
end-of-cell count check, the interactive watchdog settings and --share-gpus. The real-GPU
counterparts are in test_nccl_gpu.py; the gloo ``async_op=True`` scenarios in test_async_e2e.py."""

from __future__ import annotations

import pickle
import sys
import types

import pytest

from distnb.analysis.agreement.desync import CountMismatch, carry_over, count_mismatches, mismatch_text
from distnb.analysis.agreement.entry_words import state_mark
from distnb.analysis.agreement.sequence_numbers import dump_marks, seq_blame
from distnb.analysis.reports.nccl_dumps import read_dumps, watchdog_cause
from distnb.analysis.verdicts.position import Position
from distnb.config import LaunchConfig
from distnb.controller.collective_log import CollectiveLog
from distnb.launching.torchrun import FR_DUMP_PREFIX, SHARED_GPU_ENV, Launcher, nccl_environment
from distnb.wire.security import Credentials
from distnb.worker.torch_hooks import flight_recorder as fr
from distnb.worker.torch_hooks.call_log import CallLog
from distnb.worker.torch_hooks.flight_recorder import CellClock, RecordIds, entry_view
from distnb.worker.torch_hooks.group_state import sync_state


def _raw(rid: int, seq: int, name: str, state: str, retired: bool, t: int, group: str = "0", started: int | None = None) -> dict:
    """A recorder entry as torch's dumps hold it (fields seen on torch 2.11 with NCCL 2.28)."""
    return {"record_id": rid, "process_group": (group, "default_pg" if group == "0" else "undefined"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": name, "state": state, "retired": retired, "timeout_ms": 8000,
            "time_created_ns": t, "time_discovered_started_ns": started, "time_discovered_completed_ns": None,
            "input_sizes": [[2]], "input_dtypes": ["Float"], "is_p2p": False}


NCCL_DUMP = {"version": "2.10", "entries": [
    _raw(0, 1, "nccl:all_reduce", "completed", True, 1_000, started=1_100),
    _raw(1, 2, "nccl:all_reduce", "scheduled", False, 3_000),  # queued behind other GPU work
    _raw(2, 3, "nccl:broadcast", "completed", False, 4_000, started=4_100),  # completed, not yet retired
]}
GLOO_DUMP = {"version": "2.10", "entries": [
    _raw(0, 1, "gloo:all_reduce", "scheduled", True, 2_000, group="1"),  # gloo: retired = completed
    _raw(1, 2, "gloo:all_gather", "scheduled", False, 5_000, group="1"),
]}


def test_entries_of_both_recorders_get_one_id_sequence_in_creation_order_and_states() -> None:
    ids = RecordIds()
    got = ids.assign({"nccl": NCCL_DUMP, "fr": GLOO_DUMP})
    order = [(rec, e["profiling_name"]) for _, rec, e in got]
    assert [did for did, _, _ in got] == [0, 1, 2, 3, 4]  # record ids overlap across recorders; distnb's do not
    assert order == [("nccl", "nccl:all_reduce"), ("fr", "gloo:all_reduce"), ("nccl", "nccl:all_reduce"), ("nccl", "nccl:broadcast"),
                     ("fr", "gloo:all_gather")]
    assert [did for did, _, _ in ids.assign({"nccl": NCCL_DUMP, "fr": GLOO_DUMP})] == [0, 1, 2, 3, 4]  # stable on re-reads
    views = [entry_view(did, rec, e, CellClock()) for did, rec, e in got]
    assert [v["done"] for v in views] == [True, True, False, True, False]
    assert views[3]["state"] == "completed" and views[0]["started"] == pytest.approx(1.1e-6)
    assert {v["rec"] for v in views} == {"nccl", "fr"} and views[1]["group"] == "1"


def test_a_retired_nccl_entry_is_not_completed_and_timing_tells_queued_from_running(monkeypatch: pytest.MonkeyPatch) -> None:
    timed_out = _raw(5, 6, "nccl:all_reduce", "started", True, 9_000, started=9_100)
    assert not fr._completed(timed_out)  # NCCL retires works that timed out too
    monkeypatch.setattr(fr, "_TIMING", True)
    queued = entry_view(7, "nccl", NCCL_DUMP["entries"][1], CellClock())
    running = entry_view(8, "nccl", timed_out, CellClock())
    assert queued["queued"] and state_mark(queued) == " ⏸"
    assert not running["queued"] and state_mark(running) == " ⏳"
    monkeypatch.setattr(fr, "_TIMING", False)  # without timing every open NCCL entry reads "scheduled"
    assert not entry_view(7, "nccl", NCCL_DUMP["entries"][1], CellClock())["queued"]


def _fake_c10d(monkeypatch: pytest.MonkeyPatch, backends: list[str], **dumpers: object) -> None:
    pgs = {object(): (b, None) for b in backends}
    world = types.SimpleNamespace(pg_map=pgs, pg_names={pg: str(i) for i, pg in enumerate(pgs)})
    monkeypatch.setitem(sys.modules, "torch.distributed.distributed_c10d", types.SimpleNamespace(_world=world))
    monkeypatch.setattr(fr, "backends_in_use", lambda: {b.rsplit(":", 1)[-1] for b in backends})
    c = types.SimpleNamespace(**dumpers)
    monkeypatch.setitem(sys.modules, "torch._C._distributed_c10d", c)
    monkeypatch.setattr(sys.modules["torch._C"], "_distributed_c10d", c, raising=False)


def test_recorder_selection_reads_each_backend_in_use_and_names_what_it_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    nccl = lambda **kw: pickle.dumps(NCCL_DUMP)  # noqa: E731
    gloo = lambda **kw: pickle.dumps(GLOO_DUMP)  # noqa: E731
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    _fake_c10d(monkeypatch, ["nccl", "gloo"], _dump_nccl_trace=nccl, _dump_fr_trace=gloo)
    dumps, missing = fr.dump_recorders()
    assert set(dumps) == {"nccl", "fr"} and not missing
    _fake_c10d(monkeypatch, ["nccl"], _dump_nccl_trace=nccl, _dump_fr_trace=gloo)
    assert set(fr.dump_recorders()[0]) == {"nccl"}  # an NCCL-only pool: gloo's recorder is empty anyway
    # A torch whose NCCL recorder can't be read: said, per recorder, with the gloo side still read.
    _fake_c10d(monkeypatch, ["nccl", "gloo"], _dump_fr_trace=gloo)
    reply = fr.read_collectives(-1, CellClock(), ids=RecordIds())
    assert "no NCCL's recorder" in reply["missing"]["nccl"] and len(reply["entries"]) == 2
    log = CollectiveLog()
    log.merge(0, reply)
    text = log.report([0]).text()
    assert "not in this log: NCCL collectives" in text and "_dump_nccl_trace" in text, text
    # Nothing readable at all: unavailable, with the reason, never "no collective recorded".
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    reply = fr.read_collectives(-1, CellClock(), ids=RecordIds())
    empty = CollectiveLog()
    empty.merge(0, reply)
    assert "TORCH_FR_BUFFER_SIZE=0 turns the Flight Recorder off" in empty.report([0]).text()
    assert "no collective recorded" not in empty.report([0]).text()


def test_blame_by_sequence_numbers_after_every_rank_timed_out(tmp_path) -> None:
    """Ranks 0, 2, 3 reached all_reduce #5 and timed out there (every rank timed out: the dumps'
    states all read "completed" after the abort); rank 1's last is #4. The first to time out is
    a victim; rank 1 never arrived."""
    for rank, last in {0: 5, 1: 4, 2: 5, 3: 5}.items():
        dump = {"entries": [_raw(i, i + 1, "nccl:all_reduce", "completed", True, i) for i in range(last)]}
        (tmp_path / f"{FR_DUMP_PREFIX}{rank}").write_bytes(pickle.dumps(dump))
    (tmp_path / f"{FR_DUMP_PREFIX}7.tmp").write_bytes(b"partial")  # not a rank's dump: skipped
    dumps = read_dumps(str(tmp_path))
    assert sorted(dumps) == [0, 1, 2, 3]
    assert read_dumps(str(tmp_path), newer_than=4e9) == {}  # an earlier timeout's dumps are not this one's
    (blame,) = seq_blame({r: dump_marks(d["entries"]) for r, d in dumps.items()}, {"0": [0, 1, 2, 3]})
    assert blame.never == {1: 4} and blame.seq == 5 and blame.ahead == [0, 2, 3] and blame.op == "all_reduce"
    text = blame.text(timed_out=[0, 2, 3])
    assert text.startswith("rank 1 never arrived at all_reduce #5 on group 0") and "Root cause: rank 1" in text
    assert "ranks 0,2,3 timed out waiting" in text


def test_a_watchdog_death_is_named_in_the_post_mortem() -> None:
    stderr = ("[rank0]:[E1124 21:17:50.478926112 ProcessGroupNCCL.cpp:689] [Rank 0] Watchdog caught collective operation timeout: "
              "WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=2, NumelOut=2, Timeout(ms)=8000) ran for 8045 milliseconds before timing out.")
    cause = watchdog_cause(stderr)
    assert "collective #2 (allreduce) ran 8.0 s" in cause and "TORCH_NCCL_ASYNC_ERROR_HANDLING" in cause
    assert watchdog_cause("Segmentation fault") == ""


def test_end_of_cell_counts_name_the_rank_ahead_and_the_entries() -> None:
    syncs = {0: {"seqs": {"0": 3, "1": 1}, "created": 2}, 1: {"seqs": {"0": 2, "1": 1}, "created": 2},
             2: {"seqs": {"0": 2}, "created": 2}, 3: None}
    (m,) = count_mismatches(syncs)
    assert m.group == "0" and m.ahead == [0] and m.behind == [1, 2] and m.extra == 1
    log = CollectiveLog()
    log.merge(0, {"entries": [{"id": 9, "group": "0", "desc": "", "seq": 3, "p2p": False, "op": "all_reduce", "sizes": [[4]],
                               "dtypes": ["Float"], "t": 1.0, "done": False, "cell": 5, "call_cell": 5, "line": 3}]})
    text = mismatch_text(m, log)
    assert text.startswith("rank 0 issued 1 collective on group 0 (all_reduce [4] f32 #3 (cell 5 line 3), not completed) "
                           "that ranks 1,2 did not: the next synchronisation on group 0 will hang"), text
    (g,) = count_mismatches({0: {"seqs": {}, "created": 3}, 1: {"seqs": {}, "created": 2}})
    assert g.group is None and "rank 0 has created 1 process group more than rank 1" in mismatch_text(g)
    # Left standing, it is named in full once, then in a short line.
    first = carry_over([m], [], cell=5)
    again = carry_over([CountMismatch("0", dict(m.counts))], first, cell=6)
    assert not first[0].repeated and again[0].repeated and again[0].since == 5
    assert mismatch_text(again[0]) == "rank 0 is still 1 collective ahead of ranks 1,2 on group 0 (since cell 5; see %dist_collectives)."
    assert count_mismatches({0: {"seqs": {"0": 2}, "created": 1}, 1: {"seqs": {"0": 2}, "created": 1}}) == []


def test_sync_state_takes_gloo_point_to_point_calls_out(monkeypatch: pytest.MonkeyPatch) -> None:
    class PG:
        def __init__(self, seq: int) -> None:
            self.seq = seq

        def _get_sequence_number_for_group(self) -> int:
            return self.seq

    gloo, nccl = PG(5), PG(7)
    world = types.SimpleNamespace(pg_map={gloo: ("gloo", None), nccl: ("cuda:nccl", None)}, pg_names={gloo: "0", nccl: "1"}, group_count=4)
    monkeypatch.setitem(sys.modules, "torch.distributed.distributed_c10d", types.SimpleNamespace(_world=world))
    calls = CallLog("<cell-")
    calls.p2p_counts.update({"0": 2, "1": 3})
    assert sync_state(calls) == {"seqs": {"0": 3, "1": 7}, "created": 4, "digests": {}}


def test_interactive_nccl_settings_and_shared_gpus() -> None:
    env = nccl_environment("/tmp/run")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == f"/tmp/run/{FR_DUMP_PREFIX}" and env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "1000"
    cfg = LaunchConfig(nproc=4, share_gpus=True, env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert cfg.backend == "nccl"
    launched = Launcher(cfg, "tcp://127.0.0.1:1", Credentials(b"\x04" * 32)).environment()
    assert launched["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # the user's own setting wins
    assert launched["DISTNB_SHARE_GPUS"] == "1" and all(launched[k] == v for k, v in SHARED_GPU_ENV.items())
    gloo = Launcher(LaunchConfig(nproc=2, backend="gloo"), "tcp://127.0.0.1:1", Credentials(b"\x05" * 32)).environment()
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in gloo or gloo["TORCH_NCCL_ASYNC_ERROR_HANDLING"] != "2"
    with pytest.raises(ValueError, match="gloo ranks need no GPU"):
        LaunchConfig(nproc=2, backend="gloo", share_gpus=True)
    with pytest.raises(ValueError, match="one machine only"):
        LaunchConfig(nproc=2, share_gpus=True, nnodes=2)


def test_a_host_waiting_at_a_sync_for_an_earlier_collective_is_described_so() -> None:
    pos = Position(0, "collective", op="all_reduce", seq=2, group="0", shapes="[4] f32", since=12.0, line=1,
                   code="loss.item()", running=4, line_cell=4, issued="issued in cell 3, line 4")
    assert pos.where() == ("waiting for all_reduce #2 on group 0 [4] f32 (issued in cell 3, line 4) for 12.0 s, "
                           "now blocked at cell line 1 (loss.item())")


def test_a_bounded_abort_then_forgetting_the_groups_lets_a_new_group_start() -> None:
    """The regroup path of an NCCL pool, run on gloo in a 1-rank process: backends aborted on a
    helper thread, the groups forgotten the way torch's own abort does, a new group on a fresh
    store prefix with the same names."""
    import os
    import subprocess

    code = (
        "import torch, torch.distributed as dist\n"
        "from distnb.worker.torch_hooks.group_abort import abort_backends, forget_groups\n"
        "store = dist.HashStore()\n"
        "dist.init_process_group('gloo', store=store, rank=0, world_size=1)\n"
        "side = dist.new_group([0])\n"
        "assert abort_backends(10.0)\n"
        "forget_groups()\n"
        "assert not dist.is_initialized()\n"
        "dist.init_process_group('gloo', store=dist.PrefixStore('distnb/regroup/1', store), rank=0, world_size=1)\n"
        "t = torch.ones(2); dist.all_reduce(t); again = dist.new_group([0])\n"
        "from torch.distributed import distributed_c10d as c10d\n"
        "print(t.tolist(), sorted(c10d._world.pg_names.values()))\n"
        # As every program must: a gloo worker thread that drops a finished work's tensors while
        # the interpreter finalizes is ended inside a noexcept destructor (torch's own exit race,
        # pytorch#179291; SIGABRT once in CI's suite). Destroying the groups joins those threads.
        "dist.destroy_process_group()\n"
    )
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1.0, 1.0] ['0', '1']", out.stdout


def test_the_abort_thread_never_holds_the_last_reference_to_a_group() -> None:
    """A group's destructor releases the GIL; a daemon thread that drops the last reference while
    the interpreter finalizes is ended inside a noexcept destructor: std::terminate, SIGABRT at
    the rank's exit (7 of 40 runs of the test above on torch 2.11 before the fix). Checked
    without waiting for that race: after the abort returns, nothing the helper thread runs may
    still reach a process group. Called as the control thread calls it, holding the exit guard's
    lock: an abort that waited for that lock would return False after its whole wait."""
    import os
    import subprocess

    code = (
        "import gc, threading, torch, torch.distributed as dist\n"
        "from distnb.worker.torch_hooks.group_abort import abort_backends, forget_groups\n"
        "targets = []\n"
        "start = threading.Thread.start\n"
        "def keep(self):\n"
        "    targets.append(self._target)\n"
        "    start(self)\n"
        "threading.Thread.start = keep\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "side = dist.new_group([0])\n"
        "from distnb.worker.process.exit_guard import torch_work\n"
        "with torch_work():  # as the control thread calls it (an interrupt's escalation): no wait on that lock\n"
        "    assert abort_backends(10.0)\n"
        "forget_groups()\n"
        "def reaches_a_group(obj, depth=4):\n"
        "    if isinstance(obj, dist.ProcessGroup):\n"
        "        return True\n"
        "    if depth == 0 or isinstance(obj, (type, type(gc))):\n"
        "        return False\n"
        "    kids = [c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not obj] if callable(obj) and "
        "hasattr(obj, '__closure__') else gc.get_referents(obj) if isinstance(obj, (list, tuple, dict)) else []\n"
        "    return any(reaches_a_group(k, depth - 1) for k in kids)\n"
        "print([t.__name__ for t in targets], any(reaches_a_group(t) for t in targets))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['run'] False", out.stdout


def test_a_check_on_a_gpu_still_busy_says_so_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose GPU still has queued work (an NCCL collective whose peers never came) would
    block in any tensor read: the check waits DEVICE_WAIT at most, then names the open work, and
    while it waits the rank reports itself busy in distnb's check."""
    from distnb.worker.process import rank as rank_mod
    from distnb.worker.process.control import ControlThread
    from distnb.worker.process.execute import Executor

    class Event:
        def record(self) -> None: ...

        def query(self) -> bool:
            return False  # the queued collective never completes

    cuda = types.SimpleNamespace(is_initialized=lambda: True, Event=Event)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setitem(sys.modules, "torch.cuda", cuda)
    monkeypatch.setattr(rank_mod, "DEVICE_WAIT", 0.2)
    monkeypatch.setattr(rank_mod, "open_nccl", lambda: "all_reduce #3 on group 0")
    executor = Executor({}, lambda cell, bundle: None)
    control = object.__new__(ControlThread)
    control.executor, control.state = executor, "idle"
    seen: list[dict] = []
    rank = object.__new__(rank_mod.Rank)
    rank.rank, rank.executor = 2, executor
    reply = rank.on_device("distnb's check", lambda: seen.append(control.status()) or {"status": "ok"})
    assert reply["status"] == "error" and not seen
    assert reply["error"].startswith("rank 2's GPU is still busy with queued work after 0 s (not completed: all_reduce #3 on group 0)")
    assert executor.busy == ""  # cleared after
    monkeypatch.setattr(Event, "query", lambda self: True)
    assert rank.on_device("distnb's check", lambda: seen.append(control.status()) or {"status": "ok"}) == {"status": "ok"}
    assert seen[0]["state"] == "busy" and seen[0]["busy"] == "distnb's check"


def test_a_read_after_a_cell_waits_briefly_for_gloo_to_retire_what_the_cell_completed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gloo retires an entry on its own thread after the work completes: a read just after the cell
    returned from its all_reduce found it "entered, not completed" (CI, once, under load), and the
    notebook kept saying so until its next read."""
    import time

    def entry(retired: bool) -> dict[str, object]:
        return {"record_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 1, "p2p_seq_id": 0,
                "profiling_name": "gloo:all_reduce", "time_created_ns": int(1000.5e9), "state": "scheduled", "retired": retired,
                "input_sizes": [[1]], "input_dtypes": ["Float"]}

    reads: list[int] = []

    def dumps(retire_after: int) -> tuple[dict[str, object], dict[str, str]]:
        reads.append(1)
        return {"fr": {"entries": [entry(len(reads) > retire_after)]}}, {}

    clock = CellClock()
    clock.start(3, 1000.0)
    clock.end(1001.0)  # the cell that made it has ended
    monkeypatch.setattr(fr, "dump_recorders", lambda: dumps(2))
    reply = fr.read_collectives(-1, clock, ids=RecordIds())
    assert [e["done"] for e in reply["entries"]] == [True] and len(reads) == 3
    # A work never waited on (async_op=True) stays open: the read gives up after RETIRE_WAIT, once.
    reads.clear()
    monkeypatch.setattr(fr, "dump_recorders", lambda: dumps(10**6))
    t0 = time.monotonic()
    ids = RecordIds()
    reply = fr.read_collectives(-1, clock, ids=ids)
    assert [e["done"] for e in reply["entries"]] == [False] and time.monotonic() - t0 >= fr.RETIRE_WAIT
    reads.clear()
    fr.read_collectives(reply["entries"][0]["id"], clock, ids=ids)  # the notebook holds it now: no wait
    assert len(reads) == 1
    # Nor when the notebook's cursor stays before it, as it does for an entry it holds open
    # (CollectiveLog.cursor): waited for in vain once, not at every later read.
    reads.clear()
    fr.read_collectives(reply["entries"][0]["id"] - 1, clock, ids=ids)
    assert len(reads) == 1
    # While a cell runs, an open entry is the truth of the moment: no wait.
    clock.start(4, 1002.0)
    reads.clear()
    fr.read_collectives(-1, clock, ids=RecordIds())
    assert len(reads) == 1
