"""How long a healthy job's ranks sit in one torch.distributed call: the measurement behind
``DISTNB_RECORD_AFTER``'s default (``worker/process/job_records.py``), which must sit above it so
a healthy job leaves no record.

A 4-rank torchrun job (gloo): init_process_group, DDP's construction, a DDP training loop with an
all_reduce of the loss each step, and a barrier. In each rank a thread samples the main thread
every 5 ms with the recorder's own test (its outermost frame in ``distributed_c10d.py``, and
the groups' sequence numbers) and keeps the longest unbroken stretch per function. Reports the
longest per function over the ranks; asserts nothing.

    python benchmarks/bench_record_after.py [--nproc 4] [--steps 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])

JOB = """
import json, sys, threading, time
from distnb.worker.process.job_records import _c10d_frame

longest = {}
stop = False


def sample():
    key, since, name = None, time.monotonic(), ""
    seqs = None
    while not stop:
        time.sleep(0.005)
        outer, fn = _c10d_frame()
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        try:
            up = c10d is not None and c10d.is_initialized()
        except AttributeError:  # torch.distributed still importing
            up = False
        if up and seqs is None:
            from distnb.worker.torch_hooks.flight_recorder import SeqWatch
            seqs = SeqWatch()
        now = time.monotonic()
        new = (id(outer), fn, seqs.snapshot() if seqs else None)
        if new != key:
            if name:
                longest[name] = max(longest.get(name, 0.0), now - since)
            key, since, name = new, now, fn


threading.Thread(target=sample, daemon=True).start()
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
for step in range(int(sys.argv[1])):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    dist.all_reduce(loss.detach())
dist.barrier()
stop = True
time.sleep(0.05)
with open(sys.argv[2] + f".{dist.get_rank()}", "w") as f:
    json.dump(longest, f)
dist.destroy_process_group()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=str(Path(REPO) / "benchmarks" / "results" / "record_after.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "job.py").write_text(JOB)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), "job.py", str(args.steps),
                        str(Path(tmp) / "longest")], cwd=tmp, env=env, check=True, stdout=subprocess.DEVNULL)
        per_rank = {r: json.loads((Path(tmp) / f"longest.{r}").read_text()) for r in range(args.nproc)}
    names = sorted({n for d in per_rank.values() for n in d})
    result = {"nproc": args.nproc, "steps": args.steps, "longest_s": {n: round(max(d.get(n, 0.0) for d in per_rank.values()), 4) for n in names},
              "per_rank_s": {str(r): {n: round(v, 4) for n, v in d.items()} for r, d in per_rank.items()}}
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
