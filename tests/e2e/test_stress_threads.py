"""distnb's own threads must never harm a rank: first imports of torch._dynamo and pipelining,
``fully_shard`` and ``torch.compile`` cells on 4 fresh ranks, while the notebook asks for
everything it asks for while a cell runs (stacks, the live verdict, status) far more often than
the live view does. Any rank that dies fails the test.

Before the fix, a rank died of SIGSEGV in about one round in four of this loop on a busy 2-core
machine (Python 3.11: the control thread walked the main thread's frames while that thread ran
on; see docs/architecture.md, "What distnb's threads may touch"). ``DISTNB_STRESS_ROUNDS`` runs it
longer (CI: the default).
"""

from __future__ import annotations

import os
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: Cells whose first run imports torch._dynamo (or runs it): what the ranks died in.
CELLS = [
    "import torch._dynamo",
    "import torch.distributed.pipelining",
    "from torch.distributed.fsdp import fully_shard\nimport torch.nn as nn\nm = fully_shard(nn.Linear(8, 8))\n"
    "m(torch.ones(2, 8)).sum().backward()",
    "f = torch.compile(lambda x: (x * 2).sin(), backend='eager')\nf(torch.ones(4))",
]
ROUNDS = int(os.environ.get("DISTNB_STRESS_ROUNDS", "4"))
#: How often the test looks while a cell runs: 20× the live view's tick.
LOOK_EVERY = 0.05


def test_no_rank_dies_while_distnb_watches_first_imports_and_compiles(fresh_pool) -> None:
    pool = fresh_pool(nproc=4, spares=True)
    looks = 0
    for i in range(ROUNDS):
        if i:
            pool.restart()  # fresh interpreters: the next import is a first one again
        result = pool.submit(CELLS[i % len(CELLS)])
        watch = pool.watch(result, hang_after=0.5)
        while result.running:
            pool.stacks()
            watch.look()
            pool.status()
            looks += 1
            time.sleep(LOOK_EVERY)
        pool.wait(result, timeout=300)
        assert result.ok, f"round {i}: {result.text()}"
    assert looks >= ROUNDS, "the cells ended before anything looked at them: the test proved nothing"
