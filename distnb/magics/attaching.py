"""``%dist_attach`` and ``%dist_detach``: the notebook looks into a torchrun job distnb did not
launch (``python -m distnb run -- torchrun … train.py``), read-only. Thin over
:func:`distnb.attach` and :class:`distnb.attached.AttachedJob`."""

from __future__ import annotations

from typing import Any

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from distnb.attached import JOB_ANSWER_TIMEOUT, AttachedJob, attach, current_job
from distnb.magics.support import parse, usage_errors

__all__ = ["AttachMagics"]


@magics_class
class AttachMagics(Magics):
    """``%dist_attach`` and ``%dist_detach``."""

    @magic_arguments()
    @argument("job", nargs="?", default=None, help="The job's id, as python -m distnb run printed it (default: the one job on this machine).")
    @argument("--timeout", type=float, default=JOB_ANSWER_TIMEOUT, metavar="SECONDS", help="How long each rank has to answer (default 2).")
    @line_magic
    def dist_attach(self, line: str) -> Any:
        """Attach to an attachable torchrun job on this machine, read-only: %dist_status, %dist_stacks,
        %dist_collectives, %dist_timeline, %dist_memory and %dist_env then show its ranks, with the hang diagnosis; %dist_detach leaves it as it was."""
        args = parse(self.dist_attach, line)
        with usage_errors():
            job = attach(args.job, timeout=args.timeout)
            return job.status()

    @line_magic
    def dist_detach(self, line: str) -> None:
        """Detach from the attached job (it runs on, unchanged), or leave the job %dist_load loaded."""
        job = current_job()
        if job is None:
            print("not attached to any job (%dist_attach attaches to one; %dist_load reads the records of one that ended).")
            return
        job.detach()
        if isinstance(job, AttachedJob):
            print(f"detached from job {job.job}; it runs on as it was.")
        else:
            print(f"left the loaded job {job.job}; its files stay as they were.")
