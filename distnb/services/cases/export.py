"""Export the cells of a session as a standalone torchrun script or a notebook (the minimal case)."""

from __future__ import annotations

import ast
import base64
import pickle
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from distnb.analysis.verdicts.reproduction import FailureSignature
from distnb.config import DEBUG_ENV, LaunchConfig
from distnb.controller.session import CellRecord, PushRecord, Step
from distnb.ranks import format_ranks, rank_span
from distnb.results import CellResult
from distnb.services.cases.verify import GAVE_UP, Reproduction, session_signature, verify_script

if TYPE_CHECKING:
    from distnb.controller.session import SessionLog

__all__ = ["HANG_TIMEOUT", "Export", "export_notebook", "export_script", "export_session", "launch_line", "run_command", "select_cells", "with_pushes"]

#: Pushed values larger than this go to a file beside the export instead of inline base64.
INLINE_PUSH_BYTES = 64 * 1024
#: Seconds a collective of an exported script may wait when the session's last cell hung: the
#: printed command ends within it (torch's default, kept by the pool, is 30 minutes).
HANG_TIMEOUT = 30.0

_PRELUDE = '''\
#!/usr/bin/env python
"""Exported by distnb from a notebook session ({n} cells).

Run:  {run}
"""
import os
from datetime import timedelta
{env}

import torch
import torch.distributed as dist

# The same names every distnb rank starts with.
rank = int(os.environ["RANK"])
local_rank = int(os.environ["LOCAL_RANK"])
world_size = int(os.environ["WORLD_SIZE"])
backend = {backend!r}
TIMEOUT = {timeout!r}  # seconds a collective may wait
if backend == "auto":
    backend = "nccl" if torch.cuda.is_available() else "gloo"
if backend == "nccl":
    device = torch.device("cuda", local_rank)  # by LOCAL_RANK, before the process group
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
{timeout_note}# device_id: NCCL creates its communicator now (eagerly) on this rank's own GPU.
dist.init_process_group(backend, timeout=timedelta(seconds=TIMEOUT), device_id=device if backend == "nccl" else None)
# Groups made later (new_group, init_device_mesh's dimensions) wait TIMEOUT too, as in the pool,
# not torch's default for them (30 minutes on gloo).
for _default in ("default_pg_timeout", "default_pg_nccl_timeout"):
    if isinstance(getattr(dist.distributed_c10d, _default, None), timedelta):
        setattr(dist.distributed_c10d, _default, timedelta(seconds=TIMEOUT))


def display(*objs):
    for obj in objs:
        print(repr(obj))

'''

#: The cells ran in a pool whose group existed from launch: a pasted ``init_process_group`` kept it
#: and a pasted ``destroy_process_group()`` of the default group waited for the end (the rank
#: side's worker/torch_hooks/pasted.py). The script does the same, or it would die at the pasted
#: init ("initialize the default process group twice") before reaching the failure.
_KEPT_GROUP = '''
# As in the session: the pool's process group is kept by a pasted init_process_group and
# destroy_process_group() (both bindings: torch's own calls read distributed_c10d's).
from torch.distributed import distributed_c10d as _c10d

_pool_init, _pool_destroy = dist.init_process_group, dist.destroy_process_group


def _kept_init(*args, **kwargs):
    if not dist.is_initialized():
        return _pool_init(*args, **kwargs)


def _kept_destroy(group=None):
    if group is not None and group is not _c10d.GroupMember.WORLD:
        return _pool_destroy(group)


dist.init_process_group = _c10d.init_process_group = _kept_init
dist.destroy_process_group = _c10d.destroy_process_group = _kept_destroy
'''

#: The script's words when the session's last cell hung: its collectives wait this long, not the pool's.
_HANG_NOTE = '''# The session's last cell hung: a collective that waits longer than TIMEOUT raises torch's
# timeout, so a run ends by itself (the pool's timeout was {pg_timeout:g} s). Raise TIMEOUT if a
# rank legitimately computes that long while the others wait for it.
'''

