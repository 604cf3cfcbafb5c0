"""What a cell's code says about a call: an ``if`` on the rank, by any name the session gave it."""

from __future__ import annotations

import pytest

from distnb.analysis.agreement.cell_source import around, may_branch, rank_names

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


@pytest.mark.parametrize("code, sources, expected", [
    ("if rank == 0:\n    dist.barrier()\n", [], True),
    ("for step in range(n):\n    dist.all_reduce(x)\n", [], True),
    ("try:\n    f()\nexcept ValueError:\n    pass\n", [], True),
    # One line for every rank: a value that differs, not a line.
    ("n_mb = 2 if rank == 2 else 4\nsched = ScheduleGPipe(stage, n_microbatches=n_mb)\nsched.step()\n", ["import torch\n"], False),
    ("x = [1, 2]\n", ["def step(x):\n    if x.sum() > 0:\n        return x\n"], False),  # no call at all
    ("y = step(x)\n", ["def step(x):\n    if x.sum() > 0:\n        return x\n"], True),
    ("out = model(x)\n", ["class Net(nn.Module):\n    def forward(self, x):\n        for layer in self.layers:\n            x = layer(x)\n"], True),
    ("out = model(x)\n", ["model = nn.Linear(2, 2)\n"], False),
    ("out = model(x\n", [], True),  # unparsable: maybe
])
def test_paths_are_worth_recording_only_where_lines_could_differ(code: str, sources: list[str], expected: bool) -> None:
    assert may_branch(code, sources) is expected
