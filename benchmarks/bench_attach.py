"""What an attachable job costs while healthy (issue 40): a small DDP loop's step time, run plain
and made attachable (``python -m distnb run``, with and without the records a dead or hung job
leaves), attachable with a notebook attached and asking for stacks and collectives once a
second, and watched by the wrapper (``--watch``, issue 48: it asks the same once a second) — the
five interleaved, so the machine's drift falls on each alike. Reports medians; asserts nothing.

    python benchmarks/bench_attach.py [--nproc 2] [--steps 300] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])

LOOP = """
import json, os, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
times = []
for step in range(int(sys.argv[1])):
    t0 = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    times.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    with open(sys.argv[2], "w") as f:
        json.dump(times[20:], f)  # the first steps warm up
dist.destroy_process_group()
"""


def run_job(mode: str, nproc: int, steps: int, folder: Path) -> float:
    """One job's median step time (s), rank 0's, in ``mode``: plain, attachable (with the records a
    dead or hung job leaves, ``worker/process/job_records.py``), attachable without those records
    (``no_records``: what the recorder itself costs), attached, or watched (``--watch``)."""
    out = folder / f"{mode}-{uuid.uuid4().hex[:6]}.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), str(folder / "loop.py"), str(steps), str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
           "DISTNB_JOBS_DIR": str(folder / "jobs"), "OMP_NUM_THREADS": "1", "DISTNB_RECORDS": "0" if mode == "no_records" else "1"}
    job_id = f"bench-{uuid.uuid4().hex[:6]}"
    watch = ["--watch"] if mode == "watched" else []
    cmd = torchrun if mode == "plain" else [sys.executable, "-m", "distnb", "run", "--job-id", job_id, *watch, "--", *torchrun]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    asker = None
    if mode == "attached":
        asker = threading.Thread(target=_ask_every_second, args=(job_id, folder / "jobs", proc), daemon=True)
        asker.start()
    proc.wait()
    if asker is not None:
        asker.join(5)
    return statistics.median(json.loads(out.read_text()))


def _ask_every_second(job_id: str, jobs: Path, proc: subprocess.Popen[bytes]) -> None:
    os.environ["DISTNB_JOBS_DIR"] = str(jobs)
    import distnb

    attached = None
    while proc.poll() is None:
        try:
            attached = attached or distnb.attach(job_id)
            attached.stacks()
            attached.collectives()
        except Exception:
            pass  # not up yet, or gone
        time.sleep(1.0)
    if attached is not None:
        attached.detach()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    modes = ("plain", "attachable", "no_records", "attached", "watched")
    got: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "loop.py").write_text(LOOP)
        for i in range(args.rounds):
            for mode in modes[i % len(modes):] + modes[: i % len(modes)]:  # a different one first each round
                got[mode].append(run_job(mode, args.nproc, args.steps, folder))
                print(f"round {i + 1} {mode:<10} median step {got[mode][-1] * 1e3:.3f} ms", flush=True)
    base = statistics.median(got["plain"])
    summary = {m: {"median_step_ms": statistics.median(v) * 1e3, "runs_ms": [x * 1e3 for x in v],
                   "vs_plain": statistics.median(v) / base - 1} for m, v in got.items()}
    for m, s in summary.items():
        print(f"{m:<10} {s['median_step_ms']:.3f} ms/step ({s['vs_plain']:+.1%} vs plain)")
    if args.out:
        Path(args.out).write_text(json.dumps({"nproc": args.nproc, "steps": args.steps, "rounds": args.rounds, "modes": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