_EPILOGUE = '''
# As in the session, a rank that finished waits for the others (in the pool it stayed alive):
# leaving would end their waits with a closed connection, where in the session they hung.
def _wait_for_every_rank(seconds):
    import time
    if os.environ.get("DISTNB_VERIFY_DIR"):  # distnb's own run of this script: which ranks reached the end
        open(os.path.join(os.environ["DISTNB_VERIFY_DIR"], f"rank{{os.environ['RANK']}}.done"), "w").close()
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add("distnb/finished", 1)
        deadline = time.monotonic() + seconds
        while store.add("distnb/finished", 0) < int(os.environ["WORLD_SIZE"]):
            if time.monotonic() > deadline:
                print(f"rank {{os.environ['RANK']}} finished; {gave_up} {{seconds:g}} s", flush=True)
                return
            time.sleep(0.1)
    except Exception:  # the store left with a failed rank: torchrun ends this one too
        pass


_wait_for_every_rank(TIMEOUT + 10)
{destroy}()
'''

#: A cell's ``sys.exit()`` ended the cell, not the rank: distnb caught its SystemExit.
_CAUGHT_EXIT = '''try:
{body}
except SystemExit as _exit:  # as in the session: it ended the cell, and the rank kept running
    print(f"(SystemExit({{_exit.code!r}}) ended this cell; the rank keeps running)")
'''
_EXITS = ("exit(", "SystemExit", "quit(")
_PASTED = ("init_process_group", "destroy_process_group")


Cell = CellResult | CellRecord


def _number(cell: Cell, by_label: bool) -> int | None:
    return cell.label if by_label else cell.cell


def _name(cell: Cell) -> str:
    return f"In[{cell.label}]" if cell.label is not None else f"cell {cell.cell}"


def select_cells(history: Sequence[Cell], spec: str | None = None, include_failed: bool = False, only_ok: bool = False,
                 by_label: bool = False) -> list[Cell]:
    """Which cells to export.

    ``spec`` picks cells by number (``"3-7,9"``: the notebook's In[n] with ``by_label``, else
    distnb's cell numbers). Without it: every cell with ``include_failed``; only those that
    succeeded with ``only_ok``; by default the minimal failing case — the cells that succeeded
    up to the last one that failed, and that one, so the export fails as the session did (with no
    failure, every cell that succeeded)."""
    if spec:
        wanted: set[int] = set()
        for part in spec.replace("In[", "").replace("]", "").split(","):
            lo, sep, hi = part.strip().partition("-")
            try:
                wanted.update(range(int(lo), int(hi) + 1) if sep else [int(lo)])
            except ValueError:
                raise ValueError(f"can't read cell range {part!r}; use e.g. 3-7,9.") from None
        known = {n for c in history if (n := _number(c, by_label)) is not None}
        missing = sorted(wanted - known)
        if missing:
            what = "In[n] numbers" if by_label else "cell numbers"
            ran = rank_span(known) if known else "none (cells run from Python have no In[n]: use their cell numbers)"
            raise ValueError(f"{', '.join(map(str, missing))} {'is' if len(missing) == 1 else 'are'} not among this session's "
                             f"{what}; those run: {ran}.")
        return [c for c in history if _number(c, by_label) in wanted]
    if include_failed:
        return list(history)
    last_failed = max((i for i, c in enumerate(history) if not c.ok), default=None)
    if only_ok or last_failed is None:
        return [c for c in history if c.ok]
    return [c for c in history[:last_failed] if c.ok] + [history[last_failed]]


