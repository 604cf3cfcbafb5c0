"""The transport seam: a Pool over ranks replayed from a real pool's recording
(``tests/fake_ranks.py``) starts, runs cells, answers the views and shuts down with no process
started, and shows for each cell what the real pool showed when it was recorded."""

from __future__ import annotations

import re

import pytest
from fake_ranks import FakeRanks, Stream

import distnb
from distnb.controller.tracker import Tracker
from distnb.wire.protocol import Msg

pytestmark = pytest.mark.timeout(60)


def _steady(text: str) -> str:
    """A result's text without what differs from run to run: durations, memory figures, and the
    cell's number (this process's count; the test below checks that replayed messages carry it)."""
    text = re.sub(r"\d+\.\d+ s\b", "T s", text)
    text = re.sub(r"\bcell \d+ on\b", "cell N on", re.sub(r"<cell-\d+>", "<cell-N>", text))
    return re.sub(r"[+-]?\d+(\.\d+)? [KMG]iB", "M", text)


@pytest.fixture
def replayed() -> tuple[distnb.Pool, FakeRanks]:
    fake = FakeRanks(Stream.load("four_ranks"))
    pool = distnb.Pool(nproc=4, backend="gloo", transport=fake)
    yield pool, fake
    pool.shutdown()


def test_a_replayed_pool_shows_what_the_real_one_did(replayed: tuple[distnb.Pool, FakeRanks]) -> None:
    pool, fake = replayed
    pool.start()
    assert pool.state == distnb.PoolState.READY and pool.pids() == []
    texts = fake.stream.texts
    assert len(texts) == 5
    for code, real in texts.items():
        res = pool.run(code, timeout=30)
        assert _steady(res.text()) == _steady(real), code
    assert not fake.unrecorded and not fake.errors


def test_views_ask_the_replayed_ranks_by_id(replayed: tuple[distnb.Pool, FakeRanks]) -> None:
    pool, fake = replayed
    pool.start()
    stacks = pool.stacks()
    assert stacks.text().splitlines()[1] == "── ranks 0-3: idle"
    assert "memory of ranks 0-3" in pool.memory().text()
    asked = [m["id"] for _, m in fake.sent if m["t"] == Msg.STACKS]
    assert len(asked) == 4 and len(set(asked)) == 1  # one request, to every rank, answered under its own id
    status = pool.status()
    assert status.state == "ready" and [r.state.value for r in status.ranks] == ["idle"] * 4


def test_a_cell_the_recording_lacks_fails_at_once_and_says_how_to_record_it(replayed: tuple[distnb.Pool, FakeRanks]) -> None:
    pool, fake = replayed
    pool.start()
    with pytest.raises(AssertionError, match="add it to tests/record_streams.py"):
        pool.submit("never_recorded = 1")
    assert fake.unrecorded == ["cell 'never_recorded = 1'"]


def test_cell_numbers_are_the_pools_own_in_replayed_messages(replayed: tuple[distnb.Pool, FakeRanks]) -> None:
    pool, fake = replayed
    pool.start()
    code = "if rank == 2:\n    raise ValueError('bad value on rank 2')"
    pool.run("x = torch.ones(2) * (rank + 1)\ndist.all_reduce(x)\nx")
    first = pool.run(code)
    again = pool.run(code)  # recorded once as cell 4; replayed under the numbers the Pool gives now
    assert again.cell == first.cell + 1 and first.failed == again.failed == [2]
    for res in (first, again):
        assert res[2].error is not None and f"<cell-{res.cell}>" in res.text(), res.text()
        assert res.cell == 4 or "<cell-4>" not in res.text()


def test_a_launch_that_fails_before_it_begins_says_why_and_can_be_tried_again() -> None:
    """The wire could not listen (an address in use, not this machine's): the LaunchError says so,
    nothing was started, and the pool can start once the cause is gone."""

    class NoWire(FakeRanks):
        failures = 1

        def open(self, tracker: Tracker) -> None:
            if self.failures:
                self.failures -= 1
                raise distnb.LaunchError("can't listen on 10.0.0.1:5555: Cannot assign requested address.")
            super().open(tracker)

    pool = distnb.Pool(nproc=4, backend="gloo", transport=NoWire(Stream.load("four_ranks")))
    with pytest.raises(distnb.LaunchError, match="can't listen on"):
        pool.start()
    assert pool.state == distnb.PoolState.NEW
    pool.start()
    try:
        assert pool.state == distnb.PoolState.READY
    finally:
        pool.shutdown()
