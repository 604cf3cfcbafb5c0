"""A training script's master-only collective inside its loop, pasted into cells (issue 49, item 1):
gloo aborts rank 0 within milliseconds of the size mismatch, before its control thread pushes the
call. The headline, the death report and ``%dist_collectives`` must tell one story — rank 0's own
call, with its shape and place in the group's sequence (from its black box), under the ``if`` that
only the master takes — whichever of its records reached distnb before it died."""

from __future__ import annotations

SETUP = """
import os
import torch, torch.nn as nn, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
ddp_rank = int(os.environ["RANK"])
master_process = ddp_rank == 0
grad_accum, eval_interval = 2, 2
torch.manual_seed(1337)
model = DDP(nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
"""
LOOP = """
for iter_num in range(4):
    for micro in range(grad_accum):
        model.require_backward_grad_sync = micro == grad_accum - 1
        x = torch.randint(0, 64, (8, 16))
        loss = F.cross_entropy(model(x).view(-1, 64), torch.roll(x, 1, 1).view(-1))
        (loss / grad_accum).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if iter_num % eval_interval == 1 and master_process:
        dist.all_reduce(loss)
    print(iter_num)
"""


def test_the_master_only_all_reduce_in_the_loop_is_named_with_its_shape_and_its_if(fresh_pool) -> None:
    pool = fresh_pool(3)
    assert pool.run(SETUP, timeout=120).ok
    res = pool.run(LOOP, timeout=120)
    text = res.text()
    assert res[0].status == "dead" and "SIGABRT" in text, text
    # Rank 0's own call, from its black box: its shape and its number on the group.
    seq = res[0].collective.split("#", 1)[1].split(" ", 1)[0] if "#" in res[0].collective else "?"
    assert res[0].collective.startswith(f"all_reduce [] f32 (#{seq} on group 0)"), res[0].collective
    assert f"rank-conditional collective: rank 0 entered all_reduce #{seq} [] f32 at cell line 11, but ranks 1,2 did not enter it" \
        in text, text
    assert "is under `if iter_num % eval_interval == 1 and master_process:` (line 10)" in text and "Root cause: rank 0." in text, text
    assert "did not make" not in text and "targeting" not in text, text
    report = pool.collectives().text()
    assert report.startswith(f"first divergence: collective #{seq} on group 0 (ranks 0-2): different shapes: rank 0 all_reduce [] f32; "
                             "ranks 1,2 all_reduce [4160] f32 (the odd one out: rank 0)"), report
