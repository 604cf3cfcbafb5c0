"""Records the message streams ``tests/fake_ranks.py`` replays, from real pools (gloo, CPU):

    python tests/record_streams.py            # every recording, into tests/data/streams/

Run it again after a change to what ranks send (the wire's messages or their fields): a replayed
stream is what the ranks of this version said. Each recording is a list of cells run in order
on a fresh pool, then the views that ask the ranks (stacks, memory, env, collectives).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_ranks import STREAMS, Recorder  # noqa: E402

import distnb  # noqa: E402

#: name -> (ranks, cells)
RECORDINGS: dict[str, tuple[int, list[str]]] = {
    "four_ranks": (4, [
        "x = torch.ones(2) * (rank + 1)\ndist.all_reduce(x)\nx",
        "print(f'hello from rank {rank}')",
        "import sys\nprint('careful', file=sys.stderr)\nrank * 10",
        "if rank == 2:\n    raise ValueError('bad value on rank 2')",
        "t = torch.arange(4.0) + rank\ndist.broadcast(t, src=0)\nt.sum().item()",
    ]),
    # tests/magics/test_magics_replayed.py's cells, in its order.
    "magics_two_ranks": (2, [
        "print('hello')\nx = torch.full((2,), float(rank)); dist.all_reduce(x); x",
        "rank",
        "rank * 10",
        "semi = 5\nsemi;  # IPython's rule: no value shown",
        "print('only', rank)",
        "if rank == 1:\n    raise KeyError('missing shard')",
        "1/0 if rank == 0 else None",
        "1/0 if rank == 1 else None",
        "print('noise')\n1/0 if rank == 0 else None",
        "x = torch.ones(3); dist.all_reduce(x)",
    ]),
}


def record(name: str, nproc: int, cells: list[str]) -> Path:
    pool = distnb.Pool(nproc=nproc, backend="gloo", spares=False)
    recorder = Recorder()
    recorder.attach(pool)
    pool.start()
    texts = {}
    try:
        for code in cells:
            texts[code] = pool.run(code, timeout=60).text()
        pool.stacks()
        pool.memory()
        pool.env()
        pool.collectives()
    finally:
        pool.shutdown()
    path = STREAMS / f"{name}.pickle"
    recorder.save(path, nproc, texts)
    return path


if __name__ == "__main__":
    for name, (nproc, cells) in RECORDINGS.items():
        print(record(name, nproc, cells))
