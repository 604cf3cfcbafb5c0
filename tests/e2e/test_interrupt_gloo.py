"""One interrupt is enough on gloo: ranks blocked in a collective whose peer never comes are
unblocked by their control threads ESCALATE_AFTER seconds after the interrupt (their gloo
connections shut down: neither a signal handler nor gloo's abort can wake that wait), the cell
ends, every namespace stays, and the pool rebuilds the process group so the next collective works.

The bounds come from the product's own constants (ESCALATE_AFTER, plus a margin for messages to
travel), never from this machine's speed; the shared pool's collective timeout (--pg-timeout, 30
minutes by default) is far beyond them, so a pass can't come from the collective timing out."""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import pytest

import distnb
from distnb.ranks import parse_ranks
from distnb.worker.torch_hooks import gloo_unblock
from distnb.worker.torch_hooks.group_abort import ESCALATE_AFTER

from conftest import MARK_INSIDE, usable, wait_until

#: From the interrupt to the cell's end on every rank: the escalation's delay, then the shutdown,
#: the collective's error and the cell's end travelling back (milliseconds, given seconds here for
#: a loaded machine) — far below --pg-timeout, the wait without the escalation.
BOUND = ESCALATE_AFTER + 8.0

#: Ranks 0, 2 and 3 block in an all_reduce that rank 1 skips.
SKIP = ("tag = 'before'\nt = torch.ones(2)\nif rank != 1:\n    print('entering', flush=True)\n    dist.all_reduce(t)\n"
        "    print('never got here', flush=True)\n")


