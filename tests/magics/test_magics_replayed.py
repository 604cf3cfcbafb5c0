"""The IPython magics' arguments, words and views in a real IPython shell, over ranks replayed from a
recording of a real 2-rank gloo pool (``tests/fake_ranks.py``; ``tests/record_streams.py`` records
``magics_two_ranks``): no process is started. What needs live ranks (timeouts, interrupts, pushes,
restarts) is in ``test_magics.py``, over a real pool."""

from __future__ import annotations

import importlib
from typing import Iterator

import pytest
from fake_ranks import FakeRanks, Stream
from IPython.core.error import UsageError
from magic_shell import Shell

import distnb
from distnb.jobs import pools

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def fakes() -> list[FakeRanks]:
    return []


@pytest.fixture(scope="module")
def sh(fakes: list[FakeRanks]) -> Iterator[Shell]:
    stream = Stream.load("magics_two_ranks")

    def replayed(config: object) -> FakeRanks:
        fakes.append(FakeRanks(stream))
        return fakes[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(importlib.import_module("distnb.pool"), "TorchrunRanks", replayed)
        shell = Shell()
        with shell.launched("-n 2 --backend gloo"):
            yield shell
    assert [f.unrecorded for f in fakes] == [[]] and [f.errors for f in fakes] == [[]], "the replay was asked what it never recorded"


def test_magics_document_themselves(sh: Shell) -> None:
    magics = sh.ip.magics_manager.magics
    for name in ("dist_launch", "dist_status", "dist_stacks", "dist_push", "dist_pull", "dist_restart",
                 "dist_shutdown", "dist_env", "dist_memory", "dist_collectives", "dist_export", "dist_wait", "dist_interrupt"):
        assert name in magics["line"], name
    assert "on_ranks" in magics["cell"]
    doc = magics["line"]["dist_launch"].__doc__
    assert "--nproc" in doc and "--pg-timeout" in doc and "--env" in doc and "--debug" in doc
    # What `%dist_launch?` shows: the usage line, the docstring and every option's help.
    info = sh.ip.object_inspect("%dist_launch")
    assert info["found"] and "Start a persistent torchrun pool" in info["docstring"]
    assert "--nproc NPROC" in info["docstring"] and "Ranks per machine" in info["docstring"]
    assert "--nnodes K" in info["docstring"] and "--hosts H1,H2" in info["docstring"] and "--curve" in info["docstring"]
    help_text = sh.ip.find_line_magic("dist_launch").parser.format_help()
    assert "-n NPROC, --nproc NPROC, --nproc-per-node NPROC" in help_text and "--start-timeout" in help_text and "--hang-after" in help_text
    # %dist_launch? documents the NCCL watchdog settings distnb chooses, and --share-gpus.
    assert "--share-gpus" in help_text and "TORCH_NCCL_ASYNC_ERROR_HANDLING=2" in help_text and "TORCH_FR_DUMP_TEMP_FILE" in help_text
    on_ranks_help = sh.ip.find_cell_magic("on_ranks").parser.format_help()
    assert all(flag in on_ranks_help for flag in ("--timeout", "--quiet", "ranks"))
    for kind in ("line", "cell"):
        for name, fn in magics[kind].items():
            if getattr(fn, "__self__", None).__class__.__name__ in ("DistMagics", "InspectMagics"):
                assert (fn.__doc__ or "").strip(), f"%{name} has no docstring"


def test_launch_twice_and_bad_flags_are_usage_errors(sh: Shell) -> None:
    with pytest.raises(UsageError, match="dist_restart"):
        sh.line("dist_launch", "-n 2")
    with pytest.raises(UsageError, match=r"unrecognized arguments: --bogus\. Run %dist_status\? for its flags\."):
        sh.line("dist_status", "--bogus")
    with pytest.raises(UsageError, match="unrecognized arguments: --bogus"):
        sh.line("dist_launch", "-n 2 --bogus")
    with pytest.raises(UsageError, match="invalid int value"):
        sh.line("dist_launch", "-n two")
    with pytest.raises(UsageError, match="invalid choice"):
        sh.line("dist_launch", "--backend mpi")
    with pytest.raises(UsageError, match=r"unrecognized arguments: --bogus\. Run %%on_ranks\? for its flags\."):
        sh.cell("--bogus", "1")
    with pytest.raises(UsageError):
        sh.cell("--timeout", "1")


def test_all_reduce_value_and_grouped_output(sh: Shell) -> None:
    out, err = sh.cell("", "print('hello')\nx = torch.full((2,), float(rank)); dist.all_reduce(x); x")
    assert out.count("[ranks 0,1] hello") == 1
    assert "Out[ranks 0,1]: tensor([1., 1.])" in out
    assert sh.ip.user_ns["_dist"].ok


def test_rank_specs_with_spaces_and_a_trailing_semicolon(sh: Shell) -> None:
    out, _ = sh.cell("0 1", "rank")  # two words: both ranks, not "01"
    assert "Out[rank 0]: 0" in out and "Out[rank 1]: 1" in out
    out, _ = sh.cell("0, 1", "rank * 10")
    assert "Out[rank 1]: 10" in out
    out, _ = sh.cell("", "semi = 5\nsemi;  # IPython's rule: no value shown")
    assert "Out[" not in out and sh.ip.user_ns["_dist"].ok


def test_launch_errors_name_the_flags(sh: Shell) -> None:
    from IPython.core.error import UsageError as UE

    pool = pools.current_or_none()
    pools.set_current(None)  # let the flag checks run; nothing is launched
    try:
        with pytest.raises(UE, match="^-n/--nproc must be"):
            sh.line("dist_launch", "-n 0")
        with pytest.raises(UE, match="^--pg-timeout must be"):
            sh.line("dist_launch", "--pg-timeout 0")
    finally:
        pools.set_current(pool)


def test_rank_list_with_spaces(sh: Shell) -> None:
    out, _ = sh.cell("0, 1", "rank")
    assert "Out[rank 0]: 0" in out and "Out[rank 1]: 1" in out


def test_subset_and_per_rank_lines(sh: Shell) -> None:
    out, _ = sh.cell("1", "print('only', rank)")
    assert "[rank 1] only 1" in out and "rank 0" not in out
    res = sh.ip.user_ns["_dist"]
    assert res.ranks == [1] and list(res.results) == [1] and res.ok


def test_errors_grouped_with_cell_line(sh: Shell) -> None:
    out, err, failed = sh.failing("on_ranks", "", "if rank == 1:\n    raise KeyError('missing shard')")
    assert "── KeyError on rank 1 at cell line 2 ──" in err
    assert "raise KeyError('missing shard')" in err and "distnb/" not in err
    # The report first, then one error that stops Run All: the result it carries is _dist.
    res = sh.ip.user_ns["_dist"]
    # Named by the notebook's In[n], in the one line and in the traceback's frame, never distnb's own count.
    assert res.label is not None and f'File "In[{res.label}]", line 2' in err and "<cell-" not in err, err
    assert failed.result is res and str(failed) == f"In[{res.label}] failed on rank 1: KeyError: 'missing shard'"
    assert failed._render_traceback_() == [f"CellFailed: {failed}"]


def test_keep_going_shows_the_report_and_raises_nothing(sh: Shell, monkeypatch: pytest.MonkeyPatch) -> None:
    out, err = sh.cell("--keep-going", "1/0 if rank == 0 else None")
    assert "ZeroDivisionError on rank 0" in err and sh.ip.user_ns["_dist"].failed == [0]
    monkeypatch.setenv("DISTNB_KEEP_GOING", "1")  # the session's setting (%env DISTNB_KEEP_GOING=1)
    out, err = sh.cell("", "1/0 if rank == 1 else None")
    assert "ZeroDivisionError on rank 1" in err


def test_syntax_error_is_reported_once_and_nothing_sent(sh: Shell) -> None:
    before = len(distnb.current_pool().history)
    out, err, failed = sh.failing("on_ranks", "", "x = (1,\n")
    assert err.count("SyntaxError") == 1 and "nothing was sent" in err
    assert len(distnb.current_pool().history) == before
    assert failed.result is None and str(failed).startswith("the cell was not run: SyntaxError at cell line 1: "), failed


@pytest.mark.parametrize("spec, hint", [("9", "out of range"), ("-1", "out of range"), ("3-1", "backwards"), ("a", "can't read")])
def test_bad_rank_specs(sh: Shell, spec: str, hint: str) -> None:
    with pytest.raises(UsageError, match=hint):
        sh.cell(spec, "1")


def test_quiet_hides_output_but_not_errors(sh: Shell) -> None:
    out, err, failed = sh.failing("on_ranks", "--quiet", "print('noise')\n1/0 if rank == 0 else None")
    assert "noise" not in out and "ZeroDivisionError on rank 0" in err
    assert "failed on rank 0: ZeroDivisionError: division by zero" in str(failed)


def test_status_stacks_env_memory_collectives(sh: Shell) -> None:
    _, out, _ = sh.line("dist_status")
    assert "pool ready: 2 ranks, backend gloo" in out and out.count(" idle") == 2
    rows = [line.split() for line in out.splitlines()[1:]]
    assert rows[0] == ["rank", "pid", "host", "device", "state"]
    for rank in distnb.current_pool().status().ranks:  # one row per rank: its pid, and idle
        assert rank.pid and [str(rank.rank), str(rank.pid)] in [row[:2] for row in rows[1:]], out
        assert next(row for row in rows[1:] if row[0] == str(rank.rank))[-1] == "idle", out
    stacks, _, _ = sh.line("dist_stacks")
    assert "(idle: waiting for a cell)" in stacks.text()
    env, _, _ = sh.line("dist_env")
    assert "RANK" in env.text() and "per rank, as expected" in env.text()
    _, out, _ = sh.line("dist_memory")
    assert "memory of ranks 0,1" in out
    sh.cell("", "x = torch.ones(3); dist.all_reduce(x)")
    report, _, _ = sh.line("dist_collectives", "--last 2")
    assert "agree" in report.text() and "all_reduce [3] f32" in report.text()


def test_the_replayed_ranks_answered_everything(sh: Shell, fakes: list[FakeRanks]) -> None:
    """Runs last in this module: every cell and request the tests sent had a recorded answer."""
    assert fakes and all(not f.unrecorded and not f.errors for f in fakes), [(f.unrecorded, f.errors) for f in fakes]
