"""An idle pool at rest and quick cells that wake little (issue 15): gloo's loop threads sleep,
pings come no more often than needed, torchrun is not woken ten times a second, and a quick cell
wakes no rank's control thread (only a cell that runs on is watched). The CPU figures are in
``benchmarks/``; these tests check the mechanisms, on a real pool where they act."""

from __future__ import annotations

import ast
import ctypes
import math
import threading
import time

import pytest
import zmq

from distnb.config import LaunchConfig
from distnb.controller.channel import Channel, FollowUp
from distnb.controller.tracker import WATCH_AFTER
from distnb.wire.codec import Codec, ReplayGuard
from distnb.wire.protocol import Msg
from distnb.wire.security import Credentials
from distnb.worker.process.control import WATCH_INTERVAL
from distnb.worker.torch_hooks import gloo_idle

_libc = ctypes.CDLL(None, use_errno=True)


def _own_slack() -> int:
    return int(_libc.prctl(30, 0, 0, 0, 0))  # PR_GET_TIMERSLACK


def test_slack_is_lent_to_new_threads_only():
    seen: list[int] = []
    mine = _own_slack()
    with gloo_idle._thread_slack(250_000_000):
        assert _own_slack() == 250_000_000
        t = threading.Thread(target=lambda: seen.append(_own_slack()))
        t.start()
        t.join()
    assert seen == [250_000_000], "a thread started inside inherits the slack"
    assert _own_slack() == mine, "the creating thread gets its own slack back"
    with gloo_idle._thread_slack(0):  # 0: off
        assert _own_slack() == mine


@pytest.mark.parametrize("raw, ns", [("100", 100_000_000), ("0", 0), ("2.5", 2_500_000), ("-3", 0), ("lots", 100_000_000)])
def test_slack_setting(monkeypatch, capsys, raw, ns):
    monkeypatch.setenv("DISTNB_GLOO_TIMER_SLACK_MS", raw)
    assert gloo_idle.slack_ns() == ns
    if raw == "lots":
        assert "not a number of milliseconds" in capsys.readouterr().err


def test_only_gloo_groups_get_the_slack():
    assert gloo_idle._is_gloo("gloo") and gloo_idle._is_gloo("GLOO")
    assert not gloo_idle._is_gloo("nccl") and not gloo_idle._is_gloo("cpu:gloo,cuda:nccl")
    mine = _own_slack()
    with gloo_idle.gloo_creation("nccl"):
        assert _own_slack() == mine


@pytest.mark.parametrize("timeout, every", [(15.0, 3.0), (5.0, 1.0), (2.0, 1.0), (10.0, 2.0), (600.0, 3.0)])
def test_ping_interval_leaves_five_pings_per_timeout(timeout, every):
    assert LaunchConfig(nproc=1, heartbeat_timeout=timeout).ping_interval == every


@pytest.mark.timeout(30)
def test_pings_are_paced_apart_from_the_ticks():
    """Ticks (the pool's periodic checks) keep their pace; pings come every ``ping_every``."""
    creds = Credentials.new()
    ticks: list[float] = []
    channel = Channel(creds, lambda *a: None, lambda: ticks.append(time.monotonic()), heartbeat=0.05, ping_every=0.25)
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.IDENTITY, b"s0")
    peer.setsockopt(zmq.LINGER, 0)
    try:
        peer.connect(channel.address)
        channel.heartbeat_peers.add(b"s0")
        guard = ReplayGuard()
        pings: list[float] = []
        start = time.monotonic()
        # Eight pings, however long a loaded machine takes to send them; then ratios, not rates:
        # the ticks (every 0.05 s) keep their pace beside the pings (every 0.25 s), and the pings
        # come no more often than ping_every over the whole span (one late read bunches two).
        while len(pings) < 8 and time.monotonic() - start < 20:
            if peer.poll(50):
                if Codec(creds.key, "x").decode(peer.recv_multipart(), guard)["t"] == Msg.PING:
                    pings.append(time.monotonic())
        assert len(pings) == 8, f"{len(pings)} pings in 20 s at one per 0.25 s"
        span = pings[-1] - pings[0]
        ticks_in = [t for t in ticks if pings[0] <= t <= pings[-1]]
        assert len(ticks_in) >= 2 * (len(pings) - 1), f"ticks slowed down: {len(ticks_in)} between 8 pings"
        assert span >= 0.8 * 0.25 * (len(pings) - 1), f"8 pings in {span:.2f} s: closer than ping_every"
    finally:
        peer.close()
        ctx.term()
        channel.close()