def _show_last_value(code: str) -> str:
    """Make the last expression print its value, as the notebook showed it."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    lines = code.splitlines()
    head = lines[: last.lineno - 1]
    expr = "\n".join(lines[last.lineno - 1 : last.end_lineno])
    if last.col_offset:  # e.g. "x = 1; x": keep the statements before it on that line
        head.append(expr[: last.col_offset].rstrip().rstrip(";"))
        expr = expr[last.col_offset :]
    return "\n".join(head + [f"_ = ({expr})", "if _ is not None:", "    print(repr(_))"])


def with_pushes(history: Sequence[CellResult | CellRecord], chosen: Sequence[CellResult | CellRecord],
                pushes: Iterable[PushRecord], since: int = 0) -> list[Step]:
    """The chosen cells with the pushes they depend on: every push made since history index
    ``since`` up to the last chosen cell, placed where it happened."""
    index = {id(c): i for i, c in enumerate(history)}
    wanted = {index[id(c)] for c in chosen if id(c) in index}
    if not wanted:
        return list(chosen)
    pending = sorted((p for p in pushes if since <= p.position <= max(wanted)), key=lambda p: p.position)
    steps: list[Step] = []
    for i in sorted(wanted):
        while pending and pending[0].position <= i:
            steps.append(pending.pop(0))
        steps.append(history[i])
    return steps


def _env_lines(config: LaunchConfig) -> str:
    env: dict[str, str] = {}
    for switch in config.debug:
        env.update(DEBUG_ENV[switch])
    env.update(config.env)
    if not env:
        return ""
    # Before torch is imported: NCCL_*, TORCH_DISTRIBUTED_DEBUG and friends are read at start-up.
    return "\n# The pool's --env and --debug settings.\n" + "".join(f"os.environ.setdefault({k!r}, {v!r})\n" for k, v in env.items())


def _literal_assignments(values: dict[str, Any]) -> str | None:
    """``name = literal`` lines when every value survives repr → literal_eval unchanged."""
    lines = []
    for name, value in values.items():
        try:
            text = repr(value)
            if ast.literal_eval(text) != value or type(ast.literal_eval(text)) is not type(value):
                return None
        except Exception:
            return None
        lines.append(f"{name} = {text}")
    return "\n".join(lines)


def _push_code(push: PushRecord, path: Path, n: int, sidecars: list[Path]) -> str:
    """Code that re-creates a push: literals inline, else the pickle (inline or beside the export)."""
    names = ", ".join(push.names)
    if push.blob is None:
        return f"# {names}: pushed from the notebook but too large to keep; define them here.\nraise SystemExit('define {names} first')"
    literal = _literal_assignments(pickle.loads(push.blob))
    if literal is not None:
        return literal
    if len(push.blob) <= INLINE_PUSH_BYTES:
        data = base64.b64encode(push.blob).decode()
        wrapped = "\n".join(textwrap.wrap(data, 96))
        return f'import base64, pickle\nglobals().update(pickle.loads(base64.b64decode("""\n{wrapped}\n""")))  # {names}'
    side = path.with_name(f"{path.stem}.push{n}.pkl")
    side.write_bytes(push.blob)
    sidecars.append(side)
    return (f"import pickle\nwith open(os.path.join(os.path.dirname(os.path.abspath(__file__)), {side.name!r}), 'rb') as _f:\n"
            f"    globals().update(pickle.load(_f))  # {names}")


def _targeted(body: str, ranks: Sequence[int], everyone: bool) -> str:
    if everyone:
        return body + "\n"
    return f"if rank in {{{', '.join(map(str, ranks))}}}:\n{textwrap.indent(body, '    ') or '    pass'}\n"


def _as_in_the_session(code: str) -> str:
    """A cell's code as the session ran it: a ``sys.exit()`` in it ends the cell, not the script."""
    if not any(word in code for word in _EXITS):
        return code
    return _CAUGHT_EXIT.format(body=textwrap.indent(code, "    ") or "    pass").rstrip("\n")


def _script_timeout(config: LaunchConfig, hang: bool) -> float:
    """Seconds a collective of the exported script may wait: :data:`HANG_TIMEOUT` when the
    session's last cell hung (at most the pool's own), else the pool's."""
    return min(HANG_TIMEOUT, config.pg_timeout) if hang else config.pg_timeout


