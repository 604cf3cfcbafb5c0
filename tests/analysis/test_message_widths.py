"""Every verdict kind, and the views that show a collective, read whole at the widths they are cut
to: no label cut inside ("In[1" for In[15], "[256," for a shape), no seam where parts meet
("[256, 64].; ranks 0-2"). The rule cases of test_rules.py are rendered as written and stretched
with what real code brings: a long condition, a long error message with brackets, calls with
many arguments, notebook cell numbers in the thousands."""

from __future__ import annotations

import random
from typing import Any, Iterator

import pytest
import test_rules as rules
from words_lint import faults

from distnb import cell_names
from distnb._text import fit
from distnb.analysis.agreement.collective_table import COLUMN_MAX, PAGE_RANKS
from distnb.analysis.verdicts.failures import cut_message
from distnb.analysis.verdicts.position import Position
from distnb.errors import CellFailed
from distnb.results import CellResult, RankResult

_LABELS = ["In[15]", "In[1234]", "[256, 64]", "[2,3,4]", "(#18 on group 0)", "(ranks 0-3)", "`if rank == 0:`", "f(a, b)", "{'k': 1}"]
_WORDS = ["all_reduce", "rank", "2", "waits", "group_src=0", "f32", "a", "longer_word_than_most", "—", "on", "x" * 30]


def _texts(seed: int, n: int) -> Iterator[str]:
    rng = random.Random(seed)
    for _ in range(n):
        yield " ".join(rng.choice(_LABELS if rng.random() < 0.4 else _WORDS) for _ in range(rng.randint(1, 14)))


def _first_word(text: str) -> str:
    """Up to the first space outside brackets: a label with spaces inside is one word."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == " " and depth <= 0 and text[:i].count("`") % 2 == 0:
            return text[:i]
    return text


def test_a_text_fit_to_any_width_keeps_its_labels_whole() -> None:
    for text in _texts(7, 400):
        for width in range(1, 130, 3):
            out = fit(text, width)
            assert len(out) <= width, (text, width, out)
            if out == text:
                continue
            if len(_first_word(text)) + 2 > width:
                continue  # nothing whole fits: the one case cut inside a word (said by the ellipsis)
            kept = out.removesuffix(" …")
            assert kept != out and text.startswith(kept) and text[len(kept)] in " ,;:", (text, width, out)
            assert not faults(out), (text, width, out)


LONG_IF = ("if rank == 0 and batch['input_ids'].shape[0] > min(len(loader), cfg.max_steps) and (step % cfg.log_every == 0)"
           " and master_process:")
LONG_ERROR = ("Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! (when checking "
              "argument for argument mat1 in method wrapper_CUDA_addmm) [shapes (256, 64) and (64, [128])] " + "more " * 60)


def _stretch(mp: pytest.MonkeyPatch) -> None:
    """The rule cases stretched: the cell's `if` as long as real code's, every error a long
    message with brackets (cut as the pool cuts it), every call with many arguments, and the cell
    shown as In[12345]."""
    mp.setattr(rules, "SOURCE", rules.SOURCE.replace("if rank == 0:", LONG_IF))
    entry = rules.entry

    def long_entry(*a: Any, **kw: Any) -> dict[str, Any]:
        return entry(*a, **({"group_src": 0, "async_op": True, "tag": 12345} | kw))

    def long_position(rank: int, state: str, **kw: Any) -> Position:
        if kw.get("detail"):
            kw["detail"] = f"{kw['detail'].split(':', 1)[0]}: {cut_message(LONG_ERROR, 200)}"
        return Position(rank, state, **kw)

    mp.setattr(rules, "entry", long_entry)
    mp.setattr(rules, "Position", long_position)
    mp.setitem(cell_names._labels, rules.CELL, 12345)


@pytest.fixture(params=["as written", "stretched"])
def stretch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "stretched":
        _stretch(monkeypatch)
    return str(request.param)


@pytest.mark.parametrize("rule", list(rules.CASES))
def test_every_verdict_kind_reads_whole(rule: str, stretch: str) -> None:
    verdict = rules.CASES[rule][0]()
    for text in (verdict.text(), verdict.summary):
        assert not faults(text), (stretch, rule, faults(text))


def test_the_stretch_reaches_the_words_it_means_to() -> None:
    """The stretched cases above are only a test if the long parts reach the words: the long `if`
    cut at a word inside its backticks, the long error cut, and the cell's big In[n]."""
    with pytest.MonkeyPatch.context() as mp:
        _stretch(mp)
        agreement = rules.case_agreement().text()
        raised = rules.case_raised().text()
        table = rules.log_of({0: [rules.entry(0, 1)], 1: [rules.entry(0, 1)]}).report([0, 1]).text()
    assert "`if rank == 0 and batch['input_ids'].shape[0] >" in agreement and "… `" not in agreement, agreement
    assert "Expected all tensors to be on the same device" in raised and "…" in raised, raised
    assert "In[12345]" in table and "… In[12345]" in table, table


