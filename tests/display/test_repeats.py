"""A block a rank prints after other ranks printed it is one line in the live text view; every
fold's claim ("N lines: the same as ranks … printed above") is true, and nothing else is lost."""

from __future__ import annotations

import io
import random
import re
import traceback

from distnb._text import REPEAT_MIN_RUN as MIN_RUN
from distnb._text import Repeats, merge_lines
from distnb.display.text import LivePrinter
from distnb.ranks import format_ranks, parse_ranks

_LABEL = re.compile(r"^\[ranks? ([0-9,\-]+) stderr\] (.*)$")
_FOLD = re.compile(r"^\((\d+) lines: (?:the same as ranks? ([0-9,\-]+) printed above|repeated from above)\)$")


def _a_real_log() -> str:
    """A library's multi-line log, as a rank writes it: a real traceback (one per rank, the same)."""
    try:
        {}["key"]  # noqa: B018 - a real exception for its real traceback text
    except KeyError:
        return "".join(traceback.format_exc())
    raise AssertionError("unreachable")


def test_a_log_every_rank_writes_at_its_own_moment_is_shown_once() -> None:
    log = _a_real_log()
    err = io.StringIO()
    printer = LivePrinter(err=err, hold=0.0)
    printer.feed(0, "stderr", "rank 0 starts\n" + log)
    printer.flush()
    for rank in (1, 2, 3):  # each a flush later: seconds apart, as ranks' logs come
        printer.feed(rank, "stderr", log + f"rank {rank} goes on\n")
        printer.flush()
    printer.flush(final=True)
    shown = err.getvalue().splitlines()
    n = len(log.splitlines())
    assert shown[: n + 1] == [f"[rank 0 stderr] {line}" for line in ("rank 0 starts\n" + log).splitlines()], shown
    assert shown[n + 1:] == [line for rank in (1, 2, 3) for line in (
        f"[rank {rank} stderr] ({n} lines: the same as {format_ranks(range(rank))} printed above)",
        f"[rank {rank} stderr] rank {rank} goes on")], shown


def test_short_repeats_stay_as_they_are() -> None:
    repeats = Repeats()
    repeats.printed("stdout", 0, ["loss 0.5", "", "", "step 2"])
    # Two equal lines (and blank ones, which do not count) are not a block.
    assert repeats.fold("stdout", 1, ["loss 0.5", "", "", "step 2"]) == ["loss 0.5", "", "", "step 2"]
    assert repeats.fold("stdout", 0, ["loss 0.5", "step 2", "x"]) == ["loss 0.5", "step 2", "x"]  # its own two
    assert repeats.fold("stderr", 1, ["loss 0.5", "step 2", "loss 0.5"]) == ["loss 0.5", "step 2", "loss 0.5"]  # another stream


def test_every_fold_is_true_and_every_line_is_accounted_for() -> None:
    """Random outputs from a small vocabulary (so that runs repeat by chance as well as by copy, on
    other ranks and on the same one),
    random pieces and flushes: each rank's shown lines, folds expanded, are exactly what it wrote,
    and each fold's lines had been shown for every rank it names, before it."""
    rng = random.Random(11)
    vocab = [f"line {i}" for i in range(6)] + [""]
    folds = 0
    for trial in range(300):
        ranks = list(range(rng.randint(2, 4)))
        block = [rng.choice(vocab) for _ in range(rng.randint(0, 8))]
        written = {r: [rng.choice(vocab) for _ in range(rng.randint(0, 6))] + block + [rng.choice(vocab) for _ in range(rng.randint(0, 4))]
                   for r in ranks}
        err = io.StringIO()
        printer = LivePrinter(err=err, hold=0.0)
        queues = {r: [line + "\n" for line in written[r]] for r in ranks}
        while any(queues.values()):
            r = rng.choice([r for r in ranks if queues[r]])
            take = rng.randint(1, 3)
            printer.feed(r, "stderr", "".join(queues[r][:take]))
            del queues[r][:take]
            if rng.random() < 0.6:
                printer.flush()
        printer.flush(final=True)

        got: dict[int, list[str]] = {r: [] for r in ranks}
        for shown in err.getvalue().splitlines():
            label = _LABEL.match(shown)
            assert label, shown
            for r in parse_ranks(label.group(1), len(ranks)):
                fold = _FOLD.match(label.group(2))
                if fold is None:
                    got[r].append(label.group(2))
                    continue
                folds += 1
                n, by = int(fold.group(1)), parse_ranks(fold.group(2), len(ranks)) if fold.group(2) else [r]
                lines = written[r][len(got[r]): len(got[r]) + n]
                assert len(lines) == n and sum(1 for line in lines if line.strip()) >= MIN_RUN, (trial, shown)
                for other in by:  # every rank it names (this one too) had shown each line before it
                    assert all(line in got[other] for line in lines), (trial, shown, got)
                got[r].extend(lines)
        assert got == written, (trial, err.getvalue())
    assert folds > 30  # the test saw folds, not only lines


def test_a_finished_cells_output_shows_a_block_another_rank_printed_once() -> None:
    """Outputs of different lengths are shown whole, one group after another (the static view a
    kernel keeps): a later group's copy of a block is one line there too."""
    log = _a_real_log()
    outputs = [(0, "rank 0 alone\n" + log + "end\n"), (1, log + "end\n"), (2, log + "end\n"), (3, "x\ny\n")]
    rows = merge_lines(outputs)
    n = len(log.splitlines())
    assert rows[: n + 2] == [([0], "rank 0 alone"), *(([0], line) for line in log.splitlines()), ([0], "end")], rows
    assert rows[n + 2:] == [([1, 2], f"({n + 1} lines: the same as rank 0 printed above)"), ([3], "x"), ([3], "y")], rows


def test_a_log_a_rank_prints_again_is_shown_once() -> None:
    """A library that logs the same block each time (a recompile, a retry): the rank's second copy
    is one line, whether it came in the same piece of output as the first or later."""
    log = _a_real_log()
    n = len(log.splitlines())
    for pieces in ([log + "between\n" + log], [log + "between\n", log]):
        err = io.StringIO()
        printer = LivePrinter(err=err, hold=0.0)
        for piece in pieces:
            printer.feed(2, "stderr", piece)
            printer.flush()
        printer.flush(final=True)
        shown = err.getvalue().splitlines()
        assert shown == [f"[rank 2 stderr] {line}" for line in log.splitlines()] + [
            "[rank 2 stderr] between", f"[rank 2 stderr] ({n} lines: repeated from above)"], shown
    # One line printed again and again is not a block: it stays as it was printed.
    printer = LivePrinter(out=(out := io.StringIO()), hold=0.0)
    printer.feed(0, "stdout", "waiting\n" * 6)
    printer.flush(final=True)
    assert out.getvalue().splitlines() == ["[rank 0] waiting"] * 6
    rows = merge_lines([(0, log + log), (1, "x\n")])
    assert rows == [*(([0], line) for line in log.splitlines()), ([0], f"({n} lines: repeated from above)"), ([1], "x")], rows
