"""What stepping into a rank of a live job costs the job (issue 40, ``%dist_debug``): one attachable
rank (``python -m distnb run -- torchrun --nproc-per-node 1``) runs a loop of small Python calls
and prints its rate; each round measures, interleaved, the rate left alone, the rate while a
notebook looks into its frames ten times a second (``p n``), and the rate after a console paused,
stepped and let it go (the rank untraced again). Also the round trip of a look and of pause, next
and continue. Reports medians of the per-round ratios; asserts nothing.

    python benchmarks/bench_attach_debug.py [--rounds 6] [--window 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, REPO)

LOOP = """
import sys, time
import torch  # as a training job has it


def f(x):
    return x + 1


n = 0
out = open(sys.argv[1], "a", buffering=1)
t0 = time.perf_counter()
while True:
    for _ in range(20000):
        n = f(n)
    t1 = time.perf_counter()
    out.write(f"{t1} {20000 / (t1 - t0)}\\n")
    t0 = t1
"""


def rate(path: Path, start: float, end: float) -> float:
    """The loop's calls per second between two of its own clock readings (perf_counter, same machine)."""
    rows = [tuple(map(float, line.split())) for line in path.read_text().splitlines() if line.count(" ") == 1]
    inside = [r for t, r in rows if start <= t <= end]
    return statistics.median(inside) if inside else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window", type=float, default=2.0, help="seconds each rate is measured over")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    import distnb
    from distnb.services.job_stepper import JobStepper

    folder = Path(tempfile.mkdtemp(prefix="bench-attach-debug-"))
    (folder / "loop.py").write_text(LOOP)
    rates = folder / "rates.txt"
    os.environ["DISTNB_JOBS_DIR"] = str(folder / "jobs")
    job_id = f"bench-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "distnb", "run", "--job-id", job_id, "--", sys.executable, "-m", "torch.distributed.run",
                             "--standalone", "--nproc-per-node", "1", str(folder / "loop.py"), str(rates)],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: set[int] = set()  # torchrun starts its ranks in sessions of their own: stopped by PID
    ratios: dict[str, list[float]] = {"looked_at": [], "after_a_session": []}
    times: dict[str, list[float]] = {"look_ms": [], "pause_ms": [], "next_ms": [], "continue_ms": []}
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                job = distnb.attach(job_id)
                ranks.update(job.pids().values())
                job.peek(0)
                break
            except distnb.AttachError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        time.sleep(2.0)
        frames = job.peek(0)["frames"]
        module = max(i for i, f in enumerate(frames) if f.function == "<module>")
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            time.sleep(args.window)
            alone = rate(rates, t0, time.perf_counter())
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < args.window:
                s = time.perf_counter()
                job.peek(0, "eval", module, "n")
                times["look_ms"].append((time.perf_counter() - s) * 1000)
                time.sleep(0.1)
            ratios["looked_at"].append(rate(rates, t0, time.perf_counter()) / alone)
            stepper = job._steppers.setdefault(0, JobStepper(job._require(), 0))
            s = time.perf_counter()
            assert stepper.pause() is not None
            times["pause_ms"].append((time.perf_counter() - s) * 1000)
            s = time.perf_counter()
            stepper.step("next")
            times["next_ms"].append((time.perf_counter() - s) * 1000)
            s = time.perf_counter()
            stepper.resume()
            times["continue_ms"].append((time.perf_counter() - s) * 1000)
            time.sleep(0.5)  # the rank untraces within its next look (200 ms)
            t0 = time.perf_counter()
            time.sleep(args.window)
            ratios["after_a_session"].append(rate(rates, t0, time.perf_counter()) / alone)
        job.detach()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the wrapper and torchrun, in the session it started
        except ProcessLookupError:
            pass
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(10)
    result = {"rounds": args.rounds, "window_s": args.window,
              "rate_vs_alone_median": {k: statistics.median(v) for k, v in ratios.items()},
              "rate_vs_alone": ratios,
              "round_trip_ms_median": {k: statistics.median(v) for k, v in times.items()}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