@pytest.mark.timeout(30)
def test_follow_ups_run_when_due_and_only_while_wanted():
    channel = Channel(Credentials.new(), lambda *a: None, None, heartbeat=5.0)  # no tick to lean on
    ran: list[tuple[str, float]] = []
    try:
        start = time.monotonic()
        keep = FollowUp(0.2, lambda: ran.append(("kept", time.monotonic() - start)), lambda: True)
        dropped_flag = [True]
        drop = FollowUp(0.2, lambda: ran.append(("dropped", 0.0)), lambda: dropped_flag[0])
        boom = FollowUp(0.1, lambda: 1 / 0, lambda: True)
        channel.send_many([b"nobody"], {"t": Msg.PING}, follow_up=keep)
        channel.send_many([b"nobody"], {"t": Msg.PING}, follow_up=drop)
        channel.send_many([b"nobody"], {"t": Msg.PING}, follow_up=boom)
        dropped_flag[0] = False  # the cell ended before its follow-up was due
        deadline = time.monotonic() + 5
        while not ran and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert [name for name, _ in ran] == ["kept"], ran
        assert 0.19 <= ran[0][1] < 2.0, f"due after 0.2 s, ran after {ran[0][1]:.3f} s (heartbeat 5 s)"
        assert channel.errors == 1 and "follow-up" in (channel.last_error or "") and channel.alive
    finally:
        channel.close()


# -- on a real pool -------------------------------------------------------------------------------

_LOOPS = r"""
import ctypes as _ct, os as _os, re as _re, time as _time
def _switches(tids):
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                out[tid] = int(_re.search(r"voluntary_ctxt_switches:\s+(\d+)", f.read()).group(1))
        except OSError:
            pass
    return out
def _loops(tids):
    # gloo names its loop thread from torch 2.12; before, it is one of the threads a creation starts.
    named = set()
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "gloo_tcp_loop":
                    named.add(tid)
        except OSError:
            pass
    return named
_tasks = lambda: set(_os.listdir("/proc/self/task"))
_idle_before = _tasks()
_os.environ["DISTNB_GLOO_TIMER_SLACK_MS"] = "0"
_idle_plain = dist.new_group(backend="gloo")   # as gloo makes it: a 10 ms tick
del _os.environ["DISTNB_GLOO_TIMER_SLACK_MS"]
_plain_new = _tasks() - _idle_before
_idle_slack = dist.new_group(backend="gloo")   # as distnb makes it
_slack_new = _tasks() - _idle_before - _plain_new
_before_mesh = _tasks()
from torch.distributed.device_mesh import init_device_mesh as _idm   # its groups come from new_group it imported by name
_idle_mesh = _idm("cpu", (2, 2), mesh_dim_names=("idle_a", "idle_b"))
_mesh_new = _tasks() - _before_mesh
_named = bool(_loops(_plain_new))
_plain_loops, _slack_loops, _mesh_loops = ((_loops(_plain_new), _loops(_slack_new), _loops(_mesh_new)) if _named
                                           else (_plain_new, _slack_new, _mesh_new))
# The pool's own group is the first gloo group the rank made: its loop is the oldest (groups earlier
# cells made, and left, have loops of their own).
_pool_loops = set(sorted(_loops(_idle_before), key=int)[:1])
_t = torch.ones(2)
dist.all_reduce(_t, group=_idle_slack)       # the slack group works, at once
_every = _plain_loops | _slack_loops | _pool_loops | _mesh_loops
_a = _switches(_every); _time.sleep(1.0); _b = _switches(_every)
_rate = lambda tids: max((_b[t] - _a[t] for t in tids if t in _a and t in _b), default=None)
_result = (_named, len(_plain_loops), len(_slack_loops), _rate(_plain_loops), _rate(_slack_loops), _rate(_pool_loops),
           _ct.CDLL(None).prctl(30, 0, 0, 0, 0), _t.tolist(), len(_mesh_loops), _rate(_mesh_loops))
dist.destroy_process_group(_idle_plain); dist.destroy_process_group(_idle_slack)
for _g in _idle_mesh.get_all_groups():
    dist.destroy_process_group(_g)
_result
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gloo_loops_sleep_and_the_cells_thread_keeps_its_timers(pool):
    """Each rank's gloo loop threads (the pool's group, groups a cell makes, a DeviceMesh's) wake a
    few times a second at rest, not a hundred; a group made with the slack off shows what gloo does
    alone. The cell's own thread keeps the default slack: a user's ``time.sleep(0.001)`` stays 1 ms."""
    res = pool.run(_LOOPS, timeout=90)
    assert res.ok, res.text()
    for rank, value in res.values.items():
        named, plain_n, slack_n, plain_rate, slack_rate, pool_rate, own_slack, total, mesh_n, mesh_rate = ast.literal_eval(value)
        if named:  # torch >= 2.12: the loop threads by name, the pool's own too
            assert plain_n == 1 and slack_n == 1, f"rank {rank}: one loop thread per new gloo group, got {plain_n}, {slack_n}"
            assert pool_rate is not None and pool_rate <= 25, f"rank {rank}: the pool's loop woke {pool_rate}/s"
            # A mesh's dimensions are groups device_mesh makes with the new_group it imported by name.
            assert mesh_n >= 1 and mesh_rate is not None and mesh_rate <= 25, f"rank {rank}: {mesh_n} mesh loops woke {mesh_rate}/s"
        else:  # unnamed: the threads each creation started, the loop the busiest of them
            assert plain_n >= 1 and slack_n >= 1, f"rank {rank}: a new gloo group started no thread ({plain_n}, {slack_n})"
        # Relative to the slack group's, which shares the machine's load: gloo alone must wake far
        # more often, or this check could not tell the slack's effect.
        assert plain_rate is not None and slack_rate is not None and plain_rate >= max(20, 2 * slack_rate), (
            f"rank {rank}: gloo's own loop woke only {plain_rate}/s against the slack's {slack_rate}/s (the check can't tell)")
        assert slack_rate is not None and slack_rate <= 25, f"rank {rank}: slack loops woke {slack_rate}/s"
        assert own_slack == gloo_idle.DEFAULT_SLACK_NS, f"rank {rank}: the cell's thread has slack {own_slack} ns"
        assert total == [4.0, 4.0]


_CONTROL_SWITCHES = """
import threading as _th
_ctl = next(t for t in _th.enumerate() if t.name == "distnb-control").native_id
with open(f"/proc/self/task/{_ctl}/status") as _f:
    _switches = int(next(l for l in _f if l.startswith("voluntary_ctxt_switches")).split()[1])
