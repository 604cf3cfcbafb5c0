"""doctor's tested range: a version is inside or outside by major.minor, and says which way."""

from __future__ import annotations

import pytest

from distnb.__main__ import doctor
from distnb.services.versions import TESTED, Installed, installed, untested


def test_a_version_outside_the_range_says_which_way_and_one_inside_says_nothing() -> None:
    low, high = TESTED["torch"]
    assert Installed("torch", f"{low}.0").outside is None and Installed("torch", f"{high}.3+cu132").outside is None
    older = Installed("torch", "2.10.1")
    newer = Installed("torch", "3.0.0")
    assert older.outside == f"older than {low}, the oldest CI tests"
    assert newer.outside == f"newer than {high}, the newest CI has run"
    assert Installed("torch", None).outside is None and Installed("not-tracked", "0.1").outside is None
    assert untested([older, newer, Installed("torch", f"{low}.2")]) == [older, newer]


@pytest.mark.slow  # it imports torch and asks CUDA
def test_doctor_names_every_distribution_and_warns_only_outside_the_range(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor() == 0
    out = capsys.readouterr().out
    for item in installed():
        assert item.name in out
    assert ("warning:" in out) == bool(untested())