def export_script(steps: Iterable[Step], config: LaunchConfig, path: str | Path, hang: bool = False) -> Path:
    """The steps as a torchrun script. ``hang``: the last cell hung in the session, so the script's
    collectives time out after :data:`HANG_TIMEOUT` s, and a run of it ends by itself."""
    steps = list(steps)
    path = Path(path)
    cells = [s for s in steps if not isinstance(s, PushRecord)]
    pasted = any(word in c.code for c in cells for word in _PASTED)
    parts = [_PRELUDE.format(n=len(cells), run=run_command(config, path.name), backend=config.backend, timeout=_script_timeout(config, hang),
                             timeout_note=_HANG_NOTE.format(pg_timeout=config.pg_timeout) if hang else "", env=_env_lines(config))]
    if pasted:
        parts.append(_KEPT_GROUP)
    all_ranks = list(range(int(config.nproc or 0) * config.nnodes))
    sidecars: list[Path] = []
    for step in steps:
        everyone = list(step.ranks) == all_ranks
        where = "all ranks" if everyone else format_ranks(step.ranks)
        if isinstance(step, PushRecord):
            parts.append(f"# ---- %dist_push {' '.join(step.names)} ({where}) ----")
            parts.append(_targeted(_push_code(step, path, len(sidecars) + 1, sidecars), step.ranks, everyone))
            continue
        parts.append(f"# ---- {_name(step)} ({where}){'' if step.ok else ': it failed in the session'} ----")
        parts.append(_targeted(_as_in_the_session(_show_last_value(step.code.rstrip())), step.ranks, everyone))
    parts.append(_EPILOGUE.format(destroy="_pool_destroy" if pasted else "dist.destroy_process_group", gave_up=GAVE_UP))
    path.write_text("\n".join(parts))
    return path


def run_command(config: LaunchConfig, name: str) -> str:
    """How to run an exported script with the pool's layout: one torchrun, or one per machine."""
    if config.nnodes == 1:
        return f"torchrun --nproc-per-node {config.nproc} {name}"
    endpoint = config.rdzv_endpoint or "HOST:29500"
    multi = (f"torchrun --nnodes {config.nnodes} --nproc-per-node {config.nproc} --rdzv-backend c10d "
             f"--rdzv-endpoint {endpoint} {name}   (on each of the {config.nnodes} machines")
    if config.local_nodes:
        # The session rehearsed those machines on one box: the same script runs here as one job.
        return f"{multi}; on one machine: torchrun --nproc-per-node {config.world_size} {name})"
    return multi + ")"


def launch_line(config: LaunchConfig) -> str:
    """The ``%dist_launch`` line that starts a pool as ``config`` says."""
    line = f"%dist_launch -n {config.nproc} --backend {config.backend}"
    if config.nnodes > 1:
        line += f" --nnodes {config.nnodes}"
        if config.local_nodes:
            line += " --local-nodes"
        elif config.slurm:
            line += " --slurm"
        elif config.hosts:
            line += f" --hosts {','.join(config.hosts)}"
        if config.bind != LaunchConfig.bind:
            line += f" --bind {config.bind}"
        if config.rdzv_endpoint:
            line += f" --rdzv-endpoint {config.rdzv_endpoint}"
        if config.curve:
            line += " --curve"
    if config.pg_timeout != LaunchConfig.pg_timeout:
        line += f" --pg-timeout {config.pg_timeout:g}"
    line += "".join(f" --debug {d}" for d in config.debug)
    line += "".join(f" --env {shlex.quote(f'{k}={v}')}" for k, v in config.env.items())
    return line


def export_notebook(steps: Iterable[Step], config: LaunchConfig, path: str | Path) -> Path:
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    steps = list(steps)
    path = Path(path)
    cells = [s for s in steps if not isinstance(s, PushRecord)]
    nb = new_notebook(
        cells=[
            new_markdown_cell(f"Exported by distnb: {len(cells)} cells, {config.world_size} ranks."),
            new_code_cell(f"%load_ext distnb\n{launch_line(config)}"),
        ]
    )
    all_ranks = list(range(int(config.nproc or 0) * config.nnodes))
    sidecars: list[Path] = []
    for step in steps:
        target = "" if list(step.ranks) == all_ranks else " " + ",".join(map(str, step.ranks))
        if isinstance(step, PushRecord):
            # Defined in the notebook, then pushed, as in the session that was exported.
            code = _push_code(step, path, len(sidecars) + 1, sidecars).replace("os.path.dirname(os.path.abspath(__file__))", "'.'")
            if "os.path.join" in code:
                code = "import os\n" + code
            ranks = f" --ranks {','.join(map(str, step.ranks))}" if target else ""
            nb.cells.append(new_code_cell(f"{code}\n%dist_push {' '.join(step.names)}{ranks}"))
            continue
        cell = new_code_cell(f"%%on_ranks{target}\n{step.code.rstrip()}")
        if not step.ok:
            # It fails as it did (its CellFailed is the point): Run All and nbclient go on to the
            # shutdown past a cell tagged so, and stop at any other failure.
            cell.metadata["tags"] = ["raises-exception"]
        nb.cells.append(cell)
    nb.cells.append(new_code_cell("%dist_shutdown"))
    nbformat.write(nb, str(path))
    return path


