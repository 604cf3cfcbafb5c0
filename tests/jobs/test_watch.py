"""The watch's choice of what to act on, its verdict file, and its command line's mistakes."""

from __future__ import annotations

import json

import pytest

import distnb.jobs.watch as watch_module
from distnb.__main__ import main
from distnb.analysis.root_cause import RootCause
from distnb.analysis.verdicts.position import Place, Position
from distnb.analysis.verdicts.verdict import Kind, Site, Verdict, VerdictState
from distnb.errors import AttachError
from distnb.jobs.watch import PROVEN, JobWatch, acts_on, verdict_record


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


class _Proc:
    """A job's command that runs until the watch signals it."""

    args = ["torchrun"]
    pid = 12345

    def __init__(self) -> None:
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return None if not self.signals else -self.signals[0]

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


class _Job:
    """Answers each look from a script: a verdict, or an exception to raise."""

    def __init__(self, script: list[Verdict | Exception]) -> None:
        self.script, self.detached = script, 0

    def diagnose(self, hang_after: float) -> Verdict:
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(step, Exception):
            raise step
        return step

    def detach(self) -> None:
        self.detached += 1


def _watch(tmp_path, monkeypatch: pytest.MonkeyPatch, script: list[Verdict | Exception]) -> tuple[JobWatch, _Proc]:  # type: ignore[no-untyped-def]
    job = _Job(script)
    monkeypatch.setattr(JobWatch, "_job", lambda self: job)
    proc = _Proc()
    env = {"DISTNB_JOB_ID": "job-1", "DISTNB_RECORDS_DIR": str(tmp_path / "records")}
    watch = JobWatch(proc, env, on_hang="report", poll=0.001).start()  # type: ignore[arg-type]
    watch._thread.join(timeout=30)
    assert not watch._thread.is_alive()
    return watch, proc


def test_a_look_that_fails_is_one_look_not_the_end_of_the_watch(tmp_path, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    hang = Verdict(VerdictState.HANG, Kind.CALL_MISSING, "rank 2 did not make all_reduce", culprits=[2])
    healthy = Verdict(VerdictState.RUNNING, Kind.NONE, "ranks 0-3 running")
    watch, _ = _watch(tmp_path, monkeypatch, [healthy, ValueError("boom"), AttachError("rank 1 ended"), hang, hang])
    assert watch.verdict is hang
    err = capsys.readouterr().err
    # Said once, the unexpected error only: an attach error is what a rank ending gives.
    assert err.count("a look at the job failed") == 1 and "(ValueError: boom); still watching" in err, err
    assert "rank 2 did not make all_reduce" in err
    log = (tmp_path / "records" / "watch.log").read_text()
    assert "ranks 0-3 running" not in log  # a healthy job's readings are not kept
    assert "look failed (1 in a row): ValueError: boom" in log and "look failed (2 in a row): AttachError: rank 1 ended" in log
    assert log.count("hang call_missing culprits=[2] (proven: acted on if the next look reads the same)") == 1, log


def test_the_watch_stops_after_looks_fail_in_a_row(tmp_path, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(watch_module, "GIVE_UP_AFTER", 5)
    watch, proc = _watch(tmp_path, monkeypatch, [RuntimeError("no reply")])
    assert watch.verdict is None and proc.signals == []
    err = capsys.readouterr().err
    assert "stopped watching: 5 looks in a row failed, the last with RuntimeError: no reply" in err, err
    assert (tmp_path / "records" / "watch.log").read_text().count("look failed") == 5


def test_a_reading_where_a_rank_did_not_answer_does_not_part_two_readings_of_a_hang(tmp_path,  # type: ignore[no-untyped-def]
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    hang = Verdict(VerdictState.HANG, Kind.MISMATCH, "ranks are in different collectives", culprits=[2])
    silent = Verdict(VerdictState.HANG, Kind.UNRESPONSIVE, "rank 1 gives no stack", culprits=[1])
    healthy = Verdict(VerdictState.RUNNING, Kind.NONE, "ranks 0-3 running")
    script: list[Verdict | Exception] = [hang, silent, hang, silent]
    watch, _ = _watch(tmp_path, monkeypatch, script)
    assert watch.verdict is hang and script == [silent]  # acted at the second hang, past the silent reading
    # Any other reading between them parts them: the next hang is a first reading again.
    script = [hang, healthy, hang, hang, silent]
    watch, _ = _watch(tmp_path / "2", monkeypatch, script)
    assert watch.verdict is hang and script == [silent]  # acted at the third hang, not the second


def test_the_watch_log_keeps_problems_and_the_recovery_after_them(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    slow = Verdict(VerdictState.SLOW, Kind.SLOW_COLLECTIVE, "every rank in all_reduce", culprits=[])
    healthy = Verdict(VerdictState.RUNNING, Kind.NONE, "ranks 0-3 running")
    other = Verdict(VerdictState.RUNNING, Kind.NONE, "ranks 0-3 running, later")
    monkeypatch.setattr(watch_module, "GIVE_UP_AFTER", 1)
    _watch(tmp_path, monkeypatch, [healthy, other, slow, slow, healthy, other, slow, RuntimeError("end")])
    lines = [line.split(" s  ", 1)[1] for line in (tmp_path / "records" / "watch.log").read_text().splitlines()]
    assert lines == ["slow slow_collective culprits=[]: every rank in all_reduce", "running none culprits=[]: ranks 0-3 running",
                     "slow slow_collective culprits=[]: every rank in all_reduce", "look failed (1 in a row): RuntimeError: end"], lines
