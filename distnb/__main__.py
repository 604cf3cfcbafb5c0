"""``python -m distnb demo | doctor | run -- COMMAND | jobs``."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

__all__ = ["main"]

DEMO_CELLS = [
    ("Every rank contributes its rank number to an all_reduce:",
     "x = torch.full((2,), float(rank))\ndist.all_reduce(x)\nx", None),
    ("Per-rank output streams back live; identical lines are shown once:",
     "print('hello from the pool')\nprint(f'I am rank {rank} of {world_size} on {device}')", None),
    ("State persists between cells; a subset of ranks can run a cell:",
     "x.sum().item() * rank", "{subset}"),
    ("An error on one rank is reported with the cell's own line, grouped by rank:",
     "if rank == world_size - 1:\n    raise ValueError(f'rank {rank} got a bad batch')\n'fine'", None),
]


def demo(nproc: int) -> int:
    import distnb

    print(f"distnb demo: launching {nproc} CPU ranks under torchrun (gloo)…", flush=True)
    t0 = time.monotonic()
    last: list[dict[str, list[int]]] = [{}]

    def progress(stages: dict) -> None:
        from distnb.display.text import stage_counts, stage_summary

        if stage_counts(stages) != last[0]:
            last[0] = stage_counts(stages)
            print("  " + stage_summary(stages, time.monotonic() - t0), flush=True)

    with distnb.launch(nproc=nproc, backend="gloo", on_progress=progress) as pool:
        print(f"\n{pool.status().text()}\n", flush=True)
        for title, code, ranks in DEMO_CELLS:
            print(f"## {title}")
            print("\n".join(f"    {line}" for line in code.splitlines()))
            if ranks == "{subset}":  # the first and last rank (just rank 0 in a 1-rank pool)
                ranks = ",".join(map(str, sorted({0, nproc - 1})))
            result = pool.run(code, ranks=ranks, timeout=60)
            print(result.text(), end="\n\n", flush=True)
        expected = float(sum(range(nproc)))
        ok = all(x.tolist() == [expected, expected] for x in pool.pull("x").values())
    print("pool shut down; no process left." if not pool.pids() else f"processes left: {pool.pids()}")
    return 0 if ok else 1


def doctor() -> int:
    """Print what distnb will use, so a bug report carries the facts."""
    import importlib

    from distnb.services.versions import TESTED, installed, untested

    found = installed()
    print(f"platform   {platform.platform()}")
    for item in found:
        where = f" ({sys.executable})" if item.name == "python" else ""
        print(f"{item.name:<10} {item.version or 'missing'}{where}" + (f"  (untested: {item.outside})" if item.outside else ""))
    try:
        importlib.import_module("pynvml")
        print(f"{'pynvml':<10} installed")
    except Exception as exc:
        print(f"{'pynvml':<10} missing ({type(exc).__name__})")
    try:
        import torch

        print(f"cuda       {torch.cuda.is_available()} ({torch.cuda.device_count()} devices)")
        import torch.distributed as dist

        print(f"backends   gloo={dist.is_gloo_available()} nccl={dist.is_nccl_available()}")
    except Exception as exc:
        print(f"torch      unusable: {exc}")
    from distnb.config import default_nproc

    print(f"default -n {default_nproc()}")
    outside = untested(found)
    if outside:
        names = ", ".join(f"{i.name} {i.version}" for i in outside)
        ranges = ", ".join(f"{i.name} {TESTED[i.name][0]}–{TESTED[i.name][1]}" for i in outside)
        print(f"warning: {names} {'is' if len(outside) == 1 else 'are'} outside what distnb's CI tests ({ranges}); "
              "it may work, but a verdict there has not been checked. Report what you see with this output.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distnb", description="distnb: debug distributed PyTorch from a notebook.")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="launch a CPU pool, run a short tour, print the results, shut down")
    d.add_argument("-n", "--nproc", type=int, default=4, help="ranks (default 4)")
    sub.add_parser("doctor", help="show the versions and devices distnb sees")
    j = sub.add_parser("jobs", help="list the attachable jobs on this machine (what %%dist_attach --hosts reads over ssh)")
    j.add_argument("--json", action="store_true", help="as JSON, with each rank's keys (for a notebook on another machine)")
    r = sub.add_parser("run", help="run a job (e.g. torchrun … train.py) with ranks a notebook can %%dist_attach to")
    r.add_argument("--job-id", default=None, help="the job's name in %%dist_attach (default: run-<random>)")
    r.add_argument("--write-site", metavar="DIR", default=None,
                   help="only write the start-up hook into DIR, for launchers that cannot be wrapped: put DIR first on the "
                   "ranks' PYTHONPATH and set DISTNB_ATTACH=1")
    r.add_argument("--install-hook", nargs="?", const="", default=None, metavar="DIR",
                   help="only install distnb-attach.pth into site-packages (or DIR): every Python of that environment then starts "
                   "attachable when DISTNB_ATTACH=1 (and a rank: RANK and WORLD_SIZE set), and is untouched without it")
    r.add_argument("--uninstall-hook", nargs="?", const="", default=None, metavar="DIR", help="remove what --install-hook wrote")
    r.add_argument("--watch", action="store_true",
                   help="watch the job for a hang the records prove (different calls, a call only some ranks made, a rank that "
                   "died while others wait) and say it in the job's log; a slow collective or a rank still computing is never one")
    r.add_argument("--on-hang", choices=("report", "dump", "stop"), default=None,
                   help="with --watch: report (the verdict in the log; the default), dump (and the verdict, stacks, collectives and a "
                   "reproduce notebook in the job's records folder), stop (and end the job)")
    r.add_argument("--hang-after", type=float, default=None, metavar="SECONDS",
                   help="with --watch: how long every rank must have waited before a verdict (default 3)")
    r.add_argument("cmd", nargs=argparse.REMAINDER, metavar="command", help="-- then the command, e.g. -- torchrun --nproc-per-node 4 train.py")
    args = parser.parse_args(argv)
    if args.command == "jobs":
        from distnb.wire.discovery import jobs_json, jobs_root, list_jobs

        jobs = list_jobs()
        if args.json:
            print(jobs_json(jobs))
        else:
            print("\n".join(j.line() for j in jobs) or f"no attachable job under {jobs_root()} (python -m distnb run -- torchrun … starts one)")
        return 0
    if args.command == "run":
        from distnb.launching.attach_run import install_hook, run, write_site

        if args.install_hook is not None or args.uninstall_hook is not None:
            remove = args.uninstall_hook is not None
            try:
                path = install_hook(args.uninstall_hook if remove else args.install_hook, remove=remove)
            except OSError as exc:
                print(f"distnb run: cannot {'remove' if remove else 'write'} the hook in {exc.filename}'s folder: {exc.strerror}; "
                      "name a folder that exists and that you may write (the job's Python's site-packages).", file=sys.stderr)
                return 1
            print(f"removed {path}" if remove else f"wrote {path}: set DISTNB_ATTACH=1 in a job's environment to make its ranks attachable")
            return 0
        if args.write_site:
            print(write_site(args.write_site))
            return 0
        watcher = None
        if args.watch or os.environ.get("DISTNB_WATCH"):
            from distnb.jobs.watch import ON_HANG, start_watch

            on_hang = args.on_hang or os.environ.get("DISTNB_WATCH_ON_HANG") or "report"
            if on_hang not in ON_HANG:
                parser.error(f"DISTNB_WATCH_ON_HANG={on_hang!r}: use report, dump or stop.")
            from distnb.config import LaunchConfig

            hang_after = args.hang_after if args.hang_after is not None else LaunchConfig.hang_after
            if hang_after <= 0:
                parser.error("--hang-after takes a positive number of seconds, e.g. --hang-after 5.")
            watcher = start_watch(on_hang, hang_after)
        elif args.on_hang or args.hang_after is not None:
            parser.error("--on-hang and --hang-after go with --watch: python -m distnb run --watch --on-hang stop -- torchrun …")
        return run(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd, args.job_id, watcher)
    if args.command == "demo":
        if not 1 <= args.nproc <= 64:
            parser.error(f"-n takes 1 to 64 ranks for the demo, not {args.nproc}.")
        return demo(args.nproc)
    return doctor()


if __name__ == "__main__":
    sys.exit(main())