_switches
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_cells_leave_the_control_thread_asleep_and_long_ones_are_watched(pool, monkeypatch, tmp_path):
    """A quick cell wakes only the rank's main thread; one that runs past WATCH_AFTER is watched:
    its collectives reach the notebook while it still runs, with the pool's own poll switched off."""
    before = {r: int(v) for r, v in pool.run(_CONTROL_SWITCHES).values.items()}
    cells = [pool.run("pass") for _ in range(30)]
    after = {r: int(v) for r, v in pool.run(_CONTROL_SWITCHES).values.items()}
    assert all(c.ok for c in cells)
    woken = {r: after[r] - before[r] for r in after}
    # The product's rule, not this machine's speed: a cell that ends before WATCH_AFTER wakes no
    # control thread; one still running then (a loaded machine makes "pass" slow) is watched —
    # the WATCH, then a look every WATCH_INTERVAL until it ends.
    watched = [c.elapsed for c in cells if c.elapsed >= WATCH_AFTER]
    allowed = 10 + sum(2 + math.ceil((e - WATCH_AFTER) / WATCH_INTERVAL) for e in watched)
    assert all(n <= allowed for n in woken.values()), (
        f"control threads woke {woken} times during 31 cells ({len(watched)} ran past {WATCH_AFTER} s: {allowed} allowed)")

    # Without the notebook's 1 s poll, only the ranks' own watch can bring the entries in: any that
    # arrives while the cell still runs (it sleeps until the test has seen all four) was pushed.
    monkeypatch.setattr(pool._tracker._asks, "poll_collectives", lambda running, dead: None)
    go = str(tmp_path / "go")
    cell = pool.submit(f"_w = torch.ones(3)\ndist.all_reduce(_w)\nimport os, time\nwhile not os.path.exists({go!r}):\n    time.sleep(0.02)")
    try:
        seen: set[int] = set()
        start = time.monotonic()
        while len(seen) < 4 and time.monotonic() - start < 60:
            for r in range(4):
                if r not in seen and any(e.get("cell") == cell.cell for e in list(pool._tracker.collective_log.entries.get(r, {}).values())):
                    seen.add(r)
            time.sleep(0.01)
        assert sorted(seen) == [0, 1, 2, 3], f"the running cell's all_reduce reached the notebook from ranks {sorted(seen)} only"
        assert cell.running == [0, 1, 2, 3], "the cell ended before the test looked"
    finally:
        open(go, "w").close()
        assert pool.wait(cell, timeout=30).ok
