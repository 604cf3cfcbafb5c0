"""%dist_restart --replay brings back what cells *and* pushes built, in the order they happened."""

from __future__ import annotations

import pytest

import distnb
from distnb.controller import session

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_replay_re_pushes_values_between_cells(fresh_pool) -> None:
    pool = fresh_pool(nproc=2, spares=True)
    assert pool.run("acc = [rank]").ok
    pool.push(scale=10)
    pool.push(ranks="1", only_one=5)
    assert pool.run("acc.append(scale * (rank + 1))").ok
    assert pool.run("1/0").failed == [0, 1]  # failed cells are not replayed
    assert [type(s).__name__ for s in pool._session.since_launch()] == ["CellResult", "PushRecord", "PushRecord", "CellResult", "CellResult"]

    pool.restart(replay=True)
    assert pool.pull("acc") == {0: [0, 10], 1: [1, 20]}
    # The failure that prompted the restart is still the one %dist_minimize starts from.
    assert "1/0" in [c.code for c in pool._session.failure_window()]
    assert pool.pull("only_one", ranks="1") == {1: 5}
    with pytest.raises(distnb.RemoteError, match="'only_one' is not defined on rank 0"):
        pool.pull("only_one", ranks="0")
    # Replayed pushes are recorded again, so a second replay finds them after the new launch too.
    pool.restart(replay=True)
    assert pool.pull("acc") == {0: [0, 10], 1: [1, 20]}


def test_replay_after_quick_restarts_brings_back_the_whole_session(fresh_pool) -> None:
    """A restart without --replay leaves empty ranks but does not move where replay starts: the
    next --replay re-runs the session since launch (cells before and after the restarts, in
    order), and a restart after that replay replays the replayed copies once, not twice."""
    pool = fresh_pool(nproc=2, spares=True)
    assert pool.wait(pool.submit("before = [rank]", label=3)).ok  # as %%on_ranks in In[3] runs it
    pool.restart()  # quick: fresh ranks under the running torchrun, namespaces empty
    assert pool.run("after = 7").ok
    pool.restart()
    pool.restart(replay=True)
    assert pool.pull("before") == {0: [0], 1: [1]} and pool.pull("after") == {0: 7, 1: 7}
    # A replayed cell keeps the notebook's name for it: export's --cells 3 finds the replayed copy.
    assert [c.label for c in pool.history if c.code == "before = [rank]"] == [3, 3]
    assert pool.run("before.append(after)").ok
    pool.restart(replay=True)
    assert pool.pull("before") == {0: [0, 7], 1: [1, 7]}


def test_a_push_too_large_to_keep_stops_replay_with_a_clear_error(fresh_pool, monkeypatch) -> None:
    pool = fresh_pool(nproc=2, spares=True)
    monkeypatch.setattr(session, "KEEP_PUSH_BYTES", 0)  # every pushed value is let go at once
    pool.push(big=1)
    assert pool.pushes[-1].blob is None and pool.pushes[-1].names == ("big",)
    pool.run("x = big")
    with pytest.raises(distnb.RemoteError, match=r"values pushed before cell \d+ \(big\) were too large to keep; push them again"):
        pool.restart(replay=True)
