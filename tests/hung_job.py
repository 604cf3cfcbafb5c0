"""The torchrun job the attach and load tests hang: 4 ranks, three all_reduces, then one only rank 0
makes, while the others go on to the barrier. ``script(timeout)``: its text, gloo's timeout in
seconds (the line numbers the tests name: rank 0's call at 12, the barrier at 13)."""

from __future__ import annotations

__all__ = ["script"]

_SCRIPT = """
from datetime import timedelta
import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds={timeout}))
rank = dist.get_rank()
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
if rank == 0:
    dist.all_reduce(t)  # only rank 0: the others go on to the barrier
dist.barrier()
"""


def script(timeout: float) -> str:
    return _SCRIPT.format(timeout=timeout)
