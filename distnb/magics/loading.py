"""``%dist_load``: the notebook looks into a job that already died or hung, through the files it
left (distnb's records, Flight Recorder dumps, torchrun's error files). Thin over
:func:`distnb.load` and :class:`distnb.jobs.loaded.LoadedJob`; ``%dist_detach`` leaves it."""

from __future__ import annotations

from typing import Any

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from distnb.jobs.loaded import load
from distnb.magics.support import parse, usage_errors

__all__ = ["LoadMagics"]


@magics_class
class LoadMagics(Magics):
    """``%dist_load``."""

    @magic_arguments()
    @argument("folders", nargs="+", metavar="DIR",
              help="The folders the job's files are in (one per machine), searched recursively: the records folder python -m distnb run "
                   "printed, NCCL's dump folder, torchrun's --log-dir.")
    @line_magic
    def dist_load(self, line: str) -> Any:
        """Read what a finished or hung job left (distnb's per-rank records, PyTorch Flight Recorder dumps, torchrun's
        error files) and say why it ended: which collective, which rank, why, and the call site in the script. Then
        %dist_status, %dist_stacks, %dist_collectives, %dist_timeline, %dist_memory and %dist_env look into it;
        %dist_detach leaves it."""
        args = parse(self.dist_load, line)
        with usage_errors():
            job = load(args.folders)
            return job.status()
