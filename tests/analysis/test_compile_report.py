"""What %dist_compile says when ranks compiled alike: "the same" only where the graphs' collectives
were recorded and agree; counts alone are said as counts, with how to record the rest."""

from __future__ import annotations

from distnb.analysis.reports.compiles import CompileReport


def _compile(collectives: list[str] | None = None) -> dict:
    event = {"name": "step", "file": "<cell-3>", "line": 1, "seconds": 0.5}
    if collectives is not None:
        event["collectives"] = collectives
    return event


def test_alike_counts_without_graphs_are_not_called_the_same() -> None:
    report = CompileReport({r: [_compile()] for r in range(4)}, {}, [3])
    assert report.summary() == ("torch.compile compiled the same frames as often on ranks 0-3 (cell 3); what their graphs issue "
                                "was not recorded (run the cell with --paths to compare the graphs' collectives).")
    assert report.odd_ranks() == []


def test_graphs_recorded_alike_are_the_same_and_one_apart_is_named() -> None:
    same = CompileReport({r: [_compile(["all_reduce"])] for r in range(4)}, {}, [3])
    assert same.summary().startswith("torch.compile did the same on ranks 0-3 (cell 3): the same frames as often, graphs with the same")
    apart = CompileReport({r: [_compile(["all_reduce", "all_reduce"] if r == 2 else ["all_reduce"])] for r in range(4)}, {}, [3])
    assert "the graphs of `step` (cell 3 line 1) hold other collectives: ranks 0,1,3: all_reduce ×1; rank 2: all_reduce ×2" \
        in apart.summary(), apart.summary()
    assert apart.odd_ranks() == [2]
