"""A failure's signature, said and compared (what %dist_export's verification reports)."""

from __future__ import annotations

import pytest

from distnb.analysis.verdicts.reproduction import DIED, FailureSignature, compare_failures, last_exception


@pytest.mark.parametrize(
    ("errors", "hung", "text"),
    [
        ({0: DIED}, [], "rank 0 died"),
        ({0: DIED, 2: DIED}, [], "ranks 0,2 died"),
        ({1: "ValueError: bad batch"}, [], "rank 1 raised ValueError: bad batch"),
        ({0: DIED, 1: "KeyError: 'x'"}, [2, 3], "rank 0 died; rank 1 raised KeyError: 'x'; ranks 2,3 never finished (a hang)"),
        ({}, [0, 1, 2, 3], "ranks 0-3 never finished (a hang)"),
        ({}, [], "no failure"),
    ],
)
def test_a_signature_says_deaths_errors_and_hangs_apart(errors: dict[int, str], hung: list[int], text: str) -> None:
    assert FailureSignature.of(errors, hung).text() == text
    assert "raised died" not in FailureSignature.of(errors, hung).text()


def test_consequences_and_later_lines_are_left_out() -> None:
    sig = FailureSignature.of({0: "ValueError: bad\n  more detail", 1: "DistBackendError: Connection closed by peer"})
    assert sig.errors == {0: "ValueError: bad"}, sig


def test_two_failures_match_only_when_the_same_ranks_fail_the_same_way() -> None:
    session = FailureSignature.of({0: DIED}, [])
    assert compare_failures(session, FailureSignature.of({0: DIED}, [])) == ""
    assert compare_failures(session, FailureSignature.of({}, [0])) == ("rank 0: died in the session, no error of its own in the script; "
                                                                       "hung: none in the session, rank 0 in the script")


def test_the_last_exception_of_a_ranks_output() -> None:
    log = "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\", line 3\n[rank1]: torch.OutOfMemoryError: no room\n"
    assert last_exception(log) == "OutOfMemoryError: no room"
    assert last_exception("just output\n") is None


def test_an_export_says_it_runs_the_script_and_how_to_skip_that_before_it_does(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from distnb.config import LaunchConfig
    from distnb.controller.session import SessionLog
    from distnb.results import CellResult, RankResult
    from distnb.services.cases import export
    from distnb.services.cases.verify import Reproduction

    log = SessionLog()
    cell = CellResult(cell=log.next_cell(), code="raise ValueError('bad')", ranks=[0, 1], results={0: RankResult(0), 1: RankResult(1)})
    log.add_cell(cell)
    cell.results[0].status = "ok"
    cell.results[1].status, cell.results[1].error = "error", {"ename": "ValueError", "evalue": "bad"}
    heard: list[str] = []
    ran: list[float] = []

    def verify(path, config, session, timeout):  # the run itself is tests/services/test_export.py's
        assert heard, "the check ran before the user was told"
        ran.append(timeout)
        return Reproduction(True, True, session, session, 1.0)

    monkeypatch.setattr(export, "verify_script", verify)
    done = export.export_session(log, str(tmp_path / "repro.py"), LaunchConfig(nproc=2, backend="gloo"), verify=30.0,
                                 say=heard.append)
    assert ran == [30.0] and done.verified is not None and done.verified.reproduced
    assert len(heard) == 1 and "at most 30 s" in heard[0] and "--no-verify skips this" in heard[0], heard
    heard.clear()
    export.export_session(log, str(tmp_path / "repro.py"), LaunchConfig(nproc=2, backend="gloo"), verify=None, say=heard.append)
    assert heard == [] and ran == [30.0]  # not checked: nothing said, nothing run


def _run_logs(tmp_path, stderr: dict[int, str]):
    for rank, text in stderr.items():
        d = tmp_path / "logs" / "run" / "attempt_0" / str(rank)
        d.mkdir(parents=True)
        (d / "stderr.log").write_text(text)
    return tmp_path / "logs"


def _raised(line: str) -> str:
    return f"Traceback (most recent call last):\n  File \"repro.py\", line 9, in <module>\n{line}\n"


@pytest.mark.parametrize(
    ("stderr", "finished", "torchrun_out", "expected"),
    [
        # The hung rank's collective timed out (gloo's words); the rank that finished waited.
        ({1: _raised("RuntimeError: [gloo/unbound_buffer.cc:129] Timed out waiting 30000ms for send operation to complete")},
         {0}, "", FailureSignature({}, (1,))),
        # NCCL's watchdog on one rank; the other, stuck too, was stopped by torchrun (SIGTERM) before its own.
        ({2: _raised("torch.distributed.DistBackendError: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)")},
         {0, 1}, "", FailureSignature({}, (2, 3))),
        # A rank's own error ends the run: the ranks torchrun stopped are consequences, not hung.
        ({1: _raised("ValueError: bad batch")}, set(), "", FailureSignature({1: "ValueError: bad batch"}, ())),
        # A rank killed by a signal of its own died.
        ({}, {1}, "  rank      : 0 (local_rank: 0)\n  exitcode  : -11 (pid: 7)", FailureSignature({0: "died"}, ())),
    ],
)
def test_a_runs_signature_counts_timed_out_collectives_as_hangs(tmp_path, stderr, finished, torchrun_out, expected) -> None:
    from distnb.services.cases.verify import _signature

    world = 4 if 2 in stderr else 2
    assert _signature(_run_logs(tmp_path, stderr), torchrun_out, world, finished, ran_out=False) == expected
