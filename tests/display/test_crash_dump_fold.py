"""A rank killed by a signal streams Python's crash dump just before its death report says it, cut
to the cell's frames: the live text view folds the streamed dump to its first line, however the
dump's bytes arrive, and keeps every other line."""

from __future__ import annotations

import io
import random
import subprocess
import sys

from distnb.analysis.verdicts.failures import fold_crash_dump
from distnb.display.text import LivePrinter

# A real dump, written by a real interpreter that dies of SIGSEGV with a second thread alive.
CRASH = """
import ctypes, sys, threading, time
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
print('before the crash', file=sys.stderr, flush=True)
def in_the_cell():
    ctypes.string_at(0)
in_the_cell()
"""


def _real_dump() -> str:
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", CRASH], capture_output=True, text=True, timeout=60)
    assert proc.returncode < 0, proc  # killed by the signal
    assert "Fatal Python error: Segmentation fault" in proc.stderr and proc.stderr.count('  File "') >= 3, proc.stderr
    return proc.stderr


def test_a_streamed_crash_dump_is_one_line_however_it_arrives() -> None:
    dump = _real_dump()
    rng = random.Random(7)
    for trial in range(40):
        err = io.StringIO()
        printer = LivePrinter(err=err, hold=0.0)
        # Rank 1 dies; rank 0 keeps writing; each rank's bytes arrive in random pieces, flushed between.
        texts = {1: "rank 1 was here\n" + dump + "after the dump\n", 0: "rank 0 line\n" * 5}
        pieces = []
        for rank, text in texts.items():
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
            pieces.append([(rank, a) for a in (text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)]))])
        while any(pieces):
            rank, piece = rng.choice([p for p in pieces if p]).pop(0)
            printer.feed(rank, "stderr", piece)
            if rng.random() < 0.5:
                printer.flush()
        printer.flush(final=True)
        shown = err.getvalue().splitlines()
        one = [line for line in shown if line.startswith("[rank 1 stderr]")]
        assert one == ["[rank 1 stderr] rank 1 was here", "[rank 1 stderr] before the crash",
                       "[rank 1 stderr] Fatal Python error: Segmentation fault (Python's crash dump, folded here: the whole "
                       "of it is in _dist[1].stderr)",
                       "[rank 1 stderr] after the dump"], (trial, shown)
        assert sum("rank 0 line" in line for line in shown) == 5, shown


def test_the_whole_text_folds_the_same_way() -> None:
    dump = _real_dump()
    folded = fold_crash_dump("kept\n" + dump + "also kept", 3)
    assert folded.splitlines() == ["kept", "before the crash", "Fatal Python error: Segmentation fault (Python's crash dump, "
                                   "folded here: the whole of it is in _dist[3].stderr)", "also kept"], folded
    # Text without a dump is returned as it was, and so are lines like a dump's outside one.
    plain = '  File "x.py", line 1\nThread 0x00007f (most recent call first):\n'
    assert fold_crash_dump(plain, 0) == plain
