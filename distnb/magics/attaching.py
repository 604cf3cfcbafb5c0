"""``%dist_attach`` and ``%dist_detach``: the notebook looks into a torchrun job distnb did not
launch (``python -m distnb run -- torchrun … train.py``), read-only. Thin over
:func:`distnb.attach` and :class:`distnb.jobs.attached.AttachedJob`."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from distnb.jobs.attached import JOB_ANSWER_TIMEOUT, AttachedJob, attach
from distnb.jobs.bare import BareJob
from distnb.jobs.looking import current_job
from distnb.magics.support import parse, usage_errors

__all__ = ["AttachMagics"]


@magics_class
class AttachMagics(Magics):
    """``%dist_attach``, ``%dist_reproduce`` and ``%dist_detach``."""

    @magic_arguments()
    @argument("job", nargs="?", default=None, help="The job's id, as python -m distnb run printed it (default: the one job on this machine).")
    @argument("--timeout", type=float, default=JOB_ANSWER_TIMEOUT, metavar="SECONDS", help="How long each rank has to answer (default 2).")
    @argument("--hosts", default=None, metavar="H1,H2",
              help="Other machines of the job, read over ssh (DISTNB_SSH replaces the client); the job's ranks need DISTNB_ATTACH_HOST set.")
    @argument("--slurm", action="store_true", help="Every node of the current Slurm allocation (one srun step).")
    @argument("--pid", type=int, default=None, metavar="PID",
              help="The job by a process of it: its torchrun agent or any rank; a job not started with distnb is read from outside (py-spy).")
    @line_magic
    def dist_attach(self, line: str) -> Any:
        """Attach to a torchrun job on this machine, read-only: %dist_status, %dist_stacks,
        %dist_collectives, %dist_timeline, %dist_memory and %dist_env then show its ranks, with the hang diagnosis; %dist_detach leaves it as it was.
        A job not started with distnb (python -m distnb run) is read from outside: its stacks with py-spy, verdicts said "likely"."""
        args = parse(self.dist_attach, line)
        with usage_errors():
            job = attach(args.job, timeout=args.timeout, hosts=args.hosts, slurm=args.slurm, pid=args.pid)
            return job.status()

    @magic_arguments()
    @argument("path", nargs="?", default=None, help="The notebook to write (default: <job>-repro.ipynb here).")
    @argument("--ranks", type=int, default=None,
              help="A pool of fewer ranks than the job's (it must hold every rank the diagnosis blamed; the answer suggests how few).")
    @line_magic
    def dist_reproduce(self, line: str) -> Any:
        """Write a notebook that stands in for the attached job: a pool of its world size (or --ranks K) with its settings,
        its script cut into cells, the call where it fails alone in the last one; then cut it down with %dist_minimize."""
        args = parse(self.dist_reproduce, line)
        job = current_job()
        if job is None:
            raise UsageError("no job to reproduce: %dist_attach to a running job, or %dist_load the records of one that ended "
                             "(python -m distnb run -- torchrun … starts one whose ranks can be attached and leave records).")
        with usage_errors():
            return job.reproduce(args.path, ranks=args.ranks)

    @line_magic
    def dist_detach(self, line: str) -> None:
        """Detach from the attached job (it runs on, unchanged), or leave the job %dist_load loaded."""
        job = current_job()
        if job is None:
            print("not attached to any job (%dist_attach attaches to one; %dist_load reads the records of one that ended).")
            return
        job.detach()
        if isinstance(job, (AttachedJob, BareJob)):
            print(f"detached from job {job.job}; it runs on as it was.")
        else:
            print(f"left the loaded job {job.job}; its files stay as they were.")
