"""What CI's time went to, printed last so that the end of the log says it: each phase's start
(the "=== [ci …]" lines, collected by .ci/run) and, from each pytest run's JUnit report, the files
and the tests that took longest; then every failed test of every leg with the end of its message
(a leg's own log sits in the middle of a long run's output, where it is the first part cut).
Standard library only: it runs under whichever Python is left."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

FILES, TESTS = 15, 10
#: Of each failure's message, the end (where pytest puts the assertion and its values).
FAILURE_CHARS = 2500


def read_cases(junits: list[Path]) -> tuple[list[ET.Element], list[str]]:
    """The test cases of one pytest run's reports (a leg's runs of a file each, ``NAME--NN.xml``,
    as one), and a line for each report that could not be read."""
    cases: list[ET.Element] = []
    unreadable = []
    for junit in junits:
        try:
            cases += list(ET.parse(junit).getroot().iter("testcase"))
        except (OSError, ET.ParseError) as exc:
            unreadable.append(f"{junit.name}: unreadable ({exc})")
    return cases, unreadable


def report(name: str, cases: list[ET.Element]) -> list[str]:
    """One pytest run's timings: its longest files and tests."""
    by_file: dict[str, float] = defaultdict(float)
    tests: list[tuple[float, str]] = []
    for case in cases:
        seconds = float(case.get("time") or 0)
        file = (case.get("classname") or "").replace(".", "/") + ".py"
        by_file[file] += seconds
        tests.append((seconds, f"{file}::{case.get('name')}"))
    total = sum(by_file.values())
    lines = [f"{name}: {len(tests)} tests, {total / 60:.1f} min in tests; the longest files:"]
    lines += [f"  {s:7.1f} s  {f}" for f, s in sorted(by_file.items(), key=lambda kv: -kv[1])[:FILES]]
    lines.append("  the longest tests:")
    lines += [f"  {s:7.1f} s  {t}" for s, t in sorted(tests, reverse=True)[:TESTS]]
    return lines


def failures(name: str, cases: list[ET.Element]) -> list[str]:
    """Each failed or erred test of one pytest run, with the end of what pytest said about it."""
    lines = []
    for case in cases:
        for bad in (*case.findall("failure"), *case.findall("error")):
            text = (bad.text or bad.get("message") or "").rstrip()
            cut = "[…]\n" if len(text) > FAILURE_CHARS else ""
            lines.append(f"--- {name}: {case.get('classname')}::{case.get('name')} ({bad.tag})")
            lines.append(cut + text[-FAILURE_CHARS:])
    return lines


def main(work: Path) -> None:
    print("=== where CI's time went")
    phases = work / "phases.log"
    if phases.exists():
        print(phases.read_text().rstrip())
    runs: dict[str, list[Path]] = defaultdict(list)
    for junit in sorted(work.glob("junit-*.xml")):
        runs[junit.stem.split("--")[0]].append(junit)
    failed = []
    for name, junits in runs.items():
        cases, unreadable = read_cases(junits)
        # An unreadable report (a run cut short) makes the timings partial: said instead of them.
        print("\n".join(unreadable or report(name, cases)))
        failed += failures(name, cases)
    if failed:
        print("=== the failures, every leg's")
        print("\n".join(failed))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
