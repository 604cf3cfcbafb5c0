"""A torchrun script pasted into cells: its init_process_group and destroy_process_group keep the
pool's group, each said in one line, and the cells after it still have a group (issue 30, item 3)."""

from __future__ import annotations

import distnb

SCRIPT = """
import os
import torch
import torch.distributed as dist

def setup():
    dist.init_process_group("nccl")  # the script's own first line; this pool runs gloo
    return int(os.environ["LOCAL_RANK"])

def main():
    local = setup()
    t = torch.ones(1)
    dist.all_reduce(t)
    print("sum", int(t.item()), "local", local)
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
"""


def test_a_pasted_script_runs_and_the_pool_keeps_its_group(pool: distnb.Pool) -> None:
    res = pool.run(SCRIPT, timeout=60)
    assert res.ok, res.text()
    assert all(res[r].stdout.startswith("sum 4 local") for r in range(4)), res.text()
    text = res.text()
    assert "[ranks 0-3 stderr] [distnb] init_process_group: kept the pool's process group (gloo, 4 ranks)" in text, text
    assert "backend 'nccl' asked, the pool's is 'gloo' (%dist_launch --backend nccl)" in text, text
    assert "[ranks 0-3 stderr] [distnb] destroy_process_group: kept the pool's process group" in text, text
    # The next cell still has the group, and a subgroup's destroy is the script's own business.
    res = pool.run("g = dist.new_group([0, 1])\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                   "dist.destroy_process_group(g) if rank in (0, 1) else None\nint(t.item())", timeout=60)
    assert res.ok and set(res.values.values()) == {"4"}, res.text()
    assert "kept the pool's process group" not in res.text(), res.text()


def test_an_init_that_agrees_with_the_pool_is_noted_without_complaint(pool: distnb.Pool) -> None:
    res = pool.run("dist.init_process_group(backend='gloo', world_size=world_size, rank=rank)", timeout=60)
    assert res.ok, res.text()
    assert "kept the pool's process group (gloo, 4 ranks), which every rank has had since launch." in res.text(), res.text()
    assert "asked" not in res.text(), res.text()