def _started(pool: distnb.Pool) -> distnb.CellResult:
    """Submit the cell above once every rank holds a value to keep; return when ranks 0,2,3 are in the collective."""
    assert pool.config.pg_timeout is None or pool.config.pg_timeout > 10 * BOUND, pool.config
    assert pool.run("kept = 100 + rank").ok
    res = pool.submit(SKIP)
    # The record the interrupt's words are read from: each waiting rank's open entry, pushed.
    log = pool._tracker.collective_log
    wait_until(lambda: res[1].status == "ok" and all(log.pending(r, res.cell) for r in (0, 2, 3)), 60, "ranks 0,2,3 in the all_reduce")
    assert sorted(res.running) == [0, 2, 3], res.text()
    return res


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_one_interrupt_unblocks_a_gloo_collective_keeps_namespaces_and_rebuilds_the_group(pool4: distnb.Pool) -> None:
    pool = usable(pool4)
    res = _started(pool)
    t0 = time.monotonic()
    assert sorted(pool.interrupt()) == [0, 2, 3]
    wait_until(lambda: not res.running, BOUND, f"the cell to end within {BOUND} s of one interrupt")
    ended = time.monotonic() - t0
    pool.wait(res, timeout=60)  # the rebuild happens here, once the cell has ended on every rank
    text = res.text()
    assert ended >= ESCALATE_AFTER - 0.5, f"ended after {ended:.1f} s: before the escalation, so not by it?\n{text}"
    assert sorted(r for r in res.ranks if res[r].status == "interrupted") == [0, 2, 3], text
    assert res[1].status == "ok" and not any("never got here" in res[r].stdout for r in res.ranks), text
    # Each blocked rank shuts its own connections down after ESCALATE_AFTER, unless a peer's shutdown
    # woke it first (on a loaded machine the three timers fire apart): at least one did, and the note
    # names those. A rank whose timer fired as a peer's shutdown ended its cell says so on stderr
    # just after its cell's output closed, so its line may miss the result: the note (from the
    # ranks' own records) names at least the ranks whose line arrived, and only blocked ones.
    # Its connections: 3 on the default group, more where the shared pool made other groups before.
    escalated = [r for r in (0, 2, 3) if re.search(r"shutting down its \d+ gloo connections so the cell can stop", res[r].stderr)]
    assert escalated, text
    assert any("Every rank has a fresh default process group (4 ranks), namespaces kept" in n for n in res.notes), text
    named = re.search(r"could not land on ranks? ([\d,\-]+), blocked in all_reduce #", text)
    assert named is not None, text
    assert set(escalated) <= set(parse_ranks(named.group(1), 4)) <= {0, 2, 3}, text
    # The processes are the same, their namespaces kept; the new group works on every rank.
    again = pool.run("y = torch.ones(2) * (rank + 1)\ndist.all_reduce(y)\n(y.sum().item(), kept, tag)", timeout=30)
    assert again.ok, again.text()
    assert again.values == {r: f"(20.0, {100 + r}, 'before')" for r in range(4)}, again.text()
    assert pool.state == distnb.PoolState.READY


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_says_at_once_who_is_blocked_and_what_happens(pool4: distnb.Pool, capsys: pytest.CaptureFixture[str]) -> None:
    pool = usable(pool4)
    res = _started(pool)
    said: list[float] = []
    ended: list[float] = []
    capsys.readouterr()

    def watch() -> None:
        while res.running:
            time.sleep(0.01)
        ended.append(time.monotonic())

    threading.Thread(target=watch, daemon=True).start()

    def on_tick(result: distnb.CellResult) -> None:
        if not said:
            said.append(time.monotonic())
            raise KeyboardInterrupt  # Ctrl-C, once, in the waiting thread

    pool.wait(res, timeout=60, on_tick=on_tick)
    err = capsys.readouterr().err
    text = res.text()
    # Said at once: who is blocked where, what happens and when, and that namespaces stay.
    first = next(line for line in err.splitlines() if line.startswith(f"[distnb] interrupting cell {res.cell} on ranks 0,2,3:"))
    assert "Ranks 0,2,3 are blocked in all_reduce" in first, first
    assert f"still there in {ESCALATE_AFTER:.0f} s, they get their gloo connections shut down so the cell can stop" in first, first
    assert "namespaces stay; the process group is then rebuilt" in first, first
    assert "pool." not in err and "regroup()" not in err, err  # the notebook's words, not methods the user doesn't have
    assert not res.detached and not res.timed_out and not res.running, text
    assert ended and ended[0] - said[0] <= BOUND, f"the cell ended {ended[0] - said[0]:.1f} s after the Ctrl-C\n{text}"
    assert sorted(r for r in res.ranks if res[r].status == "interrupted") == [0, 2, 3], text
    assert "rebuilding the process group on every rank" in err, err
    again = pool.run("z = torch.ones(1)\ndist.all_reduce(z)\n(z.item(), kept)", timeout=30)
    assert again.values == {r: f"(4.0, {100 + r})" for r in range(4)}, again.text()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_interrupt_that_lands_leaves_the_group_alone(pool4: distnb.Pool) -> None:
    """A cell the interrupt reaches in Python (no rank stuck in a collective) is not escalated,
    and the group is not rebuilt: objects holding it (DDP) keep working."""
    pool = usable(pool4)
    assert pool.run("g_keep = dist.distributed_c10d._get_default_group()").ok  # a rebuild would destroy it
    res = pool.submit("import time\nprint('ready', flush=True)\ntime.sleep(60)")
    wait_until(lambda: all(res[r].stdout.startswith("ready") for r in res.ranks), 60, "every rank ready")
    pool.interrupt()
    pool.wait(res, timeout=30)
    assert all(res[r].status == "interrupted" for r in res.ranks) and not res.notes, res.text()
    still = pool.run("w = torch.ones(1)\ndist.all_reduce(w, group=g_keep)\nw.item()", timeout=30)
    assert still.values == {r: "4.0" for r in range(4)}, still.text()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_one_interrupt_unblocks_a_rank_waiting_on_an_irecv_nobody_sends(pool4: distnb.Pool, tmp_path: Path) -> None:
    """A main thread in ``work.wait()`` of an irecv is in no torch.distributed frame and gloo records
    no point-to-point entry: the call log's open irecv is what says it waits on a peer."""
    pool = usable(pool4)
    assert pool.run(MARK_INSIDE).ok
    waiting = tmp_path / "waiting"
    res = pool.submit(f"buf = torch.empty(3)\nif rank == 0:\n    req = dist.irecv(buf, src=3)\n    dbg_mark_calling({str(waiting)!r}, 5)\n"
                      "    req.wait()\n    print('never got here', flush=True)\n")
    # Rank 0 inside req.wait() (a file written before it could leave the interrupt to land in Python).
    wait_until(lambda: waiting.exists() and all(res[r].status == "ok" for r in (1, 2, 3)), 60, "rank 0 in its wait")
    t0 = time.monotonic()
    pool.interrupt()
    wait_until(lambda: not res.running, BOUND, f"the cell to end within {BOUND} s of one interrupt")
    pool.wait(res, timeout=60)
    assert time.monotonic() - t0 >= ESCALATE_AFTER - 0.5 and res[0].status == "interrupted", res.text()
    assert "irecv from rank 3 (gloo)" in res[0].stderr and "never got here" not in res[0].stdout, res.text()
    assert pool.run("z = torch.ones(1)\ndist.all_reduce(z)\nz.item()", timeout=60).values == {r: "4.0" for r in range(4)}


