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


FAILING = SCRIPT.replace('    print("sum", int(t.item()), "local", local)\n',
                         '    print("sum", int(t.item()), "local", local)\n'
                         '    if dist.get_rank() == 1:\n        raise ValueError("bad shard on rank 1")\n'
                         '    dist.barrier()\n')


def test_the_export_of_a_pasted_script_runs_as_the_cells_did_and_is_verified(fresh_pool, tmp_path) -> None:
    """The exported script keeps the pool's group at the pasted init and destroy, as the session
    did (else it dies at once: "initialize the default process group twice"), and %dist_export
    says "reproduced" only after running it: rank 1's own error, the same under torchrun."""
    pool = fresh_pool(2)
    assert pool.run("import sys\nexit_code = 0\ntry:\n    sys.exit(3)\nexcept SystemExit:\n    exit_code = 3", timeout=60).ok
    res = pool.run(FAILING, timeout=60)  # rank 0 waits in the barrier: ended at once, interrupted
    assert res[1].status == "error" and res[0].status == "interrupted", res.text()
    written = pool.export(str(tmp_path / "repro.py"))
    text = written.text()
    assert written.verified is not None and written.verified.reproduced, text
    assert "reproduced the failure (rank 1 raised ValueError: bad shard on rank 1)" in text, text
    script = (tmp_path / "repro.py").read_text()
    assert "_kept_init" in script and script.rstrip().endswith("_pool_destroy()"), script
    # A script that fails otherwise than the session is never called a reproduction.
    (tmp_path / "other.py").write_text(script.replace('raise ValueError("bad shard on rank 1")', 'raise KeyError("other")'))
    from distnb.services.cases.verify import session_signature, verify_script

    other = verify_script(tmp_path / "other.py", pool.config, session_signature(res), 60.0)
    assert other.ran and not other.reproduced and "rank 1: ValueError: bad shard on rank 1 in the session, KeyError: 'other' in the script" \
        in other.text(), other.text()
