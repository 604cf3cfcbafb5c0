"""The watch's choice of what to act on, its verdict file, and its command line's mistakes."""

from __future__ import annotations

import json

import pytest

from distnb.__main__ import main
from distnb.analysis.root_cause import RootCause
from distnb.analysis.verdicts.position import Place, Position
from distnb.analysis.verdicts.verdict import Kind, Site, Verdict, VerdictState
from distnb.jobs.watch import PROVEN, acts_on, verdict_record


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("state", list(VerdictState))
def test_only_a_proven_kind_that_hangs_or_failed_is_acted_on(kind: Kind, state: VerdictState) -> None:
    verdict = Verdict(state, kind, "x")
    assert acts_on(verdict) is (kind in PROVEN and state in (VerdictState.HANG, VerdictState.FAILED))


def test_what_waiting_can_mend_is_never_proven() -> None:
    assert not PROVEN & {Kind.SLOW_COLLECTIVE, Kind.STILL_RUNNING, Kind.COMPILING, Kind.IMPORTING, Kind.STRAGGLER, Kind.UNRESPONSIVE,
                         Kind.UNKNOWN, Kind.PAUSED, Kind.NONE}


def test_the_verdict_file_holds_its_fields() -> None:
    verdict = Verdict(VerdictState.HANG, Kind.CALL_MISSING, "rank 2 did not make all_reduce", culprits=[2], victims=[0, 1],
                      sites=[Site(None, 10, "<module>", "dist.all_reduce(t)", "the call")],
                      positions=[Position(0, Place.COLLECTIVE, op="all_reduce", line=10)])
    verdict.root = RootCause.of([2])
    data = json.loads(json.dumps(verdict_record(verdict)))
    assert data["kind"] == "call_missing" and data["culprits"] == [2] and data["sites"][0]["line"] == 10
    assert data["positions"][0]["state"] == "collective" and data["certainty"] == "likely"
    # The root cause as data beside the words the notebook shows for it.
    assert data["root"] == {"ranks": [2], "names": "ranks", "likely": False, "how": "", "note": "", "then": ""}, data["root"]
    assert data["summary"] == "rank 2 did not make all_reduce Root cause: rank 2." and data["text"].startswith("[distnb] " + data["summary"])


@pytest.mark.parametrize(("argv", "said"), [
    (["run", "--on-hang", "stop", "--", "true"], "--on-hang and --hang-after go with --watch"),
    (["run", "--watch", "--hang-after", "0", "--", "true"], "--hang-after takes a positive number"),
    (["run", "--watch", "--on-hang", "kill", "--", "true"], "invalid choice: 'kill'"),
])
def test_the_command_lines_mistakes_are_said(argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert said in capsys.readouterr().err