# -- which sockets are gloo's: the rules, on a table made up for the purpose ----------------------

def _table(monkeypatch: pytest.MonkeyPatch, rows: list[tuple[int, tuple[str, int], tuple[str, int], str]], mine: dict[int, int]) -> None:
    monkeypatch.setattr(gloo_unblock, "_tcp_table", lambda: rows)
    monkeypatch.setattr(gloo_unblock, "_own_sockets", lambda: mine)
    monkeypatch.setattr(gloo_unblock, "_ephemeral", lambda: range(32768, 61000))


@pytest.mark.timeout(10)
def test_only_gloo_pairs_are_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    est, lis = "01", "0A"
    me, peer, other_host = "10.0.0.5", "10.0.0.5", "10.0.0.9"
    rows = [
        (1, (me, 40001), ("0.0.0.0", 0), lis),           # gloo's listener (ours)
        (2, (me, 40001), (peer, 50002), est),            # accepted by it: a pair
        (3, (me, 50100), (peer, 40777), est),            # to a same-machine rank's listener: a pair
        (4, ("10.0.0.5", 40777), ("0.0.0.0", 0), lis),   # (that rank's listener, not ours)
        (5, (me, 50200), (other_host, 45000), est),      # to a peer on another machine: a pair
        (6, (me, 50300), ("127.0.0.1", 29500), est),     # the rendezvous store (MASTER_PORT)
        (7, (me, 50400), (me, 35555), est),              # the controller's ZMQ endpoint
        (8, (me, 50500), ("93.184.216.34", 443), est),   # the user's HTTPS: a well-known port
        (9, (me, 50600), (me, 41234), est),              # same machine, but to no listener
        (10, ("0.0.0.0", 8888), ("0.0.0.0", 0), lis),    # a user's wildcard server (ours)
        (11, ("10.0.0.5", 8888), ("10.0.0.7", 50123), est),  # ... and a client of it
        (12, (me, 50700), (peer, 40001), est),           # not ours (another process's socket)
    ]
    mine = {i: 100 + i for i in (1, 2, 3, 5, 6, 7, 8, 9, 10, 11)}
    _table(monkeypatch, rows, mine)
    monkeypatch.setenv("MASTER_PORT", "29500")
    keep = gloo_unblock.store_and_controller_ports("tcp://10.0.0.5:35555")
    assert keep >= {29500, 35555}
    picked = {c.inode for c in gloo_unblock.gloo_connections(keep)}
    assert picked == {2, 3, 5}, picked


@pytest.mark.timeout(10)
def test_nothing_is_picked_without_a_gloo_listener(monkeypatch: pytest.MonkeyPatch) -> None:
    _table(monkeypatch, [(2, ("10.0.0.5", 50000), ("10.0.0.6", 45000), "01")], {2: 7})
    assert gloo_unblock.gloo_connections(set()) == []


@pytest.mark.timeout(10)
def test_proc_addresses_and_a_real_shutdown() -> None:
    """/proc's hex addresses read back as this process's own listener and connection, and a
    shutdown wakes a blocked reader while its descriptor stays open."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        port = server.getsockname()[1]
        conns = gloo_unblock.gloo_connections(set())
        ours = [c for c in conns if c.fd == accepted.fileno()]
        assert [(c.local, c.remote) for c in ours] == [(("127.0.0.1", port), client.getsockname())], conns
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(accepted.recv(1)))
        reader.start()
        time.sleep(0.1)
        assert gloo_unblock.shut_down(ours) == 1
        reader.join(5)
        assert not reader.is_alive() and got == [b""]
        assert accepted.fileno() >= 0  # shut down, not closed: the owner closes it
    finally:
        for s in (accepted, client, server):
            s.close()