@dataclass(frozen=True)
class Export:
    """What an export wrote: the file (``str()`` and ``os.fspath()`` give its path), the cells in
    it, the failing cell it ends with (the session's last failure), if any, and what running it
    showed (``verified``: None when not run)."""

    path: str
    cells: tuple[str, ...]  # "In[3]" (or "cell 5" for a cell run from Python), in order
    failing: str | None
    command: str  # how to run it
    verified: Reproduction | None = None
    hang_timeout: float | None = None  # the script's collective timeout, when it ends with a hang

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path

    def text(self) -> str:
        ending = f"; it ends with {self.failing}, which failed in the session" if self.failing else ""
        checked = f"\n{self.verified.text()}" if self.verified is not None else ""
        hang = (f"\nAs in the session, ranks that finish wait for the others; its collectives time out after "
                f"{self.hang_timeout:g} s (TIMEOUT in the script), so a run of the hang ends by itself."
                if self.hang_timeout is not None else "")
        return f"wrote {self.path} with {', '.join(self.cells)}{ending}. Run it with: {self.command}{hang}{checked}"


def export_session(session: SessionLog, path: str, config: LaunchConfig, cells: str | None = None, include_failed: bool = False,
                   only_ok: bool = False, by_label: bool = False, verify: float | None = None,
                   say: Callable[[str], None] | None = None) -> Export:
    """Write the session's cells since launch as a standalone ``torchrun`` script, or as a
    notebook when ``path`` ends in ``.ipynb`` (which cells: :func:`select_cells`). With
    ``verify`` (seconds), a script that ends with a failed cell is run under torchrun, bounded
    by it, and its failure compared with the session's (services/cases/verify.py); ``say`` hears, before
    that run, what it is and how to skip it (it takes seconds: ranks start and must fail)."""
    history = session.history
    start = session.launch_index
    chosen = select_cells(history[start:] if cells is None else history, cells, include_failed, only_ok, by_label)
    if not chosen:
        raise ValueError("there is no cell to export yet; run some with %%on_ranks first (or pass --all to include failed ones).")
    # The cells read what %dist_push sent them: the pushes go in too, where they happened.
    steps = with_pushes(history, chosen, session.pushes, start)
    notebook = str(path).endswith(".ipynb")
    signature = session_signature(chosen[-1]) if not chosen[-1].ok else None
    hang = signature is not None and bool(signature.hung)
    written = str(export_notebook(steps, config, path) if notebook else export_script(steps, config, path, hang))
    failing = chosen[-1] if not chosen[-1].ok and cells is None and not include_failed else None
    checked = None
    if verify is not None and not notebook and not chosen[-1].ok:
        if signature is not None and say is not None:
            say(f"checking {written}: running it under torchrun here for at most {verify:g} s, to see it fail as the "
                "session did (--no-verify skips this) …")
        checked = verify_script(written, config, signature, verify) if signature is not None else Reproduction(
            False, False, FailureSignature(), None, 0.0, f"{_name(chosen[-1])}'s errors are no longer kept (only the newest cells' are)")
    return Export(written, tuple(_name(c) for c in chosen), _name(failing) if failing is not None else None,
                  f"open {written}" if notebook else run_command(config, written), checked,
                  _script_timeout(config, hang) if hang and not notebook else None)
