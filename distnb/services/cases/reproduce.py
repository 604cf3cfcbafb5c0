"""``%dist_reproduce``: from a job that failed (attached, or loaded from its records) to a notebook
that stands in for it — a pool of the job's world size (or fewer ranks, ``--ranks``, as long as
it holds the ranks the diagnosis blamed), with its settings, running the job's own
script cut into cells (services/cases/script_cells.py), the call where it failed in a cell of its own,
ready to be cut down further (``%dist_minimize``).

The notebook says where it came from and what the job did, sets the ranks up as torchrun had them
(working folder, ``sys.argv``, the script's folder on ``sys.path``, ``__file__``), and stops after
the failing cell: the rest of the script follows as text. A job that hung gets a failing cell
bounded by ``--timeout``, so the notebook ends (with the pool's diagnosis) rather than hanging.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from distnb.analysis.verdicts.stacks import StackReport
from distnb.analysis.verdicts.verdict import Kind, Verdict
from distnb.config import LaunchConfig
from distnb.services.cases.export import launch_line
from distnb.services.cases.script_cells import ScriptCells, split_script

__all__ = ["HUNG_CELL_TIMEOUT", "JobFacts", "Reproduced", "job_env", "job_facts", "script_path", "script_site", "write_reproduction"]

#: How long the notebook's failing cell may run when the job hung there: long enough for the
#: pool's hang diagnosis (3 s by default) to settle, short enough for Run All to end.
HUNG_CELL_TIMEOUT = 30.0

#: torchrun's contract and distnb's own switches: the pool sets these itself, per rank.
_LAUNCHER_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                   "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCH_FR_BUFFER_SIZE"}
_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "DISTNB_", "TORCH_ELASTIC_")


@dataclass(frozen=True)
class JobFacts:
    """What a notebook needs to stand in for a job: its size, its script and arguments as each rank
    saw them, its settings, and where and how it failed."""

    world_size: int
    argv: tuple[str, ...]  # a rank's sys.argv: the script, then its arguments
    cwd: str
    backend: str = "auto"
    env: Mapping[str, str] = field(default_factory=dict)
    site: int | None = None  # the line of the script where the failing rank was (its innermost frame there)
    failure: str = ""  # what the job did, in words (the verdict's headline)
    hung: bool = False  # it hung there (rather than raised or died)
    job: str = ""
    culprits: tuple[int, ...] = ()  # the ranks the diagnosis blamed (a smaller pool must still hold them)


@dataclass(frozen=True)
class Reproduced:
    """What ``%dist_reproduce`` wrote."""

    path: str
    script: str
    world_size: int  # the notebook's pool
    cells: int  # the script's cells in the notebook (the setup and launch apart)
    failing: str | None  # the failing cell's first line, when a line of the script stood out
    notes: tuple[str, ...] = ()
    job_size: int = 0  # the job's world size, where the notebook's pool is smaller
    fewest: int = 0  # the smallest pool holding every rank the diagnosis blamed and a majority of others (0: none blamed)

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path

    def text(self) -> str:
        where = f"; the failing call is alone in its cell ({self.failing!r})" if self.failing else "; no line of it stood out as the failing one"
        size = f"{self.world_size} ranks" + (f" (the job had {self.job_size}: check that it fails the same way)"
                                              if self.job_size > self.world_size else "")
        lines = [f"wrote {self.path}: {os.path.basename(self.script)} in {self.cells} cells on a pool of {size}{where}.",
                 "Open it and Run All; then cut it down with %dist_minimize."]
        if self.fewest and self.fewest < self.world_size:
            lines.append(f"  fewer ranks: a pool of {self.fewest} holds the ranks the diagnosis blamed and a majority apart from them, so "
                         f"--ranks {self.fewest} may fail the same way (likely, not certain: the script may need its world size, e.g. "
                         "for a mesh); %dist_minimize tries.")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()


def job_env(env: Mapping[str, str]) -> dict[str, str]:
    """The job's settings worth keeping for the pool: the NCCL/torch/CUDA switches (``%dist_env``'s
    set) without what torchrun and distnb set per rank."""
    return {k: v for k, v in sorted(env.items()) if k not in _LAUNCHER_NAMES and not k.startswith(_LAUNCHER_PREFIXES)}


def script_path(argv: tuple[str, ...], cwd: str) -> Path:
    """The job's script, from a rank's ``sys.argv``; ValueError (in words) when it has none here."""
    if not argv or argv[0] in ("-c", "-", ""):
        shown = " ".join(argv) or "no command line"
        raise ValueError(f"the job's ranks ran {shown!r}: no script file to cut into cells (a job started with python -c or "
                         "from stdin); save the code as a file and start the job from it.")
    path = Path(argv[0]) if os.path.isabs(argv[0]) else Path(cwd or ".", argv[0])
    if not path.is_file():
        raise ValueError(f"the job's script {path} is not on this machine: run %dist_reproduce where the job ran "
                         "(or copy the script there, same path).")
    return path


def script_site(stacks: StackReport, ranks: list[int], script: Path) -> int | None:
    """The line of ``script`` each of ``ranks`` (in order) is at, innermost frame first: the first
    rank with a frame in the script gives it (None: none has)."""
    for r in ranks:
        rs = next((s for s in stacks.ranks if s.rank == r), None)
        main = next((t for t in rs.threads if t.main), None) if rs is not None else None
        if main is None:
            continue
        for frame in reversed(main.frames):
            if _same_file(frame.filename, script):
                return frame.lineno
    return None


def job_facts(job: str, world_size: int, argv: tuple[str, ...], cwd: str, backend: str, env: Mapping[str, str], stacks: StackReport,
              verdict: Verdict) -> JobFacts:
    """An attached or loaded job's facts for :func:`write_reproduction`: the failing line is the
    culprits' innermost frame in the script (else any rank's), and only when the diagnosis found a
    problem (else every cell is kept, none tagged); a job that did not fail by an error or a death
    hung there. ValueError (in words) when the job has no script file here."""
    script = script_path(argv, cwd)
    order = [*verdict.culprits, *(rs.rank for rs in stacks.ranks if rs.rank not in verdict.culprits)]
    site = script_site(stacks, order, script) if verdict.is_problem else None
    hung = verdict.is_problem and verdict.kind not in (Kind.RAISED, Kind.DIED)
    return JobFacts(world_size, argv, cwd, backend if backend in ("gloo", "nccl") else "auto", env, site,
                    verdict.summary if verdict.is_problem else "", hung, job, tuple(verdict.culprits) if verdict.is_problem else ())


def _same_file(name: str, script: Path) -> bool:
    try:
        return os.path.samefile(name, script)
    except OSError:
        return False


def _setup_cell(facts: JobFacts, script: Path) -> str:
    return "\n".join([
        "%%on_ranks",
        "# As torchrun started each rank: its folder, its command line, the script's folder first on the path.",
        "import os, sys",
        f"os.chdir({facts.cwd or str(script.parent)!r})",
        f"sys.argv = {[str(script), *facts.argv[1:]]!r}",
        f"sys.path.insert(0, {str(script.parent)!r})",
        f"__file__ = {str(script)!r}",
    ])


def write_reproduction(facts: JobFacts, path: str | Path, hung_timeout: float = HUNG_CELL_TIMEOUT, ranks: int | None = None) -> Reproduced:
    """Write the notebook that stands in for the job (see the module's docstring), on a pool of the
    job's world size or of ``ranks`` (fewer; it must hold every rank the diagnosis blamed)."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    if facts.world_size < 1:
        raise ValueError(f"the job's world size is {facts.world_size}: no rank published it; attach once its ranks run, or load its records.")
    need = max(facts.culprits) + 1 if facts.culprits else 0  # a pool holding every blamed rank
    # The blamed ranks, and more ranks apart from them: a majority, so the pool can blame them again.
    fewest = max(need, 2 * len(facts.culprits) + 1) if facts.culprits else 0
    size = facts.world_size if ranks is None else ranks
    if not 1 <= size <= facts.world_size:
        raise ValueError(f"--ranks {size}: give 1 to the job's world size, {facts.world_size} (a pool the size of the job is the default).")
    if size < need:
        raise ValueError(f"--ranks {size}: the failure is rank {need - 1}'s, which a pool of {size} ranks does not have; give at least {need}.")
    script = script_path(facts.argv, facts.cwd)
    try:
        source = script.read_text()
        split: ScriptCells = split_script(source, facts.site, str(script))
    except SyntaxError as exc:
        raise ValueError(f"{script} does not parse here ({exc.msg}, line {exc.lineno}): this Python is not the job's, or the file "
                         "changed since the job started.") from None
    config = LaunchConfig(nproc=size, backend=facts.backend, env=job_env(facts.env))
    title = f"job {facts.job}" if facts.job else "the job"
    failure = f"\n\nWhat it did: {facts.failure}" if facts.failure else ""
    where = (f"\n\nThe failing call, line {facts.site} of `{script.name}`, is alone in the last cell." if split.failing is not None
             else "\n\nNo line of the script stood out as the failing one: every cell of the script is here.")
    notes = "".join(f"\n- {n}" for n in split.notes)
    smaller = (f"\n\nThis pool has {size} of the job's {facts.world_size} ranks: if the cells do not fail as the job did, the failure "
               "needs more of them." if size < facts.world_size else "")
    nb = new_notebook(cells=[
        new_markdown_cell(f"Made by distnb's `%dist_reproduce` from {title}: `{' '.join(facts.argv)}` on {facts.world_size} ranks "
                          f"(in `{facts.cwd}`).{failure}{where}{smaller}{notes}"),
        new_code_cell(f"%load_ext distnb\n{launch_line(config)}"),
        new_code_cell(_setup_cell(facts, script)),
    ])
    for i, code in enumerate(split.before()):
        failing = i == split.failing
        options = f" --timeout {hung_timeout:g}" if failing and facts.hung else ""
        cell = new_code_cell(f"%%on_ranks{options}\n{code}")
        if failing:
            # It fails as the job did: Run All and nbclient go on to the shutdown past a cell tagged so.
            cell.metadata["tags"] = ["raises-exception"]
        nb.cells.append(cell)
    nb.cells.append(new_code_cell("%dist_shutdown"))
    rest = split.after()
    if rest:
        body = "\n\n".join(rest)
        nb.cells.append(new_markdown_cell(f"The rest of `{script.name}`, after the failing call (not run):\n\n```python\n{body}\n```"))
    out = Path(path)
    nbformat.write(nb, str(out))
    lines = source.splitlines()
    failing_line = lines[facts.site - 1].strip() if split.failing is not None and facts.site and facts.site <= len(lines) else None
    return Reproduced(str(out), str(script), size, len(split.before()), failing_line, tuple(split.notes), facts.world_size, fewest)
