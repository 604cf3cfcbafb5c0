"""The magics over a fake pool, in a real IPython shell: argument parsing, the errors a user meets,
and what each magic shows. No process is started: the magics are thin over the Pool's public
methods, so a stand-in with those methods is all they need (the end-to-end magics tests, on real
pools, are in test_magics.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from magic_shell import process_shell

from distnb.analysis.reports.env import EnvReport
from distnb.analysis.verdicts.stacks import Frame, RankStack, StackReport, ThreadStack
from distnb.analysis.verdicts.verdict import Blame, Certainty
from distnb.config import LaunchConfig
from distnb.errors import CellFailed, NoPoolError, PoolBusyError
from distnb.magics import running, support
from distnb.ranks import parse_ranks
from distnb.results import CellEvents, CellResult, RankResult
from distnb.services.cases.export import Export, run_command
from distnb.states import PoolState, RankState
from distnb.status import PoolStatus, RankStatus


class FakePool:
    """The Pool's public surface the magics use, answering from a script: each rank's output and
    outcome for the next cell, and what every call received."""

    def __init__(self, world_size: int = 4) -> None:
        self.config = LaunchConfig(nproc=world_size, backend="gloo")
        self.world_size = world_size
        self.state = PoolState.READY
        self.history: list[CellResult] = []
        self.calls: list[tuple[str, Any]] = []
        #: rank -> (stdout, error or None) for the next cell
        self.script: dict[int, tuple[str, dict[str, Any] | None]] = {}

    def submit(self, code: str, ranks: Any = None, events: CellEvents | None = None, profile: bool = False, pdb: bool = False,
               label: int | None = None, comms: bool = False, paths: bool = False, source: dict[str, Any] | None = None,
               numerics: bool | str = False) -> CellResult:
        compile(code, "<cell>", "exec")  # the real pool raises a SyntaxError before sending
        targets = parse_ranks(ranks, self.world_size)
        result = CellResult(cell=len(self.history) + 1, code=code, ranks=targets, results={r: RankResult(r) for r in targets}, label=label)
        self.calls.append(("submit", {"code": code, "ranks": targets, "profile": profile, "pdb": pdb, "comms": comms}))
        for r in targets:
            out, error = self.script.get(r, ("", None))
            if out and events is not None and events.on_output is not None:
                events.on_output(r, "stdout", out)
            res = result.results[r]
            res.add_output("stdout", out)
            res.status, res.error, res.finished_at = ("error" if error else "ok"), error, float(r)
            if events is not None and events.on_rank_done is not None:
                events.on_rank_done(res)
        self.history.append(result)
        return result

    def wait(self, result: CellResult, timeout: float | None = None, on_tick: Any = None, tick: float = 1.0, ask: Any = None,
             fail_fast: bool = True) -> CellResult:
        self.calls.append(("wait", timeout) if fail_fast else ("wait", timeout, "no fail-fast"))
        return result

    def explain_timeout(self, result: CellResult) -> None:
        if result.timed_out:
            result.notes.append("[distnb] why it still runs: (the fake's diagnosis)")

    def watch(self, result: CellResult, hang_after: float | None = None) -> Any:
        self.calls.append(("watch", hang_after))
        return SimpleNamespace(look=lambda: None)  # the scripted cells end at once: nothing to diagnose

    def status(self) -> PoolStatus:
        ranks = [RankStatus(rank=r, state=RankState.IDLE, pid=100 + r, host="h", device="cpu") for r in range(self.world_size)]  # type: ignore[call-arg]
        return PoolStatus(state=self.state.value, backend="gloo", world_size=self.world_size, ranks=ranks, cells_run=len(self.history))

    def stacks(self, ranks: Any = None, all_threads: bool = False, native: bool = False) -> StackReport:
        self.calls.append(("stacks", (ranks, all_threads, native)))
        frames = [Frame("<cell-1>", 2, "<module>", "dist.all_reduce(x)")]
        return StackReport([RankStack(r, "running cell 1", "control thread", [ThreadStack("MainThread", True, frames)])  # type: ignore[arg-type]
                            for r in parse_ranks(ranks, self.world_size)])

    def env(self, ranks: Any = None) -> EnvReport:
        envs = {r: {"RANK": str(r), "WORLD_SIZE": "4", "MASTER_PORT": "29500" if r != 3 else "29501"} for r in parse_ranks(ranks, self.world_size)}
        return EnvReport(envs, {r: "h" for r in envs})

    def push(self, ranks: Any = None, **values: Any) -> None:
        self.calls.append(("push", (ranks, values)))

    def pull(self, name: str, ranks: Any = None) -> dict[int, Any]:
        return {r: f"{name}@{r}" for r in parse_ranks(ranks, self.world_size)}

    def export(self, path: str, cells: str | None = None, include_failed: bool = False, only_ok: bool = False,
               by_label: bool = False, say: Any = None, **verify: float | None) -> Export:
        self.calls.append(("export", (cells, include_failed, only_ok, by_label, verify)))
        if verify.get("verify", 30) is not None:
            say("checking it …")  # as the pool's export does before it runs the script
        Path(path).write_text("# exported\n")  # raises OSError for a folder that does not exist, as the real one
        return Export(path, ("In[3]", "In[4]"), "In[4]", run_command(self.config, path))

    def interrupt(self, ranks: Any = None) -> list[int]:
        self.calls.append(("interrupt", ranks))
        return list(ranks or [])

    def shutdown(self) -> None:
        self.state = PoolState.STOPPED

    def restart(self, on_progress: Any = None, replay: bool = False, on_replay: Any = None, on_note: Any = None, full: bool = False) -> FakePool:
        """Replays the cells of the history as they are scripted now: stops at the first that fails."""
        self.calls.append(("restart", replay))
        for old in list(self.history) if replay else []:
            result = self.submit(old.code, old.ranks)
            on_replay(result)
            if not result.ok:
                break
        return self

    def regroup(self) -> None:
        raise PoolBusyError.of({1: 3})


@pytest.fixture
def shell() -> InteractiveShell:
    ip = process_shell()
    if "on_ranks" not in ip.magics_manager.magics["cell"]:
        ip.run_line_magic("load_ext", "distnb")
    return ip


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakePool:
    pool = FakePool()
    monkeypatch.setattr(support, "current_pool", lambda: pool)
    monkeypatch.setattr(running, "current_pool", lambda: pool)
    return pool


def test_a_cell_shows_grouped_output_and_the_failing_rank_with_its_line(shell: InteractiveShell, fake: FakePool,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    error = {"ename": "ValueError", "evalue": "bad batch", "traceback": "Traceback …\nValueError: bad batch\n", "line": 3}
    fake.script = {r: ("step 1\n", error if r == 2 else None) for r in range(4)}
    with pytest.raises(CellFailed, match=r"^cell 1 failed on rank 2: ValueError: bad batch$"):
        shell.run_cell_magic("on_ranks", "0-3", "x = 1\nprint('step 1')\nraise ValueError('bad batch')")
    out, err = capsys.readouterr()
    assert "[ranks 0-3] step 1" in out
    assert "── ValueError on rank 2 at cell line 3 ──" in err and "ValueError: bad batch" in err
    assert shell.user_ns["_dist"] is fake.history[-1] and fake.history[-1].failed == [2]
    assert fake.history[-1].label is None  # called from Python, outside any cell: it has no In[n]
    assert fake.calls[0] == ("submit", {"code": "x = 1\nprint('step 1')\nraise ValueError('bad batch')", "ranks": [0, 1, 2, 3],
                                        "profile": False, "pdb": False, "comms": False})


def test_each_cell_is_named_by_the_in_n_ipython_gives_it(shell: InteractiveShell, fake: FakePool) -> None:
    # IPython 9 moves execution_count before a cell runs, IPython 8 after: read during the cell it
    # is this cell's number on 8 and the next one's on 9. Run as IPython runs cells, each cell's label
    # must be the number under which IPython keeps its source in In[], on either version.
    fake.script = {r: ("", None) for r in range(4)}
    labels = []
    for step in range(3):
        result = shell.run_cell(f"%%on_ranks\nx = {step}\n", store_history=True)
        assert result.success, result
        assert fake.history[-1].code == f"x = {step}\n"
        labels.append(fake.history[-1].label)
        assert labels[-1] == result.execution_count, (labels, result.execution_count)  # the number IPython shows as [n]
    assert labels == sorted(set(labels))
    # A silent run (a front end's own request) is no cell of the notebook's: no In[n] for it.
    shell.run_cell("%%on_ranks\nx = 9\n", silent=True)
    assert fake.history[-1].label is None


def test_cell_flags_reach_the_pool(shell: InteractiveShell, fake: FakePool) -> None:
    shell.run_cell_magic("on_ranks", "1, 3 --pdb --timeout 5", "pass")
    assert fake.calls[0][1]["ranks"] == [1, 3] and fake.calls[0][1]["pdb"] and not fake.calls[0][1]["profile"]
    assert not fake.calls[0][1]["comms"]
    assert ("wait", 5.0) in fake.calls
    shell.run_cell_magic("on_ranks", "--no-fail-fast --timeout 7", "pass")
    assert ("wait", 7.0, "no fail-fast") in fake.calls


@pytest.mark.parametrize(
    ("magic", "line", "error"),
    [
        ("on_ranks", "--timeout -1", "--timeout takes a positive number of seconds"),
        ("on_ranks", "--no-such-flag", "Run %%on_ranks? for its flags"),
        ("on_ranks", "9", "rank 9 is out of range"),
        ("dist_collectives", "--last 0", "--last takes a positive count"),
        ("dist_timeline", "--last 0", "--last takes a positive count"),
        ("dist_push", "not_defined_here", "'not_defined_here' is not defined in the notebook"),
        ("dist_export", "/no/such/folder/repro.py", "can't write /no/such/folder/repro.py"),
        ("dist_minimize", "--budget 0", "--budget takes a positive number of seconds"),
        ("dist_regroup", "", "rank 1 is still running cell 3. Wait for it, see where it is with %dist_stacks, interrupt it with %dist_interrupt"),
        ("dist_stacks", "--bogus", "Run %dist_stacks? for its flags"),
    ],
)
def test_bad_input_is_a_usage_error_that_says_what_to_do(shell: InteractiveShell, fake: FakePool, magic: str, line: str, error: str) -> None:
    with pytest.raises(UsageError, match=error.replace("?", r"\?").replace("(", r"\(")):
        if magic == "on_ranks":
            shell.run_cell_magic(magic, line, "pass")
        else:
            shell.run_line_magic(magic, line)


def test_every_magic_without_a_pool_says_how_to_start_one(shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch) -> None:
    def none() -> Any:
        raise NoPoolError("no pool is running; start one with %dist_launch -n 4 (or distnb.launch(nproc=4)).")

    monkeypatch.setattr(support, "current_pool", none)
    for magic in ("dist_stacks", "dist_env", "dist_status", "dist_memory", "dist_collectives", "dist_shutdown", "dist_restart"):
        with pytest.raises(UsageError, match="%dist_launch"):
            shell.run_line_magic(magic, "")
    with pytest.raises(UsageError, match="%dist_launch"):
        shell.run_cell_magic("on_ranks", "", "pass")


def test_a_syntax_error_is_shown_once_and_nothing_is_sent(shell: InteractiveShell, fake: FakePool, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CellFailed, match=r"^the cell was not run: SyntaxError at cell line 1: .*; nothing was sent to the ranks$") as failed:
        shell.run_cell_magic("on_ranks", "", "x = (")
    err = capsys.readouterr().err
    assert "SyntaxError" in err and "nothing was sent to the ranks" in err and not fake.history
    assert failed.value.result is None
    shell.run_cell_magic("on_ranks", "--keep-going", "x = (")  # said, and nothing raised
    assert "nothing was sent to the ranks" in capsys.readouterr().err


def test_launch_flags_become_a_validated_config(shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    made: list[LaunchConfig] = []

    class Launched(FakePool):
        def __init__(self, config: LaunchConfig) -> None:
            super().__init__(config.world_size)
            self.config = config
            made.append(config)

        def start(self, on_progress: Any = None, on_note: Any = None) -> Launched:
            return self

    def no_pool() -> Any:
        raise NoPoolError("none")

    monkeypatch.setattr(running, "current_pool", no_pool)
    monkeypatch.setattr(running, "Pool", Launched)
    shell.run_line_magic("dist_launch", "-n 3 --backend gloo --env NCCL_DEBUG=INFO --hang-after 2 --pg-timeout 60 --no-spares")
    assert "every rank starts with: torch, dist, rank, local_rank, world_size, device" in capsys.readouterr().out
    config = made[-1]
    assert (config.nproc, config.backend, config.env) == (3, "gloo", {"NCCL_DEBUG": "INFO"})
    assert (config.hang_after, config.pg_timeout, config.spares) == (2.0, 60.0, False)
    with pytest.raises(UsageError, match="-n/--nproc"):
        shell.run_line_magic("dist_launch", "-n 0")
    with pytest.raises(UsageError, match="--env"):
        shell.run_line_magic("dist_launch", "--env NOEQUALS")


def test_launch_refuses_a_second_pool(shell: InteractiveShell, fake: FakePool) -> None:
    with pytest.raises(UsageError, match="already ready; use %dist_restart"):
        shell.run_line_magic("dist_launch", "-n 2")


def test_pull_push_and_env_show_what_the_pool_answers(shell: InteractiveShell, fake: FakePool, capsys: pytest.CaptureFixture[str]) -> None:
    shell.user_ns["lr"] = 0.1
    shell.run_line_magic("dist_push", "lr --ranks 0,1")
    assert fake.calls[-1] == ("push", ("0,1", {"lr": 0.1}))
    assert shell.run_line_magic("dist_pull", "w --ranks 2") == {2: "w@2"}
    report = shell.run_line_magic("dist_env", "")
    assert "MASTER_PORT" in report.text() and "rank 3" in report.text()
    stacks = shell.run_line_magic("dist_stacks", "1 --all-threads")
    assert fake.calls[-1] == ("stacks", ("1", True, False)) and "dist.all_reduce(x)" in stacks.text()


def test_interrupt_reaches_only_the_busy_ranks(shell: InteractiveShell, fake: FakePool, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    shell.run_line_magic("dist_interrupt", "")
    assert "no cell is running: nothing to interrupt." in capsys.readouterr().out
    status = fake.status()
    status.ranks[1].state = status.ranks[3].state = RankState.RUNNING
    monkeypatch.setattr(fake, "status", lambda: status)
    shell.run_line_magic("dist_interrupt", "0-1")
    assert fake.calls[-1] == ("interrupt", [1]) and "interrupting the cell on rank 1: they stop at their next Python line" in capsys.readouterr().out
    shell.run_line_magic("dist_interrupt", "")
    assert fake.calls[-1] == ("interrupt", [1, 3])


def test_wait_without_a_cell_says_how_to_run_one(shell: InteractiveShell, fake: FakePool) -> None:
    with pytest.raises(UsageError, match="no cell has run on this pool yet"):
        shell.run_line_magic("dist_wait", "")


def test_export_prints_the_command_that_runs_the_script(shell: InteractiveShell, fake: FakePool, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "repro.py"
    shell.run_line_magic("dist_export", f"{target} --cells 3-4")
    out, err = capsys.readouterr()
    assert f"wrote {target} with In[3], In[4]; it ends with In[4], which failed in the session." in out
    assert f"Run it with: torchrun --nproc-per-node 4 {target}" in out
    assert "checking it …" in err  # a terminal hears the check start (a notebook's line is rewritten)
    assert fake.calls[-1] == ("export", ("3-4", False, False, True, {}))  # the cells by the notebook's In[n]; the pool's check
    shell.run_line_magic("dist_export", f"{target} --no-verify")
    assert fake.calls[-1][1][-1] == {"verify": None}
    shell.run_line_magic("dist_export", f"{target} --verify-timeout 90")
    assert fake.calls[-1][1][-1] == {"verify": 90.0}
    with pytest.raises(UsageError, match="--verify-timeout takes a positive number"):
        shell.run_line_magic("dist_export", f"{target} --verify-timeout 0")


# -- a failed cell stops Run All ----------------------------------------------------------------
BAD_BATCH = {"ename": "ValueError", "evalue": "bad batch", "traceback": "Traceback …\nValueError: bad batch\n", "line": 2}


def test_a_failed_cell_shows_its_report_then_one_line(shell: InteractiveShell, fake: FakePool, capsys: pytest.CaptureFixture[str]) -> None:
    """As a notebook runs it (run_cell): the report, then the error as one line — no second traceback
    of distnb's frames — and the cell counts as failed, which is what stops Run All."""
    fake.script = {2: ("", BAD_BATCH)}
    ran = shell.run_cell("%%on_ranks\nx = 1\nraise ValueError('bad batch')")
    out, err = capsys.readouterr()
    assert not ran.success and isinstance(ran.error_in_exec, CellFailed)
    assert ran.error_in_exec.result is shell.user_ns["_dist"] is fake.history[-1]  # _dist is set before the raise
    assert "── ValueError on rank 2 at cell line 2 ──" in err
    shown = [line for line in out.splitlines() if "CellFailed" in line]
    assert shown == ["CellFailed: cell 1 failed on rank 2: ValueError: bad batch"], out
    assert "Traceback" not in out and "distnb/" not in out + err.replace("Traceback …", "")


