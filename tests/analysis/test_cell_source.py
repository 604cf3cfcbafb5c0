"""What a cell's code says about a call: an ``if`` on the rank, by any name the session gave it."""

from __future__ import annotations

import pytest

from distnb.analysis.agreement.cell_source import around, rank_names

SETUP = """
import os
ddp_rank = int(os.environ["RANK"])
ddp_local_rank = int(os.environ.get("LOCAL_RANK", 0))
master_process = ddp_rank == 0
seed_offset = ddp_rank
is_leader: bool = master_process and True
lr = 6e-4
device = f"cuda:{ddp_local_rank}"
"""


def test_names_made_from_the_rank_are_rank_names_and_others_are_not() -> None:
    names = rank_names([SETUP, "x = (", "eval_only = False"])  # a cell that does not parse is skipped
    assert {"ddp_rank", "ddp_local_rank", "master_process", "seed_offset", "is_leader", "device"} <= names
    assert not {"lr", "eval_only", "os"} & names
    assert "rank" in names and "get_rank" in names  # torch's own stay


@pytest.mark.parametrize("test", ["master_process", "iter_num % 10 == 0 and master_process", "not is_leader", "ddp_rank > 0"])
def test_an_if_on_a_rank_name_is_a_condition_on_the_rank(test: str) -> None:
    code = f"for iter_num in range(5):\n    if {test}:\n        dist.all_reduce(loss)\n"
    found = around(code, 3, rank_names([SETUP]))
    assert found is not None and found.rank_condition() == (2, f"if {test}:")
    # Without the session's names the same `if` says nothing of the rank.
    plain = around(code, 3)
    assert plain is not None and plain.rank_condition() is None


def test_an_if_on_a_setting_is_not_a_condition_on_the_rank() -> None:
    found = around("if lr > 1e-3:\n    dist.all_reduce(x)\n", 2, rank_names([SETUP]))
    assert found is not None and found.rank_condition() is None
