"""Hangs found without a notebook (issue 48): how long from the moment a job hangs to

* the verdict in its log, with ``python -m distnb run --watch --on-hang stop`` (the default
  threshold, 3 s), and to the job's end;
* a verdict from a job started without distnb, looked into with ``distnb.attach(pid=…)`` (py-spy
  from outside): the attach and diagnosis' own time, once the job hangs;

at 4 and 8 gloo ranks on this machine. The job: every rank loops over all_reduce; one rank leaves
the loop early (writing the time it does: the hang's start) and waits in a barrier. Reports
medians over rounds (the two kinds interleaved); asserts nothing.

    python benchmarks/bench_watch.py [--ranks 4 8] [--rounds 3] [--out FILE]
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
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])

HANG = """import sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
for step in range(10**9):
    if rank == 1 and step == 20:
        with open(sys.argv[1], "w") as f:
            f.write(repr(time.time()))  # the hang starts: rank 1 goes to the barrier, the others wait in the all_reduce
        break
    dist.all_reduce(t)
dist.barrier()
"""


def _torchrun(n: int, folder: Path, mark: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--monitor-interval", "1",
            str(folder / "hang.py"), str(mark)]


def watched(n: int, folder: Path) -> dict[str, float]:
    """Seconds from the hang to the watch's verdict line, and to the job's end (--on-hang stop)."""
    mark = folder / f"watched-{n}-{time.monotonic_ns()}.t"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
           "DISTNB_JOBS_DIR": str(folder / "jobs"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "distnb", "run", "--watch", "--on-hang", "stop", "--", *_torchrun(n, folder, mark)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    said: list[float] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("[distnb watch] job ") and not said:
                said.append(time.time())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.wait(timeout=600)
    ended = time.time()
    reader.join(10)
    hung = float(mark.read_text())
    return {"to_verdict_s": said[0] - hung if said else float("nan"), "to_end_s": ended - hung}


def from_outside(n: int, folder: Path) -> dict[str, float]:
    """A plain torchrun job, hung: seconds for attach(pid=…) and its verdict, and whether it named rank 1."""
    sys.path.insert(0, REPO)
    import distnb

    mark = folder / f"outside-{n}-{time.monotonic_ns()}.t"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTNB_") and k != "PYTHONPATH"}
    proc = subprocess.Popen(_torchrun(n, folder, mark), env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while not mark.exists():
            time.sleep(0.1)
        time.sleep(1.0)  # the others reach the all_reduce they will wait in
        t0 = time.monotonic()
        with distnb.attach(pid=proc.pid) as job:
            verdict = job.diagnose()
        took = time.monotonic() - t0
        return {"attach_and_verdict_s": took, "named_rank_1": float(verdict.culprits == [1])}
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    got: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "hang.py").write_text(HANG)
        for i in range(args.rounds):
            for n in args.ranks:
                kinds = [("watched", watched), ("outside", from_outside)]
                for kind, run in kinds if i % 2 == 0 else kinds[::-1]:  # interleaved, the first alternating
                    figures = run(n, folder)
                    for name, value in figures.items():
                        got.setdefault(f"{kind}_{n}", {}).setdefault(name, []).append(value)
                    print(f"round {i + 1} {kind:<8} {n} ranks: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()), flush=True)
    summary = {key: {name: statistics.median(values) for name, values in figures.items()} for key, figures in got.items()}
    for key, figures in summary.items():
        print(f"{key:<12} " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"rounds": args.rounds, "runs": got, "medians": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