def test_keep_going_per_cell_and_for_the_session(shell: InteractiveShell, fake: FakePool, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    fake.script = {0: ("", BAD_BATCH)}
    shell.run_cell_magic("on_ranks", "--keep-going", "raise ValueError('bad batch')")
    assert "ValueError on rank 0" in capsys.readouterr().err and shell.user_ns["_dist"].failed == [0]
    for value in ("1", "on", " True "):
        monkeypatch.setenv("DISTNB_KEEP_GOING", value)
        shell.run_cell_magic("on_ranks", "", "raise ValueError('bad batch')")
    for value in ("0", "off", ""):
        monkeypatch.setenv("DISTNB_KEEP_GOING", value)
        with pytest.raises(CellFailed):
            shell.run_cell_magic("on_ranks", "", "raise ValueError('bad batch')")
    monkeypatch.setenv("DISTNB_KEEP_GOING", "maybe")
    with pytest.raises(UsageError, match=r"DISTNB_KEEP_GOING='maybe' is neither on nor off: set it to 1"):
        shell.run_cell_magic("on_ranks", "", "raise ValueError('bad batch')")
    monkeypatch.delenv("DISTNB_KEEP_GOING")
    fake.script = {}
    shell.run_cell_magic("on_ranks", "", "pass")  # a cell that succeeds raises nothing
    assert "--keep-going" in shell.find_cell_magic("on_ranks").parser.format_help()
    assert "DISTNB_KEEP_GOING" in (shell.find_cell_magic("on_ranks").__doc__ or "")


def test_wait_and_replay_raise_for_the_cell_they_show(shell: InteractiveShell, fake: FakePool, capsys: pytest.CaptureFixture[str]) -> None:
    fake.script = {1: ("", BAD_BATCH)}
    shell.run_cell_magic("on_ranks", "--bg", "raise ValueError('bad batch')")  # --bg: nothing to raise yet
    assert "running in the background" in capsys.readouterr().out
    with pytest.raises(CellFailed, match=r"^cell 1 failed on rank 1: ValueError: bad batch$"):
        shell.run_line_magic("dist_wait", "")
    assert "ValueError on rank 1" in capsys.readouterr().out
    shell.run_line_magic("dist_wait", "--keep-going")
    # A replayed cell that fails this time: the pool is not back where it was.
    with pytest.raises(CellFailed, match=r"^replay stopped: cell 2 failed on rank 1: ValueError: bad batch$") as failed:
        shell.run_line_magic("dist_restart", "--replay")
    assert failed.value.result is shell.user_ns["_dist"] is fake.history[-1]
    assert "FAILED — replay stopped here" in capsys.readouterr().out
    shell.run_line_magic("dist_restart", "--replay --keep-going")
    fake.script = {}
    shell.run_line_magic("dist_restart", "--replay")  # every replayed cell succeeds: nothing raised


def _cell(statuses: dict[int, str], **fields: Any) -> CellResult:
    result = CellResult(cell=7, code="", ranks=sorted(statuses), results={r: RankResult(r, status=s) for r, s in statuses.items()})
    for name, value in fields.items():
        setattr(result, name, value)
    return result


def test_the_one_line_names_the_root_cause_first() -> None:
    # Errors: the earliest first, with every rank that raised the same; the others after it.
    result = _cell({0: "error", 1: "error", 2: "error", 3: "running"}, timed_out=True, elapsed=6.02)
    for r, (ename, evalue, at) in {0: ("RuntimeError", "Connection closed by peer", 5.0), 1: ("RuntimeError", "Connection closed", 5.1),
                                   2: ("ValueError", "bad batch\nmore lines", 1.0)}.items():
        result[r].error, result[r].finished_at = {"ename": ename, "evalue": evalue, "traceback": ""}, at
    assert str(CellFailed.of(result)) == "cell 7 failed on rank 2: ValueError: bad batch; ranks 0,1 raised RuntimeError; rank 3 still running (timed out)"
    # A death leads: it explains the ranks that waited for it (the signal's explanation is the report's).
    result = _cell({0: "stranded", 1: "dead", 2: "dead", 3: "ok"})
    result[1].returncode, result[2].returncode, result[2].first_death = -6, -9, True
    assert str(CellFailed.of(result)) == "cell 7 failed: ranks 1,2 died, rank 2 first: killed (SIGKILL); rank 0 stranded"
    # Unless the diagnosis found the rank that caused it: then the line names that rank too, from
    # whom the diagnosis blamed (data), as sure as the records make it — never from its words.
    result = _cell({0: "dead", 1: "ok", 2: "error"}, root_cause="rank 0 died (aborted) inside all_gather #1 on dp (ranks 0,2), a shape "
                   "mismatch: … Root cause: rank 3, said in words that the line must not read.",
                   blamed=Blame((2,), Certainty.CERTAIN))
    result[0].returncode, result[2].error = -6, {"ename": "RuntimeError", "evalue": "Connection reset by peer", "traceback": ""}
    assert str(CellFailed.of(result)) == "cell 7 failed: rank 0 died: aborted (SIGABRT); rank 2 raised RuntimeError — root cause: rank 2"
    result.blamed = Blame((1, 2), Certainty.LIKELY)
    assert str(CellFailed.of(result)).endswith(" — root cause: likely ranks 1,2")
    result.blamed = None
    assert "root cause" not in str(CellFailed.of(result))
    # No rank raised or died.
    assert str(CellFailed.of(_cell({0: "interrupted", 1: "interrupted"}))) == "cell 7 was interrupted on ranks 0,1"
    assert str(CellFailed.of(_cell({0: "ok", 1: "running"}, timed_out=True, elapsed=4.04))) == "cell 7 timed out: rank 1 still running after 4.0 s"
    assert str(CellFailed.of(_cell({0: "running"}, detached=True))) == "cell 7: stopped waiting after a second interrupt; rank 0 still running"
    assert str(CellFailed.of(_cell({0: "stranded", 1: "ok"}))) == "cell 7 failed: rank 0 stranded, waiting for a rank that died"
    # A long message is cut to a line; many ranks are named compactly.
    result = _cell({r: "error" for r in range(64)})
    for r in range(64):
        result[r].error = {"ename": "OSError", "evalue": "x" * 500, "traceback": ""}
    line = str(CellFailed.of(result))
    assert line.startswith("cell 7 failed on ranks 0-63: OSError: xxx") and line.endswith("…") and len(line) < 200
