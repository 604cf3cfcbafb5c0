"""Issue 28, the first differing decision: the rank side's recorder (worker/recorders/paths.py) run here on
cells compiled as the notebook's (``<cell-N>``), each "rank" with its own data, and the
controller's comparison (analysis/paths.py) of what they recorded. The same on real ranks is in
tests/e2e/test_paths_e2e.py."""

from __future__ import annotations

import math
from typing import Any

from distnb.analysis.verdicts.paths import first_difference, rank_condition
from distnb.worker.recorders.paths import PathRecorder

GUARD = """\
def train(losses):
    done = 0
    for step in range(12):
        loss = losses[step]
        if not math.isfinite(loss):
            break
        done += 1
    return done
"""


def run_ranks(cells: dict[int, str], call: str, world: int, per_rank: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any] | None]:
    """Run the cells (earlier ones define functions) on ``world`` simulated ranks, recording the
    last one's paths: each rank in its own namespace, with ``rank`` and its own data."""
    out = {}
    last = max(cells)
    for rank in range(world):
        ns: dict[str, Any] = {"math": math, "rank": rank, **per_rank.get(rank, {})}
        for n in sorted(cells):
            if n != last:
                exec(compile(cells[n], f"<cell-{n}>", "exec"), ns)
        recorder = PathRecorder("<cell-")
        code = compile(cells[last], f"<cell-{last}>", "exec")
        recorder.start([code])
        try:
            exec(code, ns)
        finally:
            out[rank] = recorder.stop()
    return out


def test_a_guard_that_breaks_out_on_one_rank_is_the_first_differing_decision() -> None:
    data = {r: {"losses": [2.0] * 12} for r in range(4)}
    data[2]["losses"][6] = float("nan")
    cells = {1: GUARD, 2: "n = train(losses)"}
    diff = first_difference(run_ranks(cells, "", 4, data), cells)
    assert diff is not None and diff.odd == [2] and diff.cell == 1 and diff.decided == 5
    assert diff.text() == "rank 2 took line 6 (`break`, under `if not math.isfinite(loss):`) at iteration 7 of 12; ranks 0,1,3 never did"
    assert diff.summary().startswith("the first decision that differed, at cell 1 line 5: rank 2 took line 6")


def test_a_swallowed_exception_on_one_rank_is_named() -> None:
    cells = {1: "def risky(x):\n    if x < 0:\n        raise RuntimeError('negative')\n    return x\n",
             2: "total = 0\nfor v in values:\n    try:\n        total += risky(v)\n    except RuntimeError:\n        pass\n"}
    data = {r: {"values": [1, 2, 3]} for r in range(4)}
    data[1]["values"] = [1, -2, 3]
    diff = first_difference(run_ranks(cells, "", 4, data), cells)
    assert diff is not None and diff.odd == [1], diff and diff.text()
    assert diff.cell == 1 and diff.decided == 2
    assert "rank 1 took line 3 (`raise RuntimeError('negative')`, under `if x < 0:`) at iteration 2 of 3" in diff.text()


def test_a_data_dependent_loop_bound_says_each_side_s_trip_count() -> None:
    cells = {1: "seen = 0\nfor b in range(n_batches):\n    seen += b\nseen\n"}
    data = {r: {"n_batches": 12} for r in range(4)}
    data[1]["n_batches"] = 7
    diff = first_difference(run_ranks(cells, "", 4, data), cells)
    assert diff is not None and diff.odd == [1]
    assert diff.text() == "rank 1 left the loop `for b in range(n_batches):` after 7 iterations; ranks 0,2,3 after 12", diff.text()


def test_rank_targeting_is_recognised_and_can_stay_quiet() -> None:
    cells = {1: "if rank == 0:\n    msg = 'hello'\nelse:\n    msg = 'hi'\nx = 1\n"}
    paths = run_ranks(cells, "", 4, {})
    diff = first_difference(paths, cells)
    assert diff is not None and diff.expected and diff.odd == [0]
    assert first_difference(paths, cells, quiet_expected=True) is None
    assert rank_condition("if dist.get_rank() == 0:") and rank_condition("elif is_main_process:")
    assert rank_condition("if int(os.environ['LOCAL_RANK']) == 0:") and not rank_condition("if loss > 3:")


def test_ranks_that_decided_alike_have_no_difference() -> None:
    cells = {1: GUARD, 2: "n = train(losses)"}
    paths = run_ranks(cells, "", 3, {r: {"losses": [1.0] * 12} for r in range(3)})
    assert first_difference(paths, cells) is None
    assert paths[0] is not None and paths[0]["transitions"] and not paths[0]["full"]


def test_recording_steps_aside_for_a_debugger_s_tracer_or_runs_beside_it() -> None:
    import sys

    from distnb.worker.recorders.paths import MONITORING

    recorder = PathRecorder("<cell-")
    previous = sys.gettrace()
    sys.settrace(lambda *a: None)
    code = compile("x = 0\nfor i in range(3):\n    x += i\n", "<cell-1>", "exec")
    try:
        recorder.start([code])
        exec(code, {})
        record = recorder.stop()
    finally:
        sys.settrace(previous)
    if MONITORING:
        # 3.12+: sys.monitoring and a debugger's sys.settrace run side by side.
        assert record is not None and record.get("transitions"), record
    else:
        assert record == {"skipped": "another tracer (a debugger or coverage) was active"}


def test_a_rank_inside_torch_compile_keeps_the_others_waiting_and_is_called_slow() -> None:
    from distnb.analysis.verdicts.diagnose import diagnose
    from distnb.analysis.verdicts.position import Position, position_from_stack
    from distnb.analysis.verdicts.stacks import Frame, RankStack, ThreadStack

    frames = [Frame("<cell-4>", 3, "<module>", "loss = step(x)"), Frame("<cell-2>", 5, "step", "return compiled(x)"),
              Frame("/site-packages/torch/_dynamo/eval_frame.py", 900, "_fn", "return fn(*args)"),
              Frame("/site-packages/torch/_dynamo/convert_frame.py", 1200, "_compile", "out = transform()")]
    pos = position_from_stack(RankStack(1, "running cell 4", "control thread", [ThreadStack("MainThread", True, frames)]), 4)
    assert pos.state == "computing" and pos.detail == "compiling `step` with torch.compile"
    waiting = [Position(r, "collective", op="all_reduce", seq=3, group="0", since=5.0) for r in (0, 2, 3)]
    d = diagnose([*waiting, pos], 3.0, 10.0)
    assert d.state == "slow" and d.culprits == [1], d.text()
    assert "rank 1 is compiling `step` with torch.compile: slow, not a hang yet" in d.summary


def test_a_thousand_ranks_leaving_a_loop_each_at_its_own_count_read_in_a_few_words() -> None:
    cells = {1: "seen = 0\nfor b in range(n_batches):\n    seen += b\nseen\n"}
    paths = run_ranks(cells, "", 64, {r: {"n_batches": 10 if r < 40 else r} for r in range(64)})
    diff = first_difference(paths, cells)
    assert diff is not None and diff.text().count(";") <= 5, diff.text()
    assert "more ranks in" in diff.text() and "ranks 0-39 after 10" in diff.text(), diff.text()