def _columns(seed: int) -> Iterator[tuple[dict[int, list[dict[str, Any]]], int]]:
    """Per-rank logs of a few collectives whose entries carry the arguments and shapes real calls
    have (long enough that the per-rank view must cut them), with cells numbered up to 99,999."""
    rng = random.Random(seed)
    ops = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single", "barrier"]
    for _ in range(60):
        ranks = rng.randint(2, PAGE_RANKS)
        cell = rng.choice([3, 15, 1234, 99999])
        per_rank: dict[int, list[dict[str, Any]]] = {}
        for r in range(ranks):
            entries = []
            for i in range(rng.randint(1, 4)):
                args = {k: v for k, v in [("group_src", 0), ("async_op", True), ("tag", rng.randint(0, 10**6)),
                                          ("op", rng.choice(["SUM", "MAX", "PREMUL_SUM"]))] if rng.random() < 0.6}
                e = rules.entry(i, i + 1, rng.choice(ops), size=rng.choice([4, 119104, 2**31]), done=rng.random() < 0.7, cell=cell)
                e["args"] = args
                e["sizes"] = [[rng.choice([256, 64, 119104])] * rng.randint(1, 3) for _ in range(rng.randint(1, 6))]
                entries.append(e)
            per_rank[r] = entries
        yield per_rank, cell


def test_the_per_rank_view_cuts_an_entry_before_its_cell_and_never_inside_a_label() -> None:
    cut = 0
    for per_rank, cell in _columns(11):
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(cell_names._labels, cell, cell)
            text = rules.log_of(per_rank).report(sorted(per_rank)).text()
        assert not faults(text), faults(text)
        lines = text.splitlines()
        header = next(line for line in lines if line.startswith("    #  rank 0"))
        starts = [header.index(f"rank {r}") for r in sorted(per_rank)]
        width = starts[1] - starts[0]
        assert width <= COLUMN_MAX, header
        rows = [line for line in lines if line[:6].strip().isdigit()]
        assert rows, text
        for line in rows:
            for start in starts:
                column = line[start: start + width]
                # Each entry within its column with a space to spare, ending with its cell's whole
                # tag however much of it was cut.
                assert column.endswith(" ") and column.rstrip().endswith((f"In[{cell}]", "—")), (column, line)
                cut += "…" in column
    assert cut > 20, "the logs never made the view cut an entry: the test tests nothing"


def _result(evalue: str) -> CellResult:
    result = CellResult(cell=7, code="", ranks=[0, 1], results={0: RankResult(0, status="error"), 1: RankResult(1, status="ok")})
    result[0].error = {"ename": "RuntimeError", "evalue": evalue, "traceback": ""}
    return result


@pytest.mark.parametrize("evalue", [LONG_ERROR, "x" * 500, "shape [" + ", ".join(["256"] * 80) + "] is wrong", LONG_ERROR.replace(" ", "")])
def test_a_failed_cells_one_line_keeps_its_labels_whole(evalue: str) -> None:
    line = str(CellFailed.of(_result(evalue)))
    assert line.startswith("cell 7 failed on rank 0: RuntimeError: "), line
    assert len(line) <= len("cell 7 failed on rank 0: RuntimeError: ") + 160, line
    message = line.split("RuntimeError: ", 1)[1]
    if " " in evalue[:158]:
        assert not faults(line), line
    else:
        assert message.endswith("…"), line  # one word too long for the line: cut inside it, and said
